"""GGUF block formats in array operations, for numpy or CuPy: the K-quant dequantizers of
llama.cpp's mixed files and the q8_0 quantizer, so that runtime/convert.py can requantize
on the device what the kernels cannot run.

gguf's block functions call numpy by name, so they run on the host only. These are the same
float32 operations in the same order with the array module as a parameter: with numpy they
give gguf's bits (tests/cpu/test_convert.py); CuPy runs one launch an operation, so nothing
is contracted into an FMA, and gives the host's bits (tests/gpu/test_upload.py). Blocks are
uint8 (n, block_bytes); the dequantizers return float32 (n, 256).
"""
from __future__ import annotations

import numpy as np


def _f16(b, xp):
    return xp.ascontiguousarray(b).view(xp.float16).astype(xp.float32)


def _bits(b, n: int, group: int, width: int, xp):
    """(n, bytes) -> (n, bytes // group, 8 // width, group): each group of bytes read
    `width` bits at a time, lowest bits first (gguf's reshape-and-shift)."""
    b = b.reshape(n, -1, 1, group)
    mask = (1 << width) - 1
    return xp.concatenate([(b >> s) & mask for s in range(0, 8, width)], axis=2)


def scale_min_k4(packed, xp=np):
    """A q4_K/q5_K super-block's 12 scale bytes (.., 12) uint8 -> (scales, mins) (.., 8)
    uint8: sub-blocks 0-3 in the low 6 bits of bytes 0-3 and 4-7; 4-7 in the nibbles of
    bytes 8-11 with their top two bits in the high bits of bytes 0-3 and 4-7 (ggml's
    get_scale_min_k4; the reference's emulation reads them here too)."""
    lo, mid, hi = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = xp.concatenate([lo & 0x3F, (hi & 0x0F) | ((lo >> 2) & 0x30)], axis=-1)
    mn = xp.concatenate([mid & 0x3F, (hi >> 4) | ((mid >> 2) & 0x30)], axis=-1)
    return sc, mn


def q2_k_parts(blocks, xp=np):
    """q2_K super-blocks (n, 84) -> (quants 0..3 as uint8 (n, 256) in weight order, the
    sixteen scales and mins 0..15 as uint8 (n, 16) each, one a 16 weights, d and dmin as
    float32 (n, 1)); the split and the reference read them here too."""
    n = blocks.shape[0]
    scales = blocks[:, :16]
    q = _bits(blocks[:, 16:80], n, 32, 2, xp).reshape(n, 256)
    return q, scales & 0xF, scales >> 4, _f16(blocks[:, 80:82], xp), _f16(blocks[:, 82:84], xp)


def dequantize_q2_k(blocks, xp=np):
    n = blocks.shape[0]
    q, sc, mn, d, dmin = q2_k_parts(blocks, xp)
    dl = (d * sc.astype(xp.float32)).reshape(n, 16, 1)
    ml = (dmin * mn.astype(xp.float32)).reshape(n, 16, 1)
    return (dl * q.reshape(n, 16, 16).astype(xp.float32) - ml).reshape(n, 256)


def q3_k_parts(blocks, xp=np):
    """q3_K super-blocks (n, 110) -> (q - 4 as int8 (n, 256) in weight order, the sixteen
    scales s - 32 as int8 (n, 16), one a 16 weights, d as float32 (n, 1)): ggml's unpacking
    (scale i's low nibble in byte i & 7, the low half for i < 8; its top two bits at bits
    2(i >> 2) of byte 8 + (i & 3)); the split and the reference's emulation read them here."""
    n = blocks.shape[0]
    hmask, qs, scales = blocks[:, :32], blocks[:, 32:96], blocks[:, 96:108]
    lo = _bits(scales[:, :8], n, 8, 4, xp).reshape(n, 16)
    hi = _bits(scales[:, 8:], n, 4, 2, xp).reshape(n, 16)
    sc = (lo | (hi << 4)).astype(xp.int8) - xp.int8(32)
    ql = _bits(qs, n, 32, 2, xp).reshape(n, 16, 16)
    qh = _bits(hmask, n, 32, 1, xp).reshape(n, 16, 16) ^ 1   # the offset is 4 where the bit is 0
    q = ql.astype(xp.int8) - (qh << 2).astype(xp.int8)
    return q.reshape(n, 256), sc, _f16(blocks[:, 108:110], xp)


