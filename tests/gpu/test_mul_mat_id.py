"""MUL_MAT_ID on the GPU, every path against both references (pytest -m gpu)."""
import dataclasses

import numpy as np
import pytest

from moeforge import reference as ref

pytestmark = pytest.mark.gpu

NMSE_FLOAT = 5e-4     # ggml's bar against float64 on dequantized weights
NMSE_EMULATED = ref.NMSE_EMULATED  # against the emulation of the kernels' own integer arithmetic


def _setup(rng, qtype, E, m, k, n, top_k, per_slot=False, skew=False):
    import cupy as cp
    import moeforge
    raw = ref.random_blocks(qtype, E * m, k, rng)
    w = moeforge.QuantTensor.from_blocks(raw, qtype, (E, m, k))
    xs = (n, top_k, k) if per_slot else (n, k)
    x = (rng.standard_normal(xs) * rng.uniform(0.1, 3.0)).astype(np.float32)
    ids = np.stack([rng.choice(E, size=top_k, replace=False) for _ in range(n)]).astype(np.int32)
    if skew and E > top_k:
        # half the tokens send their first choice to expert 0; empty experts stay empty
        hot = rng.random(n) < 0.5
        for t in np.nonzero(hot)[0]:
            row = ids[t]
            if 0 not in row:
                row[0] = 0
    return raw, w, x, ids, cp.asarray(x), cp.asarray(ids)


def _combined(res, wts, y):
    """res (n, m) + sum_j wts[:, j] * y[:, j] in slot order with moe_combine's arithmetic
    (each step one fused multiply-add, rounded to float32)."""
    want = res.copy()
    for t in range(len(res)):
        s = np.zeros(res.shape[1], dtype=np.float32)
        for j in range(wts.shape[1]):
            s = (wts[t, j].astype(np.float64) * y[t, j] + s).astype(np.float32)
        want[t] = want[t] + s
    return want


def _check(raw, qtype, shape, x, ids, out, emulated=ref.mul_mat_id_emulated):
    """out against float64 and the emulation of the path that made it (the int8 paths', or
    reference.mul_mat_id_emulated_f16 for the f16 tiles)."""
    emu = emulated(raw, qtype, shape, x, ids)
    flt = ref.mul_mat_id_float(ref.dequantize(raw, qtype, shape), x, ids)
    got = out.get()
    assert np.isfinite(got).all(), "unwritten or non-finite outputs"
    e_emu, e_flt = ref.nmse(got, emu), ref.nmse(got, flt)
    assert e_emu <= NMSE_EMULATED, f"NMSE vs emulation {e_emu:.3e}"
    assert e_flt <= NMSE_FLOAT, f"NMSE vs float64 {e_flt:.3e}"
    return e_emu, e_flt


def _choices(qtype, n, top_k):
    from moeforge.codegen.spec import MmqSpec, MmvqSpec
    from moeforge.runtime.dispatch import Choice
    out = []
    if n <= 8:
        out += [Choice("mmvq", MmvqSpec(qtype, tokens=t, warps=w, rows=r))
                for t, w, r in ((1, 4, 1), (8, 4, 2), (4, 2, 4), (2, 8, 1), (1, 8, 4))]
    if 8 < n <= 64:   # the tuner may pick the routed mat-vec up to 32 tokens (any n is correct)
        out += [Choice("mmvq", MmvqSpec(qtype, tokens=t, warps=w, rows=r))
                for t, w, r in ((1, 4, 4), (2, 8, 2), (4, 4, 1), (8, 2, 4))]
    if n <= 64:
        out += [Choice("mmvq", MmvqSpec(qtype, tokens=1, warps=w, rows=r, per_pair=True))
                for w, r in ((4, 2), (2, 1), (8, 4))]
        # x quantized by the launch before, PDL: any n is correct (the default at n=1)
        out += [Choice("mmvq", MmvqSpec(qtype, tokens=1, warps=w, rows=r, per_pair=True, prequant=True,
                                        evict_first=ef, pdl=True)) for w, r, ef in ((4, 4, True), (2, 1, False))]
    out += [Choice("mmq_id", MmqSpec(qtype, x=8, y=128, warps=8, stages=3, stream_k=True)),
            Choice("mmq_id", MmqSpec(qtype, x=8, y=96, warps=3, kblocks=16, stages=2, stream_k=False)),
            Choice("mmq_id", MmqSpec(qtype, x=16, y=96, warps=6, kblocks=8, stages=3, stream_k=True)),
            Choice("mmq_id", MmqSpec(qtype, x=32, y=64, warps=4, stages=2, stream_k=True)),
            Choice("mmq_id", MmqSpec(qtype, x=16, y=128, warps=4, stages=3, stream_k=False)),
            Choice("per_expert", MmqSpec(qtype, x=64, y=64, warps=4, ids=False, stream_k=False))]
    return out


