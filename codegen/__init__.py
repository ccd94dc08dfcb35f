"""Code generation: quant formats, kernel specs, rendering and NVRTC compilation.
Knows nothing of the CUDA runtime."""
from .quant import QUANT_TYPES, QuantType, parse_types, quant_type
from .spec import KernelSpec, MmqSpec, MmvqSpec, ModelSpec, UtilSpec

__all__ = ["QUANT_TYPES", "QuantType", "parse_types", "quant_type",
           "KernelSpec", "MmqSpec", "MmvqSpec", "ModelSpec", "UtilSpec"]
