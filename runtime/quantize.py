"""Float weights -> GGUF blocks: gguf's reference quantizers where it has one, our own for
the formats it lacks (gguf-py dequantizes q2_K, q3_K, q4_K, q5_K, q6_K and iq4_xs but
cannot quantize them).

The q4_K and q5_K quantizers are plain ones, not ggml's (which searches each sub-block's
scale and min to minimise the error): per 32-weight sub-block the range [min(0, lo), hi] is
spread over the 16 (32) levels, and the super-block's d and dmin are the largest sub-block
scale and offset over 63, so that every 6-bit scale and min fits. Any valid blocks serve
moeforge's purposes (test weights, synthetic models, `QuantTensor.from_float`); the files
they write are ordinary q4_K and q5_K.
"""
from __future__ import annotations

import numpy as np

from ..codegen.quant import QuantType


def quantize(x: np.ndarray, q: QuantType) -> np.ndarray:
    """Float rows (.., k) -> GGUF block bytes (rows, row_bytes), uint8."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    x = x.reshape(-1, x.shape[-1])
    q.blocks_per_row(x.shape[-1])            # k a multiple of the block size, or a clear error
    own = {"q2_K": quantize_q2_k, "q3_K": quantize_q3_k, "q4_K": quantize_q4_k, "q5_K": quantize_q5_k,
           "q6_K": quantize_q6_k, "iq4_xs": quantize_iq4_xs}.get(q.name)
    if own is not None:
        return own(x)
    from gguf import quants
    return quants.quantize(x, q.ggml_type)


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    qv, head = _scale_min_quants(x, 15)
    rows, nsb = head.shape[:2]
    pairs = qv.reshape(rows, nsb, 4, 2, 32)                     # sub-blocks 2i (low), 2i+1 (high)
    nibbles = (pairs[..., 0, :] | (pairs[..., 1, :] << 4)).reshape(rows, nsb, 128)
    return np.concatenate([head, nibbles], axis=-1).reshape(rows, nsb * 144)


def quantize_q5_k(x: np.ndarray) -> np.ndarray:
    """q4_K's plain quantizer over 32 levels: the fifth bit of value l of sub-block i is bit i
    of high byte l, the low four bits are q4_K's nibbles."""
    qv, head = _scale_min_quants(x, 31)
    rows, nsb = head.shape[:2]
    fifth = (qv >> 4).astype(np.uint8)                          # (rows, nsb, 8, 32)
    qh = np.zeros((rows, nsb, 32), dtype=np.uint8)
    for i in range(8):
        qh |= fifth[:, :, i, :] << i
    pairs = (qv & 15).reshape(rows, nsb, 4, 2, 32)
    nibbles = (pairs[..., 0, :] | (pairs[..., 1, :] << 4)).reshape(rows, nsb, 128)
    return np.concatenate([head, qh, nibbles], axis=-1).reshape(rows, nsb * 176)


def _scale_min_quants(x: np.ndarray, levels: int) -> tuple[np.ndarray, np.ndarray]:
    """Float rows (rows, k) -> (quants 0..levels (rows, nsb, 8, 32) uint8, each super-block's
    d, dmin and 12 scale bytes (rows, nsb, 16)): the module doc's plain quantizer."""
    rows, k = x.shape
    nsb = k // 256
    sub = x.reshape(rows, nsb, 8, 32).astype(np.float64)
    lo = np.minimum(sub.min(axis=-1), 0.0)
    hi = sub.max(axis=-1)
    scale, offset = (hi - lo) / float(levels), -lo              # (rows, nsb, 8), both >= 0
    d = (scale.max(axis=-1) / 63.0).astype(np.float16)
    dmin = (offset.max(axis=-1) / 63.0).astype(np.float16)
    d64, dmin64 = d.astype(np.float64)[..., None], dmin.astype(np.float64)[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d64 > 0, np.rint(scale / d64), 0).clip(0, 63).astype(np.uint8)
        mn = np.where(dmin64 > 0, np.rint(offset / dmin64), 0).clip(0, 63).astype(np.uint8)
        step = (d64 * sc)[..., None]
        qv = np.where(step > 0, np.rint((sub + (dmin64 * mn)[..., None]) / step), 0)
    qv = qv.clip(0, levels).astype(np.uint8)                    # (rows, nsb, 8, 32)
    head = np.empty((rows, nsb, 16), dtype=np.uint8)
    head[..., 0:2] = d.view(np.uint8).reshape(rows, nsb, 2)
    head[..., 2:4] = dmin.view(np.uint8).reshape(rows, nsb, 2)
    head[..., 4:16] = pack_q4_k_scales(sc, mn)
    return qv, head