GRID = [
    # (E, top_k, m, k, n)
    (8, 2, 96, 256, 1), (8, 1, 72, 160, 2), (32, 4, 200, 288, 7), (32, 4, 64, 512, 8),
    (8, 8, 80, 96, 9), (128, 8, 128, 256, 16), (32, 2, 136, 224, 33), (128, 8, 64, 256, 128),
    (32, 4, 48, 352, 511), (8, 2, 40, 64, 4096), (128, 8, 32, 128, 4096),
]


@pytest.mark.parametrize("qtype", ["q4_0", "q8_0", "mxfp4"])
@pytest.mark.parametrize("E,top_k,m,k,n", GRID)
def test_every_path_both_references(rng, qtype, E, top_k, m, k, n):
    import cupy as cp
    import moeforge
    raw, w, x, ids, xd, idsd = _setup(rng, qtype, E, m, k, n, top_k, skew=n >= 16)
    for choice in _choices(qtype, n, top_k):
        out = cp.full((n, top_k, m), cp.nan, dtype=cp.float32)  # poison: every element must be written
        moeforge.mul_mat_id(w, xd, idsd, out=out, choice=choice)
        e_emu, e_flt = _check(raw, qtype, (E, m, k), x, ids, out)
        print(f"{choice.path:<10} {choice.spec.name:<34} nmse emu {e_emu:.2e} float {e_flt:.2e}")


@pytest.mark.parametrize("qtype", ["q4_0", "q8_0", "mxfp4"])
@pytest.mark.parametrize("n", [1, 5, 8, 40])
def test_per_slot_activations(rng, qtype, n):
    """x of shape (n, top_k, k): each chosen expert gets its own row (the down projection)."""
    import cupy as cp
    import moeforge
    E, top_k, m, k = 16, 4, 72, 192
    raw, w, x, ids, xd, idsd = _setup(rng, qtype, E, m, k, n, top_k, per_slot=True)
    for choice in _choices(qtype, n, top_k):
        out = cp.full((n, top_k, m), cp.nan, dtype=cp.float32)
        moeforge.mul_mat_id(w, xd, idsd, out=out, choice=choice)
        _check(raw, qtype, (E, m, k), x, ids, out)


@pytest.mark.parametrize("qtype", ["q4_0", "q8_0", "mxfp4"])
def test_default_dispatch_anchor_shape(rng, qtype):
    import moeforge
    E, top_k, m, k = 128, 8, 768, 2048
    for n in (1, 4, 16, 128, 512):
        raw, w, x, ids, xd, idsd = _setup(rng, qtype, E, m, k, n, top_k)
        out = moeforge.mul_mat_id(w, xd, idsd)
        _check(raw, qtype, (E, m, k), x, ids, out)


@pytest.mark.parametrize("qtype", ["q4_0", "q8_0", "mxfp4"])
def test_repeated_calls_bitwise_identical(rng, qtype):
    import moeforge
    E, top_k, m, k, n = 64, 8, 192, 512, 300
    raw, w, x, ids, xd, idsd = _setup(rng, qtype, E, m, k, n, top_k, skew=True)
    for choice in _choices(qtype, n, top_k):
        first = moeforge.mul_mat_id(w, xd, idsd, choice=choice).get()
        for _ in range(19):
            again = moeforge.mul_mat_id(w, xd, idsd, choice=choice).get()
            assert np.array_equal(first.view(np.uint32), again.view(np.uint32)), choice.spec.name


