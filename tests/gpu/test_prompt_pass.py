"""The prompt pass on the GPU (pytest -m gpu): the prompt attention kernels against their
references, the tiled float product, and a prompt ubatch replayed as a CUDA graph bit for
bit the eager pass, at other positions too."""
import warnings

import numpy as np
import pytest
from conftest import attention64 as _attention64
from conftest import attn_hparams as _hp

from moeforge.runtime.model import load_model
from moeforge.runtime.prompt_attention import attention_tc, fa_kernel, kernel_for

pytestmark = pytest.mark.gpu


CASES = [
    ((32, 4, 128), 0, 77),       # Qwen3-30B-A3B's heads, a prompt from the start
    ((32, 4, 128), 301, 45),     # later ubatch: keys from earlier ones, a partial last tile
    ((16, 4, 64), 33, 19),       # narrower heads
    ((8, 8, 32), 0, 9),          # no grouping, a partial query tile
]


PRECISION = {"attn_prefill_fa64": "f16", "attn_prefill_fa128": "f16", "attn_prefill_fa": "f16", "attn_prefill_tc": "tf32",
             "attn_prefill": "f32"}


def _f16(heads):
    return fa_kernel(heads[2])


@pytest.mark.parametrize("kernel,heads,pos0,n,bufs", [
    (tc(c[0]), *c, None) for tc in (_f16, lambda h: "attn_prefill_tc") for c in CASES] + [
    (tc(h), h, 301, 45, 1) for h in ((32, 4, 128),) for tc in (_f16, lambda h: "attn_prefill_tc")] + [  # one key tile buffer, as on an A100
    (tc(h), h, 70, 9, 1) for h in ((8, 8, 32),) for tc in (_f16, lambda h: "attn_prefill_tc")] + [
    ("attn_prefill_fa", (6, 3, 48), 130, 33, None),     # a width of 16s, not of 32s: only f16; 4 token tiles a block
    ("attn_prefill_fa", (12, 2, 80), 64, 70, 1),        # groups of 6 (6 warps a block), a 64-key boundary at the start
    ("attn_prefill_fa64", (16, 16, 64), 200, 300, None),  # no grouping: 128 tokens a block, some tiles past the prompt
    ("attn_prefill_fa128", (40, 8, 128), 0, 200, None),   # groups of 5: one token tile a block
    ("attn_prefill_fa128", (64, 4, 128), 33, 19, None),   # groups of 16 (Qwen3-235B): two blocks a key head
    ("attn_prefill_fa128", (64, 4, 128), 900, 130, 1),
    ("attn_prefill_fa", (24, 2, 48), 100, 70, None),      # groups of 12: blocks of 6 heads
] + [
    ("attn_prefill", *c, None) for c in CASES + [
        ((64, 4, 128), 33, 19),  # 16 query heads a group (Qwen3-235B) at float32
        ((6, 3, 36), 5, 40),     # head width a multiple of 4, not of 32
    ]])
