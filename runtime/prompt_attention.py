"""Prompt attention: which kernel a model's heads get, the shared memory it takes, and the
arithmetic of the tensor-core one in numpy (what numerics="kernel" reproduces).

attn_prefill_tc (templates/attn_prefill.cuh.j2) runs on tf32 tensor cores: q (scaled by
scale * log2 e in float32) and the probabilities are rounded to 10-bit mantissas, keys and
values truncated to them (the tensor cores read their float32 as it is); sums are float32,
the softmax online in base 2, in two halves of each tile merged at the end. It is used
where the attention weights are quantized: their q8_1 activations already cost more than
tf32 does, and it is the precision llama.cpp's flash attention works at (f16). Float models
keep attn_prefill, float32 throughout.
"""
from __future__ import annotations

import numpy as np

ROWS = {"attn_prefill": 8, "attn_prefill_tc": 16}   # query tokens per block
KEYS, HALF = 64, 32                                 # attn_prefill_tc: keys per tile, per warp


def kernel_for(hp, cc: str, tensor_cores: bool = True, smem_limit: int | None = None) -> str | None:
    """The prompt attention kernel for these heads, None where neither takes them (cuBLAS
    then, eagerly). attn_prefill_tc (sm_80+): query heads in groups of up to 8, head widths
    multiples of 32 up to 128. attn_prefill (float32 FMA): groups of up to 16, widths multiples
    of 4 up to 128. smem_limit: a block's shared memory on the card (none: any fits)."""
    if hp.n_head % hp.n_head_kv or hp.head_dim > 128:
        return None
    g, hd = hp.n_head // hp.n_head_kv, hp.head_dim
    fits = lambda kernel: smem_limit is None or smem_bytes(hp, kernel, bufs=1) <= smem_limit  # noqa: E731
    if tensor_cores and int(cc.split(".")[0]) >= 8 and g <= 8 and hd % 32 == 0 and fits("attn_prefill_tc"):
        return "attn_prefill_tc"
    return "attn_prefill" if g <= 16 and hd % 4 == 0 and fits("attn_prefill") else None


def threads(hp, kernel: str) -> int:
    """A block's threads: attn_prefill a warp per query head of the group; attn_prefill_tc
    sixteen warps whatever the group (two per head of up to 8; those past the group only
    copy key tiles)."""
    return 512 if kernel == "attn_prefill_tc" else 32 * (hp.n_head // hp.n_head_kv)


def smem_bytes(hp, kernel: str, bufs: int = 2) -> int:
    """A block's dynamic shared memory, row strides as in the kernels: attn_prefill holds q
    rows, two key and two value tiles and the probabilities (floats); attn_prefill_tc q rows
    (tf32) and `bufs` 64-key tiles of keys and values (float32)."""
    g, hd = hp.n_head // hp.n_head_kv, hp.head_dim
    rows = ROWS[kernel]
    if kernel == "attn_prefill_tc":
        return 4 * (g * rows * (hd + 4) + bufs * KEYS * (hd + 4) + bufs * KEYS * (hd + 8))
    return 4 * (g * rows * hd + 2 * 32 * (hd + 1) + 2 * 32 * hd + g * rows * 32)


def tile_buffers(hp, smem_limit: int) -> int:
    """attn_prefill_tc's key tiles: two (the next copied while this one is used) where a block
    has the room, else one."""
    return 2 if smem_bytes(hp, "attn_prefill_tc", bufs=2) <= smem_limit else 1


def _top19(a, half_ulp: int) -> np.ndarray:
    """float32's top 19 bits (sign, exponent, 10 mantissa bits) after adding half_ulp."""
    bits = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    return ((bits + np.uint32(half_ulp)) & np.uint32(0xFFFFE000)).view(np.float32)


def tf32(a) -> np.ndarray:
    """cvt.rna.tf32.f32: float32 rounded to a 10-bit mantissa, ties away from zero."""
    return _top19(a, 0x1000)


def tf32_truncated(a) -> np.ndarray:
    """float32 as the tensor cores read it for a tf32 operand: the top 19 bits."""
    return _top19(a, 0)


def attention_tf32(q, k, v, hp, pos0: int) -> np.ndarray:
    """attn_prefill_tc's result in float64 between its rounding points. q (n, q_dim) float32
    for positions pos0.., k and v (L, kv_dim) float32 the cache up to pos0 + n. Half h of
    each 64-key tile (keys 32h..32h+31) has its own online softmax, as in the kernel (where p
    is rounded relative to that half's running max); the halves merge at the end."""
    n, hd, hkv = q.shape[0], hp.head_dim, hp.n_head_kv
    g, L = hp.n_head // hkv, pos0 + n
    scale_log2 = np.float32(1.0 / np.sqrt(hd) * np.log2(np.e))
    qs = tf32(q * scale_log2).astype(np.float64).reshape(n, hkv, g, hd)
    ks = tf32_truncated(k[:L]).astype(np.float64).reshape(L, hkv, hd)
    vs = tf32_truncated(v[:L]).astype(np.float64).reshape(L, hkv, hd)
    last = pos0 + np.arange(n)
    halves = []
    for h in range(KEYS // HALF):
        m = np.full((hkv, g, n), -np.inf)
        total = np.zeros((hkv, g, n))
        o = np.zeros((hkv, g, n, hd))
        for j0 in range(h * HALF, L, KEYS):
            j1 = min(L, j0 + HALF)
            s = np.einsum("nhgd,lhd->hgnl", qs, ks[j0:j1])
            s[..., np.arange(j0, j1)[None, :] > last[:, None]] = -np.inf
            mn = np.maximum(m, s.max(axis=-1))
            base = np.where(mn == -np.inf, 0.0, mn)     # a row that has seen no key of this half
            alpha, p = np.exp2(m - base), np.exp2(s - base[..., None])
            total = total * alpha + p.sum(axis=-1)
            o = o * alpha[..., None] + np.einsum("hgnl,lhd->hgnd", tf32(p).astype(np.float64), vs[j0:j1])
            m = mn
        halves.append((m, total, o))
    (ma, la, oa), (mb, lb, ob) = halves
    top = np.maximum(ma, mb)                            # ma is finite: key 0 is in the first half
    fa, fb = np.exp2(ma - top), np.exp2(mb - top)
    o = (oa * fa[..., None] + ob * fb[..., None]) / (la * fa + lb * fb)[..., None]
    return o.transpose(2, 0, 1, 3).reshape(n, hp.q_dim)
