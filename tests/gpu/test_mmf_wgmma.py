"""The f16 tiles on sm_90a's warpgroup MMA (MmfSpec.wgmma: x copied into 128-byte-swizzled
shared memory and read from there by the tensor cores, each warp's rows dequantized into
the MMA's A registers), every built instance, against both references: float64 on
dequantized weights and the emulation of the f16 rounding (pytest -m gpu; sm_90 only)."""
import numpy as np
import pytest

from moeforge import reference as ref

from test_mmf import _compare, _ids, _k

pytestmark = pytest.mark.gpu


def _built(ids):
    from moeforge.codegen.enumerate import mmf_wgmma_specs
    from moeforge.codegen.quant import quant_type
    from moeforge.codegen.spec import MmfSpec
    return [s for q in MmfSpec.QTYPES for s in mmf_wgmma_specs(quant_type(q)) if s.ids == ids]


@pytest.fixture(autouse=True)
def _sm90():
    from moeforge.runtime import dispatch
    if not dispatch.wgmma_available():
        pytest.skip("wgmma needs an sm_90 device (H100, H200)")


def _twice(run, shape):
    import cupy as cp
    outs = []
    for _ in range(2):
        out = cp.full(shape, np.nan, dtype=cp.float32)   # poisoned: every entry must be written
        run(out)
        outs.append(out.get())
    np.testing.assert_array_equal(outs[0], outs[1])      # bitwise the same run to run
    return outs[0]


@pytest.mark.parametrize("spec", _built(True), ids=lambda s: s.name)
@pytest.mark.parametrize("E,top_k,m,k,n,skew,per_slot", [
    # odd row counts (partial 128- and 256-row tiles), k past a stage's end, experts with
    # no tokens (skew: the upper half), a tile's tokens from one to past TX
    (8, 2, 296, 416, 333, True, False), (32, 4, 136, 1056, 77, False, True), (128, 8, 72, 160, 300, True, False),
])
def test_mul_mat_id(rng, spec, E, top_k, m, k, n, skew, per_slot):
    import cupy as cp
    import moeforge
    from moeforge.runtime import ops
    from moeforge.runtime.dispatch import Choice
    k = _k(spec.qtype, k)
    raw = ref.random_blocks(spec.qtype, E * m, k, rng)
    w = moeforge.QuantTensor.from_blocks(raw, spec.qtype, (E, m, k))
    x = (rng.standard_normal((n, top_k, k) if per_slot else (n, k)) * rng.uniform(0.1, 3.0)).astype(np.float32)
    ids = _ids(rng, n, E, top_k, skew)
    xs, idss = cp.asarray(x), cp.asarray(ids)
    got = _twice(lambda out: ops.run_mul_mat_id(w, xs, idss, out, Choice("mmf_id", spec)), (n, top_k, m))
    _compare(got, ref.mul_mat_id_emulated_f16(raw, spec.qtype, (E, m, k), x, ids),
             ref.mul_mat_id_float(ref.dequantize(raw, spec.qtype, (E, m, k)), x, ids))


