"""Every instance `moeforge generate` builds, per quant type: the tuner's whole search
space (the tuner may only choose what was generated)."""
from __future__ import annotations

import dataclasses
from itertools import product

from .quant import QuantType
from .spec import KernelSpec, MmfSpec, MmqSpec, MmvqSpec, ModelSpec, UtilSpec

FAMILIES = tuple(c.family for c in (MmqSpec, MmvqSpec, MmfSpec, ModelSpec, UtilSpec))
MMQ_X = (8, 16, 32, 64, 128)
MMQ_X_DENSE = (16, 32, 64, 128)   # dense products take the mmq path only past 8 tokens
MMQ_YW = ((64, 4), (96, 3), (96, 6), (128, 4), (128, 8))
MMQ_KBLOCKS = (8, 16)
MMQ_STAGES = (2, 3)
MMVQ_TOKENS = (1, 2, 4, 8)
MMVQ_WARPS = (2, 4, 8)
MMVQ_ROWS = (1, 2, 4)
FUSED_WARPS = (4,)
FUSED_ROWS = (1, 2, 4)


def mmq_specs(q: QuantType) -> list[MmqSpec]:
    out = []
    for ids in (True, False):
        # dense tiles are regular: their imbalance is only the last wave, which stream-k removes
        for sk, x, (y, w), kb, st in product((True, False) if ids else (True,), MMQ_X if ids else MMQ_X_DENSE,
                                             MMQ_YW, MMQ_KBLOCKS, MMQ_STAGES):
            out.append(MmqSpec(q.name, x=x, y=y, warps=w, kblocks=kb, stages=st, ids=ids, stream_k=sk))
    return out


def mmvq_specs(q: QuantType) -> list[MmvqSpec]:
    out = []
    for ids, (t, pp) in product((True, False), [(t, False) for t in MMVQ_TOKENS] + [(1, True)]):
        out += [MmvqSpec(q.name, tokens=t, warps=w, rows=r, ids=ids, per_pair=pp)
                for w, r in product(MMVQ_WARPS, MMVQ_ROWS)]
        out += [MmvqSpec(q.name, tokens=t, warps=w, rows=r, ids=ids, act=act, bias=bias, per_pair=pp)
                for act, bias, w, r in product(MmvqSpec.ACTS, (False, True), FUSED_WARPS, FUSED_ROWS)]
    # one token: x quantized once just before, weights streamed, PDL launch (the defaults
    # of dispatch.default_mmvq and default_fused); with experts also the guessing form, the
    # one-token default, and the wait-first one, the model's expert gate/up after the router
    # (x quantized by the norm before it)
    expert_forms = (dict(), dict(guess=True), dict(wait_first=True))
    out += [MmvqSpec.decode(q.name, ids=ids) for ids in (True, False)]
    out += [MmvqSpec.decode(q.name, guess=True)]
    for rows in (2, 1) if q.qs_bytes == 16 else (1,):
        out += [MmvqSpec.decode(q.name, ids=False, rows=rows, act=act, bias=bias)
                for act, bias in product(MmvqSpec.ACTS, (False, True))]
        out += [MmvqSpec.decode(q.name, rows=rows, act=act, bias=bias, **form)
                for form, act, bias in product(expert_forms, MmvqSpec.ACTS, (False, True))]
    # one token, where two rows of two k-units do not fit one wave: one unit in flight
    out += [MmvqSpec.decode(q.name, rows=2, act=act, bias=bias, units=1, **form)
            for form, act, bias in product(expert_forms[1:], MmvqSpec.ACTS, (False, True))]
    # dense rows of many k-units at one token, split over the block's warps (dispatch.KSPLIT_MIN_UNITS)
    out.append(dataclasses.replace(MmvqSpec.decode(q.name, ids=False), ksplit=True, warps=2))
    # the model's wait-first expert gate/up, its units split over 4 warps (dispatch.FUSED_KSPLIT_MIN_UNITS)
    out += [dataclasses.replace(MmvqSpec.decode(q.name, rows=2, act=act, bias=bias, units=1, wait_first=True),
                                warps=4, ksplit=True)
            for act, bias in product(MmvqSpec.ACTS, (False, True))]
    # the model's down product adding its experts' weighted sum to the residual (top_k <= warps)
    # (one k-unit in flight on short rows, rows of four; two units of two rows on longer ones)
    out += [dataclasses.replace(MmvqSpec.decode(q.name, rows=r), warps=w, combine=True, units=u)
            for w in (1, 2, 4, 8) for r, u in ((2, 2), (4, 1))]
    # ... on long rows a slot's k-units split over warps/top_k warps (dispatch.COMBINE_KSPLIT_MIN_UNITS)
    out += [dataclasses.replace(MmvqSpec.decode(q.name, rows=r), warps=w, combine=True, units=u, ksplit=True)
            for w in (2, 4, 8) for r, u in ((2, 2), (4, 1))]
    return out


