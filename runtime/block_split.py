"""The split layout: GGUF blocks <-> moeforge's kernel blocks, per format.

Each block's bytes are split into its quant bytes (16-byte aligned rows, the kernels' 16-byte
loads) and its scales (a meta region beside them), or, for the low-bit K-quants, packed into
16 bytes a 32-weight block with the scales inline (codegen/quant.py's QuantType says which).
A byte permutation for the 32-weight formats and q4_K, a lossless re-encoding for the others;
`join_blocks` gives back the GGUF bytes exactly. Array operations only, so that numpy and CuPy
run the same code (the split runs on the device as a model loads, QuantTensor.from_blocks).
"""
from __future__ import annotations

import numpy as np

from ..codegen.quant import QuantType


def split_blocks(raw, q: QuantType, rows: int, k: int):
    """GGUF blocks (rows x row_bytes, uint8) -> (qs [rows, nb*qs_bytes], meta [rows, meta_stride]),
    nb kernel blocks a row. Array operations only, so that a CuPy array splits on its device
    with the same bits (QuantTensor.from_blocks: the host only reads the file)."""
    xp = array_module(raw)
    nb = q.blocks_per_row(k)
    nsb = nb // q.sub_blocks
    span = q.qs_bytes * q.sub_blocks
    blocks = xp.ascontiguousarray(raw).reshape(rows, nsb, q.block_bytes)
    if q.inline_meta:
        split = _split_q2_k if q.half_mins else _split_q3_k
        qs, own = split(blocks, xp), xp.zeros((rows, 0), dtype=xp.uint8)
    elif q.own_meta_bytes:
        qs, own = _split_q6_k(blocks, xp)
    else:
        qs = blocks[:, :, q.qs_offset:q.qs_offset + span]
        if q.paired_nibbles:
            qs = _unpair_nibbles(qs, xp)
        own = xp.concatenate([blocks[:, :, :q.qs_offset], blocks[:, :, q.qs_offset + span:]], axis=2)
        if q.high_bits:
            own = xp.concatenate([own[..., :16], _q5_k_high_words(own[..., 16:48], xp)], axis=-1)
    meta = xp.zeros((rows, q.meta_stride(k)), dtype=xp.uint8)
    meta[:, :nb * q.meta_bytes] = own.reshape(rows, nb * q.meta_bytes)
    return xp.ascontiguousarray(qs).reshape(rows, nb * q.qs_bytes), meta


def array_module(a):
    """numpy for host arrays, cupy for device ones (imported only when one is given)."""
    if isinstance(a, np.ndarray):
        return np
    import cupy as cp
    return cp.get_array_module(a)


def join_blocks(qs: np.ndarray, meta: np.ndarray, q: QuantType, rows: int, k: int) -> np.ndarray:
    """The inverse of split_blocks: GGUF block bytes, (rows, row_bytes)."""
    nb = q.blocks_per_row(k)
    nsb = nb // q.sub_blocks
    if q.inline_meta:
        join = _join_q2_k if q.half_mins else _join_q3_k
        return join(qs.reshape(rows, nsb, q.sub_blocks, q.qs_bytes)).reshape(rows, nsb * q.block_bytes)
    if q.own_meta_bytes:
        own = meta[:, :nb * q.meta_bytes].reshape(rows, nsb, q.sub_blocks, q.meta_bytes)
        return _join_q6_k(qs.reshape(rows, nsb, q.sub_blocks, q.qs_bytes), own).reshape(rows, nsb * q.block_bytes)
    qs = qs.reshape(rows, nsb, q.qs_bytes * q.sub_blocks)
    if q.paired_nibbles:
        qs = _pair_nibbles(qs)
    m = meta[:, :nb * q.meta_bytes].reshape(rows, nsb, q.meta_bytes * q.sub_blocks)
    if q.high_bits:
        m = np.concatenate([m[..., :16], _q5_k_high_bytes(m[..., 16:48])], axis=-1)
    head, tail = m[:, :, :q.qs_offset], m[:, :, q.qs_offset:]
    return np.concatenate([head, qs, tail], axis=2).reshape(rows, nsb * q.block_bytes)


def _unpair_nibbles(qs, xp=np):
    """K-quant quant bytes (.., 32*pairs; sub-blocks 2i, 2i+1 in the low and high nibbles of
    32 bytes) -> one 16-byte run a sub-block in q4_0's order (byte j: values j and j+16)."""
    c = qs.reshape(*qs.shape[:-1], -1, 32)
    subs = xp.stack([c & 0x0F, c >> 4], axis=-2)              # (.., pairs, 2, 32 values)
    out = subs[..., :16] | (subs[..., 16:] << 4)
    return out.reshape(qs.shape)


def _pair_nibbles(qs: np.ndarray) -> np.ndarray:
    """The inverse of _unpair_nibbles."""
    b = qs.reshape(*qs.shape[:-1], -1, 2, 16)
    vals = np.concatenate([b & 0x0F, b >> 4], axis=-1)         # (.., pairs, 2, 32 values)
    out = vals[..., 0, :] | (vals[..., 1, :] << 4)
    return out.reshape(qs.shape)


