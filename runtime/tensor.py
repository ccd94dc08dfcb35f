"""QuantTensor: GGUF block bytes on the GPU, with a quant type and a logical shape.

The bytes are kept in moeforge's split layout (runtime/block_split.py): per block the quant
bytes and the remaining bytes (scales) in two regions, each row of each 16-byte aligned (the
low-bit K-quants: one region, scales inline). `to_blocks()` returns the GGUF bytes exactly.
"""
from __future__ import annotations

import math

import numpy as np

from ..codegen.quant import QuantType, quant_type
from .block_split import array_module, join_blocks, split_blocks

_ALIGN = 256


def _numel(shape) -> int:
    return math.prod(shape)


F16_MAX = 65504.0


def blocks_fit_f16(raw, q: QuantType) -> bool:
    """Whether the f16 tiles (MmfSpec) can hold these GGUF blocks (numpy or CuPy, uint8):
    for an e8m0 scale (mxfp4) while the largest scale byte lies in the format's range
    (QuantType.f16_scale_bytes: no weight past 65504, the largest blocks normal f16
    numbers); for f16 scales while the largest |scale| times the largest integer it
    multiplies, summed over the block's scales (QuantType.f16_scales), stays within f16 (a
    NaN or infinite scale does not). Blocks far below the largest round as f16
    subnormals, as any weights converted to f16 do."""
    blocks = raw.reshape(-1, q.block_bytes)
    if q.f16_scale_bytes is not None:
        lo, hi = q.f16_scale_bytes
        return lo <= int(blocks[:, 0].max()) <= hi      # the e8m0 byte leads each block
    xp = array_module(blocks)
    bound = 0.0
    for at, factor in q.f16_scales:
        d = xp.ascontiguousarray(blocks[:, at:at + 2]).view(xp.float16).astype(xp.float32)
        bound += float(xp.abs(d).max()) * factor
    return bound <= F16_MAX


