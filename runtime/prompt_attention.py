"""Prompt attention: which kernel a model's heads get, the shared memory it takes, and the
arithmetic of the tensor-core ones in numpy (what numerics="kernel" reproduces).

The precision is a choice of the model (`attn_precision`): "f16" (the default where the
attention weights are quantized: their q8_1 activations already cost more than f16 does, and
it is the precision of llama.cpp's flash attention and f16 KV cache), "tf32" (float32's
range, 10-bit mantissas) or "f32" (the default of float models). Kernels
(templates/attn_prefill*.cuh.j2):
- attn_prefill_fa64, attn_prefill_fa128 (heads of exactly that width) and attn_prefill_fa
  (any multiple of 16 up to 128): q (scaled by scale * log2 e in float32), keys, values and
  the probabilities rounded to f16 (nearest even); sums float32; one online softmax a row
  over steps of 64 keys.
- attn_prefill_tc: q and the probabilities rounded to tf32 (ties away), keys and values
  truncated to it (the tensor cores read their float32 as it is); sums float32; each 64-key
  tile in two halves of 32 with a softmax each, merged at the end.
- attn_prefill: float32 FMA throughout.
Both tensor-core kernels run the softmax online in base 2. An f16 KV cache holds what the
f16 kernels would round the keys and values to, so they are the ones built for such a cache
(the same bits, no conversion).
"""
from __future__ import annotations

import numpy as np

PRECISIONS = ("f16", "tf32", "f32")
ROWS = {"attn_prefill": 8, "attn_prefill_tc": 16}   # query tokens per block (attn_prefill_fa: rows())
KEYS, HALF = 64, 32                      # the tensor-core kernels: keys per tile, per warp
FA_EXACT = (64, 128)                     # attn_prefill_fa's instances for heads of exactly that width
FA_WARPS = 8
# attn_prefill_fa's block layout: attn_prefill_wg128 (wgmma, ModelSpec.wgmma) keeps it
FA_BLOCKS = ("attn_prefill_fa", "attn_prefill_wg")
WG_KERNEL, WG_HEAD_DIM = "attn_prefill_wg128", 128
WG_TILE_BYTES = 2 * 64 * 128 * 2                # a tile's K and V^T, f16
# the online softmax of each precision's kernel: keys a step, and the parts a row's steps
# are dealt to in turn (each with its own max and sums, merged at the end)
LAYOUT = {"f16": (KEYS, 1), "tf32": (HALF, 2)}


def fa_kernel(head_dim: int) -> str:
    """The f16 prompt kernel for heads of head_dim: the instance built for that width, else
    the one that tests the width in its loops."""
    return f"attn_prefill_fa{head_dim}" if head_dim in FA_EXACT else "attn_prefill_fa"


def tensor_core(kernel: str | None) -> bool:
    return kernel is not None and (kernel == "attn_prefill_tc" or kernel.startswith(FA_BLOCKS))


def check_precision(precision: str) -> str:
    if precision not in PRECISIONS:
        raise ValueError(f"attn_precision must be one of {PRECISIONS}, got {precision!r}")
    return precision