def test_attn_prefill_matches_its_references(kernel, heads, pos0, n, bufs):
    """attn_prefill against float64 (2e-5); the tensor-core kernels against an emulation of
    their rounding (median and max, below) and against float64 within the design's NMSE bar.
    Rows poisoned before the launch, the same bits on a second launch."""
    import cupy as cp

    from moeforge.runtime.backend_cuda import CudaBackend
    hp = _hp(*heads)
    B = CudaBackend(hp)
    B.attn_precision = PRECISION[kernel]
    B.attn_tile_buffers = bufs
    info = B._device()
    if kernel_for(hp, info["cc"], B.attn_precision, info["smem_per_block_optin"]) != kernel:
        pytest.skip(f"{kernel} does not run here (tensor cores need sm_80)")
    rng = np.random.default_rng()
    ctx = pos0 + n + 7
    cache = B.new_cache(ctx)
    il = 1
    kc = rng.standard_normal((ctx, hp.kv_dim)).astype(np.float32)
    vc = rng.standard_normal((ctx, hp.kv_dim)).astype(np.float32)
    q = (2.0 * rng.standard_normal((n, hp.q_dim))).astype(np.float32)   # peaked softmax rows too
    pos = np.arange(pos0, pos0 + n, dtype=np.int32)
    with B.context():
        cache.k[il].set(kc)
        cache.v[il].set(vc)
        out = B.ws("attn", (n, hp.q_dim))
        out.fill(cp.nan)
        poison_f16_rows(B, ctx)
        got = B.attention(cache, il, cp.asarray(q), cp.asarray(pos), pos0, n, "attn").get()
        again = B.attention(cache, il, cp.asarray(q), cp.asarray(pos), pos0, n, "attn").get()
    exact = _attention64(q.astype(np.float64), kc.astype(np.float64), vc.astype(np.float64), pos, hp)
    assert np.isfinite(got).all()
    np.testing.assert_array_equal(got, again)
    if kernel == "attn_prefill":
        err = np.abs(got - exact).max()
        assert err < 2e-5 * max(1.0, np.abs(exact).max()), f"max abs error {err:.2e}"
        return
    # the cache beyond the prompt's positions is never read: the emulation sees up to pos0 + n
    emul = attention_tc(q, kc, vc, hp, pos0, PRECISION[kernel])
    # Not bit for bit: a probability within float32 noise of a rounding boundary (10-bit
    # mantissas in both precisions) can round
    # the other way in the kernel (its sums and exp2 are float32), moving its row by up to 2^-11
    # of that probability times v. So: typical elements at float32 noise (the wrong rounding
    # mode on one operand puts the median near 1e-4), and no element off by more than a few
    # such flips.
    err = np.abs(got - emul)
    median = np.median(err) / max(1.0, np.abs(emul).max())
    assert median < 1e-6, f"median error {median:.2e} (relative) against the emulation"
    assert err.max() < 2.0 ** -9 * np.abs(vc).max(), f"max abs error {err.max():.2e} against the emulation"
    nmse = ((got - exact) ** 2).sum() / (exact ** 2).sum()
    assert nmse < 5e-4, f"NMSE {nmse:.2e} against float64"


def poison_f16_rows(B, ctx: int) -> None:
    """NaN in the f16 rows attn_prefill_fa reads from a float32 cache (kv_rows_f16 writes
    them first): a row it reads and was not given would reach the output (0 * NaN)."""
    import cupy as cp
    for name in ("attn_k_f16", "attn_v_f16"):
        B.ws(name, (ctx, B.hp.kv_dim), np.float16).fill(cp.nan)


@pytest.mark.parametrize("precision,heads", [("f16", (64, 8, 64)), ("f16", (8, 2, 32)), ("f16", (32, 4, 128)),
                                             ("f16", (64, 4, 64)), ("tf32", (64, 8, 64))])
@pytest.mark.parametrize("pos0,n,window", [(0, 150, 128), (700, 90, 128), (37, 64, 8), (300, 200, 0)])
def test_tensor_core_prompt_attention_with_sinks_and_windows(precision, heads, pos0, n, window):
    """gpt-oss's attention: a sink logit per head in each denominator and sliding windows
    that start before the ubatch, inside it, and across 64-key tiles; against the emulation
    (sinks and windows in float64 between the rounding points) and float64."""
    import cupy as cp

    from moeforge.runtime.backend_cuda import CudaBackend
    hp = _hp(*heads)
    B = CudaBackend(hp)
    B.attn_precision = precision
    rng = np.random.default_rng()
    ctx = pos0 + n + 5
    cache = B.new_cache(ctx)
    kc = rng.standard_normal((ctx, hp.kv_dim)).astype(np.float32)
    vc = rng.standard_normal((ctx, hp.kv_dim)).astype(np.float32)
    q = (2.0 * rng.standard_normal((n, hp.q_dim))).astype(np.float32)
    sinks = rng.uniform(-2.0, 4.0, hp.n_head).astype(np.float32)
    pos = np.arange(pos0, pos0 + n, dtype=np.int32)
    with B.context():
        cache.k[0].set(kc)
        cache.v[0].set(vc)
        B.ws("attn", (n, hp.q_dim)).fill(cp.nan)
        poison_f16_rows(B, ctx)     # a window's rows before its first key tile stay NaN
        args = (cache, 0, cp.asarray(q), cp.asarray(pos), pos0, n, "attn")
        got = B.attention(*args, sinks=cp.asarray(sinks), window=window).get()
        again = B.attention(*args, sinks=cp.asarray(sinks), window=window).get()
    assert np.isfinite(got).all()
    np.testing.assert_array_equal(got, again)
    emul = attention_tc(q, kc, vc, hp, pos0, precision, sinks=sinks, window=window)
    err = np.abs(got - emul)
    assert np.median(err) / max(1.0, np.abs(emul).max()) < 1e-6
    assert err.max() < 2.0 ** -9 * np.abs(vc).max(), f"max abs error {err.max():.2e} against the emulation"
    exact = _attention64(q.astype(np.float64), kc.astype(np.float64), vc.astype(np.float64), pos, hp,
                         sinks=sinks, window=window)
    nmse = ((got - exact) ** 2).sum() / (exact ** 2).sum()
    assert nmse < 5e-4, f"NMSE {nmse:.2e} against float64"


