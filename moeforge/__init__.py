"""moeforge: generated, autotuned CUDA kernels for quantized Mixture-of-Experts GGUF models."""
__version__ = "0.1.0"

from .runtime.fused import gate_up, moe_gate_up  # noqa: E402
from .runtime.ops import mul_mat, mul_mat_id  # noqa: E402
from .runtime.tensor import QuantTensor  # noqa: E402
from .tuning import activate as _activate  # noqa: E402

# Dispatch asks this for the per-GPU profile; it reads nothing until the first product runs.
_activate.install()

__all__ = ["QuantTensor", "Sampling", "load_model", "mul_mat", "mul_mat_id", "moe_gate_up", "gate_up", "__version__"]


def __getattr__(name):
    # The model runtime loads on first use, so `import moeforge` stays cheap and GPU-free.
    if name == "load_model":
        from .runtime.model import load_model
        return load_model
    if name == "Sampling":
        from .runtime.sampling import Sampling
        return Sampling
    raise AttributeError(f"module 'moeforge' has no attribute {name!r}")
