"""Decode attention's launch plan (templates/attn_decode*.cuh.j2): which kernel, how many
blocks per head. A block per query head (attn_decode_h64/128/256) or, for long contexts, a
block per key head taking its group of query heads (attn_decode_gqa_g*h*: the key and value
rows read once per key head); either split over several blocks per head (flash-decoding)
once the cache is long; at f16 precision (attn_precision="f16", sm_80+) the grouped
blocks run on tensor cores (attn_decode_gqa_tc_g*h*: emulate_tc is their arithmetic). The
backend launches the plan (backend_cuda.attention)."""
from __future__ import annotations

import numpy as np

from ..codegen.spec import ModelSpec
from . import prompt_attention
from .kv_cache import CACHE_TYPES

ATTN_DECODE_THREADS = 512   # attn_decode.cuh.j2's ATTN_THREADS
ATTN_DECODE_CHUNK = 128     # positions a block takes at a time (U * warps for heads up to 128)
GQA_THREADS, GQA_CHUNK = 256, 32   # attn_decode_gqa.cuh.j2: GQA_THREADS, GQA_CHUNK
GQA_GROUPS, GQA_MAX_SPLITS = (2, 4, 8), 32
GQA_SPLIT_CAP = 4 * GQA_CHUNK   # forced splits: the merge keeps every split's maxima and sums in shared memory
GQA_MAX_STAGES = 8              # chunk buffers of the ring (its waits take up to 7 in flight)
# Steps whose per-head blocks (a wave of them: splits_per_head) would each take this many
# positions or more take the grouped kernel (where it exists): below it the per-head kernel
# was faster. H100, Qwen3-30B-A3B heads (4 splits a head), the kernels alone in a graph of 8
# layers: per head 13.2 against 14.2 us at 1536 positions, grouped 14.7 against 15.9 at 2048,
# 20.1 against 26.4 at 4096, 39.4 against 87.5 at 16384. H200, tg64 of whole models: Qwen3
# (4 splits) even at 2048, gpt-oss-20b (64 heads: 2 splits) even at 512 and grouped 2% faster
# at 1024, 6% at 2048, 57% at 16384 (scratch probe, 2026-11-28).
GQA_MIN_KV_PER_BLOCK = 512
TC_GROUPS, TC_TILE, TC_OS_PAD = (2, 4, 8), 16, 2   # attn_decode_gqa_tc: its variants, positions a tile, O row pad
TC_WARPS = GQA_THREADS // 32   # attn_decode_gqa_tc: a split takes at least a tile a warp
TC_STATIC = 16 * 1024           # attn_decode_gqa_tc's static shared memory, rounded up (~14 KB)