def kernel_for(hp, cc: str, precision: str = "f16", smem_limit: int | None = None, cache: str = "f32",
               wgmma: bool = False) -> str | None:
    """The prompt attention kernel for these heads at this precision, None where none takes
    them (cuBLAS then, eagerly). The tensor-core kernels (sm_80+): head widths up to 128,
    multiples of 16 (f16) or 32 (tf32); attn_prefill_tc query heads in groups of up to 8,
    attn_prefill_fa groups of any size (in blocks of up to 8 of their heads). attn_prefill (float32
    FMA, also where a tensor-core one cannot run): groups of up to 16, widths multiples of 4
    up to 128, a float32 cache. smem_limit: a block's shared memory on the card (none: any
    fits). cache: the KV cache's type ("f16" takes precision "f16"). wgmma: the module has
    attn_prefill_wg128 (ModelSpec.wgmma, sm_90), which then takes f16 heads 128 wide."""
    check_precision(precision)
    if hp.n_head % hp.n_head_kv or hp.head_dim > 128:
        return None
    if (wgmma and precision == "f16" and hp.head_dim == WG_HEAD_DIM and cc.split(".")[0] == "9"
            and (smem_limit is None or smem_bytes(hp, WG_KERNEL) <= smem_limit)):
        return WG_KERNEL
    g, hd = hp.n_head // hp.n_head_kv, hp.head_dim
    fits = lambda kernel: smem_limit is None or smem_bytes(hp, kernel, bufs=1, cache=cache) <= smem_limit  # noqa: E731
    kernel = {"f16": fa_kernel(hd), "tf32": "attn_prefill_tc"}.get(precision)
    width = 16 if precision == "f16" else 32
    if kernel and int(cc.split(".")[0]) >= 8 and (g <= 8 or precision == "f16") and hd % width == 0 and fits(kernel):
        return kernel
    if cache != "f32":
        return None
    return "attn_prefill" if g <= 16 and hd % 4 == 0 and fits("attn_prefill") else None


def fa_heads(hp) -> int:
    """attn_prefill_fa's query heads a block: the largest divisor of the group up to 8 (the
    kernel works it out the same way)."""
    g = hp.n_head // hp.n_head_kv
    return max(d for d in range(1, min(g, FA_WARPS) + 1) if g % d == 0)