class QuantTensor:
    """Quantized weights on the GPU: (E, m, k) for experts, (m, k) for a matrix."""

    def __init__(self, buffer, quant: QuantType, shape: tuple[int, ...], f16_fits: bool | None = None):
        if len(shape) not in (2, 3):
            raise ValueError(f"shape must be (m, k) or (E, m, k), got {shape}")
        self.quant = quant
        self.shape = tuple(int(s) for s in shape)
        self.nb = quant.blocks_per_row(self.k)
        self.meta_stride = quant.meta_stride(self.k)
        self.buffer = buffer
        self.qs_offset = 0
        self.meta_offset = self._meta_offset(self.rows, self.nb, quant)
        # read once, so that dispatch needs no host read: from the GGUF bytes where the
        # tensor is built from them (from_blocks), else from this buffer joined back
        self.f16_fits = blocks_fit_f16(self.to_blocks(), quant) if f16_fits is None else bool(f16_fits)

    def copy(self) -> "QuantTensor":
        """The same weights in a buffer of their own (benchmarks rotate copies past the L2)."""
        return QuantTensor(self.buffer.copy(), self.quant, self.shape, self.f16_fits)

    @staticmethod
    def _meta_offset(rows: int, nb: int, q: QuantType) -> int:
        return -(-(rows * nb * q.qs_bytes) // _ALIGN) * _ALIGN

    @property
    def qtype(self) -> str:
        return self.quant.name

    @property
    def k(self) -> int:
        return self.shape[-1]

    @property
    def m(self) -> int:
        return self.shape[-2]

    @property
    def n_experts(self) -> int:
        return self.shape[0] if len(self.shape) == 3 else 1

    @property
    def rows(self) -> int:
        return _numel(self.shape[:-1])

    @property
    def nbytes(self) -> int:
        """GGUF bytes of the tensor (what a kernel must read)."""
        return self.rows * self.quant.row_bytes(self.k)

    @property
    def device(self):
        return getattr(self.buffer, "device", None)

    def qs_ptr(self, row: int = 0) -> int:
        return self.buffer.data.ptr + self.qs_offset + row * self.nb * self.quant.qs_bytes

    def meta_ptr(self, row: int = 0) -> int:
        return self.buffer.data.ptr + self.meta_offset + row * self.meta_stride

    def __repr__(self) -> str:
        return f"QuantTensor({self.qtype}, shape={self.shape})"

    # -- construction ---------------------------------------------------------------------
    @classmethod
    def from_blocks(cls, raw, qtype: str | QuantType, shape) -> "QuantTensor":
        """From GGUF block bytes (uint8, any shape holding rows*row_bytes bytes)."""
        import cupy as cp
        q = quant_type(qtype) if isinstance(qtype, str) else qtype
        shape = tuple(int(s) for s in shape)
        if len(shape) not in (2, 3) or min(shape) <= 0:
            raise ValueError(f"shape must be (m, k) or (E, m, k) with positive sizes, got {shape}")
        rows, k = _numel(shape[:-1]), shape[-1]
        raw = raw if hasattr(raw, "dtype") else np.asarray(raw)
        if raw.dtype != np.uint8:
            raise ValueError(f"raw must hold uint8 block bytes, got {raw.dtype}")
        expected = rows * q.row_bytes(k)
        if raw.size != expected:
            raise ValueError(f"raw holds {raw.size} bytes; {q.name} {shape} needs {expected}")
        # to the device as they are and split there: the host only reads the bytes (the
        # file's pages); on the host the split of q4_K's nibbles ran at ~0.13 GB/s, a
        # minute for a 16 GiB model
        dev = cp.asarray(raw)
        qs, meta = split_blocks(dev, q, rows, k)
        meta_off = cls._meta_offset(rows, q.blocks_per_row(k), q)
        buf = cp.zeros(meta_off + meta.size, dtype=cp.uint8)
        buf[:qs.size] = qs.reshape(-1)
        buf[meta_off:] = meta.reshape(-1)
        return cls(buf, q, shape, blocks_fit_f16(dev, q))

    @classmethod
    def from_float(cls, array, qtype: str | QuantType) -> "QuantTensor":
        """Quantize float weights (gguf's reference quantizers; q4_K: runtime.quantize)."""
        from .quantize import quantize
        q = quant_type(qtype) if isinstance(qtype, str) else qtype
        arr = array.get() if hasattr(array, "get") and not isinstance(array, np.ndarray) else np.asarray(array)
        arr = np.ascontiguousarray(arr, dtype=np.float32)
        raw = quantize(arr, q)
        return cls.from_blocks(raw, q, arr.shape)

    @classmethod
    def from_gguf(cls, tensor) -> "QuantTensor":
        """From a gguf.ReaderTensor (its shape is in ggml order: k first)."""
        from ..codegen.quant import QUANT_TYPES, type_name
        name = type_name(tensor.tensor_type)
        if name not in QUANT_TYPES:
            raise ValueError(f"tensor {tensor.name!r} is {name}, which moeforge cannot run yet")
        shape = tuple(int(s) for s in reversed(list(tensor.shape)))
        return cls.from_blocks(np.asarray(tensor.data), name, shape)

    # -- back to the host --------------------------------------------------------------------
    def to_blocks(self) -> np.ndarray:
        host = self.buffer.get() if hasattr(self.buffer, "get") else np.asarray(self.buffer)
        qs = host[:self.rows * self.nb * self.quant.qs_bytes].reshape(self.rows, -1)
        meta = host[self.meta_offset:self.meta_offset + self.rows * self.meta_stride].reshape(self.rows, -1)
        return join_blocks(qs, meta, self.quant, self.rows, self.k)

    def dequantize(self) -> np.ndarray:
        from gguf import quants
        return quants.dequantize(self.to_blocks(), self.quant.ggml_type).reshape(self.shape)