def splits_per_head(hp, n_ctx: int, sm_count: int) -> int:
    """Blocks per query head of decode attention for a cache of n_ctx positions: one wave of
    blocks (one fits an SM) once the context is long, never more than its chunks. The count
    used at a step is min(this, the chunks the step's context fills), read on the device."""
    return max(1, min(sm_count // hp.n_head, -(-n_ctx // ATTN_DECODE_CHUNK), 256))


ELEMENT_BYTES = {c: np.dtype(t).itemsize for c, t in CACHE_TYPES.items()}   # a KV cache element


def gqa_group(hp) -> int | None:
    """The query heads a grouped block takes: the key head's group where a variant is built
    for it, a share of GQA_GROUPS[-1] of a group of a multiple of that (Qwen3-235B's 16: two
    blocks a key head, each reading its rows), else None."""
    g = hp.n_head // hp.n_head_kv
    if g in GQA_GROUPS:
        return g
    return GQA_GROUPS[-1] if g % GQA_GROUPS[-1] == 0 else None


def can_group(hp, cache: str = "f32") -> bool:
    """Whether the grouped decode attention (a block per key head or share of its group)
    takes these heads: its rows are copied in 16-byte pieces, so widths are multiples of 4
    (float32 cache) or 8 (f16)."""
    return (gqa_group(hp) is not None and hp.head_dim <= 128
            and hp.head_dim % (16 // ELEMENT_BYTES[cache]) == 0)


def tc_group(hp) -> int | None:
    """The query heads a tensor-core grouped block takes: the largest of TC_GROUPS that
    divides the group (the whole group up to 8; Qwen3-235B's 16 in two blocks), else None."""
    g = hp.n_head // hp.n_head_kv
    return max((d for d in TC_GROUPS if g % d == 0), default=None)


def can_tc(hp) -> bool:
    """Whether the tensor-core grouped kernel takes these heads: a lane loads 8 dimensions of
    a key row at a time and W/8 of a value row, so widths are multiples of 16 up to 128."""
    return tc_group(hp) is not None and hp.head_dim <= 128 and hp.head_dim % 16 == 0


def tc_smem(hp, smem_limit: int | None = None) -> int:
    """attn_decode_gqa_tc's dynamic shared memory: at least its warps' O rows, [8][G][W + 2]
    floats; given a block's shared memory on the card, as much more as holds the records of
    a full wave of splits (G (head_dim + 2) floats each), less TC_STATIC for the kernel's
    own arrays: the merging block or blocks take theirs in one batch (one block merges
    records of up to 32 KB, 16 splits of 8 heads of 64; a share of 32 splits of 8 heads of
    128 is 18 KB)."""
    g = tc_group(hp)
    least = 4 * TC_WARPS * g * (_gqa_width(hp.head_dim) + TC_OS_PAD)
    if smem_limit is None:
        return least
    records = 4 * GQA_MAX_SPLITS * g * (hp.head_dim + 2)
    return max(least, min(records, (smem_limit - TC_STATIC) // 16 * 16))


def _gqa_width(head_dim: int) -> int:
    """The grouped kernel's variant width for heads of head_dim (up to 128)."""
    return 64 if head_dim <= 64 else 128


def ring(hp, smem_limit: int, stages: int | None = None, cache: str = "f32") -> tuple[int, int]:
    """(stages, dynamic shared memory bytes) of the grouped kernel: as many chunk buffers
    (GQA_CHUNK key rows padded by 16 bytes, as many value rows, of cache elements) as a
    block's shared memory holds besides the kernel's static arrays, up to GQA_MAX_STAGES.
    After the sweep the ring takes the value phases' sums (float32: (1024 / width) * g *
    head_dim * 4 bytes), so it is never smaller than those (two float32 buffers always
    hold them, f16 ones may need four). stages: fewer than fit, forced (tests); raised to
    what holds the sums."""
    g, hd, eb = gqa_group(hp), hp.head_dim, ELEMENT_BYTES[cache]
    width = _gqa_width(hd)
    static = 4 * (g * width + GQA_CHUNK * g + (GQA_THREADS // 32) * g * GQA_CHUNK + 3 * g) + 64
    chunk = eb * GQA_CHUNK * (2 * hd + 16 // eb)
    sums = 4 * (GQA_THREADS // (width // 4)) * g * hd
    least = max(2, -(-sums // chunk))
    fit = min(GQA_MAX_STAGES, (smem_limit - static) // chunk)
    if fit < least:
        raise ValueError(f"grouped decode attention needs {least} buffers of {chunk} bytes; a block has {smem_limit}")
    stages = max(least, min(stages, fit)) if stages else fit
    return stages, stages * chunk


def plan(hp, n_ctx: int, sm_count: int, grouped: bool, splits: int | None = None,
         cache: str = "f32", tc: bool = False) -> tuple[str, int, int, int]:
    """(kernel, blocks of heads, threads, splits) of decode attention for a cache of n_ctx.
    grouped: a block per key head and its query heads (attn_decode_gqa: the rows read once
    per key head; tc: on tensor cores), else a block per query head. splits: forced blocks
    per head (None: one wave, at most the cache's chunks)."""
    if grouped and tc:
        if not can_tc(hp):
            raise ValueError(f"tensor-core decode attention takes groups of a multiple of 2 query heads and "
                             f"heads of up to 128, multiples of 16; this model has "
                             f"{hp.n_head // hp.n_head_kv} and {hp.head_dim}")
        g = tc_group(hp)
        blocks = hp.n_head // g
        splits = min(splits, GQA_SPLIT_CAP) if splits else max(1, min(sm_count // blocks, GQA_MAX_SPLITS,
                                                                      -(-n_ctx // (TC_TILE * TC_WARPS))))
        return f"attn_decode_gqa_tc_g{g}h{_gqa_width(hp.head_dim)}", blocks, GQA_THREADS, splits
    if grouped and not can_group(hp, cache):
        raise ValueError(f"grouped decode attention takes groups of {GQA_GROUPS} query heads (or multiples of "
                         f"{GQA_GROUPS[-1]}) and heads of up to "
                         f"128 (multiples of {16 // ELEMENT_BYTES[cache]} with a {cache} cache); this model has "
                         f"{hp.n_head // hp.n_head_kv} and {hp.head_dim}")
    if grouped:
        g = gqa_group(hp)
        blocks = hp.n_head // g
        splits = min(splits, GQA_SPLIT_CAP) if splits else max(1, min(sm_count // blocks, GQA_MAX_SPLITS,
                                                                      -(-n_ctx // GQA_CHUNK)))
        return f"attn_decode_gqa_g{g}h{_gqa_width(hp.head_dim)}", blocks, GQA_THREADS, splits
    splits = splits or splits_per_head(hp, n_ctx, sm_count)
    return ModelSpec.decode_kernel(hp.head_dim), hp.n_head, ATTN_DECODE_THREADS, splits


def grouped_min_kv(hp, sm_count: int) -> int:
    """Positions attended from which a step takes the grouped kernel: where the per-head
    kernel's wave of blocks would take GQA_MIN_KV_PER_BLOCK positions each (2048 for
    Qwen3-30B-A3B's 32 heads on 132 SMs, 1024 for gpt-oss's 64)."""
    return GQA_MIN_KV_PER_BLOCK * max(1, sm_count // hp.n_head)


def grouped_at(hp, pos0: int, sm_count: int, smem_limit: int | None = None, cache: str = "f32",
               tc: bool = False) -> bool:
    """The step at position pos0 (known on the host: the backend captures a graph per
    choice) takes the grouped kernel (tc: the tensor-core one): from grouped_min_kv
    positions, where it has a variant for the heads and, given a block's shared memory on
    the card, where its buffers fit (else the per-head kernel, which needs no more than 17 KB)."""
    if not ((can_tc(hp) if tc else can_group(hp, cache)) and pos0 + 1 >= grouped_min_kv(hp, sm_count)):
        return False
    if tc:
        return smem_limit is None or tc_smem(hp) + TC_STATIC <= smem_limit
    if smem_limit is not None:
        try:
            ring(hp, smem_limit, cache=cache)
        except ValueError:
            return False
    return True


def emulate_tc(q, k, v, hp, pos0: int, splits: int, sinks=None, window: int = 0) -> np.ndarray:
    """attn_decode_gqa_tc's result in float64 between its rounding points (those of
    attn_prefill_fa: prompt_attention.attention_tc) for the token at pos0, launched with
    `splits` blocks a head: the 16-position tiles from the window's first are dealt in turn
    to 8 warps a split (as many splits as have a tile a warp, up to `splits`), each warp with
    an online softmax of its own."""
    n_kv = pos0 + 1
    t0 = (max(0, n_kv - window) if window else 0) // TC_TILE
    tiles = -(-n_kv // TC_TILE) - t0
    active = min(splits, -(-tiles // TC_WARPS))
    return prompt_attention.attention_tc(q, k, v, hp, pos0, "f16", sinks=sinks, window=window,
                                         layout=(TC_TILE, TC_WARPS * active), start=t0 * TC_TILE)