def pack_q4_k_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """Eight 6-bit scales and mins (.., 8) -> ggml's 12 bytes (.., 12): sub-blocks 0-3 in the
    low 6 bits of bytes 0-3 (scales) and 4-7 (mins); 4-7 in the nibbles of bytes 8-11 with
    their top two bits in the high bits of bytes 0-3 and 4-7 (reference.q4_k_scales reads it)."""
    sc, mn = sc.astype(np.uint8), mn.astype(np.uint8)
    out = np.empty((*sc.shape[:-1], 12), dtype=np.uint8)
    out[..., 0:4] = sc[..., :4] | ((sc[..., 4:] >> 4) << 6)
    out[..., 4:8] = mn[..., :4] | ((mn[..., 4:] >> 4) << 6)
    out[..., 8:12] = (sc[..., 4:] & 15) | ((mn[..., 4:] & 15) << 4)
    return out


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """Float rows (rows, k), k a multiple of 256 -> q6_K blocks (rows, k // 256 * 210), uint8.
    A plain quantizer like quantize_q4_k: each 16 weights' scale spans their largest
    magnitude over 31 levels, the super-block's d the largest scale over 127."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    rows, k = x.shape
    nsb = k // 256
    grp = x.reshape(rows, nsb, 16, 16).astype(np.float64)
    scale = np.abs(grp).max(axis=-1) / 31.0                      # (rows, nsb, 16)
    d = (scale.max(axis=-1) / 127.0).astype(np.float16)
    d64 = d.astype(np.float64)[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d64 > 0, np.rint(scale / d64), 0).clip(-128, 127).astype(np.int8)
        step = (d64 * sc)[..., None]
        qv = np.where(step != 0, np.rint(grp / step), 0)
    qv = (qv.clip(-32, 31) + 32).astype(np.uint8).reshape(rows, nsb, 2, 4, 32)   # halves, quarters
    lo, hi = qv & 15, qv >> 4
    out = np.empty((rows, nsb, 210), dtype=np.uint8)
    # ggml's order: ql byte l of a half holds quarters 0 (low) and 2 (high), byte 32+l quarters
    # 1 and 3; qh byte l holds the top two bits of quarters 0-3 at bits 0, 2, 4, 6
    ql = np.concatenate([lo[..., 0, :] | (lo[..., 2, :] << 4), lo[..., 1, :] | (lo[..., 3, :] << 4)], axis=-1)
    qh = hi[..., 0, :] | (hi[..., 1, :] << 2) | (hi[..., 2, :] << 4) | (hi[..., 3, :] << 6)
    out[..., 0:128] = ql.reshape(rows, nsb, 128)
    out[..., 128:192] = qh.reshape(rows, nsb, 64)
    out[..., 192:208] = sc.view(np.uint8)
    out[..., 208:210] = d.view(np.uint8).reshape(rows, nsb, 2)
    return out.reshape(rows, nsb * 210)


def quantize_q2_k(x: np.ndarray) -> np.ndarray:
    """Float rows (rows, k), k a multiple of 256 -> q2_K blocks (rows, k // 256 * 84), uint8.
    A plain quantizer like quantize_q4_k: each 16 weights' range [min(0, lo), hi] spread over
    the 4 levels, the super-block's d and dmin the largest scale and offset over 15, so that
    every 4-bit scale and min fits."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    rows, k = x.shape
    nsb = k // 256
    grp = x.reshape(rows * nsb, 16, 16).astype(np.float64)
    lo = np.minimum(grp.min(axis=-1), 0.0)
    scale = (grp.max(axis=-1) - lo) / 3.0                                         # (blocks, 16)
    d = (scale.max(axis=-1) / 15.0).astype(np.float16)
    dmin = (-lo.min(axis=-1) / 15.0).astype(np.float16)
    d64, m64 = d.astype(np.float64)[..., None], dmin.astype(np.float64)[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d64 > 0, np.rint(scale / d64), 0).clip(0, 15).astype(np.uint8)
        mn = np.where(m64 > 0, np.rint(-lo / m64), 0).clip(0, 15).astype(np.uint8)
        step = (d64 * sc)[..., None]
        qv = np.where(step > 0, np.rint((grp + (m64 * mn)[..., None]) / step), 0).clip(0, 3).astype(np.uint8)
    dd = np.concatenate([d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2)], axis=-1)
    return pack_q2_k(qv.reshape(-1, 256), sc | (mn << 4), dd).reshape(rows, nsb * 84)


def pack_q2_k(q: np.ndarray, scale_mins: np.ndarray, dd: np.ndarray) -> np.ndarray:
    """q2_K super-blocks (n, 84) from the quants 0..3 (n, 256) uint8 in weight order, the
    sixteen (scale | min << 4) bytes (n, 16) and d's and dmin's bytes (n, 4): ggml's layout
    (weight 128n + 32j + l: bits 2j of qs[32n + l])."""
    v = q.reshape(-1, 2, 4, 32)                                                   # (n, j, l)
    qs = v[:, :, 0] | (v[:, :, 1] << 2) | (v[:, :, 2] << 4) | (v[:, :, 3] << 6)
    return np.concatenate([scale_mins, qs.reshape(-1, 64), dd], axis=-1)