@pytest.mark.parametrize("spec", _built(False), ids=lambda s: s.name)
@pytest.mark.parametrize("m,k,n", [(200, 416, 77), (5120 // 8, 2048, 512), (300, 96, 9)])
def test_mul_mat(rng, spec, m, k, n):
    import cupy as cp
    import moeforge
    from moeforge.runtime import ops
    from moeforge.runtime.dispatch import Choice
    k = _k(spec.qtype, k)
    raw = ref.random_blocks(spec.qtype, m, k, rng)
    w = moeforge.QuantTensor.from_blocks(raw, spec.qtype, (m, k))
    x = (rng.standard_normal((n, k)) * rng.uniform(0.1, 3.0)).astype(np.float32)
    xs = cp.asarray(x)
    got = _twice(lambda out: ops.run_mul_mat(w, xs, out, Choice("mmf", spec)), (n, m))
    ids = np.zeros((n, 1), dtype=np.int32)
    _compare(got, ref.mul_mat_id_emulated_f16(raw, spec.qtype, (1, m, k), x, ids)[:, 0],
             ref.mul_mat_float(ref.dequantize(raw, spec.qtype, (m, k)), x))


@pytest.mark.parametrize("qtype", ["q4_0", "q8_0", "q4_K", "q5_K"])
def test_long_rows(rng, qtype):
    """Mixtral's down product, k = 14336, on both tiles: held to the k-scaled bar of the
    truncating float32 sums (ref.nmse_emulated_bar) as the mma.sync tiles are."""
    import cupy as cp
    import moeforge
    from moeforge.runtime import ops
    from moeforge.runtime.dispatch import Choice
    E, top_k, m, k, n = 8, 2, 264, 14336, 150
    raw = ref.random_blocks(qtype, E * m, k, rng)
    w = moeforge.QuantTensor.from_blocks(raw, qtype, (E, m, k))
    x = (rng.standard_normal((n, top_k, k)) * rng.uniform(0.1, 3.0)).astype(np.float32)
    ids = _ids(rng, n, E, top_k, skew=True)
    xs, idss = cp.asarray(x), cp.asarray(ids)
    emu = ref.mul_mat_id_emulated_f16(raw, qtype, (E, m, k), x, ids)
    flt = ref.mul_mat_id_float(ref.dequantize(raw, qtype, (E, m, k)), x, ids)
    for spec in (s for s in _built(True) if s.qtype == qtype):
        got = _twice(lambda out: ops.run_mul_mat_id(w, xs, idss, out, Choice("mmf_id", spec)), (n, top_k, m))
        _compare(got, emu, flt, k)


def test_the_rule_takes_them(rng, monkeypatch):
    """On sm_90 the rule's unsplit wide tile is a wgmma tile: the 256-row one for an expert
    product whose tiles fill MMF_WGMMA_Y256_MIN_WAVES waves (Mixtral's gate/up at 2048
    tokens), the 128-row one below (its down at 512) and for dense products; with
    MOEFORGE_WGMMA=0 the mma.sync tile. Run end to end through moeforge.mul_mat_id."""
    import cupy as cp
    import moeforge
    from moeforge.runtime import dispatch
    gate = dispatch.choose_mul_mat_id("q4_0", 8, 2, 28672, 4096, 2048)
    down = dispatch.choose_mul_mat_id("q4_0", 8, 2, 4096, 14336, 2048)
    dense = dispatch.choose_mul_mat("q4_0", 6144, 4096, 2048)
    for c in (gate, down, dense):
        if c.source == "rule":       # a profile entry that timed the wgmma tiles may choose another
            assert c.spec.wgmma, c
    if gate.source == "rule":
        assert gate.spec.y == 256
    with monkeypatch.context() as mp:
        mp.setenv("MOEFORGE_WGMMA", "0")
        assert not dispatch.mmf_choice("q4_0", 2048, 512.0, 28672, (8, 2)).spec.wgmma
    E, top_k, m, k, n = 8, 2, 264, 512, 2100
    raw = ref.random_blocks("q4_0", E * m, k, rng)
    w = moeforge.QuantTensor.from_blocks(raw, "q4_0", (E, m, k))
    assert dispatch.choose_mul_mat_id("q4_0", E, top_k, m, k, n).spec.wgmma
    x = (rng.standard_normal((n, k)) * rng.uniform(0.1, 3.0)).astype(np.float32)
    ids = _ids(rng, n, E, top_k, skew=False)
    out = cp.full((n, top_k, m), np.nan, dtype=cp.float32)
    moeforge.mul_mat_id(w, cp.asarray(x), cp.asarray(ids), out=out)
    _compare(out.get(), ref.mul_mat_id_emulated_f16(raw, "q4_0", (E, m, k), x, ids),
             ref.mul_mat_id_float(ref.dequantize(raw, "q4_0", (E, m, k)), x, ids))