@pytest.mark.parametrize("m,n", [(136, 77), (60, 5)])
def test_streamk_grid_sizes(rng, m, n):
    """Stream-k over many grid sizes: the fixup must add the right partials to the right
    tokens whatever the SM count (llama.cpp PR 17089). With 5 tokens the routing fills
    fewer tiles than the launch plans for, so the grid has more blocks than units and
    empty blocks lie between a tile's partials."""
    import cupy as cp
    from moeforge.codegen.spec import MmqSpec
    from moeforge.runtime import ops
    from moeforge.runtime.dispatch import Choice
    import moeforge
    qtype, E, top_k, k = "q4_0", 16, 4, 544
    raw, w, x, ids, xd, idsd = _setup(rng, qtype, E, m, k, n, top_k, skew=True)
    spec = MmqSpec(qtype, x=16, y=64, warps=4, stages=2, stream_k=True)
    real = ops.device_info
    try:
        for sms in (1, 2, 3, 7, 13, 64, 131, 132, 264):
            info = dict(real(cp.cuda.Device().id), sm_count=sms)
            ops.device_info = lambda _dev, info=info: info
            out = cp.full((n, top_k, m), cp.nan, dtype=cp.float32)
            moeforge.mul_mat_id(w, xd, idsd, out=out, choice=Choice("mmq_id", spec))
            _check(raw, qtype, (E, m, k), x, ids, out)
    finally:
        ops.device_info = real


@pytest.mark.parametrize("qtype", ["q4_0", "q8_0", "q2_K", "q3_K", "q4_K", "q5_K", "q6_K", "iq4_xs", "mxfp4"])
@pytest.mark.parametrize("n", [1, 3, 8, 9, 100, 600])
def test_mul_mat_dense(rng, qtype, n):
    import cupy as cp
    import moeforge
    m, k = 333, 416 if ref.quant_type(qtype).sub_blocks == 1 else 768    # super-blocks: rows of whole ones
    raw = ref.random_blocks(qtype, m, k, rng)
    w = moeforge.QuantTensor.from_blocks(raw, qtype, (m, k))
    x = rng.standard_normal((n, k)).astype(np.float32)
    out = cp.full((n, m), cp.nan, dtype=cp.float32)
    moeforge.mul_mat(w, cp.asarray(x), out=out)
    got = out.get()
    assert np.isfinite(got).all()
    from moeforge.runtime.dispatch import mmf_choice
    if mmf_choice(qtype, n, None, m) is not None:     # the f16 tiles (q6_K has none: int8 tiles)
        emu = ref.mul_mat_id_emulated_f16(raw, qtype, (1, m, k), x, np.zeros((n, 1), np.int32))[:, 0]
    else:
        emu = ref.mul_mat_emulated(raw, qtype, (m, k), x)
    assert ref.nmse(got, emu) <= NMSE_EMULATED
    assert ref.nmse(got, ref.mul_mat_float(ref.dequantize(raw, qtype, (m, k)), x)) <= NMSE_FLOAT


def test_quantize_activations_bitwise(rng):
    import cupy as cp
    from moeforge.runtime.ops import quantize_activations
    x = (rng.standard_normal((37, 320)) * 5).astype(np.float32)
    x[3, :32] = 0.0  # an all-zero block
    xq, xds, nbp = quantize_activations(cp.asarray(x))
    q, d, s = ref.quantize_q8_1(x)
    assert np.array_equal(xq.get(), q)
    got = xds.get()
    assert np.array_equal(got[:, :10, 0], d) and np.array_equal(got[:, :10, 1], s)
    assert not got[:, 10:].any(), "padding blocks must be zero"