def _q5_k_high_words(qh, xp=np):
    """A q5_K super-block's 32 high-bit bytes (bit i of byte l: value l of sub-block i) ->
    one word a sub-block (.., 8 x 4 bytes) for its quants in q4_0's order: byte b, bit w
    (w < 4) is value 4w + b's high bit, bit 4 + w value 16 + 4w + b's, so that a shift and a
    mask put the fifth bit under the nibbles of word w (quant_q5_K.cuh.j2)."""
    lead = qh.shape[:-1]
    sub = xp.arange(8, dtype=xp.uint8).reshape(8, 1)
    bits = ((qh[..., None, :] >> sub) & 1).reshape(*lead, 8, 2, 4, 4)     # (sub, half, w, b)
    words = xp.zeros((*lead, 8, 4), dtype=xp.uint8)
    for half in range(2):
        for w in range(4):
            words |= bits[..., half, w, :] << (w + 4 * half)
    return words.reshape(*lead, 32)


def _q5_k_high_bytes(words: np.ndarray) -> np.ndarray:
    """The inverse of _q5_k_high_words."""
    lead = words.shape[:-1]
    wb = words.reshape(*lead, 8, 1, 1, 4)                                  # (sub, ., ., b)
    shifts = (np.arange(4).reshape(1, 4, 1) + 4 * np.arange(2).reshape(2, 1, 1)).astype(np.uint8)
    bits = ((wb >> shifts) & 1).reshape(*lead, 8, 32)                      # (sub, value)
    qh = np.zeros((*lead, 32), dtype=np.uint8)
    for sub in range(8):
        qh |= bits[..., sub, :] << sub
    return qh


def _split_q6_k(blocks, xp=np):
    """q6_K super-blocks (.., 210) -> (qs (.., 8, 16), meta (.., 8, 12)) a kernel block
    (quant_q6_K.cuh.j2). Kernel block j = 4n + p of a super-block (n: its 128-weight half,
    p: the quarter in it) holds ggml's weights 128n + 32p + l, l < 32: their low nibbles are
    ql[64n + 32(p & 1) + l] (the low nibble for p < 2, the high one else), their high parts
    bits 2p+1..2p of qh[32n + l] (stored with the top bit flipped), their scales sc[2j]
    (l < 16) and sc[2j + 1]."""
    lead = blocks.shape[:-1]
    ql = blocks[..., :128].reshape(*lead, 2, 2, 32)                 # (n, p & 1, l)
    low = xp.concatenate([ql & 0x0F, ql >> 4], axis=-2)              # (n, p, l)
    qs = low[..., :16] | (low[..., 16:] << 4)                        # q4_0's order: (n, p, 16)
    qh = blocks[..., 128:192].reshape(*lead, 2, 1, 32)
    shifts = xp.asarray([0, 2, 4, 6], dtype=xp.uint8).reshape(4, 1)
    high = ((qh >> shifts) & 3).reshape(*lead, 2, 4, 2, 4, 4)       # (n, p, half, i, b): l = 16 half + 4i + b
    words = (high[..., 0, :] | (high[..., 1, :] << 2) | (high[..., 2, :] << 4) | (high[..., 3, :] << 6))
    words = words ^ 0xAA        # each high part's top bit flipped: q - 32 in two's complement
    sc = blocks[..., 192:208].reshape(*lead, 8, 2)
    d = xp.broadcast_to(blocks[..., None, 208:210], (*lead, 8, 2))
    meta = xp.concatenate([words.reshape(*lead, 8, 8), sc, d], axis=-1)
    return qs.reshape(*lead, 8, 16), meta


def _join_q6_k(qs: np.ndarray, meta: np.ndarray) -> np.ndarray:
    """The inverse of _split_q6_k: (.., 8, 16) and (.., 8, 12) -> (.., 210)."""
    lead = qs.shape[:-2]
    low = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(*lead, 2, 4, 32)   # (n, p, l)
    ql = low[..., :2, :] | (low[..., 2:, :] << 4)                                  # (n, p & 1, l)
    words = meta[..., :8].reshape(*lead, 2, 4, 2, 4) ^ 0xAA                        # (n, p, half, b)
    high = np.stack([(words >> (2 * i)) & 3 for i in range(4)], axis=-2)          # (n, p, half, i, b)
    high = high.reshape(*lead, 2, 4, 32)
    qh = high[..., 0, :] | (high[..., 1, :] << 2) | (high[..., 2, :] << 4) | (high[..., 3, :] << 6)
    return np.concatenate([ql.reshape(*lead, 128), qh.reshape(*lead, 64),
                           meta[..., 8:10].reshape(*lead, 16), meta[..., 0, 10:12]], axis=-1)


