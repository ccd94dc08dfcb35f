"""The glu tiles (MmfSpec.glu): an expert gate|up product on wgmma tiles that writes
act(gate) * up as the down product's f16 x itself. Every built instance must give the bits
of the plain tile followed by the conversion the model ran before (mmf_x_to_f16 with SiLU,
glu_oai_id_f16 with SwiGLU-OAI and its biases), in the wgmma k order, zeros to the row's
padded end, every row written; and stay within the float64 bar (pytest -m gpu; sm_90)."""
import dataclasses

import numpy as np
import pytest

from moeforge import reference as ref

from test_mmf import NMSE_FLOAT, _ids, _k

pytestmark = pytest.mark.gpu

# position of column e of a group of 16 in the wgmma k order (mmf_x_to_f16's)
_WGMMA_POS = np.array([(e & 1) * 8 + (e >> 2) * 2 + ((e >> 1) & 1) for e in range(16)])


def _glu_built():
    from moeforge.codegen.enumerate import mmf_glu_specs
    from moeforge.codegen.quant import quant_type
    from moeforge.codegen.spec import MmfSpec
    return [s for q in MmfSpec.QTYPES for s in mmf_glu_specs(quant_type(q))]


@pytest.fixture(autouse=True)
def _sm90():
    from moeforge.runtime import dispatch
    if not dispatch.wgmma_available():
        pytest.skip("wgmma needs an sm_90 device (H100, H200)")


def _act64(g, u, act):
    if act == "silu":
        return g / (1.0 + np.exp(-g)) * u
    g, u = np.minimum(g, 7.0), np.clip(u, -7.0, 7.0)
    return g / (1.0 + np.exp(-1.702 * g)) * (u + 1.0)


def _unpermuted(xh, ff):
    """(rows, kp) f16 bits in the wgmma k order -> float64 (rows, ff) in column order."""
    rows, kp = xh.shape
    natural = xh.reshape(rows, kp // 16, 16)[:, :, _WGMMA_POS].reshape(rows, kp)
    return natural[:, :ff].view(np.float16).astype(np.float64)


@pytest.mark.parametrize("spec", _glu_built(), ids=lambda s: s.name)
@pytest.mark.parametrize("E,top_k,ff,k,n,skew,per_slot,biases", [
    # ff past a tile's end (a partial last column tile, padding to zero), one tile narrower
    # than HALF, whole tiles with kp > ff; experts with no tokens (skew); biases (OAI only)
    (8, 2, 288, 416, 333, True, False, True), (32, 4, 96, 1056, 77, False, True, False),
    (32, 8, 768, 160, 300, True, False, True),
])
def test_glu_tile_is_the_plain_tile_then_the_conversion(rng, spec, E, top_k, ff, k, n, skew, per_slot, biases):
    import cupy as cp
    import moeforge
    from moeforge.codegen.spec import ModelSpec
    from moeforge.runtime import ops
    from moeforge.runtime.dispatch import Choice
    from moeforge.runtime.kernels import grid_1d, load
    from moeforge.runtime.mmf import run_mmf_glu, x_f16_buffer, x_to_f16
    k = _k(spec.qtype, k)
    m = 2 * ff
    raw = ref.random_blocks(spec.qtype, E * m, k, rng)
    w = moeforge.QuantTensor.from_blocks(raw, spec.qtype, (E, m, k))
    x = (rng.standard_normal((n, top_k, k) if per_slot else (n, k)) * rng.uniform(0.1, 3.0)).astype(np.float32)
    ids = _ids(rng, n, E, top_k, skew)
    xs, idss = cp.asarray(x), cp.asarray(ids)
    x_div = 1 if per_slot else top_k
    rows = n * top_k
    oai = spec.glu == "swiglu_oai"
    gb = ub = None
    if oai and biases:
        gb, ub = (cp.asarray(rng.standard_normal((E, ff)).astype(np.float32)) for _ in range(2))

    base = dataclasses.replace(spec, glu=None)
    prod = cp.full((n, top_k, m), np.nan, dtype=cp.float32)
    ops.run_mul_mat_id(w, xs, idss, prod, Choice("mmf_id", base))
    if oai:
        want, kp = x_f16_buffer(base, rows, ff)
        load(ModelSpec(), "glu_oai_id_f16")(grid_1d(rows * kp // 4), (
            prod, gb if gb is not None else np.uint64(0), ub if ub is not None else np.uint64(0), idss, want,
            np.int64(rows), np.int32(ff), np.int32(kp), np.int32(1)), block=256, smem=0)
    else:
        want, kp = x_to_f16(base, prod.reshape(rows, m), glu=True)
    want = want.get()

    outs = []
    for _ in range(2):
        poison, _ = x_f16_buffer(spec, rows, ff, "x_f16_act")
        poison.fill(0x7E00)                       # f16 NaN: every column of every row must be written
        got, okp = run_mmf_glu(spec, w, xs.reshape(-1, k), idss, x_div, gb, ub)
        assert okp == kp and got.shape == (rows, kp)
        outs.append(got.get())
    np.testing.assert_array_equal(outs[0], outs[1])          # bitwise the same run to run
    np.testing.assert_array_equal(outs[0], want)             # the plain tile's bits, converted
    assert not outs[0][:, ff:].any()                         # zeros past ff

    # and the float64 bar, on the activations of the dequantized weights' products
    prod64 = ref.mul_mat_id_float(ref.dequantize(raw, spec.qtype, (E, m, k)), x, ids).reshape(rows, m)
    g64, u64 = prod64[:, :ff], prod64[:, ff:]
    if gb is not None:
        slot_e = ids.reshape(-1)
        g64, u64 = g64 + gb.get()[slot_e], u64 + ub.get()[slot_e]
    err = ref.nmse(_unpermuted(outs[0], ff), _act64(g64, u64, spec.glu))
    assert err <= NMSE_FLOAT, f"NMSE vs float64 {err:.3e}"


def test_glu_tiles_refuse_what_they_cannot_take(rng):
    """Biases with SiLU, one bias without the other, biases of the wrong shape, a plain
    tile, rows that are not two halves of whole blocks: refused before any launch."""
    import cupy as cp
    import moeforge
    from moeforge.runtime.mmf import run_mmf_glu
    spec = next(s for s in _glu_built() if s.qtype == "q8_0" and s.glu == "swiglu_oai")
    E, ff, k, n = 4, 64, 64, 5
    w = moeforge.QuantTensor.from_blocks(ref.random_blocks("q8_0", E * 2 * ff, k, rng), "q8_0", (E, 2 * ff, k))
    x = cp.asarray(rng.standard_normal((n, k)).astype(np.float32))
    ids = cp.asarray(_ids(rng, n, E, 2, False))
    b = cp.zeros((E, ff), dtype=cp.float32)
    silu = dataclasses.replace(spec, glu="silu")
    for s, gb, ub, msg in [(silu, b, b, "biases are for swiglu_oai"), (spec, b, None, "gate and up both"),
                           (spec, b[:, :32], b[:, :32], "biases must be contiguous float32"),
                           (dataclasses.replace(spec, glu=None), None, None, "not a glu tile")]:
        with pytest.raises(ValueError, match=msg):
            run_mmf_glu(s, w, x, ids, 2, gb, ub)
    odd = moeforge.QuantTensor.from_blocks(ref.random_blocks("q8_0", E * 96, k, rng), "q8_0", (E, 96, k))
    with pytest.raises(ValueError, match="two halves"):
        run_mmf_glu(spec, odd, x, ids, 2)