@pytest.mark.parametrize("m,k,n", [(128, 2048, 512), (130, 2050, 37), (7, 33, 17), (200, 64, 100),
                                   (64, 300, 40), (65, 96, 130)])
def test_float_product_tiles_match_float64(m, k, n):
    """dense_f32_tiled and dense_f32_tiled128 (float products of more than SMALL_N tokens:
    the router in a prompt; up to 64 rows and past them)."""
    import cupy as cp

    from moeforge.runtime.backend_cuda import SMALL_N, CudaBackend, GpuWeight
    assert n > SMALL_N
    B = CudaBackend(_hp(4, 2, 32))
    rng = np.random.default_rng()
    w = rng.standard_normal((m, k)).astype(np.float32)
    x = rng.standard_normal((n, k)).astype(np.float32)
    W = GpuWeight("f32", (m, k), f=cp.asarray(w))
    with B.context():
        B.ws("router", (n, m)).fill(cp.nan)
        got = B.matmul(W, cp.asarray(x), "router").get()
        again = B.matmul(W, cp.asarray(x), "router").get()
    want = x.astype(np.float64) @ w.astype(np.float64).T
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * np.sqrt(k))
    np.testing.assert_array_equal(got, again)          # split sums added in a fixed order


def _prompt_logits(path, toks, ubatch, graphs):
    m = load_model(path, backend="cuda", n_ubatch=ubatch)
    m.backend.use_graphs = graphs
    m.reset(len(toks))
    return m, m.eval(toks)


def test_prompt_graph_replay_equals_eager(parity_models):
    """Ubatches of 16 tokens: the first runs eagerly, the second is captured, the rest
    replay that graph at later positions (ids and positions are read on the device). Every
    row of logits must be the eager pass's, bit for bit."""
    fx = parity_models["q4_0"]
    toks = np.asarray(fx["tokens"][:16 * 5 + 3])
    with warnings.catch_warnings():
        warnings.simplefilter("error")      # a refused capture warns: fail here
        m, got = _prompt_logits(fx["path"], toks, 16, True)
    assert m.backend.graphs.captured(("prompt", 16, False))
    _, want = _prompt_logits(fx["path"], toks, 16, False)
    np.testing.assert_array_equal(got, want)
    # and a second prompt through the captured graph, from the start
    m.reset(len(toks))
    np.testing.assert_array_equal(m.eval(toks), want)


def test_prompt_graph_recaptured_when_the_cache_changes(parity_models):
    fx = parity_models["q8_0"]
    toks = np.asarray(fx["tokens"][:40])
    m, first = _prompt_logits(fx["path"], toks, 8, True)
    m.reset(len(toks) + 64)                 # a new cache: the graph's addresses are stale
    np.testing.assert_array_equal(m.eval(toks), first)
    m.reset()
    np.testing.assert_array_equal(m.eval(toks), first)
    assert m.backend.graphs.captured(("prompt", 8, False))