def rows(hp, kernel: str) -> int:
    """Query tokens a block: attn_prefill_fa 16 a warp, its 8 warps over the block's heads
    first (8 // fa_heads token tiles of 16; attn_prefill_wg128 the same)."""
    if kernel.startswith(FA_BLOCKS):
        return 16 * (FA_WARPS // fa_heads(hp))
    return ROWS[kernel]


def blocks_per_kv_head(hp, kernel: str) -> int:
    """attn_prefill_fa: the group's heads in blocks of fa_heads; the others: one."""
    return hp.n_head // hp.n_head_kv // fa_heads(hp) if kernel.startswith(FA_BLOCKS) else 1


def threads(hp, kernel: str) -> int:
    """A block's threads: attn_prefill a warp per query head of the group; attn_prefill_fa a
    warp per head and 16 tokens, up to 8 (attn_prefill_wg128 always 8: where fa_heads does not
    divide 8, as for groups of 5, the warps past its rows compute rows nobody writes); the other tensor-core kernels sixteen warps whatever
    the group (two per head of up to 8; those past the group only copy key tiles)."""
    g = hp.n_head // hp.n_head_kv
    if kernel == WG_KERNEL:      # two whole warpgroups: a wgmma is issued by all four warps of one
        return 32 * FA_WARPS
    if kernel.startswith(FA_BLOCKS):
        hb = fa_heads(hp)
        return 32 * hb * (FA_WARPS // hb)
    return 32 * g if kernel == "attn_prefill" else 512


def smem_bytes(hp, kernel: str, bufs: int = 2, cache: str = "f32") -> int:
    """A block's dynamic shared memory, row strides as in the kernels: attn_prefill holds q
    rows, two key and two value tiles and the probabilities (floats); attn_prefill_tc q rows
    (tf32) and `bufs` 64-key tiles of keys and values (float32); attn_prefill_fa `bufs` key
    and value tiles (f16) whatever the cache (a float32 cache's rows are rounded to f16
    before it runs, kv_rows_f16). (attn_prefill_fa's q lives in registers.)"""
    g, hd = hp.n_head // hp.n_head_kv, hp.head_dim
    tokens = ROWS.get(kernel, 0)
    if kernel == WG_KERNEL:      # three tiles from a 1024-byte boundary (the swizzle's period)
        return 3 * WG_TILE_BYTES + 1024
    if kernel.startswith("attn_prefill_fa"):
        return 2 * 2 * bufs * KEYS * (hd + 8)
    if kernel == "attn_prefill_tc":
        return 4 * (g * tokens * (hd + 4) + bufs * KEYS * (hd + 4) + bufs * KEYS * (hd + 8))
    return 4 * (g * tokens * hd + 2 * 32 * (hd + 1) + 2 * 32 * hd + g * tokens * 32)


def tile_buffers(hp, smem_limit: int, kernel: str, cache: str = "f32") -> int:
    """A tensor-core kernel's key tiles in flight: two (the next copied while this one is
    used) where a block has the room, else one."""
    return 2 if smem_bytes(hp, kernel, bufs=2, cache=cache) <= smem_limit else 1


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


def f16(a) -> np.ndarray:
    """cvt.rn.f16.f32: float32 rounded to f16, nearest even (subnormals kept, past 65504 inf)."""
    with np.errstate(over="ignore"):
        return np.asarray(a, dtype=np.float32).astype(np.float16).astype(np.float32)


# the rounding points of each tensor-core kernel: q (scaled), keys and values, probabilities
ROUNDING = {"tf32": (tf32, tf32_truncated, tf32), "f16": (f16, f16, f16)}


def attention_tc(q, k, v, hp, pos0: int, precision: str = "f16", sinks=None, window: int = 0,
                 layout: tuple[int, int] | None = None, start: int = 0) -> np.ndarray:
    """A tensor-core kernel's result in float64 between its rounding points. q (n, q_dim)
    float32 for positions pos0.., k and v (L, kv_dim) float32 the cache up to pos0 + n. The
    keys from `start` go in steps of the kernel's (layout: (keys a step, parts); None: the
    prompt kernel's, LAYOUT), dealt in turn to its parts: each part has its own online
    softmax (p rounded relative to that part's running max, as in the kernels) and the parts
    merge at the end."""
    round_q, round_kv, round_p = ROUNDING[precision]
    step, parts = layout or LAYOUT[precision]
    n, hd, hkv = q.shape[0], hp.head_dim, hp.n_head_kv
    g, L = hp.n_head // hkv, pos0 + n
    scale_log2 = np.float32(1.0 / np.sqrt(hd) * np.log2(np.e))
    qs = round_q(q * scale_log2).astype(np.float64).reshape(n, hkv, g, hd)
    ks = round_kv(k[:L]).astype(np.float64).reshape(L, hkv, hd)
    vs = round_kv(v[:L]).astype(np.float64).reshape(L, hkv, hd)
    last = pos0 + np.arange(n)
    ms, totals, os_ = [], [], []
    for h in range(parts):
        m = np.full((hkv, g, n), -np.inf)
        total = np.zeros((hkv, g, n))
        o = np.zeros((hkv, g, n, hd))
        for j0 in range(start + h * step, L, step * parts):
            j1 = min(L, j0 + step)
            s = np.einsum("nhgd,lhd->hgnl", qs, ks[j0:j1])
            gap = last[:, None] - np.arange(j0, j1)[None, :]
            s[..., (gap < 0) | (window > 0) & (gap >= window)] = -np.inf
            mn = np.maximum(m, s.max(axis=-1))
            base = np.where(mn == -np.inf, 0.0, mn)     # a row that has seen no key of this part
            alpha, p = np.exp2(m - base), np.exp2(s - base[..., None])
            total = total * alpha + p.sum(axis=-1)
            o = o * alpha[..., None] + np.einsum("hgnl,lhd->hgnd", round_p(p).astype(np.float64), vs[j0:j1])
            m = mn
        ms.append(m), totals.append(total), os_.append(o)
    top = np.max(ms, axis=0)                            # finite: a row's own key is in one part
    extra = 0.0
    if sinks is not None:
        sk = (np.asarray(sinks, dtype=np.float64) * np.log2(np.e)).reshape(hkv, g, 1)
        top = np.maximum(top, sk)
        extra = np.exp2(sk - top)
    f = [np.exp2(m - top) for m in ms]
    o = sum(oi * fi[..., None] for oi, fi in zip(os_, f)) / (sum(li * fi for li, fi in zip(totals, f)) + extra)[..., None]
    return o.transpose(2, 0, 1, 3).reshape(n, hp.q_dim)
