"""Which kernel runs a product: the per-GPU profile's choice when one exists for the
shape and token count, else the defaults below (chosen from measurements on an H100).

A choice is a path and a spec:
  mmvq        mat-vec, every expert's weights read once for all its tokens (n <= 8)
  mmq_id      one int8 tensor-core launch for all experts, tiles from the routing kernel
  per_expert  gather each expert's tokens, one dense launch per expert, scatter back
  mmf_id      one f16 tensor-core launch for all experts (weights dequantized in registers)
  mmf         its dense form, in place of mmq
"""
from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import dataclass, replace

from ..codegen.quant import KERNEL_BLOCK, quant_type
from ..codegen.spec import KernelSpec, MmfSpec, MmqSpec, MmvqSpec

PATHS = ("mmvq", "mmq_id", "per_expert", "mmf_id", "mmf")
F16_PATHS = ("mmf_id", "mmf")
MMVQ_MAX_TOKENS = 8     # past this the int8 tensor-core tiles win by default
# Expert mat-vec in routing-table mode stays correct for any n, and with 1-2 tokens per
# expert (n = 16..32 of 128 experts x top-8) it streams whole weight rows where the
# tensor-core tiles read 128-byte pieces of many rows: the tuner may choose it up to here.
MMVQ_ID_TUNABLE_TOKENS = 32


@dataclass(frozen=True)
class Choice:
    path: str
    spec: KernelSpec
    source: str = "default"   # "default", "profile" or "rule" (mmf_choice)
    paths: tuple[str, ...] = ()   # a profile entry's: the paths its study measured
    kept_default: bool = False    # a profile entry's: its study found nothing faster than its default
    trials: int | None = None     # a profile entry's: how many specs its study timed
    wgmma_timed: bool = False     # a profile entry's: its study timed wgmma tiles (sm_90)


def _pow2_at_least(v: float, lo: int, hi: int) -> int:
    p = lo
    while p < v and p < hi:
        p *= 2
    return p


def guesses_ids(n: int, ids: bool) -> bool:
    """Whether the decode form guesses its expert ids (MmvqSpec.guess; its quantizer then
    releases it at once): for one token with experts. H100, one call, cold, against the form
    before (BENCHMARKS.md): Qwen3 q4_0 fused gate+up 8.09 -> 7.20 us, its two separate calls
    10.8 -> 9.6; q8_0 12.76 -> 12.16. Not past one token: there the same launches took 39.2
    -> 40.1 us at n=8 (the early blocks hold the SMs for several waves), and the guessing
    kernel with its quantizer waiting first 2.5-5% more than the plain one at n = 2..8."""
    return ids and n == 1


# The model's dense one-token products (x quantized by the kernel before) on rows of at
# least this many k-units (32 blocks of 32 a lane) split the units over the block's warps
# (MmvqSpec.ksplit): GLM-4.5-Air's attention output product is 12 units a row. H200, tg128
# with the rule against without, one process: GLM-4.5-Air's 12-layer slice 952 -> 992,
# Qwen3-30B-A3B (4 units) 623 -> 643, gpt-oss-20b 657 -> 663 (BENCHMARKS.md).
KSPLIT_MIN_UNITS = 4
# ... and only products of at most this many rows: past it the unsplit form already has
# warps enough (GLM-4.5-Air's qkv, 14336 rows of 4 units, is 3584 warps unsplit) ...
KSPLIT_MAX_ROWS = 8192
# ... over this many warps, not 4: fewer warps each with more units in flight. H200, tg128,
# one process, 4 warps and every row count (the rule before) -> 4 warps up to 8192 rows ->
# 2 warps up to 8192 rows: GLM slice 1011 -> 1017 -> 1036, Qwen3-30B-A3B 643 -> 643 -> 652,
# gpt-oss-20b 663 -> 663 -> 668 (BENCHMARKS.md).
KSPLIT_WARPS = 2
# The model's wait-first expert gate/up (one unit in flight a warp) on rows of at least this
# many units splits them over 4 warps: four dependent round trips become one. Shorter rows
# lose more to the meet in shared memory than they gain. H200, tg128 with the rule against
# without, one process: GLM-4.5-Air's slice (4 units) 994 -> 1012; at 2 units Qwen3-30B-A3B
# lost 643 -> 630, at 3 gpt-oss-20b 664 -> 637 (BENCHMARKS.md).
FUSED_KSPLIT_MIN_UNITS = 4
FUSED_KSPLIT_WARPS = 4
# Below the split, rows of more than two k-units (gpt-oss's k = 2880: three) of 16-byte
# blocks without super-blocks (q4_0, mxfp4) take one row a warp with two units in flight: two rows of one unit made three
# dependent round trips a warp. H200, gpt-oss-20b tg128, one process, two rounds: MXFP4
# 737.6, 738.1 t/s against 729.9, 726.4 (two rows of two units, 96 registers: 703.6,
# 704.0); q8_0's 32-byte blocks lose (617.4, 617.8 against 630.7, 631.4) and keep two rows,
# as do the super-block formats (their scale bytes a unit: the K-quants' rule below).
FUSED_TWO_UNIT_MIN_UNITS = 3
# The model's down product that adds its experts' sum to the residual (MmvqSpec.combine)
# keeps one k-unit in flight a warp on rows of at most this many units: its launch bounds
# then hold 32 warps an SM (MmvqSpec.combine_blocks), where two units' registers held 24 or
# fewer and left a 2048-row product's 512 blocks of 8 warps a second wave. Longer rows keep
# two units (a dense first layer's down, ~11 units: as many round trips). H200, tg128 /
# @ d4096, one process, two units against one: Qwen3-30B-A3B (1 unit) 648.4 -> 682.0 /
# 502.7 -> 523.1, DeepSeek-V2-Lite (2 units) 547.9 -> 558.0 / 525.5 -> 533.8, gpt-oss-20b
# (3 units, blocks of 4 warps: one wave either way) 671.6 -> 672.4 / 622.7 -> 624.6.
COMBINE_ONE_UNIT_MAX_UNITS = 2
# Rows that keep two units in flight take two rows a warp, not four: 56-79 registers against
# 78-124, so more warps an SM share the product's round trips. H200, tg128 / @ d4096, one
# process, alternating, two rounds: gpt-oss-20b (3 units) 681.1, 678.8 -> 697.1, 697.1 /
# 627.7, 627.4 -> 643.9, 643.4 (+2.5%). On rows of 1-2 units two rows a warp lost (Qwen3-
# 30B-A3B 683 -> 631 with one unit, 647 with two; DeepSeek-V2-Lite 679 -> 655, 666).
COMBINE_TWO_UNIT_ROWS = 2
# Rows of at least this many k-units split each slot's units over COMBINE_KSPLIT_WAYS warps
# (MmvqSpec.ksplit with combine: a block of top_k x ways warps) in COMBINE_KSPLIT_FORM's
# (rows a warp, units in flight): Mixtral-8x7B's down (14 units, 2 slots) ran at 3.1 TB/s
# against its gate/up's 4.0, a warp walking a slot's 14 units in 7 dependent pairs. H200,
# synthetic Mixtral-8x7B q4_0, tg128, alternating in one process, two rounds: a warp a slot
# 385.7, 385.5; two warps a slot of four rows with one unit in flight (56 registers, launch
# bounds of 8 blocks: 1024 blocks of 4 warps, one wave) 397.9, 397.9 (+3.2%); two rows with
# two units 379.5, 379.4 (2048 blocks of 4 warps at 56 registers: two waves); four warps a
# slot of two rows 369.6, 369.6. Measured at 14 units only; 8 is where a warp a slot still
# walks 4 dependent pairs.
COMBINE_KSPLIT_MIN_UNITS = 8
COMBINE_KSPLIT_WAYS = 2
COMBINE_KSPLIT_FORM = (4, 1)
# moe_combine_rms_norm's threads a token: a decode step's one block takes 1024 (each thread's
# top_k loads issued together); a prompt's tokens this many, eight blocks an SM, so that one
# block's reduction and writes overlap others' loads. H200, synthetic Qwen3-30B-A3B q4_0
# (balanced routing), alternating in one process, two rounds: 1024 -> 256 pp2048 29159,
# 29179 -> 29755, 29823 (+2.1%), pp4096 31598, 31608 -> 32239, 32230 (+2.0%).
COMBINE_PROMPT_THREADS = 256