def test_float_models_keep_float32_prompt_attention(parity_models):
    """f16 tensor cores by default only where the attention weights are quantized (their q8_1
    activations already cost more precision than f16 does); the model may ask for another."""
    assert load_model(parity_models["q4_0"]["path"], backend="cuda").backend.attn_precision == "f16"
    assert load_model(parity_models["f32"]["path"], backend="cuda").backend.attn_precision == "f32"
    assert load_model(parity_models["q4_0"]["path"], backend="cuda",
                      attn_precision="tf32").backend.attn_precision == "tf32"


@pytest.mark.parametrize("name", ["q4_0", "q8_0"])
def test_swiglu_in_the_down_quantizer_changes_no_bit(parity_models, name):
    """Past decode sizes the experts' SiLU(gate) * up is computed by the down product's
    quantizer (no swiglu launch, no buffer of its own): a prompt's logits must be those of
    the separate swiglu launch, bit for bit, and the launch must really be gone."""
    fx = parity_models[name]
    toks = np.asarray(fx["tokens"][:40])
    outs = []
    for fused in (True, False):
        m = load_model(fx["path"], backend="cuda", n_ubatch=20)
        m.backend.fuse_glu_quant = fused
        calls = []
        swiglu = m.backend.swiglu
        m.backend.swiglu = lambda *a, _f=swiglu: calls.append(1) or _f(*a)
        m.reset(len(toks))
        outs.append(m.eval(toks))
        assert (len(calls) == 0) == fused, len(calls)
        assert np.isfinite(outs[-1]).all()
    np.testing.assert_array_equal(outs[0], outs[1])


@pytest.mark.parametrize("name", ["q4_0", "q8_0", "glm-q4_0", "ds-q8_0"])
def test_glu_tiles_change_no_bit(parity_models, monkeypatch, name):
    """Where the gate|up and the down products both run on wgmma tiles, the gate|up tiles
    write SiLU(gate) * up as the down's f16 x themselves (MmfSpec.glu): a prompt's logits
    must be those of the plain tiles and the down's conversion, bit for bit, and the glu
    tiles must really have run (GLM: a dense first layer as one expert and a shared expert
    apart; DeepSeek: shared experts riding as experts). Every expert product past decode
    sizes is held on a wgmma tile here, of 256 rows or 128 by its shape."""

    from moeforge.codegen.enumerate import mmf_wgmma_specs
    from moeforge.codegen.quant import quant_type
    from moeforge.runtime import dispatch, mmf
    if not dispatch.wgmma_available():
        pytest.skip("the wgmma tiles need an sm_90 device (H100, H200)")
    real = dispatch.choose_mul_mat_id

    def held(q, E, top_k, m, k, n, f16=True):
        if n <= dispatch.MMVQ_MAX_TOKENS or q not in ("q4_0", "q8_0"):
            return real(q, E, top_k, m, k, n, f16)
        tiles = {s.y: s for s in mmf_wgmma_specs(quant_type(q)) if s.ids}
        return dispatch.Choice("mmf_id", tiles[256 if k > m // 2 else 128])
    monkeypatch.setattr(dispatch, "choose_mul_mat_id", held)
    glu_runs = []
    run_glu = mmf.run_mmf_glu
    monkeypatch.setattr(mmf, "run_mmf_glu", lambda spec, *a: glu_runs.append(spec) or run_glu(spec, *a))
    fx = parity_models[name]
    toks = np.asarray(fx["tokens"][:100])
    outs = []
    for tiles in (True, False):
        glu_runs.clear()
        m = load_model(fx["path"], backend="cuda", n_ubatch=100)
        m.backend.fuse_glu_tiles = tiles
        m.reset(len(toks))
        outs.append(m.eval(toks))
        assert np.isfinite(outs[-1]).all()
        if tiles:
            assert glu_runs and all(s.glu == "silu" for s in glu_runs), glu_runs
        else:
            assert not glu_runs
    np.testing.assert_array_equal(outs[0], outs[1])
