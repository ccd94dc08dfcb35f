"""The f16 tensor-core path (MmfSpec), dense and MUL_MAT_ID, against both references:
float64 on dequantized weights and the emulation of its own f16 rounding (pytest -m gpu).
q4_K's and q5_K's weights are q * f16(d*sc) - f16(dmin*m) rounded once, q3_K's (q - 4) *
f16(d*sc) rounded once, q2_K's as q4_K's with 16-weight scales and mins, iq4_xs's level *
f16(d*(ls-32)), mxfp4's level * f16(2^(e-128)) (tensors whose largest scale keeps every
weight in f16's range: others are refused, and dispatch gives them the int8 tiles); the
K-quants' stages hold whole super-blocks (kblocks at least 8) and their rows whole
super-blocks (k rounded up to 256)."""
import dataclasses

import numpy as np
import pytest

from moeforge import reference as ref

pytestmark = pytest.mark.gpu

NMSE_FLOAT = 5e-4      # ggml's bar
NMSE_EMULATED = ref.NMSE_EMULATED  # the emulation differs by float32 accumulation only
SMEM_OPTIN_SM90 = 227 * 1024   # shared memory a block may opt in to on sm_90

SPECS = [  # (x, y, warps, kblocks, stages, warps along the tokens, blocks sharing a tile's k)
    (64, 128, 4, 4, 3, 1), (32, 128, 4, 8, 2, 1), (128, 128, 8, 4, 3, 1), (16, 64, 4, 16, 4, 1), (8, 96, 2, 2, 2, 1),
    (64, 128, 8, 4, 3, 2), (128, 256, 8, 4, 2, 2), (32, 64, 4, 8, 3, 4),
    (128, 128, 4, 4, 2, 1, 4), (64, 128, 8, 4, 3, 1, 2), (32, 64, 4, 8, 3, 2, 3),
    (32, 256, 8, 8, 2, 1), (64, 256, 8, 4, 3, 1),   # dispatch.MMF_NARROW_TILES
]