# The f16 tiles: the two the runtime's rule chooses (runtime.dispatch.mmf_choice) and the
# others that were within a few percent of them somewhere on the H100 (BENCHMARKS.md).
MMF_TILES = ((64, 128, 8, 4, 3), (128, 128, 4, 4, 2), (32, 128, 4, 8, 3), (32, 256, 8, 8, 2),
             (64, 256, 8, 4, 3))


# A block's opt-in shared memory on sm_90 (H100, H200): a tile whose stages pass it is also
# built with one stage fewer (q5_K's x64y256: 251904 bytes at three stages of whole
# super-blocks, 167936 at two; the two-stage form is q5_K's expert tile, runtime.dispatch).
SM90_SMEM_PER_BLOCK = 232448


# Dense products of few tiles split k over this many blocks a tile (the wide tile: the
# runtime's rule, runtime.dispatch.mmf_dense_splits; the 64-token one: for the tuner).
MMF_SPLITS = (2, 3, 4)
MMF_SPLIT_TILES = ((128, 128, 4, 4, 2), (64, 128, 8, 4, 3))


# sm_90a's warpgroup MMA tiles (MmfSpec.wgmma: x read by the tensor cores from shared
# memory, the rows dequantized into their A registers): per row count the first of these
# that fits, the deepest pipeline (H200, q4_0, Mixtral-8x7B's down at 2048 tokens: five
# stages of 128 rows 1343.5 us, three 1395.8; its gate/up on 256 rows, stages of four
# blocks 2599.1, of two blocks 2684.5 in four stages, 2696.0 in six). The super-block
# formats' stages hold half a super-block (MmfSpec.part_super).
MMF_WGMMA_TILES = (((128, 128, 8, 4, 5), (128, 128, 8, 4, 4)), ((128, 256, 8, 4, 3),))


def mmf_wgmma_specs(q: QuantType) -> list[MmfSpec]:
    """Format q's wgmma tiles, expert and dense: one of each row count."""
    def fits(s):
        s.check()
        return s.smem_bytes() <= SM90_SMEM_PER_BLOCK
    return [next(s for s in (MmfSpec(q.name, *t, ids=ids, wgmma=True) for t in tiles) if fits(s))
            for ids in (True, False) for tiles in MMF_WGMMA_TILES]


def mmf_glu_specs(q: QuantType) -> list[MmfSpec]:
    """The expert wgmma tiles as glu tiles, one per activation (MmfSpec.glu: the runtime
    takes the tile the rules chose for the gate|up product in that form)."""
    return [dataclasses.replace(s, glu=act) for s in mmf_wgmma_specs(q) if s.ids for act in MmfSpec.GLU_ACTS]


def mmf_specs(q: QuantType) -> list[MmfSpec]:
    if q.name not in MmfSpec.QTYPES:
        return []

    def whole(t):
        x, y, w, kb, st = t
        return x, y, w, q.whole_kblocks(kb), st
    out = [MmfSpec(q.name, *whole(t), ids=ids) for ids in (True, False) for t in MMF_TILES]
    out += [dataclasses.replace(s, stages=s.stages - 1) for s in out
            if s.smem_bytes() > SM90_SMEM_PER_BLOCK and s.stages > 2]
    out += [MmfSpec(q.name, *whole(t), ids=False, splits=s) for t in MMF_SPLIT_TILES for s in MMF_SPLITS]
    out += mmf_wgmma_specs(q)
    out += mmf_glu_specs(q)
    return list(dict.fromkeys(out))


def all_specs(types: list[QuantType]) -> list[KernelSpec]:
    specs: list[KernelSpec] = [UtilSpec(), *(ModelSpec(cache=c, wgmma=w) for w in (False, True)
                                             for c in ModelSpec.CACHE_TYPES)]
    for q in types:
        specs += mmq_specs(q)
        specs += mmvq_specs(q)
        specs += mmf_specs(q)
    for s in specs:
        s.check()
    return specs