def test_bad_input_is_a_value_error_before_launch(rng):
    import cupy as cp
    import moeforge
    raw = ref.random_blocks("q4_0", 4 * 64, 128, rng)
    w = moeforge.QuantTensor.from_blocks(raw, "q4_0", (4, 64, 128))
    x = cp.ones((3, 128), dtype=cp.float32)
    ids = cp.zeros((3, 2), dtype=cp.int32)
    with pytest.raises(ValueError, match="x"):
        moeforge.mul_mat_id(w, x.astype(cp.float16), ids)
    with pytest.raises(ValueError, match="x"):
        moeforge.mul_mat_id(w, np.ones((3, 128), np.float32), ids)
    with pytest.raises(ValueError, match="k="):
        moeforge.mul_mat_id(w, cp.ones((3, 96), dtype=cp.float32), ids)
    with pytest.raises(ValueError, match="ids"):
        moeforge.mul_mat_id(w, x, ids.astype(cp.int64))
    with pytest.raises(ValueError, match="ids"):
        moeforge.mul_mat_id(w, x, cp.full((3, 2), 4, dtype=cp.int32))
    with pytest.raises(ValueError, match="ids"):
        moeforge.mul_mat_id(w, x, cp.full((3, 2), -1, dtype=cp.int32))
    with pytest.raises(ValueError, match="tokens"):
        moeforge.mul_mat_id(w, x, cp.zeros((4, 2), dtype=cp.int32))


@pytest.mark.parametrize("qtype", ["q4_0", "q8_0"])
@pytest.mark.parametrize("n", [1, 6, 33])
def test_router_weights_scale_each_entry(rng, qtype, n):
    import cupy as cp
    import moeforge
    E, top_k, m, k = 16, 4, 64, 256
    raw, w, x, ids, xd, idsd = _setup(rng, qtype, E, m, k, n, top_k, per_slot=True)
    wts = rng.random((n, top_k)).astype(np.float32)
    out = moeforge.mul_mat_id(w, xd, idsd, weights=cp.asarray(wts))
    emu = ref.mul_mat_id_emulated(raw, qtype, (E, m, k), x, ids) * wts[:, :, None]
    assert ref.nmse(out.get(), emu) <= NMSE_EMULATED


@pytest.mark.parametrize("n,top_k,E,tx", [(1, 8, 128, 1), (3, 8, 128, 2), (4, 8, 16, 8), (2, 6, 4, 3),
                                          (5, 4, 32, 8), (37, 8, 64, 16), (600, 8, 128, 32)])