def _low_words(low, xp=np):
    """2-bit parts (.., 32) of a kernel block's values -> its first two words (.., 8): word h
    holds value 16h + 4i + b at byte b, bits 2i+1..2i (quant_q3_K.cuh.j2, quant_q2_K.cuh.j2),
    so that lane i's four values of a half are one shift and one mask away."""
    v = low.reshape(*low.shape[:-1], 2, 4, 4)                                      # (h, i, b)
    return (v[..., 0, :] | (v[..., 1, :] << 2) | (v[..., 2, :] << 4) | (v[..., 3, :] << 6)).reshape(*low.shape[:-1], 8)


def _low_parts(words: np.ndarray) -> np.ndarray:
    """The inverse of _low_words: (.., 8) -> (.., 32)."""
    shifts = np.arange(0, 8, 2, dtype=np.uint8).reshape(4, 1)
    w = words.reshape(*words.shape[:-1], 2, 1, 4)
    return ((w >> shifts) & 3).reshape(*words.shape[:-1], 32)


def _split_q3_k(blocks, xp=np):
    """q3_K super-blocks (.., 110) -> 16 bytes a kernel block (.., 8, 16), everything in
    them (quant_q3_K.cuh.j2). Kernel block j = 4n + p holds ggml's weights 128n + 32p + v,
    v = 16h + 4i + b: words 0 and 1 the low two bits of q - 4 (_low_words); word 2 byte b,
    bit 4h + i its bit 2 (set where ggml's hmask bit is clear: q - 4 in 3-bit two's
    complement); bytes 12 and 13 the scales s - 32 of values 0..15 and 16..31 as int8; 14, 15 d."""
    from .array_blocks import q3_k_parts
    lead = blocks.shape[:-1]
    flat = blocks.reshape(-1, 110)
    val, sc, _ = q3_k_parts(flat, xp)
    u = val.view(xp.uint8).reshape(-1, 8, 32)
    top = ((u >> 2) & 1).reshape(-1, 8, 2, 4, 4)                                  # (block, h, i, b)
    tops = xp.zeros((flat.shape[0], 8, 4), dtype=xp.uint8)
    for h in range(2):
        for i in range(4):
            tops |= top[:, :, h, i] << (4 * h + i)
    d = xp.broadcast_to(flat[:, None, 108:110], (flat.shape[0], 8, 2))
    out = xp.concatenate([_low_words(u & 3, xp), tops, sc.view(xp.uint8).reshape(-1, 8, 2), d], axis=-1)
    return out.reshape(*lead, 8, 16)


def _join_q3_k(qs: np.ndarray) -> np.ndarray:
    """The inverse of _split_q3_k: (.., 8, 16) -> (.., 110)."""
    from .quantize import pack_q3_k
    lead = qs.shape[:-2]
    b = qs.reshape(-1, 8, 16)
    n = b.shape[0]
    low = _low_parts(b[:, :, :8]).reshape(n, 8, 2, 4, 4)                           # (block, h, i, b)
    top = (b[:, :, None, None, 8:12] >> np.arange(8, dtype=np.uint8).reshape(1, 1, 2, 4, 1)) & 1
    val = low.astype(np.int8) - (top << 2).astype(np.int8)
    sc = b[:, :, 12:14].view(np.int8).reshape(n, 16)
    return pack_q3_k(val.reshape(n, 256), sc, b[:, 0, 14:16]).reshape(*lead, 110)


def _split_q2_k(blocks, xp=np):
    """q2_K super-blocks (.., 84) -> 16 bytes a kernel block (.., 8, 16), everything in them
    (quant_q2_K.cuh.j2). Kernel block j = 4n + p holds ggml's weights 128n + 32p + v: words 0
    and 1 their quants (_low_words), bytes 8 and 9 the (scale, min) bytes of values 0..15 and
    16..31 as in the file (scale in the low nibble), 10 and 11 zero, then d and dmin."""
    from .array_blocks import q2_k_parts
    lead = blocks.shape[:-1]
    flat = blocks.reshape(-1, 84)
    n = flat.shape[0]
    q = q2_k_parts(flat, xp)[0].reshape(n, 8, 32)
    sc = flat[:, :16].reshape(n, 8, 2)
    pad = xp.zeros((n, 8, 2), dtype=xp.uint8)
    dd = xp.broadcast_to(flat[:, None, 80:84], (n, 8, 4))
    return xp.concatenate([_low_words(q, xp), sc, pad, dd], axis=-1).reshape(*lead, 8, 16)


def _join_q2_k(qs: np.ndarray) -> np.ndarray:
    """The inverse of _split_q2_k: (.., 8, 16) -> (.., 84)."""
    from .quantize import pack_q2_k
    lead = qs.shape[:-2]
    b = qs.reshape(-1, 8, 16)
    n = b.shape[0]
    return pack_q2_k(_low_parts(b[:, :, :8]).reshape(n, 256), b[:, :, 8:10].reshape(n, 16),
                     b[:, 0, 12:16]).reshape(*lead, 84)