def _spec(qtype, ids, x, y, warps, kblocks, stages, wn=1, splits=1):
    from moeforge.codegen.spec import MmfSpec
    from moeforge.codegen.quant import quant_type
    q = quant_type(qtype)
    whole = max(q.whole_kblocks(kblocks), -(-4 // q.meta_bytes) if q.meta_bytes else 1)  # 4 scale bytes a stage
    if whole != kblocks:
        # a K-quant stage holds whole super-blocks; three stages of them at 128 tokens would
        # not fit an SM (264 KiB: the launch refuses it), two do
        kblocks, stages = whole, (2 if x * whole >= 1024 else stages)
    spec = MmfSpec(qtype, x=x, y=y, warps=warps, kblocks=kblocks, stages=stages, ids=ids, wn=wn, splits=splits)
    if spec.smem_bytes() > SMEM_OPTIN_SM90:
        # q5_K's 48 meta bytes a super-block do not leave 256 rows of them room: 128 rows
        spec = dataclasses.replace(spec, y=spec.y // 2)
    return spec


def _k(qtype, k):
    """k rounded up to whole blocks of qtype (q4_K's rows hold whole 256-weight super-blocks)."""
    values = ref.quant_type(qtype).block_values
    return -(-k // values) * values


def _ids(rng, n, E, top_k, skew):
    ids = np.stack([rng.choice(E, size=top_k, replace=False) for _ in range(n)]).astype(np.int32)
    if skew:
        # most tokens send their first choice to expert 1; experts past E/2 get nothing
        ids = np.stack([rng.choice(E // 2, size=top_k, replace=False) for _ in range(n)]).astype(np.int32)
        hot = rng.random(n) < 0.7
        for t in np.nonzero(hot)[0]:
            if 1 not in ids[t]:
                ids[t, 0] = 1
    return ids


def _compare(got, emu, flt, k=0):
    """k: past 4096 the truncating accumulators' bar grows (ref.nmse_emulated_bar)."""
    assert np.isfinite(got).all(), "unwritten or non-finite outputs"
    e_emu, e_flt = ref.nmse(got, emu), ref.nmse(got, flt)
    assert e_emu <= ref.nmse_emulated_bar(k, True), f"NMSE vs emulation {e_emu:.3e}"
    assert e_flt <= NMSE_FLOAT, f"NMSE vs float64 {e_flt:.3e}"


@pytest.mark.parametrize("qtype", ["q4_0", "q8_0", "q2_K", "q3_K", "q4_K", "q5_K", "q6_K", "iq4_xs", "mxfp4"])
@pytest.mark.parametrize("spec_i", range(len(SPECS)))
@pytest.mark.parametrize("E,top_k,m,k,n,skew,per_slot", [
    (8, 2, 96, 256, 33, False, False), (32, 4, 200, 416, 77, True, False), (128, 8, 72, 160, 300, True, False),
    (16, 4, 136, 1056, 129, False, True), (8, 8, 40, 64, 5, False, False),
])
def test_mul_mat_id(rng, qtype, spec_i, E, top_k, m, k, n, skew, per_slot):
    import cupy as cp
    import moeforge
    from moeforge.runtime import ops
    from moeforge.runtime.dispatch import Choice
    k = _k(qtype, k)
    raw = ref.random_blocks(qtype, E * m, k, rng)
    w = moeforge.QuantTensor.from_blocks(raw, qtype, (E, m, k))
    x = (rng.standard_normal((n, top_k, k) if per_slot else (n, k)) * rng.uniform(0.1, 3.0)).astype(np.float32)
    ids = _ids(rng, n, E, top_k, skew)
    choice = Choice("mmf_id", _spec(qtype, True, *SPECS[spec_i]))
    outs = []
    for _ in range(2):
        out = cp.full((n, top_k, m), np.nan, dtype=cp.float32)   # poisoned: every entry must be written
        ops.run_mul_mat_id(w, cp.asarray(x), cp.asarray(ids), out, choice)
        outs.append(out.get())
    np.testing.assert_array_equal(outs[0], outs[1])               # bitwise the same run to run
    _compare(outs[0], ref.mul_mat_id_emulated_f16(raw, qtype, (E, m, k), x, ids),
             ref.mul_mat_id_float(ref.dequantize(raw, qtype, (E, m, k)), x, ids))


@pytest.mark.parametrize("qtype", ["q4_0", "q8_0", "q4_K"])
@pytest.mark.parametrize("tile", [(128, 128, 4, 4, 2), (32, 256, 8, 8, 2), (64, 128, 4, 4, 3)])
def test_long_rows(rng, qtype, tile):
    """Mixtral's down product, k = 14336: the f16 MMA's float32 sums round toward zero, so
    the error against the emulation grows with k^2 (2.8e-10 measured, past the flat 1e-10
    that had the tuner refuse these tiles); held to ref.nmse_emulated_bar, and bitwise
    the same run to run."""
    import cupy as cp
    import moeforge
    from moeforge.runtime import ops
    from moeforge.runtime.dispatch import Choice
    E, top_k, m, k, n = 8, 2, 72, 14336, 150
    raw = ref.random_blocks(qtype, E * m, k, rng)
    w = moeforge.QuantTensor.from_blocks(raw, qtype, (E, m, k))
    x = (rng.standard_normal((n, top_k, k)) * rng.uniform(0.1, 3.0)).astype(np.float32)
    ids = _ids(rng, n, E, top_k, skew=True)
    outs = []
    for _ in range(2):
        out = cp.full((n, top_k, m), np.nan, dtype=cp.float32)
        ops.run_mul_mat_id(w, cp.asarray(x), cp.asarray(ids), out, Choice("mmf_id", _spec(qtype, True, *tile)))
        outs.append(out.get())
    np.testing.assert_array_equal(outs[0], outs[1])
    _compare(outs[0], ref.mul_mat_id_emulated_f16(raw, qtype, (E, m, k), x, ids),
             ref.mul_mat_id_float(ref.dequantize(raw, qtype, (E, m, k)), x, ids), k)


@pytest.mark.parametrize("qtype", ["q4_0", "q8_0", "q2_K", "q3_K", "q4_K", "q5_K", "q6_K", "iq4_xs", "mxfp4"])
@pytest.mark.parametrize("n", [520, 2100])
def test_the_rules_choice_past_its_threshold(rng, qtype, n):
    """What dispatch runs with no choice given, at 130 and 525 tokens an expert (8 experts,
    top-2): the f16 tiles of each format's rule (dispatch.MMF_MIN_TOKENS_PER_EXPERT_OF,
    MMF_EXPERT_TILE_OF) where it takes them, checked as any other tile."""
    import cupy as cp
    import moeforge
    from moeforge.runtime import dispatch
    E, top_k, m, k = 8, 2, 136, 512
    raw = ref.random_blocks(qtype, E * m, k, rng)
    w = moeforge.QuantTensor.from_blocks(raw, qtype, (E, m, k))
    x = (rng.standard_normal((n, k)) * rng.uniform(0.1, 3.0)).astype(np.float32)
    ids = _ids(rng, n, E, top_k, skew=False)
    f16 = dispatch.choose_mul_mat_id(qtype, E, top_k, m, k, n, w.f16_fits).path == "mmf_id"
    assert f16 or not w.f16_fits or n * top_k / E < dispatch.MMF_MIN_TOKENS_PER_EXPERT_OF.get(qtype, dispatch.MMF_MIN_TOKENS_PER_EXPERT)
    out = cp.full((n, top_k, m), np.nan, dtype=cp.float32)
    moeforge.mul_mat_id(w, cp.asarray(x), cp.asarray(ids), out=out)
    emulated = ref.mul_mat_id_emulated_f16 if f16 else ref.mul_mat_id_emulated
    _compare(out.get(), emulated(raw, qtype, (E, m, k), x, ids),
             ref.mul_mat_id_float(ref.dequantize(raw, qtype, (E, m, k)), x, ids))


@pytest.mark.parametrize("qtype", ["q4_0", "q8_0", "q2_K", "q3_K", "q4_K", "q5_K", "q6_K", "iq4_xs", "mxfp4"])
@pytest.mark.parametrize("spec_i", range(len(SPECS)))
@pytest.mark.parametrize("m,k,n", [(200, 416, 77), (5120 // 8, 2048, 512), (72, 96, 9)])
def test_mul_mat(rng, qtype, spec_i, m, k, n):
    import cupy as cp
    import moeforge
    from moeforge.runtime import ops
    from moeforge.runtime.dispatch import Choice
    k = _k(qtype, k)
    raw = ref.random_blocks(qtype, m, k, rng)
    w = moeforge.QuantTensor.from_blocks(raw, qtype, (m, k))
    x = (rng.standard_normal((n, k)) * rng.uniform(0.1, 3.0)).astype(np.float32)
    outs = []
    for _ in range(2):
        out = cp.full((n, m), np.nan, dtype=cp.float32)   # poisoned: every entry must be written
        ops.run_mul_mat(w, cp.asarray(x), out, Choice("mmf", _spec(qtype, False, *SPECS[spec_i])))
        outs.append(out.get())
    np.testing.assert_array_equal(outs[0], outs[1])       # split partials summed in order: the same bits
    ids = np.zeros((n, 1), dtype=np.int32)
    _compare(outs[0], ref.mul_mat_id_emulated_f16(raw, qtype, (1, m, k), x, ids)[:, 0],
             ref.mul_mat_float(ref.dequantize(raw, qtype, (m, k)), x))


def test_swiglu_input_changes_no_bit(rng):
    """glu: the conversion reads gate|up products as SiLU(gate) * up, bit for bit the
    model's swiglu kernel followed by the plain conversion."""
    import cupy as cp
    import moeforge
    from moeforge.codegen.spec import ModelSpec
    from moeforge.runtime import ops
    from moeforge.runtime.dispatch import Choice
    from moeforge.runtime.kernels import load
    E, top_k, ff, m, n = 16, 4, 96, 72, 37
    raw = ref.random_blocks("q4_0", E * m, ff, rng)
    w = moeforge.QuantTensor.from_blocks(raw, "q4_0", (E, m, ff))
    ids = cp.asarray(_ids(rng, n, E, top_k, False))
    gu = cp.asarray((rng.standard_normal((n, top_k, 2 * ff)) * 2).astype(np.float32))
    act = cp.full((n, top_k, ff), np.nan, dtype=cp.float32)
    load(ModelSpec(), "swiglu")((-(-act.size // 256),), (gu, act, np.int64(n * top_k), np.int32(ff)), block=256)
    choice = Choice("mmf_id", _spec("q4_0", True, 32, 64, 4, 4, 3))
    want = cp.full((n, top_k, m), np.nan, dtype=cp.float32)
    got = cp.full((n, top_k, m), np.nan, dtype=cp.float32)
    ops.run_mul_mat_id(w, act, ids, want, choice)
    ops.run_mul_mat_id(w, gu, ids, got, choice, glu=True)
    assert np.isfinite(want.get()).all()
    np.testing.assert_array_equal(got.get(), want.get())


def test_refuses_mismatched_routing():
    import cupy as cp
    import moeforge
    from moeforge.runtime.mmf import run_mmf
    rng = np.random.default_rng(0)
    w = moeforge.QuantTensor.from_blocks(ref.random_blocks("q4_0", 64, 64, rng), "q4_0", (64, 64))
    x = cp.ones((4, 64), dtype=cp.float32)
    with pytest.raises(ValueError, match="needs expert ids"):
        run_mmf(_spec("q4_0", True, 32, 64, 4, 4, 3), w, x, None, 1, cp.empty((4, 64), dtype=cp.float32))


def test_mxfp4_past_f16_runs_on_the_int8_tiles(rng, monkeypatch):
    """An mxfp4 tensor with one block scaled past f16's range (2^13 * 12 > 65504): the f16
    launch refuses it before any kernel runs, and the default dispatch, which would take the
    f16 tiles at this size, runs the int8 tiles: right against both of their references.
    Also a scale below the window (largest blocks subnormal in f16)."""
    import cupy as cp
    import moeforge
    from moeforge.runtime import dispatch, ops
    from moeforge.runtime.dispatch import Choice
    monkeypatch.delenv("MOEFORGE_MMF", raising=False)
    E, top_k, m, k, n = 8, 2, 64, 256, 1024          # 256 tokens an expert: the f16 rule's size
    for scale_byte in (141, 112):
        raw = ref.random_blocks("mxfp4", E * m, k, rng)
        if scale_byte < 114:
            raw.reshape(E * m, -1, 17)[:, :, 0] -= 10        # every block 2^-10 smaller
        raw.reshape(E * m, -1, 17)[5, 3, 0] = scale_byte
        w = moeforge.QuantTensor.from_blocks(raw, "mxfp4", (E, m, k))
        assert not w.f16_fits
        x = rng.standard_normal((n, k)).astype(np.float32)
        ids = _ids(rng, n, E, top_k, False)
        assert dispatch.choose_mul_mat_id("mxfp4", E, top_k, m, k, n).path == "mmf_id"
        with pytest.raises(ValueError, match="largest scale byte"):
            ops.run_mul_mat_id(w, cp.asarray(x), cp.asarray(ids), cp.empty((n, top_k, m), dtype=cp.float32),
                               Choice("mmf_id", _spec("mxfp4", True, 128, 128, 4, 4, 2)))
        got = moeforge.mul_mat_id(w, cp.asarray(x), cp.asarray(ids)).get()
        assert np.isfinite(got).all()
        emu = ref.mul_mat_id_emulated(raw, "mxfp4", (E, m, k), x, ids)          # q8_1: the int8 tiles
        assert ref.nmse(got, emu) <= NMSE_EMULATED
        assert ref.nmse(got, ref.mul_mat_id_float(ref.dequantize(raw, "mxfp4", (E, m, k)), x, ids)) <= NMSE_FLOAT
