"""GGUF types moeforge has no kernels for, converted to q8_0 as they load.

Real files mix types: llama.cpp's Q4_K_M is q4_K with q6_K in places, Q5_K_M q5_K with
q6_K, IQ4_XS iq4_xs with q5_K and q6_K, Q3_K_M q3_K with q4_K, q5_K and q6_K, Q2_K q2_K with
q3_K, q4_K and q6_K (all have kernels), and other mixes bring q4_1, q5_0 or the other
i-quants. Such a file is not refused: each tensor of a type gguf can
dequantize is dequantized with gguf's reference dequantizer and requantized to q8_0 with
gguf's reference quantizer (ggml's quantize_row_q8_0): the K-quants and iq4_xs (only when
MOEFORGE_CONVERT asks: they have kernels) on the device when the GPU loads them, with the same bits
(array_blocks), the rest on the host, in chunks of blocks spread over threads (numpy lets go
of the GIL in its loops). q8_0 is the most precise format the kernels take: a weight moves
by at most half a q8_0 step (a block's largest magnitude / 254). Both backends load the
same converted bytes, so the numpy backend stays the reference of the GPU's results;
llama.cpp, which runs these types itself, differs by the requantization.
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from ..codegen.quant import QUANT_TYPES
from . import array_blocks

TARGET = "q8_0"
# ggml names of the types converted (those gguf's dequantizer knows and the kernels do not)
FOREIGN = ("q4_1", "q5_0", "q5_1", "iq1_s", "iq1_m", "iq2_xxs", "iq2_xs",
           "iq2_s", "iq3_xxs", "iq3_s", "iq4_nl", "tq1_0", "tq2_0")
CHUNK_WEIGHTS = 1 << 18   # per task: ~1 MB of float32, small enough that threads do not queue on fresh mmaps
# Types with kernels of their own that a user may still have converted (MOEFORGE_CONVERT=q6_K:
# to compare a file's speed and numerics with and without them); all but mxfp4 ran as
# q8_0 before they had kernels (mxfp4 was refused).
CONVERTIBLE = ("q2_K", "q3_K", "q5_K", "q6_K", "iq4_xs", "mxfp4")


def converted_types() -> tuple[str, ...]:
    """The types a load converts to q8_0: FOREIGN, and those of CONVERTIBLE named in the
    comma-separated MOEFORGE_CONVERT."""
    asked = [t.strip() for t in os.environ.get("MOEFORGE_CONVERT", "").split(",") if t.strip()]
    bad = [t for t in asked if t not in CONVERTIBLE]
    if bad:
        raise ValueError(f"MOEFORGE_CONVERT: {', '.join(bad)} cannot be converted to {TARGET} "
                         f"(convertible types with kernels: {', '.join(CONVERTIBLE)})")
    return FOREIGN + tuple(asked)


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


# the types converted on the device when the GPU loads them (array_blocks: gguf's bits there)
DEVICE_DEQUANTIZE = {"q2_K": array_blocks.dequantize_q2_k, "q3_K": array_blocks.dequantize_q3_k,
                     "q5_K": array_blocks.dequantize_q5_k, "q6_K": array_blocks.dequantize_q6_k,
                     "iq4_xs": array_blocks.dequantize_iq4_xs}
DEVICE_CHUNK_BLOCKS = 1 << 16    # 16M weights: ~64 MB of float32 and a few times that in temporaries


def to_q8_0_device(raw, qtype: str, k: int):
    """to_q8_0 on a CuPy array of a type in DEVICE_DEQUANTIZE: the same bytes, made on the
    device (the host only reads the file)."""
    import cupy as cp
    dequantize = DEVICE_DEQUANTIZE[qtype]
    values, nbytes = block_size(qtype)
    blocks = cp.ascontiguousarray(raw).reshape(-1, nbytes)
    out = cp.empty((blocks.shape[0] * values // 32, QUANT_TYPES[TARGET].block_bytes), dtype=cp.uint8)
    per = values // 32
    for lo in range(0, blocks.shape[0], DEVICE_CHUNK_BLOCKS):
        w = dequantize(blocks[lo:lo + DEVICE_CHUNK_BLOCKS], cp).reshape(-1, 32)
        out[lo * per:lo * per + w.shape[0]] = array_blocks.quantize_q8_0(w, cp)
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
    convert = converted_types()
    for ref in f.tensors.values():
        if ref.qtype in convert:
            c = counts.setdefault(ref.qtype, [0, 0])
            c[0] += 1
            c[1] += int(np.prod(ref.shape[:-1])) * QUANT_TYPES[TARGET].row_bytes(ref.shape[-1]) - ref.nbytes
    if not counts:
        return None
    parts = ", ".join(f"{n} {t} tensors (+{extra / 2**20:.1f} MiB)" for t, (n, extra) in counts.items())
    why = "MOEFORGE_CONVERT, or no kernels for them" if len(convert) > len(FOREIGN) else "moeforge has no kernels for them"
    return f"{f.path}: {parts} run as {TARGET}, converted as they load ({why})"
