"""Prompt attention: which kernel a model's heads get, the shared memory it takes, and the
arithmetic of the tensor-core one in numpy (what numerics="kernel" reproduces).

attn_prefill_tc (templates/attn_prefill.cuh.j2) runs on tf32 tensor cores: q (scaled by
scale * log2 e in float32), k, v and each 32-key tile's probabilities are rounded to 10-bit
mantissas; sums are float32, the softmax online in base 2. It is used where the attention
weights are quantized: their q8_1 activations already cost more than tf32 does, and it is
the precision llama.cpp's flash attention works at (f16). Float models keep attn_prefill,
float32 throughout.
"""
from __future__ import annotations

import numpy as np

ROWS = {"attn_prefill": 8, "attn_prefill_tc": 16}   # query tokens per block
TILE = 32                                          # keys per tile


def kernel_for(hp, cc: str, tensor_cores: bool = True) -> str | None:
    """The prompt attention kernel for these heads, None where neither takes them (cuBLAS
    then, eagerly). attn_prefill_tc (sm_80+): a warp per query head of a group of up to 8,
    head widths multiples of 32 up to 128. attn_prefill (float32 FMA): groups of up to 16,
    widths multiples of 4 up to 128."""
    if hp.n_head % hp.n_head_kv or hp.head_dim > 128:
        return None
    g, hd = hp.n_head // hp.n_head_kv, hp.head_dim
    if tensor_cores and int(cc.split(".")[0]) >= 8 and g <= 8 and hd % 32 == 0:
        return "attn_prefill_tc"
    return "attn_prefill" if g <= 16 and hd % 4 == 0 else None


def threads(hp, kernel: str) -> int:
    """A block's threads: attn_prefill a warp per query head of the group; attn_prefill_tc
    eight warps whatever the group (those past it only load keys and values)."""
    return 256 if kernel == "attn_prefill_tc" else 32 * (hp.n_head // hp.n_head_kv)


def smem_bytes(hp, kernel: str) -> int:
    """A block's dynamic shared memory, row strides as in the kernels: attn_prefill holds q
    rows, two key and two value tiles and the probabilities (floats); attn_prefill_tc q rows,
    a key and a value tile (tf32)."""
    g, hd = hp.n_head // hp.n_head_kv, hp.head_dim
    rows = ROWS[kernel]
    if kernel == "attn_prefill_tc":
        return 4 * (g * rows * (hd + 4) + TILE * (hd + 4) + TILE * (hd + 8))
    return 4 * (g * rows * hd + 2 * TILE * (hd + 1) + 2 * TILE * hd + g * rows * TILE)


def tf32(a) -> np.ndarray:
    """cvt.rna.tf32.f32: float32 rounded to a 10-bit mantissa, ties away from zero."""
    bits = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    return ((bits + np.uint32(0x1000)) & np.uint32(0xFFFFE000)).view(np.float32)


def attention_tf32(q, k, v, hp, pos0: int) -> np.ndarray:
    """attn_prefill_tc's result in float64 between its rounding points. q (n, q_dim) float32
    for positions pos0.., k and v (L, kv_dim) float32 the cache up to pos0 + n."""
    n, hd, hkv = q.shape[0], hp.head_dim, hp.n_head_kv
    g, L = hp.n_head // hkv, pos0 + n
    scale_log2 = np.float32(1.0 / np.sqrt(hd) * np.log2(np.e))
    qs = tf32(q * scale_log2).astype(np.float64).reshape(n, hkv, g, hd)
    ks = tf32(k[:L]).astype(np.float64).reshape(L, hkv, hd)
    vs = tf32(v[:L]).astype(np.float64).reshape(L, hkv, hd)
    last = pos0 + np.arange(n)
    m = np.full((hkv, g, n), -np.inf)
    total = np.zeros((hkv, g, n))
    o = np.zeros((hkv, g, n, hd))
    for j0 in range(0, L, TILE):
        j1 = min(L, j0 + TILE)
        s = np.einsum("nhgd,lhd->hgnl", qs, ks[j0:j1])
        s[..., np.arange(j0, j1)[None, :] > last[:, None]] = -np.inf
        mn = np.maximum(m, s.max(axis=-1))     # finite from the first tile on: key 0 is visible
        alpha, p = np.exp2(m - mn), np.exp2(s - mn[..., None])
        total = total * alpha + p.sum(axis=-1)
        o = o * alpha[..., None] + np.einsum("hgnl,lhd->hgnd", tf32(p).astype(np.float64), vs[j0:j1])
        m = mn
    return (o / total[..., None]).transpose(2, 0, 1, 3).reshape(n, hp.q_dim)