def dequantize_q3_k(blocks, xp=np):
    n = blocks.shape[0]
    q, sc, d = q3_k_parts(blocks, xp)
    dl = (d * sc.astype(xp.float32)).reshape(n, 16, 1)
    return (dl * q.reshape(n, 16, 16).astype(xp.float32)).reshape(n, 256)


def q5_k_quants(blocks, xp=np):
    """q5_K super-blocks (n, 176) -> their quants 0..31 (n, 256) uint8 in weight order, the
    nibble and the fifth bit joined; the reference's emulation reads them here too."""
    n = blocks.shape[0]
    ql = _bits(blocks[:, 48:176], n, 32, 4, xp).reshape(n, -1, 32)
    qh = _bits(blocks[:, 16:48], n, 32, 1, xp).reshape(n, -1, 32)
    return (ql | (qh << 4)).reshape(n, 256)


def dequantize_q5_k(blocks, xp=np):
    n = blocks.shape[0]
    d, dmin = _f16(blocks[:, 0:2], xp), _f16(blocks[:, 2:4], xp)
    sc, mn = scale_min_k4(blocks[:, 4:16], xp)
    dl = (d * sc.astype(xp.float32)).reshape(n, -1, 1)
    ml = (dmin * mn.astype(xp.float32)).reshape(n, -1, 1)
    q = q5_k_quants(blocks, xp).reshape(n, -1, 32).astype(xp.float32)
    return (dl * q - ml).reshape(n, 256)


def q6_k_parts(blocks, xp=np):
    """q6_K super-blocks (n, 210) -> (q - 32 as int8 (n, 256) in weight order, the sixteen
    scales as int8 (n, 16), one a 16 weights, d as float32 (n, 1)); the reference's
    emulation reads them here too."""
    n = blocks.shape[0]
    ql = _bits(blocks[:, :128], n, 64, 4, xp).reshape(n, -1, 32)
    qh = _bits(blocks[:, 128:192], n, 32, 2, xp).reshape(n, -1, 32)
    q = (ql | (qh << 4)).astype(xp.int8) - xp.int8(32)
    return q.reshape(n, 256), xp.ascontiguousarray(blocks[:, 192:208]).view(xp.int8), _f16(blocks[:, 208:210], xp)


def dequantize_q6_k(blocks, xp=np):
    n = blocks.shape[0]
    q, scales, d = q6_k_parts(blocks, xp)
    d = (d * scales.astype(xp.float32)).reshape(n, 16, 1)
    return (d * q.reshape(n, 16, -1).astype(xp.float32)).reshape(n, 256)


def iq4_xs_parts(blocks, xp=np):
    """iq4_xs super-blocks (n, 136) -> (levels as int8 (n, 256) in weight order, the eight
    sub-block scales ls - 32 as int8 (n, 8), d as float32 (n, 1)); the reference's
    emulation reads them here too."""
    from ..codegen.quant import IQ4_VALUES
    n = blocks.shape[0]
    high = xp.ascontiguousarray(blocks[:, 2:4]).view(xp.uint16)                      # (n, 1)
    low = _bits(blocks[:, 4:8], n, 4, 4, xp).reshape(n, 2, 4).transpose(0, 2, 1).reshape(n, 8)
    top = (high >> xp.arange(0, 16, 2, dtype=xp.uint16)) & 3                          # (n, 8)
    ls = (low | (top.astype(xp.uint8) << 4)).astype(xp.int8) - xp.int8(32)
    idx = _bits(blocks[:, 8:136], n, 16, 4, xp).reshape(n, 256)                       # (sub, nibble, j)
    levels = xp.asarray(IQ4_VALUES, dtype=xp.int8)[idx]
    return levels, ls, _f16(blocks[:, 0:2], xp)


def dequantize_iq4_xs(blocks, xp=np):
    n = blocks.shape[0]
    levels, ls, d = iq4_xs_parts(blocks, xp)
    dl = (d * ls.astype(xp.float32)).reshape(n, 8, 1)
    return (dl * levels.reshape(n, 8, 32).astype(xp.float32)).reshape(n, 256)


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
