"""GGUF types moeforge has no kernels for, converted to q8_0 as they load.

Real files mix types: llama.cpp's Q4_K_M gives the output head, and attn_v and ffn_down in
half the layers, q6_K; its Q4_0 keeps a q6_K head. Such a file is not refused:
each tensor of a type gguf can dequantize is dequantized with gguf's reference dequantizer
and requantized to q8_0 with gguf's reference quantizer (ggml's quantize_row_q8_0): q6_K (the
type of common files) on the device when the GPU loads it, with the same bits (array
operations below), the rest on the host, in chunks of blocks spread over threads (numpy lets
go of the GIL in its loops). q8_0 is the
most precise format the kernels take: a weight moves by at most half a q8_0 step (a block's
largest magnitude / 254), about a quarter of q6_K's own step, and costs 8.5 bits against
q6_K's 6.56. Both backends load the same converted bytes, so the numpy backend stays the
reference of the GPU's results; llama.cpp, which runs q6_K itself, differs by the requantization
(the q4_K_M parity fixture measures it).
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from ..codegen.quant import QUANT_TYPES

TARGET = "q8_0"
# ggml names of the types converted (those gguf's dequantizer knows and the kernels do not)
FOREIGN = ("q4_1", "q5_0", "q5_1", "q2_K", "q3_K", "q5_K", "q6_K", "iq1_s", "iq1_m", "iq2_xxs", "iq2_xs",
           "iq2_s", "iq3_xxs", "iq3_s", "iq4_nl", "iq4_xs", "tq1_0", "tq2_0")
CHUNK_WEIGHTS = 1 << 18   # per task: ~1 MB of float32, small enough that threads do not queue on fresh mmaps


def ggml_type(name: str):
    import gguf
    return getattr(gguf.GGMLQuantizationType, name.upper())


def block_size(name: str) -> tuple[int, int]:
    """(weights, bytes) of one block of any GGUF block type (moeforge's own or foreign)."""
    import gguf
    return gguf.GGML_QUANT_SIZES[ggml_type(name)]


def row_bytes(name: str, k: int) -> int:
    values, nbytes = block_size(name)
    return k // values * nbytes


def to_q8_0(raw: np.ndarray, qtype: str, k: int, threads: int | None = None) -> np.ndarray:
    """GGUF rows of a foreign type, uint8 (rows, row_bytes) -> q8_0 rows, bit for bit what
    gguf.quants.quantize(gguf.quants.dequantize(...), Q8_0) gives. gguf's block functions
    are called on large chunks: its own entry points loop in Python over 16-row groups,
    which holds the GIL (5x slower, and no gain from threads)."""
    from gguf import quants
    src, q8 = getattr(quants, qtype.upper()), quants.Q8_0
    src.init_grid()   # the i-quants' lattices; nothing for the others
    values, nbytes = block_size(qtype)
    blocks = np.ascontiguousarray(raw).reshape(-1, nbytes)
    out = np.empty((blocks.shape[0] * values // 32, QUANT_TYPES[TARGET].block_bytes), dtype=np.uint8)
    step = max(1, CHUNK_WEIGHTS // values)

    def one(lo: int) -> None:
        w = src.dequantize_blocks(blocks[lo:lo + step]).reshape(-1, 32)
        out[lo * values // 32:(lo + step) * values // 32] = q8.quantize_blocks(w)

    starts = range(0, blocks.shape[0], step)
    if len(starts) == 1 or threads == 1:
        for lo in starts:
            one(lo)
    else:
        with ThreadPoolExecutor(threads or min(16, os.cpu_count() or 1)) as pool:
            list(pool.map(one, starts))
    return out.reshape(-1, QUANT_TYPES[TARGET].row_bytes(k))


# -- on the device: the types of common files, in array operations ----------------------------
# gguf's block functions call numpy by name, so they run on the host only. These write the
# same float32 operations in the same order with the array module as a parameter: numpy gives
# gguf's bits (tests/cpu/test_convert.py), CuPy the same bits on the device, one launch an
# operation, so nothing is contracted into an FMA (tests/gpu/test_upload.py).

def dequantize_q6_k(blocks, xp=np):
    """q6_K blocks (n, 210) uint8 -> float32 (n, 256): gguf's Q6_K.dequantize_blocks."""
    n = blocks.shape[0]
    ql, qh, scales, d = blocks[:, :128], blocks[:, 128:192], blocks[:, 192:208], blocks[:, 208:210]
    d = xp.ascontiguousarray(d).view(xp.float16).astype(xp.float32)
    d = (d * xp.ascontiguousarray(scales).view(xp.int8).astype(xp.float32)).reshape(n, 16, 1)
    ql = ql.reshape(n, -1, 1, 64)
    ql = xp.concatenate([ql & 0x0F, ql >> 4], axis=2).reshape(n, -1, 32)
    qh = qh.reshape(n, -1, 1, 32)
    qh = xp.concatenate([(qh >> s) & 0x03 for s in (0, 2, 4, 6)], axis=2).reshape(n, -1, 32)
    q = (ql | (qh << 4)).astype(xp.int8) - xp.int8(32)
    return (d * q.reshape(n, 16, -1).astype(xp.float32)).reshape(n, 256)


def quantize_q8_0(w, xp=np):
    """float32 (n, 32) -> q8_0 blocks (n, 34) uint8: gguf's Q8_0.quantize_blocks (ggml's
    reference rounding, halves away from zero)."""
    d = xp.abs(w).max(axis=1, keepdims=True) / xp.float32(127)
    safe = xp.where(d == 0, xp.float32(1), d)
    inv = xp.where(d == 0, xp.float32(0), xp.float32(1) / safe)
    x = w * inv
    a = xp.abs(x)
    fl = xp.floor(a)
    q = xp.sign(x) * (fl + xp.floor(xp.float32(2) * (a - fl)))
    return xp.concatenate([d.astype(xp.float16).view(xp.uint8), q.astype(xp.int8).view(xp.uint8)], axis=1)


DEVICE_DEQUANTIZE = {"q6_K": (dequantize_q6_k, 256, 210)}
DEVICE_CHUNK_BLOCKS = 1 << 16    # 16M weights: ~64 MB of float32 and a few times that in temporaries


def to_q8_0_device(raw, qtype: str, k: int):
    """to_q8_0 on a CuPy array of a type in DEVICE_DEQUANTIZE: the same bytes, made on the
    device (the host only reads the file)."""
    import cupy as cp
    dequantize, values, nbytes = DEVICE_DEQUANTIZE[qtype]
    blocks = cp.ascontiguousarray(raw).reshape(-1, nbytes)
    out = cp.empty((blocks.shape[0] * values // 32, QUANT_TYPES[TARGET].block_bytes), dtype=cp.uint8)
    per = values // 32
    for lo in range(0, blocks.shape[0], DEVICE_CHUNK_BLOCKS):
        w = dequantize(blocks[lo:lo + DEVICE_CHUNK_BLOCKS], cp).reshape(-1, 32)
        out[lo * per:lo * per + w.shape[0]] = quantize_q8_0(w, cp)
    return out.reshape(-1, QUANT_TYPES[TARGET].row_bytes(k))


def converted(ref):
    """A TensorRef of a foreign type as the q8_0 TensorRef its load produces: load(cupy)
    converts on the device where the type has array-operation code, on the host otherwise."""
    from .gguf_file import TensorRef
    k = ref.shape[-1]

    def load(xp=np):
        if xp is not np and ref.qtype in DEVICE_DEQUANTIZE:
            return to_q8_0_device(ref.load(xp), ref.qtype, k)
        return xp.asarray(to_q8_0(ref.load(), ref.qtype, k))

    return TensorRef(ref.name, TARGET, ref.shape, load)


def note(f) -> str | None:
    """One line on what a file's load converts, or None."""
    counts: dict[str, list[int]] = {}
    for ref in f.tensors.values():
        if ref.qtype in FOREIGN:
            c = counts.setdefault(ref.qtype, [0, 0])
            c[0] += 1
            c[1] += int(np.prod(ref.shape[:-1])) * QUANT_TYPES[TARGET].row_bytes(ref.shape[-1]) - ref.nbytes
    if not counts:
        return None
    parts = ", ".join(f"{n} {t} tensors (+{extra / 2**20:.1f} MiB)" for t, (n, extra) in counts.items())
    return f"{f.path}: {parts} run as {TARGET}, converted as they load (moeforge has no kernels for them)"