def row_units(k: int) -> int:
    """A row's k-units: 32 lanes a unit, a lane a quant block (KERNEL_BLOCK values)."""
    return -(-k // (32 * KERNEL_BLOCK))


def default_mmvq(qtype: str, n: int, ids: bool, k: int = 0, m: int = 0) -> MmvqSpec:
    """The decode form (MmvqSpec.decode) up to 8 tokens: a block per (token, slot) pair, no
    routing launch (with 128 experts a few tokens rarely share one, so grouping saves
    little); x quantized once by the launch just before, the weights streamed (evict-first),
    the product launched with PDL so that its blocks request their expert ids and weights
    while x is being quantized. H100, one call, hot (BENCHMARKS.md), against what the shipped
    profile had chosen before the form existed: Qwen3 q4_0 gate n=4 12.2 -> 9.6 us, n=8 23.1
    -> 19.4; its down product n=8 42.5 -> 21.3; q8_0 n=8 37.6 -> 33.8. One token with
    experts: the guessing form (guesses_ids), but for K-quants: their raw 16-byte scales
    overflow the 80 registers that form is bounded to (it spills); H100, the tuner's q4_K
    Qwen3 entry (shipped profile), 5.84 us guessing against 4.45 without. q6_K keeps 12 meta
    bytes a block (three words a row and unit, as q4_K's four) and follows the same rules.
    k and m (given by the model's one-token dense products; m 0: not known): long rows of a
    product with few of them split k (KSPLIT_MIN_UNITS, KSPLIT_MAX_ROWS)."""
    guess = guesses_ids(n, ids) and quant_type(qtype).sub_blocks == 1
    spec = MmvqSpec.decode(qtype, ids=ids, guess=guess)
    split = not ids and n == 1 and row_units(k) >= KSPLIT_MIN_UNITS and m <= KSPLIT_MAX_ROWS
    return replace(spec, ksplit=True, warps=KSPLIT_WARPS) if split else spec


def default_combine(qtype: str, k: int, top_k: int) -> MmvqSpec:
    """The decode form (MmvqSpec.decode) adding the weighted sum of a token's top_k expert
    products to its residual row: a warp a slot, one k-unit in flight where the rows are
    short (COMBINE_ONE_UNIT_MAX_UNITS), else two units of two rows (COMBINE_TWO_UNIT_ROWS)."""
    warps = next((w for w in (1, 2, 4, 8) if w >= top_k), None)
    if warps is None:
        raise ValueError(f"the combining down product takes at most 8 slots a token, got {top_k}")
    if row_units(k) <= COMBINE_ONE_UNIT_MAX_UNITS:
        return replace(MmvqSpec.decode(qtype), warps=warps, combine=True, units=1)
    if row_units(k) >= COMBINE_KSPLIT_MIN_UNITS and top_k * COMBINE_KSPLIT_WAYS in (2, 4, 8):
        rows, units = COMBINE_KSPLIT_FORM
        return replace(MmvqSpec.decode(qtype, rows=rows), warps=top_k * COMBINE_KSPLIT_WAYS, combine=True,
                       units=units, ksplit=True)
    return replace(MmvqSpec.decode(qtype, rows=COMBINE_TWO_UNIT_ROWS), warps=warps, combine=True, units=2)


def default_fused(qtype: str, n: int, act: str, bias: bool, ids: bool, k: int = 0,
                  wait_first: bool = False) -> MmvqSpec:
    """Up to 8 tokens: the decode form (MmvqSpec.decode), a block per (token, slot) pair
    streaming gate and up rows, x quantized once before. Two rows of each per warp for 4-bit
    blocks and rows of at most two k-units (k <= 2048: 80 registers, one wave at n=1); one
    row otherwise (q8_0's 32-byte blocks, gpt-oss's k=2880). H100, cold, one call
    (BENCHMARKS.md), against the routing tiles this replaced at n = 2..8: Qwen3 q4_0 n=2
    18.0 -> 13.1 us, n=8 63.7 -> 39.7; gpt-oss q4_0 n=8 125.7 -> 101.4; q8_0 Qwen3 n=8 84.5
    -> 71.9. With 128 experts (or 32 and top-4) a few tokens rarely share an expert, so
    grouping them saves little and costs a routing launch; the one loss seen: q8_0 gpt-oss
    at n=8, 182.8 against 169.7 us with tiles of 8. The row rule is the one-token sweep's;
    at n >= 2 the other row counts were within 5%. One token with experts (the guessing
    form), where two rows of two k-units in flight do not fit one wave: two rows with one
    k-unit in flight (MmvqSpec.units). The q8_0 row of one had run two waves (1536 blocks,
    6 an SM); H100, cold, two rounds: q8_0 Qwen3 11.20-11.43 -> 9.93-10.01 us (two separate
    calls 10.17-10.28), q8_0 gpt-oss 25.54-25.56 -> 25.16-25.17, q4_0 gpt-oss 16.38-16.44 ->
    16.22-16.31. wait_first: x was quantized by an earlier kernel and the kernel just before
    wrote the ids (the model's expert gate/up after the router): the form that waits first,
    which cannot guess, with two rows of one unit for every type (measured faster than two
    units in flight for q4_0 as well, below), but one row of two units where a row has
    three of q4_0's or mxfp4's blocks (FUSED_TWO_UNIT_MIN_UNITS), and four or more split over warps. K-quants
    keep a super-block's raw 16 scale bytes a row and unit, which doubles q4_0's buffers
    (118 registers: two waves), so they guess with two rows of one unit too. H100, one call,
    cold, Qwen3 (BENCHMARKS.md): q4_K guessing 9.06 -> 6.19 us (q4_0's 6.34), wait-first
    8.59 -> 7.27 (q4_0 7.91 -> 7.27); the model's tg128, same call: q4_K 566.7 -> 588.2 t/s,
    q4_0 593.0 -> 602.4."""
    if n <= MMVQ_MAX_TOKENS:
        guess = guesses_ids(n, ids) and not wait_first
        q = quant_type(qtype)
        short_4bit = q.qs_bytes == 16 and 0 < k <= 2048     # two units of two rows: 80 registers
        rows, units = 1, 2
        if (ids and n == 1 and wait_first and q.qs_bytes == 16 and q.sub_blocks == 1
                and FUSED_TWO_UNIT_MIN_UNITS <= row_units(k) < FUSED_KSPLIT_MIN_UNITS):
            rows, units = 1, 2
        elif ids and n == 1 and (wait_first or not short_4bit or q.sub_blocks > 1):
            rows, units = 2, 1
        elif short_4bit:
            rows = 2
        spec = MmvqSpec.decode(qtype, ids=ids, rows=rows, act=act, bias=bias, guess=guess, units=units,
                               wait_first=wait_first)
        if wait_first and ids and n == 1 and row_units(k) >= FUSED_KSPLIT_MIN_UNITS:
            spec = replace(spec, warps=FUSED_KSPLIT_WARPS, ksplit=True)
        return spec
    return MmvqSpec(qtype, tokens=_pow2_at_least(n, 1, 8), warps=4, rows=2 if n >= 8 else 1, ids=ids,
                    act=act, bias=bias)


def default_mmq(qtype: str, tokens_per_tile: float, ids: bool, stream_k: bool | None = None) -> MmqSpec:
    """Tile width from the tokens each expert receives, not from the batch: with 128
    experts and 128 tokens x top-8, each expert sees ~8 tokens and a 64-wide tile would
    be mostly empty (where llama.cpp loses most of its time). Twice the mean leaves room
    for the experts above it; the H100 sweep found no gain from stream-k for MoE tiles
    (Qwen3's, many waves; below one wave it gains: default_mul_mat_id).
    Dense products (one "expert", regular tiles) keep stream-k for their last wave.
    Past 16 tokens a tile is 32 wide: H100, same call, hot (BENCHMARKS.md), 64-wide tiles
    against 32 (y128, 4 warps, 8 k-blocks, 2 stages): dense 4096x2048 n=512 q8_0 116.6 ->
    83.5 us, n=2048 373.8 -> 274.9 (a 64-wide q8_0 stage pair fills an SM's shared memory);
    q4_0 n=2048 on Qwen3's gate_up, 128 tokens an expert, 727.5 -> 686.4, q8_0 1177.0 -> 908.1."""
    if ids:
        x = 64 if tokens_per_tile >= 256 else _pow2_at_least(2 * tokens_per_tile, 8, 32)
    else:
        x = _pow2_at_least(tokens_per_tile, 16, 32)
    sk = (not ids) if stream_k is None else stream_k
    return MmqSpec(qtype, x=x, y=128, warps=4, kblocks=8, stages=2, ids=ids, stream_k=sk)


# The f16 tensor-core path where it was measured to win on the H100 (mmf_choice).
# MOEFORGE_MMF=0 turns it off (the int8 tiles of the profile or the defaults run).
# Dense products from 128 tokens: the rule's wide tile, k split up to 4 ways, against the
# default int8 tile (x32y128, stream-k), H200, weights rotated past the L2, random inputs
# (scripts/product_ab.py dense-f16, BENCHMARKS.md "Dense f16 tiles from 128 tokens"), the
# attention products of Qwen3-30B-A3B, Mixtral-8x7B, gpt-oss-20b and DeepSeek-V2-Lite, q4_0
# and q8_0: at 128 tokens 0.52-0.84x the int8 time (Qwen3's qkv 35.2 -> 25.0 us, attn_out
# 38.7 -> 27.8), at 256 0.59-0.85x; at 64 tokens 0.69-0.96x but Mixtral's 6144-row qkv 1.11
# and 1.20x and gpt-oss's q8_0 qkv 1.10x (the 128-token tile three-quarters empty).
MMF_MIN_DENSE_TOKENS = 128
MMF_WIDE_TILE = (128, 128, 4, 4, 2)   # x, y, warps, kblocks, stages
MMF_MAX_SPLITS = 4
MMF_MIN_TOKENS_PER_EXPERT = 256
# Formats whose int8 tiles pay more a block, so that the f16 tiles win from fewer tokens an
# expert (with the narrower tiles below 64, MMF_NARROW_TILES). q3_K: two k16 products a
# block and its scales folded into the integer sums (as q6_K's); q2_K: a second product a
# block, of its mins. H200, hot, Qwen3 experts, 128-token f16 tiles against the default int8
# ones (BENCHMARKS.md, "q3_K kernels", "q2_K kernels"):
# q3_K n=512 (32 an expert) 228.4 against 159.5 us, n=1024 (64) 230.5 against 261.1, n=2048
# 357.5 against 451.1, n=4096 590.1 against 968.2; q2_K 229.5 against 178.9, 234.0 against
# 289.2, 357.7 against 514.6, 594.2 against 1123.9.
# q6_K (its int8 tiles pay two k16 IMMA and the scale IMADs a fragment, as q3_K's) from 64:
# H200, against the int8 default, Qwen3 experts n=1024 (64 an expert) gate/up 440.3 against
# 575.4 us, down 271.2 against 334.2, Mixtral-8x7B's at 64 0.72x and 0.71x, from 128
# 0.43-0.63x; at 16 and 32 the narrow tiles tie (0.94-1.02x: not taken; BENCHMARKS.md "q6_K
# on f16 tiles").
MMF_MIN_TOKENS_PER_EXPERT_OF = {"q2_K": 16, "q3_K": 16, "q5_K": 64, "q6_K": 64, "q4_K": 128, "iq4_xs": 128,
                                "q8_0": 128}
# q4_K, iq4_xs and q8_0 from 128 tokens an expert, where their int8 tiles fall behind (H200,
# hot, Qwen3 experts, one call, BENCHMARKS.md "f16 tiles from 128 tokens an expert": n=2048,
# q4_K x64y256 359.9 against the int8 x32 tile's 401.0 us, iq4_xs 380.7 against 432.0, q8_0's
# wide tile 367.8 against 403.9; DeepSeek-V2-Lite's and gpt-oss-20b's shapes gain as well); at
# 64 an expert all of them tie (q4_K 220.6 against 223.0), at 32 the int8 tiles win or tie.
# q4_0's int8 tiles tie the best f16 tile at 128 an expert (331.4 against 325.4): 256 stands.
# Below 64 tokens an expert the wide tile is mostly empty: narrower f16 tiles (x, y, warps,
# kblocks, stages), each below its count of tokens an expert. H200, hot, Qwen3 experts,
# against the int8 tiles' default: n=256 (16 an expert) x32y256 q2_K 99.4 against 125.5 us,
# q3_K 95.0 against 108.5; n=512 (32) x64y256 143.4 against 177.7, 141.2 against 156.7; at
# n=1024 the wide tile and x64y256 tie (232.7 and 233.4). q4_0's int8 tiles beat all of them
# up to n=1024 (76.6 against 87.5 us at n=256): its rule keeps 256 tokens an expert.
MMF_NARROW_TILES = ((32, (32, 256, 8, 8, 2)), (64, (64, 256, 8, 4, 3)))
# Formats of 256-weight super-blocks whose stages hold whole ones (kblocks 8): the wide tile
# then has only two stages of 8, and x64y256's three stages of 8 beat it for expert products
# at any count of tokens an expert measured (H200, hot, Qwen3 experts, n=2048 and 4096: q4_K
# 359.9 and 596.1 us against the wide tile's 432.7 and 723.9, iq4_xs 380.7 and 664.6 against
# 481.8 and 803.8). q5_K's x64y256 needs more shared memory than an H200 has at three
# stages; at two it beats q5_K's int8 tiles from 64 tokens an expert and the wide f16 tile
# beyond (H200, hot, Qwen3 experts, one call, BENCHMARKS.md "q5_K's two-stage f16 tile":
# n=1024 237.2 against the int8 default's 249.5 us, n=2048 380.8 against 449.9, n=4096 631.2
# against the wide tile's 843.7 and the int8 default's 862.5).
MMF_EXPERT_TILE_OF = {"q4_K": (64, 256, 8, 4, 3), "iq4_xs": (64, 256, 8, 4, 3), "q5_K": (64, 256, 8, 4, 2)}
MMF_CC_MAJOR = (9,)
# the formats the rules give f16 tiles: all that have them (a format's A/B switch:
# scripts/dispatch_ab.py MODEL "MMF_TYPES=('q4_K',)")
MMF_TYPES = MmfSpec.QTYPES
# sm_90a's warpgroup MMA in place of the wide mma.sync tile (unsplit): x read by the
# tensor cores from 128-byte-swizzled panels, the rows dequantized by each warp into the
# MMA's A registers (MmfSpec.wgmma). H200, q4_0, against the wide tile, random and skewed
# routing (scripts/product_ab.py wgmma, BENCHMARKS.md "Prompt products on wgmma"), with
# the rows through shared memory as first built: Mixtral-8x7B's gate/up n=2048 4391 ->
# 3322 us (x128y256), down 2148 -> 1572 (x128y128), gpt-oss-20b's gate/up 1364 -> 1008,
# Qwen3's n=4096 1099 -> 872, dense q|k|v 6144x4096 n=2048 386 -> 303; 0.72-0.82x
# everywhere, q8_0 0.75-0.92x. The rows from registers then took 0.67-0.92x of that at
# 2048 tokens, every product of q4_0, q4_K and q6_K (Mixtral's gate/up q4_0 3269.8 ->
# 2599.1 us, q6_K 4684.6 -> 3224.8, down q4_0 1543.6 -> 1343.5; BENCHMARKS.md "wgmma's
# rows from registers"). The 256-row tile halves x's traffic a weight but has half the
# blocks: it goes where its mean-routing tiles fill MMF_WGMMA_Y256_MIN_WAVES waves
# (Mixtral's down at 2048 tokens, 4 waves: 1746 against the 128-row tile's 1550 us; its
# gate/up at 27 waves 3270 against 3364, both through shared memory). Since the expert
# tiles' epilogue went through shared memory (8d956dd) the 256-row tile wins from 4 waves:
# H200, q4_0, the rule's tile at 8 waves against 4 (scripts/tree_ab.py, alternating
# processes, bit-identical outputs), Qwen3-30B-A3B's down n=1024 / 2048 (7.8 waves) 197.0
# -> 165.2 / 271.8 -> 235.4 us, its gate|up (5.8) 307.2 -> 277.8 / 421.4 -> 380.4,
# DeepSeek-V2-Lite's down n=2048 (7.8) 267.2 -> 243.9, gate|up n=1024 (5.3) 314.9 ->
# 282.8, gpt-oss-20b's down n=2048 (5.8) 448.5 -> 424.8, gate|up n=1024 (5.6) 584.4 ->
# 523.6; synthetic Qwen3-30B-A3B q4_0 pp2048 33905-33914 -> 36880-36972 t/s. At 4096
# tokens the 128-row tile lost everywhere (0.86-0.95x). Under 4 waves nothing measured
# since (Mixtral's down at 3.9 waves kept the 128-row tile, above). The super-block
# formats (q4_K, q5_K, iq4_xs: stages of half of one, MmfSpec.part_super) take them in
# place of their own expert tile (MMF_EXPERT_TILE_OF) from MMF_WGMMA_MIN_TOKENS_PER_EXPERT
# too (BENCHMARKS.md "wgmma for the super-block formats").
WGMMA = True     # off: the mma.sync tiles everywhere (as MOEFORGE_WGMMA=0; scripts/dispatch_ab.py's switch)
MMF_WGMMA_Y256_MIN_WAVES = 4
# With them the f16 tiles win from 64 tokens an expert for every format that has them.
# H200, the int8 default (the super-block formats' own f16 tile from 128) against the
# wgmma tile at 64 an expert: q4_0 Mixtral-8x7B's gate/up and down 0.92x and 0.86x,
# gpt-oss-20b's 0.97x and 0.96x, Qwen3-30B-A3B's 0.94x and 1.08x; q4_K 0.81x, 0.76x,
# Qwen3's 0.87x and 0.94x; at 96 DeepSeek-V2-Lite's 0.69-0.78x; at 32-48 1.14-2.07x (the
# int8 tiles stay there). With the rows through shared memory it was 128: at 64 an
# expert 1.10-1.94x.
MMF_WGMMA_MIN_TOKENS_PER_EXPERT = 64


def _device_cc_major() -> int | None:
    from .device import device_info, has_gpu
    if not has_gpu():
        return None
    import cupy as cp
    return int(device_info(cp.cuda.Device().id)["cc"].split(".")[0])


def device_sm_count() -> int:
    """The current device's; without a GPU an H100's (where the rule's tiles were measured),
    so that the tuner's seeds can be listed on a CPU."""
    from .device import device_info, has_gpu
    if not has_gpu():
        return 132
    import cupy as cp
    return device_info(cp.cuda.Device().id)["sm_count"]


@contextlib.contextmanager
def on_card(cc_major: int | None, sm_count: int):
    """The rules as they answer on another card (its compute capability's major and its
    SMs), asked on any machine: what a profile's entries run on the card it was made on
    (`moeforge profile show`). Not for a process that launches kernels meanwhile."""
    global _device_cc_major, device_sm_count
    saved = _device_cc_major, device_sm_count
    _device_cc_major, device_sm_count = (lambda: cc_major), (lambda: sm_count)
    try:
        yield
    finally:
        _device_cc_major, device_sm_count = saved


def mmf_dense_splits(n: int, m: int, sm_count: int) -> int:
    """Blocks sharing each wide tile's k, so that a dense product fills two blocks an SM:
    with fewer tiles than that the blocks are few and long, and latency-bound (ncu, H100,
    2048x4096 at 512 tokens with 64-token tiles: 128 blocks, two warps a scheduler, 43% of
    issue slots)."""
    tiles = -(-n // MMF_WIDE_TILE[0]) * -(-m // MMF_WIDE_TILE[1])
    return max(1, min(MMF_MAX_SPLITS, 2 * sm_count // tiles))


def _wgmma_enabled() -> bool:
    return WGMMA and os.environ.get("MOEFORGE_WGMMA", "1") != "0"


def wgmma_available() -> bool:
    """sm_90 (H100, H200), unless MOEFORGE_WGMMA=0 (the A/B switch)."""
    return _wgmma_enabled() and _device_cc_major() == 9


# Prompt attention on wgmma (attn_prefill_wg128 in the model module built with
# ModelSpec.wgmma, sm_90a): attention alone on an H200, Qwen3's heads from an empty context,
# 4096 tokens 672 -> 401 us a layer, 2048 189 -> 125, 512 28.7 -> 23.8 (kv_rows_f16 +
# attn_prefill_fa128 against kv_tiles_f16 + it), the same bits as attn_prefill_fa on every
# case tried; the whole synthetic Qwen3-30B-A3B q4_0 pp2048 +1.8%, pp4096 +4.5% with its
# first form (thirteenth session), +2.9% and +5.8% more since (BENCHMARKS.md, fourteenth).
# MOEFORGE_ATTN_WGMMA=0 turns it off (the A/B switch), =1 on.
ATTN_WGMMA = True


def attn_wgmma_available() -> bool:
    """The model module with prompt attention on wgmma: sm_90 and switched on."""
    on = os.environ.get("MOEFORGE_ATTN_WGMMA", "1" if ATTN_WGMMA else "0") != "0"
    return on and _device_cc_major() == 9


# Expert gate|up products on wgmma tiles that write act(gate) * up as the down product's f16
# x themselves (MmfSpec.glu, where both products take wgmma tiles), in place of the plain
# tile's float32 output and a conversion launch. H200, the product and the conversion alone
# (scripts/glu_probe.py), gpt-oss-20b 2048 / 4096 tokens 981.3 -> 973.6, 1828.4 -> 1809.2 us;
# Qwen3-30B-A3B 475.7 -> 448.2, 704.6 -> 659.0; whole prompts +0.1% / +1.2% and +1.9% /
# +2.4% at pp2048 / pp4096 (BENCHMARKS.md "Glu tiles with a rolled epilogue").
# MOEFORGE_GLU_TILES=0 turns it off.
GLU_TILES = True


def glu_tiles_enabled() -> bool:
    return os.environ.get("MOEFORGE_GLU_TILES", "1" if GLU_TILES else "0") != "0"


def mmf_choice(qtype: str, n: int, tokens_per_expert: float | None, m: int | None = None,
               moe: tuple[int, int] | None = None) -> Choice | None:
    """The f16 tiles in place of any int8 choice, profile or default, where they won every
    measured case: on sm_90 (f16 mma.sync runs at half the int8 rate there, but MMQ spends
    ~27 issued instructions per int8 mma on per-block scale arithmetic and never gets near
    that rate), dense products from 128 tokens and expert products from 256 tokens an
    expert. Tiles of 128 tokens; a dense product with fewer than two tiles an SM splits k
    over up to 4 blocks a tile (mmf_dense_splits; m None: no split). H100, hot, against the
    64-token tiles of 8 warps this rule chose below 2048 tokens before (BENCHMARKS.md):
    q4_0 2048x4096 n=512 53.5 -> 45.9 us, n=256 42.7 -> 29.0, n=1024 89.2 -> 83.3, 5120x2048
    n=512 69.2 -> 67.9, 4096x2048 45.2 -> 46.2; q8_0 55.7 -> 49.1, 46.4 -> 30.5, 111.0 ->
    87.5, 82.0 -> 69.8, 54.4 -> 47.4. Earlier, against the shipped profile's int8 tiles:
    q4_0 dense 5120x2048
    n=512 73.1 -> 67.0 us, 2048x4096 65.6 -> 52.2, n=2048 241.1 -> 174.7 and 212.4 -> 141.0;
    q8_0 87.6 -> 81.9, 73.7 -> 54.7, 285.6 -> 180.3, 241.6 -> 147.9; Qwen3 experts at
    n=4096 (256 an expert) q4_0 gate 699.4 -> 574.0, down 789.5 -> 607.2, q8_0 963.6 ->
    616.7, 1179.9 -> 649.6. At 128 tokens an expert they were even (0.94-1.06x), at 32 to 64
    the int8 tiles won (0.77-0.94x). q4_K (stages of whole super-blocks) the same way:
    Qwen3 experts n=4096 816.3 -> 716.1 us, at 128 an expert 386.0 against 428.2, and the
    model's pp512 +6%. A profile entry whose study timed the f16 tiles as well
    overrides this (choose_mul_mat*); the shipped profiles predate them. On other cards the
    int8 tiles stay unless a profile says otherwise. q2_K and q3_K, whose int8 tiles pay two
    IMMA a fragment, take the f16 tiles from 16 tokens an expert, narrower ones below 64;
    q5_K from 64 (two stages of x64y256), q4_K, iq4_xs and q8_0 from 128
    (MMF_MIN_TOKENS_PER_EXPERT_OF, MMF_NARROW_TILES, MMF_EXPERT_TILE_OF); with the wgmma
    tiles (wgmma_available) every format that has them from 64 at most
    (MMF_WGMMA_MIN_TOKENS_PER_EXPERT). moe: (E, top_k) of an expert product, whose tile
    count picks the wgmma tile's rows."""
    if os.environ.get("MOEFORGE_MMF", "1") == "0" or qtype not in MMF_TYPES:
        return None
    ids = tokens_per_expert is not None
    min_per_expert = MMF_MIN_TOKENS_PER_EXPERT_OF.get(qtype, MMF_MIN_TOKENS_PER_EXPERT)
    below = ids and tokens_per_expert < min_per_expert or not ids and n < MMF_MIN_DENSE_TOKENS
    # below the format's threshold only the wgmma tiles may still take it; the device is
    # asked only where the answer matters (this runs on every eager product's path)
    if below and not (ids and tokens_per_expert >= MMF_WGMMA_MIN_TOKENS_PER_EXPERT and _wgmma_built(qtype)
                      and _wgmma_enabled()):
        return None
    cc = _device_cc_major()
    if cc not in MMF_CC_MAJOR:
        return None
    wgmma = cc == 9 and _wgmma_enabled()
    if below and not wgmma:
        return None
    return Choice("mmf_id" if ids else "mmf",
                  mmf_rule_spec(qtype, n, ids, m, device_sm_count(), tokens_per_expert, wgmma, moe), "rule")


def mmf_rule_spec(qtype: str, n: int, ids: bool, m: int | None, sm_count: int,
                  tokens_per_expert: float | None = None, wgmma: bool = False,
                  moe: tuple[int, int] | None = None) -> MmfSpec:
    """The rule's tile on a card of sm_count SMs (a dense product of m rows may split k; an
    expert product of few tokens an expert takes a narrower tile, MMF_NARROW_TILES, and a
    super-block format its own, MMF_EXPERT_TILE_OF). wgmma (sm_90): the warpgroup tiles in
    place of the unsplit wide tile (and of a super-block format's own from
    MMF_WGMMA_MIN_TOKENS_PER_EXPERT), for the formats that have them; the 256-row one for an
    expert product (moe: E, top_k) of m rows whose tiles fill MMF_WGMMA_Y256_MIN_WAVES waves."""
    splits = mmf_dense_splits(n, m, sm_count) if not ids and m is not None else 1
    x, y, warps, kblocks, stages = MMF_WIDE_TILE
    if ids:
        x, y, warps, kblocks, stages = MMF_EXPERT_TILE_OF.get(qtype, MMF_WIDE_TILE)
        if tokens_per_expert is not None:
            x, y, warps, kblocks, stages = next((t for below, t in MMF_NARROW_TILES if tokens_per_expert < below),
                                                (x, y, warps, kblocks, stages))
    tile = (x, y, warps, kblocks, stages)
    # the super-block formats' own expert tile as well, from the wgmma tiles' threshold (q5_K
    # takes its tile from 64 tokens an expert; no count: as the narrow tiles, any)
    own = ids and tile == MMF_EXPERT_TILE_OF.get(qtype) and \
        (tokens_per_expert is None or tokens_per_expert >= MMF_WGMMA_MIN_TOKENS_PER_EXPERT)
    if wgmma and splits == 1 and (tile == MMF_WIDE_TILE or own):
        by_rows = {s.y: s for s in _wgmma_built(qtype) if s.ids == ids}
        wide = by_rows.get(256)
        if wide is not None and ids and moe is not None and m is not None and \
                moe_tiles(*moe, m, n, wide.x, wide.y) >= MMF_WGMMA_Y256_MIN_WAVES * sm_count:
            return wide
        if 128 in by_rows:
            return by_rows[128]
    return MmfSpec(qtype, x, y, warps, quant_type(qtype).whole_kblocks(kblocks), stages, ids=ids, splits=splits)


@functools.lru_cache(maxsize=None)
def _wgmma_built(qtype: str) -> tuple:
    from ..codegen.enumerate import mmf_wgmma_specs
    return tuple(mmf_wgmma_specs(quant_type(qtype)))


# Fewer trials than this: the study timed its seeds (the default, the profile's incumbent,
# each other path's default) and hardly more.
SHORT_STUDY_TRIALS = 8


def outdated(found: Choice | None, default: Choice) -> bool:
    """A profile entry that kept the default of its day after a short study, where today's
    default (what runs without the entry: _unprofiled) is another spec: it says nothing
    today's rules do not, and they are used. (The
    shipped H200 profile's Qwen3 q8_0 entry at 2048 tokens kept x64 tiles after one trial,
    621.3 us; the rule's x32 tile takes 403.9, the f16 tile 367.8; q4_0's 398.4 against
    331.4.) An entry that found a faster spec stands, and so does a default that won a
    longer study (the dense one-token entries kept the plain mat-vec over 18 trials)."""
    return (found is not None and found.kept_default and found.trials is not None
            and found.trials < SHORT_STUDY_TRIALS and found.spec != default.spec)


def _measured_f16(found: Choice | None) -> bool:
    """A profile entry whose study timed the f16 tiles too (on sm_90, the wgmma ones among
    them): its choice stands."""
    return (found is not None and bool({"mmf", "mmf_id"} & set(found.paths))
            and (found.wgmma_timed or not wgmma_available()))


def _without_f16(found: Choice | None) -> Choice | None:
    return None if found is not None and found.path in F16_PATHS else found


def _unprofiled(default, f16: bool, rule) -> Choice:
    """What runs where the profile has no entry: the f16 rule's tile where it applies,
    else the default."""
    return (rule() if f16 else None) or default()


def _resolve(found: Choice | None, default, f16: bool, rule) -> Choice:
    """A product's choice from the profile's entry (found), today's default (default()) and
    the f16 rule (rule(): mmf_choice, or None): an entry outdated against what runs without
    it counts for nothing; the rule goes ahead of an entry whose study did not time the f16
    tiles. The callables run only where needed: this is on every eager product's path."""
    if found is not None and found.kept_default and outdated(found, _unprofiled(default, f16, rule)):
        found = None
    if not f16:
        found = _without_f16(found)
    elif not _measured_f16(found):
        chosen = rule()
        if chosen is not None:
            return chosen
    return found if found is not None else default()


def resolve(op: str, qtype: str, shape: tuple[int, int, int, int], n: int, found: Choice | None) -> Choice:
    """What runs for a product (op "mul_mat_id" or "mul_mat", shape (E, top_k, m, k)) where
    the profile's entry is found (None: no entry): choose_mul_mat_id's and choose_mul_mat's
    answer for a tensor the f16 tiles can hold, without their lookup."""
    default, rule = _rules(op, qtype, shape, n)
    return _resolve(found, default, True, rule)


def unprofiled(op: str, qtype: str, shape: tuple[int, int, int, int], n: int) -> Choice:
    """What choose_mul_mat_id or choose_mul_mat runs where no profile entry speaks: the
    tuner's baseline."""
    default, rule = _rules(op, qtype, shape, n)
    return _unprofiled(default, True, rule)


def _rules(op: str, qtype: str, shape: tuple[int, int, int, int], n: int):
    """A product's default and f16 rule, as callables (_resolve runs them only where needed)."""
    E, top_k, m, k = shape
    if op == "mul_mat_id":
        return (lambda: default_mul_mat_id(qtype, E, top_k, m, k, n),
                lambda: mmf_choice(qtype, n, n * top_k / E, m, (E, top_k)))
    return lambda: default_mul_mat(qtype, m, k, n), lambda: mmf_choice(qtype, n, None, m)


def choose_mul_mat_id(qtype: str, E: int, top_k: int, m: int, k: int, n: int, f16: bool = True) -> Choice:
    """f16 False (a tensor the f16 tiles cannot hold, QuantTensor.f16_fits): an int8 path,
    the profile's where it chose one, else the default."""
    from .profiles_hook import lookup
    default, rule = _rules("mul_mat_id", qtype, (E, top_k, m, k), n)
    return _resolve(lookup("mul_mat_id", qtype, (E, top_k, m, k), n), default, f16, rule)


# Expert tiles of the mean routing fewer than this many an SM: MMQ-ID with stream-k. Below
# one wave (these 4-warp tiles run 2-4 an SM) SMs sit idle for a tile's whole k unless its
# k is shared out. H200, q4_0, default tile with and without stream-k, random and skewed
# routing (scripts/product_ab.py streamk, BENCHMARKS.md "MoE stream-k below one wave"):
# Mixtral-8x7B's down (8 experts x 32 row tiles, k = 14336) at 16, 32, 64 and 128 tokens
# 150.6 -> 94.3, 206.8 -> 125.2, 236.5 -> 180.7, 239.0 -> 230.7 us. Above one wave most
# products lose (gpt-oss-20b's down at 1.4 waves +8-13%, Qwen3's and DeepSeek-V2-Lite's at
# 1.9-8 waves +6-30%); Mixtral's gate/up gained 3-10% at 3.4-4.5 waves, one product alone.
MMQ_ID_STREAM_K_TILES_PER_SM = 2


def moe_tiles(E: int, top_k: int, m: int, n: int, x: int, y: int) -> int:
    """An expert product's tiles when every expert chosen gets the mean count of tokens."""
    used = min(E, n * top_k)
    return used * -(-(n * top_k) // (used * x)) * -(-m // y)


def default_mul_mat_id(qtype: str, E: int, top_k: int, m: int, k: int, n: int) -> Choice:
    """The choice without any profile: the tuner's baseline, enqueued first."""
    if n <= MMVQ_MAX_TOKENS:
        return Choice("mmvq", default_mmvq(qtype, n, ids=True))
    spec = default_mmq(qtype, n * top_k / E, ids=True)
    if moe_tiles(E, top_k, m, n, spec.x, spec.y) < MMQ_ID_STREAM_K_TILES_PER_SM * device_sm_count():
        spec = replace(spec, stream_k=True)
    return Choice("mmq_id", spec)


def choose_mul_mat(qtype: str, m: int, k: int, n: int, f16: bool = True) -> Choice:
    from .profiles_hook import lookup
    default, rule = _rules("mul_mat", qtype, (1, 1, m, k), n)
    return _resolve(lookup("mul_mat", qtype, (1, 1, m, k), n), default, f16, rule)


def default_mul_mat(qtype: str, m: int, k: int, n: int) -> Choice:
    if n <= MMVQ_MAX_TOKENS:
        return Choice("mmvq", default_mmvq(qtype, n, ids=False))
    return Choice("mmq", default_mmq(qtype, n, ids=False))