def quantize_q3_k(x: np.ndarray) -> np.ndarray:
    """Float rows (rows, k), k a multiple of 256 -> q3_K blocks (rows, k // 256 * 110), uint8.
    A plain quantizer like quantize_iq4_xs: each 16 weights' scale maps their largest
    magnitude onto the level -4, the super-block's d is the largest scale over -32 (every
    s - 32 in [-32, 31]), each weight the level in [-4, 3] nearest under its rounded scale."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    rows, k = x.shape
    nsb = k // 256
    grp = x.reshape(rows * nsb, 16, 16).astype(np.float64)
    at = np.abs(grp).argmax(axis=-1)[..., None]
    scale = np.take_along_axis(grp, at, axis=-1)[..., 0] / -4.0                 # (blocks, 16)
    big = np.take_along_axis(scale, np.abs(scale).argmax(axis=-1)[..., None], axis=-1)
    d = (big[..., 0] / -32.0).astype(np.float16)
    d64 = d.astype(np.float64)[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d64 != 0, np.rint(scale / d64), 0).clip(-32, 31).astype(np.int8)
        step = (d64 * sc)[..., None]
        qv = np.where(step != 0, np.rint(grp / step), 0).clip(-4, 3).astype(np.int8)
    return pack_q3_k(qv.reshape(-1, 256), sc, d.view(np.uint8).reshape(-1, 2)).reshape(rows, nsb * 110)


def pack_q3_k(q: np.ndarray, sc: np.ndarray, d: np.ndarray) -> np.ndarray:
    """q3_K super-blocks (n, 110) from q - 4 (n, 256) int8 in weight order, the scales s - 32
    (n, 16) int8 and d's two bytes (n, 2): ggml's layout (weight 128n + 32j + l: bits 2j of
    qs[32n + l], bit 4n + j of hmask[l], set where q - 4 >= 0; scale i's low nibble in byte
    i & 7, the high one for i >= 8, its top two bits at bits 2(i >> 2) of byte 8 + (i & 3))."""
    n = q.shape[0]
    u = (q.astype(np.int16) + 4).astype(np.uint8).reshape(n, 2, 4, 32)            # (n, j, l)
    qs = np.zeros((n, 2, 32), dtype=np.uint8)
    hmask = np.zeros((n, 32), dtype=np.uint8)
    for j in range(4):
        qs |= (u[:, :, j] & 3) << (2 * j)
        for half in range(2):
            hmask |= (u[:, half, j] >> 2) << (4 * half + j)
    s6 = (sc.astype(np.int16) + 32).astype(np.uint8)
    scales = np.zeros((n, 12), dtype=np.uint8)
    scales[:, :8] = (s6[:, :8] & 15) | ((s6[:, 8:] & 15) << 4)
    for i in range(4):
        scales[:, 8:] |= ((s6[:, 4 * i:4 * i + 4] >> 4) & 3) << (2 * i)
    return np.concatenate([hmask, qs.reshape(n, 64), scales, d], axis=-1)


def quantize_iq4_xs(x: np.ndarray) -> np.ndarray:
    """Float rows (rows, k), k a multiple of 256 -> iq4_xs blocks (rows, k // 256 * 136).
    A plain quantizer, not ggml's search: each 32 weights' scale maps their largest magnitude
    onto the level -127, the super-block's d is the largest scale over -32 (so that every
    ls - 32 lies in [-32, 31]), and each weight takes the level nearest to it under the
    sub-block's rounded scale."""
    from ..codegen.quant import IQ4_VALUES
    x = np.ascontiguousarray(x, dtype=np.float32)
    rows, k = x.shape
    nsb = k // 256
    sub = x.reshape(rows, nsb, 8, 32).astype(np.float64)
    at = np.abs(sub).argmax(axis=-1)[..., None]
    scale = np.take_along_axis(sub, at, axis=-1)[..., 0] / -127.0          # (rows, nsb, 8)
    big = np.take_along_axis(scale, np.abs(scale).argmax(axis=-1)[..., None], axis=-1)
    d = (big[..., 0] / -32.0).astype(np.float16)
    d64 = d.astype(np.float64)[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        ls = np.where(d64 != 0, np.rint(scale / d64), 0).clip(-32, 31).astype(np.int64) + 32
        step = (d64 * (ls - 32))[..., None]
        r = np.where(step != 0, sub / step, 0.0)
    levels = np.asarray(IQ4_VALUES, dtype=np.float64)
    idx = np.abs(r[..., None] - levels).argmin(axis=-1).astype(np.uint8)  # (rows, nsb, 8, 32)
    out = np.empty((rows, nsb, 136), dtype=np.uint8)
    out[..., 0:2] = d.view(np.uint8).reshape(rows, nsb, 2)
    high = ((ls >> 4) << np.arange(0, 16, 2)).sum(axis=-1).astype(np.uint16)
    out[..., 2:4] = high.view(np.uint8).reshape(rows, nsb, 2)
    low = (ls & 15).astype(np.uint8)
    out[..., 4:8] = low[..., 0::2] | (low[..., 1::2] << 4)
    out[..., 8:136] = (idx[..., :16] | (idx[..., 16:] << 4)).reshape(rows, nsb, 128)
    return out.reshape(rows, nsb * 136)