def test_routing_table_is_a_stable_sort(rng, n, top_k, E, tx):
    """Rows grouped by expert in entry order, tiles of at most tx, per-expert offsets: both
    routing kernels (one warp for N <= 32, the block version beyond)."""
    import cupy as cp
    from moeforge.runtime.ops import _prepare
    ids = np.stack([rng.choice(E, size=top_k, replace=top_k > E) for _ in range(n)]).astype(np.int32)
    x = cp.asarray(rng.standard_normal((n, 64)).astype(np.float32))
    (rows, tiles, ntt, eoff, max_tiles), _ = _prepare(cp.asarray(ids), E, tx, x)
    flat = ids.reshape(-1)
    order = np.argsort(flat, kind="stable")
    assert np.array_equal(rows.get()[:flat.size], order)
    counts = np.bincount(flat, minlength=E)
    assert np.array_equal(eoff.get()[:E + 1], np.concatenate([[0], np.cumsum(counts)]))
    want = [(e, int(np.cumsum(counts)[e] - counts[e]) + t * tx, min(tx, counts[e] - t * tx))
            for e in range(E) for t in range(-(-counts[e] // tx))]
    assert int(ntt.get()[0]) == len(want) <= max_tiles
    got = tiles.get()[:4 * len(want)].reshape(-1, 4)[:, :3]
    assert [tuple(map(int, r)) for r in got] == want


@pytest.mark.parametrize("n", [16, 97, 512])
def test_launch_forms_change_no_bit(rng, n, monkeypatch):
    """PDL-chained routing + product and evict-first weight copies (ops.mmq_launch_form)
    against the plain launches of the same tile: the same bits, also in a chain of calls
    captured in a graph where each call's routing overlaps the end of the call before."""
    import cupy as cp
    from moeforge.codegen.spec import MmqSpec
    from moeforge.runtime import dispatch, ops
    E, top_k, m, k = 64, 6, 320, 1024
    raw, w, x, ids, xd, idsd = _setup(rng, "q4_0", E, m, k, n, top_k, skew=True)
    tx = 8 * -(-n * top_k // (8 * E))            # tiles as wide as the tokens an expert gets
    choice = dispatch.Choice("mmq_id", MmqSpec("q4_0", x=tx, y=64, warps=4, kblocks=16, stages=2,
                                               stream_k=False))
    form = ops.mmq_launch_form(choice.spec, n * top_k, E, True)
    assert form.pdl and form.evict_first
    outs = {}
    for forms in (False, True):
        monkeypatch.setattr(ops, "MMQ_LAUNCH_FORMS", forms)
        bufs = [cp.full((n, top_k, m), cp.nan, dtype=cp.float32) for _ in range(3)]
        stream = cp.cuda.Stream(non_blocking=True)
        with stream:
            stream.begin_capture()
            for b in bufs:
                ops.run_mul_mat_id(w, xd, idsd, b, choice)
            graph = stream.end_capture()
            graph.launch(stream)
            stream.synchronize()
        outs[forms] = [b.get() for b in bufs]
    _check(raw, "q4_0", (E, m, k), x, ids, cp.asarray(outs[True][0]))
    for a, b in zip(outs[False], outs[True]):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("qtype", ["q4_0", "q8_0", "mxfp4"])
@pytest.mark.parametrize("E,top_k,m,k,n,tx,stages,per_slot", [
    (64, 6, 320, 1024, 16, 8, 2, False), (128, 8, 200, 512, 11, 8, 3, True),
    (32, 4, 136, 288, 97, 16, 2, False), (8, 2, 72, 160, 300, 32, 4, True),
])
def test_direct_routing_changes_no_bit(rng, qtype, E, top_k, m, k, n, tx, stages, per_slot,
                                                        monkeypatch):
    """Direct routing (each block finds its (expert, column) in ids itself; an expert with
    more tokens than a tile has extra columns; experts with none have no block at work),
    plain and PDL-launched in a captured chain: the bits of the routed launch of the tile."""
    import cupy as cp
    from moeforge.codegen.spec import MmqSpec
    from moeforge.runtime import dispatch, ops
    raw, w, x, ids, xd, idsd = _setup(rng, qtype, E, m, k, n, top_k, per_slot=per_slot, skew=True)
    for row in ids[:tx + 1]:  # expert 0 spans two columns or more
        if 0 not in row:
            row[0] = 0
    idsd = cp.asarray(ids)
    monkeypatch.setattr(ops, "MMQ_LAUNCH_FORMS", False)  # each form exactly as written here
    base = MmqSpec(qtype, x=tx, y=64, warps=2, kblocks=8, stages=stages, stream_k=False)
    forms = {"plain": base, "direct": dataclasses.replace(base, direct=True),
             "direct-ef-pdl": dataclasses.replace(base, direct=True, pdl=True, evict_first=True)}
    outs = {}
    for name, spec in forms.items():
        bufs = [cp.full((n, top_k, m), cp.nan, dtype=cp.float32) for _ in range(2)]
        stream = cp.cuda.Stream(non_blocking=True)
        with stream:
            stream.begin_capture()
            for b in bufs:
                ops.run_mul_mat_id(w, xd, idsd, b, dispatch.Choice("mmq_id", spec))
            graph = stream.end_capture()
            graph.launch(stream)
            stream.synchronize()
        outs[name] = [b.get() for b in bufs]
    _check(raw, qtype, (E, m, k), x, ids, cp.asarray(outs["plain"][0]))
    for name in ("direct", "direct-ef-pdl"):
        for a, b in zip(outs["plain"], outs[name]):
            np.testing.assert_array_equal(a, b, err_msg=name)


@pytest.mark.parametrize("qtype", ["q4_0", "q8_0", "mxfp4"])
@pytest.mark.parametrize("n,top_k,E,m,k", [(1, 8, 128, 2048, 768), (3, 6, 64, 200, 352), (8, 8, 16, 97, 256),
                                           (2, 1, 8, 64, 128), (5, 3, 32, 130, 512), (1, 6, 64, 300, 1408),
                                           (2, 4, 32, 97, 2880)])
def test_down_product_adding_its_weighted_sum(rng, qtype, n, top_k, E, m, k):
    """The model's decode down product adds sum_j wts[j] * (W[ids[j]] x_j) to the residual
    row itself (no expert outputs in memory): against both references, and the separate
    product followed by moe_combine's sum in slot order (bit for bit in the model test)."""
    import cupy as cp
    from moeforge.runtime import dispatch, ops
    raw, w, x, ids, xd, idsd = _setup(rng, qtype, E, m, k, n, top_k, per_slot=True)
    wts = rng.random((n, top_k)).astype(np.float32)
    res = rng.standard_normal((n, m)).astype(np.float32)
    got = cp.asarray(res)
    ops.run_mul_mat_id_combine(w, xd, idsd, cp.asarray(wts), got)
    emu = ref.mul_mat_id_emulated(raw, qtype, (E, m, k), x, ids)
    flt = ref.mul_mat_id_float(ref.dequantize(raw, qtype, (E, m, k)), x, ids)
    g = got.get()
    assert np.isfinite(g).all()
    assert ref.nmse(g - res, np.einsum("tj,tjm->tm", wts, emu)) <= NMSE_EMULATED
    assert ref.nmse(g - res, np.einsum("tj,tjm->tm", wts.astype(np.float64), flt)) <= NMSE_FLOAT
    y = cp.full((n, top_k, m), cp.nan, dtype=cp.float32)
    ops.run_mul_mat_id(w, xd, idsd, y, dispatch.Choice("mmvq", dispatch.default_mmvq(qtype, n, True)))
    np.testing.assert_allclose(g, _combined(res, wts, y.get()), rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("qtype,k", [("q4_0", 256), ("q4_0", 768), ("q4_0", 1408), ("q8_0", 2880),
                                     ("q4_K", 768), ("q4_K", 2048), ("mxfp4", 2880)])
def test_down_product_with_one_unit_in_flight_changes_no_bit(rng, qtype, k):
    """The combining down product with one k-unit in flight a warp (dispatch.default_combine's
    form for short rows, launch bounds of 32 warps an SM) against two: the same bits on rows
    of one to three units, skewed routing."""
    import cupy as cp
    from moeforge.codegen.spec import MmvqSpec
    from moeforge.runtime import ops
    E, m, n, top_k = 16, 130, 3, 8
    raw, w, x, ids, xd, idsd = _setup(rng, qtype, E, m, k, n, top_k, per_slot=True, skew=True)
    wts = cp.asarray(rng.random((n, top_k)).astype(np.float32))
    res = rng.standard_normal((n, m)).astype(np.float32)
    outs = {}
    for units in (1, 2):
        spec = dataclasses.replace(MmvqSpec.decode(qtype), warps=8, combine=True, units=units)
        got = cp.asarray(res)
        ops._mmvq(spec, w, xd.reshape(-1, k), idsd, 1, got, m, combine=(wts, got))
        outs[units] = got.get()
    assert np.isfinite(outs[1]).all() and not np.array_equal(outs[1], res)
    np.testing.assert_array_equal(outs[1], outs[2])


@pytest.mark.parametrize("qtype,k", [("q4_0", 14336), ("q4_0", 9248), ("q8_0", 14336), ("q4_K", 9472),
                                     ("mxfp4", 8224)])
@pytest.mark.parametrize("top_k,warps,rows,units", [(2, 4, 2, 2), (2, 8, 2, 2), (2, 4, 4, 1), (1, 2, 2, 2),
                                                    (4, 8, 4, 1)])
def test_down_product_with_k_split_over_warps(rng, qtype, k, top_k, warps, rows, units):
    """The combining down product with each slot's k-units split over warps / top_k warps
    (long rows: Mixtral's down, dispatch.COMBINE_KSPLIT_MIN_UNITS), on rows of 9 to 14
    units (a last unit partly filled), odd m, skewed routing: both references, the separate
    product with the same k split followed by moe_combine's sum in slot order, and the same
    bits twice."""
    import cupy as cp
    from moeforge.codegen.spec import MmvqSpec
    from moeforge.runtime import ops
    E, m, n = 8, 133, 3
    raw, w, x, ids, xd, idsd = _setup(rng, qtype, E, m, k, n, top_k, per_slot=True, skew=True)
    wts = rng.random((n, top_k)).astype(np.float32)
    res = rng.standard_normal((n, m)).astype(np.float32)
    spec = dataclasses.replace(MmvqSpec.decode(qtype, rows=rows), warps=warps, combine=True, units=units, ksplit=True)
    spec.check()
    runs = []
    for _ in range(2):
        got = cp.asarray(res)
        ops._mmvq(spec, w, xd.reshape(-1, k), idsd, 1, got, m, combine=(cp.asarray(wts), got))
        runs.append(got.get())
    g = runs[0]
    np.testing.assert_array_equal(runs[0], runs[1])
    assert np.isfinite(g).all()
    emu = ref.mul_mat_id_emulated(raw, qtype, (E, m, k), x, ids)
    flt = ref.mul_mat_id_float(ref.dequantize(raw, qtype, (E, m, k)), x, ids)
    assert ref.nmse(g - res, np.einsum("tj,tjm->tm", wts, emu)) <= NMSE_EMULATED
    assert ref.nmse(g - res, np.einsum("tj,tjm->tm", wts.astype(np.float64), flt)) <= NMSE_FLOAT
    separate = dataclasses.replace(MmvqSpec.decode(qtype), warps=warps // top_k, ksplit=True)
    y = cp.full((n, top_k, m), cp.nan, dtype=cp.float32)
    ops._mmvq(separate, w, xd.reshape(-1, k), idsd, 1, y, m)
    np.testing.assert_allclose(g, _combined(res, wts, y.get()), rtol=2e-6, atol=2e-6)
    with pytest.raises(ValueError, match="divides"):
        odd = dataclasses.replace(spec, warps=8)
        ops._mmvq(odd, w, xd.reshape(-1, k)[:n * 3], cp.asarray(np.zeros((n, 3), np.int32)), 1, got, m,
                  combine=(cp.asarray(np.ones((n, 3), np.float32)), got))


@pytest.mark.parametrize("qtype", ["q4_0", "q8_0"])
@pytest.mark.parametrize("case", ["dense-sk", "routed", "routed-sk", "direct", "per-slot-x"])
def test_lean_form_changes_no_bit(rng, qtype, case, monkeypatch):
    """The lean unit walk (counters instead of divisions, a tile's x rows looked up once)
    against the plain tile: the same bits on odd sizes, skewed routing, tiles that cross
    stream-k blocks, direct routing and x of one row per slot (x_div 1)."""
    import cupy as cp
    import moeforge
    from moeforge.codegen.spec import MmqSpec
    from moeforge.runtime import dispatch, ops
    monkeypatch.setattr(ops, "MMQ_LAUNCH_FORMS", False)   # the spec exactly as written here
    outs = {}
    if case == "dense-sk":
        m, k, n = 333, 416, 157
        raw = ref.random_blocks(qtype, m, k, rng)
        w = moeforge.QuantTensor.from_blocks(raw, qtype, (m, k))
        x = rng.standard_normal((n, k)).astype(np.float32)
        spec = MmqSpec(qtype, x=32, y=64, warps=4, kblocks=4, stages=3, ids=False, stream_k=True)
        for lean in (False, True):
            monkeypatch.setattr(ops, "MMQ_LEAN", lean)
            out = cp.full((n, m), cp.nan, dtype=cp.float32)
            ops.run_mul_mat(w, cp.asarray(x), out, dispatch.Choice("mmq", spec))
            outs[lean] = out.get()
        assert ref.nmse(outs[True], ref.mul_mat_emulated(raw, qtype, (m, k), x)) <= NMSE_EMULATED
        assert ref.nmse(outs[True], ref.mul_mat_float(ref.dequantize(raw, qtype, (m, k)), x)) <= NMSE_FLOAT
    else:
        E, top_k, m, k, n = 48, 6, 200, 544, 131
        raw, w, x, ids, xd, idsd = _setup(rng, qtype, E, m, k, n, top_k, per_slot=case == "per-slot-x", skew=True)
        tx = 8 if case == "direct" else 16
        spec = MmqSpec(qtype, x=tx, y=64, warps=2, kblocks=8, stages=2, stream_k=case == "routed-sk",
                       direct=case == "direct", pdl=case == "direct")
        for lean in (False, True):
            monkeypatch.setattr(ops, "MMQ_LEAN", lean)
            out = cp.full((n, top_k, m), cp.nan, dtype=cp.float32)
            ops.run_mul_mat_id(w, xd, idsd, out, dispatch.Choice("mmq_id", spec))
            outs[lean] = out.get()
        _check(raw, qtype, (E, m, k), x, ids, cp.asarray(outs[True]))
    assert np.isfinite(outs[True]).all()
    np.testing.assert_array_equal(outs[False], outs[True])


@pytest.mark.parametrize("path,spec_kw,n", [
    ("mmq_id", dict(x=16, y=64, warps=4, kblocks=16, stages=2), 37),     # routing launch
    ("mmq_id", dict(x=8, y=64, warps=4, kblocks=16, stages=2, stream_k=False, direct=True), 9),
    ("per_expert", dict(x=32, y=64, warps=4, ids=False, stream_k=False), 21),
])
def test_swiglu_in_the_quantizer_changes_no_bit(rng, path, spec_kw, n):
    """The down product fed gate|up products (glu): its quantizer computes SiLU(gate) * up
    itself. The result must be that of the model's swiglu kernel and then the product, bit
    for bit, on every path that quantizes x in its own launch; the mat-vec path refuses."""
    import cupy as cp
    from moeforge.codegen.spec import MmqSpec, ModelSpec
    from moeforge.runtime import dispatch, ops
    from moeforge.runtime.kernels import load
    E, top_k, ff, m = 16, 4, 96, 72
    raw, w, _, ids, _, idsd = _setup(rng, "q4_0", E, m, ff, n, top_k)
    gu = cp.asarray((rng.standard_normal((n, top_k, 2 * ff)) * 2).astype(np.float32))
    act = cp.full((n, top_k, ff), np.nan, dtype=cp.float32)
    load(ModelSpec(), "swiglu")((-(-act.size // 256),), (gu, act, np.int64(n * top_k), np.int32(ff)), block=256)
    choice = dispatch.Choice(path, MmqSpec("q4_0", **spec_kw))
    want = cp.full((n, top_k, m), np.nan, dtype=cp.float32)
    got = cp.full((n, top_k, m), np.nan, dtype=cp.float32)
    ops.run_mul_mat_id(w, act, idsd, want, choice)
    ops.run_mul_mat_id(w, gu, idsd, got, choice, glu=True)
    assert np.isfinite(want.get()).all()
    np.testing.assert_array_equal(got.get(), want.get())
    _check(raw, "q4_0", (E, m, ff), act.get(), ids, got)
    with pytest.raises(ValueError, match="gate|up"):
        ops.run_mul_mat_id(w, gu, idsd, got, dispatch.Choice("mmvq", dispatch.default_mmvq("q4_0", n, True)),
                           glu=True)
