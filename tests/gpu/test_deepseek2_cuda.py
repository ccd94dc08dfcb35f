"""deepseek2 on the CUDA backend (pytest -m gpu): llama.cpp's tiny fixtures, and a model
with DeepSeek-V2-Lite's head layout (16 heads of 128 + 64 query values, a latent of 512,
value heads of 128) on tiny other dimensions, against the numpy backend that emulates the
kernels: prompts in ubatches and decode steps (latent attention on its own kernels, the
passes captured as CUDA graphs), q8_0 and q4_0, low-rank q; and the one-token latent
attention kernel against float64."""
import warnings
from dataclasses import replace

import numpy as np
import pytest

from conftest import assert_cache_consistent, assert_matches_emulation, assert_matches_llama_cpp, run_seed
from moeforge.reference import nmse
from moeforge.runtime.model import load_model
from moeforge.synth import preset, write_model

pytestmark = pytest.mark.gpu

LITE_HEADS = replace(preset("tiny-deepseek"), n_vocab=512, n_embd=256, n_head=16, head_dim=192, n_rot=64,
                     kv_lora_rank=512, v_head_dim=128, n_ff_exp=128, n_expert=16, n_expert_used=6, n_ff=384,
                     yarn_factor=40.0, yarn_orig_ctx=64)


@pytest.mark.parametrize("name", ["ds-f32", "ds-q8_0", "ds-q4_0", "ds-qlora-f32"])
def test_cuda_matches_llama_cpp(parity_models, name):
    """Issue 4's bar on llama.cpp's deepseek2 fixtures: the same top-1 at every position,
    mean KL per token < 1e-3; float weights also elementwise."""
    fx = parity_models[name]
    m = load_model(fx["path"], backend="cuda")
    got = m.logits(fx["tokens"])
    assert_matches_llama_cpp(fx, got, name.endswith("f32"))


@pytest.fixture(scope="module")
def lite_models(tmp_path_factory):
    d = tmp_path_factory.mktemp("ds")
    seed = run_seed()
    out = {}
    for t in ("f32", "q8_0", "q4_0"):
        p = d / f"lite-{t}.gguf"
        write_model(p, LITE_HEADS, t, source="float", seed=seed)
        out[t] = str(p)
    return out, np.random.default_rng(seed).integers(0, 500, 150), seed


@pytest.mark.parametrize("t", ["f32", "q8_0", "q4_0"])
def test_prompt_and_decode_match_the_emulation(lite_models, t):
    """V2-Lite's heads (576-wide latent rows, 16 query heads on one) and YaRN's softmax
    scale: a 60-token prompt in ubatches of 16, then 20 decode steps (captured from the
    second), against the numpy backend emulating the kernels (q8_1 activations)."""
    paths, toks, seed = lite_models
    outs = []
    for backend in ("cuda", "numpy"):
        m = load_model(paths[t], backend=backend, n_ubatch=16,
                       **({} if backend == "cuda" else {"numerics": "kernel"}))
        m.reset(len(toks))
        with warnings.catch_warnings():
            warnings.simplefilter("error")        # no pass refused capture, none warned
            outs.append(np.concatenate([m.eval(toks[:60]), *(m.eval([x]) for x in toks[60:80])]))
        if backend == "cuda":
            assert m.backend.graphs.captured("decode")
    # quantized: every token's 16 x 512 latent outputs feed v_b's q8_1 quantizer, where
    # cuBLAS's or the kernel's last bits against numpy's flip a rounding now and then
    # (H200: the first flip at a token of 8, 5e-4 of that product, 1e-2 of its logits)
    assert_matches_emulation(*outs, t, seed)


def test_kv_cache_consistency(lite_models):
    """All at once == token by token == in uneven chunks, on the GPU: the latent rows one
    pass writes are what the next reads. 150 tokens at once and a chunk of 133 take a block
    a token (from an SM's worth of tokens: no merge), the short chunks split each token's
    positions over blocks and merge; float weights (the splits add in other orders)."""
    paths, toks, _ = lite_models
    m = load_model(paths["f32"], backend="cuda")
    assert_cache_consistent(m, toks, (5, 6, 17, 150), rel=1e-4)


def test_deep_prompts_on_cublas_match_the_kernel(lite_models, monkeypatch):
    """Past attention_cuda.MLA_KERNEL_MAX_PAIRS a prompt's latent attention runs on cuBLAS,
    eagerly: the same logits as the kernel's (float weights: other summation orders), the
    ubatches after the first past the bound here (a bound of 300 pairs)."""
    from moeforge.runtime import attention_cuda
    paths, toks, _ = lite_models
    outs = []
    for bound in (attention_cuda.MLA_KERNEL_MAX_PAIRS, 300):
        monkeypatch.setattr(attention_cuda, "MLA_KERNEL_MAX_PAIRS", bound)
        m = load_model(paths["f32"], backend="cuda", n_ubatch=24)
        outs.append(m.logits(toks[:72]))
        assert m.backend.graphs.captured(("prompt", 24, False)) == (bound > 300 * 24)
    np.testing.assert_allclose(outs[1], outs[0], rtol=0, atol=1e-4 * np.abs(outs[0]).max())


def test_cache_row_is_the_latent_and_the_roped_key(lite_models):
    """The cache after a prompt: each row the normed latent and the shared key, the value
    rows a view of the key rows' first 512 values (no second allocation)."""
    import cupy as cp
    paths, toks, _ = lite_models
    m = load_model(paths["f32"], backend="cuda", n_ctx=64)
    m.logits(toks[:7])
    k, v = m.cache.k[1], m.cache.v[1]
    assert k.shape == (64, 576) and v.shape == (64, 512) and v.data.ptr == k.data.ptr
    ref = load_model(paths["f32"], backend="numpy", n_ctx=64)
    ref.logits(toks[:7])
    np.testing.assert_allclose(cp.asnumpy(k[:7]), ref.cache.k[1][:7], rtol=0, atol=2e-4)
    assert not cp.asnumpy(k[7:]).any()


@pytest.mark.parametrize("n_head", [4, 16, 20, 128])
@pytest.mark.parametrize("L", [1, 63, 64, 65, 700, 4096])
@pytest.mark.parametrize("cache_type", ["f32", "f16"])
def test_decode_attention_kernel(n_head, L, cache_type, rng):
    """attn_decode_mla and its merge against float64: n_head query heads (in groups of 16,
    the last one partial at 20) over one latent row a position (576 = 512 + 64; values the
    first 512), the positions split over a block an SM at a context of 4096 (at least 16
    a block: most blocks return at once at short L; 700: blocks of 16 but the last), the cache f32 or f16 (the reference reads the same rounded rows);
    poisoned output, the same bits twice."""
    import cupy as cp
    from moeforge.runtime.arch import MLA, HParams
    from moeforge.runtime.attention_cuda import MlaQuery
    from moeforge.runtime.backend_cuda import CudaBackend
    hp = HParams(n_vocab=32, n_embd=64, n_layer=1, n_head=n_head, n_head_kv=1, head_dim=576, n_ff_exp=64,
                 n_expert=8, n_expert_used=2, rms_eps=1e-6, rope_base=1e4, n_ctx_train=4096,
                 mla=MLA(512, 128, 64, 128, 0.1147214))
    B = CudaBackend(hp, cache_type=cache_type)
    cache = B.new_cache(4096)
    rows = (rng.standard_normal((L, 576)) * rng.uniform(0.5, 2.0)).astype(np.float32)
    if cache_type == "f16":
        rows = rows.astype(np.float16).astype(np.float32)
    with B.context():   # the backend's stream (non-blocking): on CuPy's own, the copy could land late
        cache.k[0][:L] = cp.asarray(rows).astype(cache.k[0].dtype)
    # a head's query: its absorbed latent part, and the RoPE part of q's (128 + 64)-value head
    lat = (rng.standard_normal((1, n_head, 512)) * 0.5).astype(np.float32)
    qfull = (rng.standard_normal((1, n_head, 192)) * 0.5).astype(np.float32)
    q = np.concatenate([lat, qfull[..., 128:]], axis=-1).reshape(1, -1)
    pos = cp.asarray(np.array([L - 1], dtype=np.int32))
    outs = []
    for _ in range(2):
        with B.context():   # the poison on the kernels' stream, ordered before them
            B.ws("attn", (1, n_head * 512))[...] = cp.nan
            o = B.attention(cache, 0, MlaQuery(cp.asarray(lat), cp.asarray(qfull.reshape(1, -1))), pos, L - 1, 1,
                            "attn")
        B.synchronize()
        outs.append(cp.asnumpy(o))
    np.testing.assert_array_equal(outs[0], outs[1])
    s = q.reshape(n_head, 576).astype(np.float64) @ rows.T.astype(np.float64) * hp.kq_scale
    p = np.exp(s - s.max(-1, keepdims=True))
    want = (p / p.sum(-1, keepdims=True)) @ rows[:, :512].astype(np.float64)
    got = outs[0].reshape(n_head, 512)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max())


def _emulate_prefill_mla(q, rows, pos, scale_log2, r=512):
    """attn_prefill_mla's arithmetic in float64: q * scale * log2 e (float32) and the rows
    rounded to f16, per 64-key tile from 0 a running max, p rounded to f16 in P . V (its
    unrounded value in the sum)."""
    f16 = lambda x: np.asarray(x).astype(np.float16).astype(np.float64)  # noqa: E731
    qh = f16(q * np.float32(scale_log2))
    K = f16(rows)
    out = np.zeros(q.shape[:2] + (r,))
    for t, lim in enumerate(pos):
        m = np.full(q.shape[1], -np.inf)
        den, o = np.zeros(q.shape[1]), np.zeros((q.shape[1], r))
        for j0 in range(0, lim + 1, 64):
            ks = K[j0:min(j0 + 64, lim + 1)]
            s = qh[t] @ ks.T
            mn = np.maximum(m, s.max(1))
            a, p = np.exp2(m - mn), np.exp2(s - mn[:, None])
            den, o, m = den * a + p.sum(1), o * a[:, None] + f16(p) @ ks[:, :r], mn
        out[t] = o / den[:, None]
    return out


# decode steps (n = 1) with an f16 cache only: a float32 cache's stay on attn_decode_mla
_TC_CASES = [(n, pos0, c) for c in ("f32", "f16")
             for n, pos0 in [(1, 0), (1, 15), (1, 700), (1, 3000), (1, 4095), (2, 0), (3, 0), (37, 70), (130, 0),
                             (64, 600)]
             if n > 1 or c == "f16"]


@pytest.mark.parametrize("n_head", [16, 32])
@pytest.mark.parametrize("n,pos0,cache_type", _TC_CASES)
def test_prompt_attention_on_tensor_cores(n_head, n, pos0, cache_type, rng):
    """attn_prefill_mla (f16 precision) against the emulation of its rounding (float64): two
    tokens a block (an odd prompt leaves a block one), 16 heads a pair of warps, positions
    after pos0 cached ones; a decode step (n = 1, an f16 cache) with its positions split
    over the SMs as attn_decode_mla splits them (16 a block at least, past that a 64-key
    tile at least) and merged by its merge; both caches (a float32 cache converted by the
    block, an f16 one copied in two tiles), and against unrounded float64 (NMSE); poisoned
    output, the same bits twice."""
    import cupy as cp
    from moeforge.runtime.arch import MLA, HParams
    from moeforge.runtime.attention_cuda import MlaQuery
    from moeforge.runtime.backend_cuda import CudaBackend
    hp = HParams(n_vocab=32, n_embd=64, n_layer=1, n_head=n_head, n_head_kv=1, head_dim=576, n_ff_exp=64,
                 n_expert=8, n_expert_used=2, rms_eps=1e-6, rope_base=1e4, n_ctx_train=4096,
                 mla=MLA(512, 128, 64, 128, 0.1147214))
    B = CudaBackend(hp, attn_precision="f16", cache_type=cache_type)
    assert B._mla_prefill_bufs(n) == (2 if cache_type == "f16" else 1)
    assert B._mla_prefill_bufs(1) == (2 if cache_type == "f16" else 0)
    L = pos0 + n
    cache = B.new_cache(4096)
    rows = (rng.standard_normal((L, 576)) * rng.uniform(0.5, 2.0)).astype(np.float32)
    if cache_type == "f16":
        rows = rows.astype(np.float16).astype(np.float32)
    with B.context():   # the backend's stream (non-blocking): on CuPy's own, the copy could land late
        cache.k[0][:L] = cp.asarray(rows).astype(cache.k[0].dtype)
    lat = (rng.standard_normal((n, n_head, 512)) * 0.5).astype(np.float32)
    qfull = (rng.standard_normal((n, n_head, 192)) * 0.5).astype(np.float32)
    positions = np.arange(pos0, L, dtype=np.int32)
    pos = cp.asarray(positions)
    outs = []
    for _ in range(2):
        with B.context():   # the poison on the kernels' stream, ordered before them
            B.ws("attn", (n, n_head * 512))[...] = cp.nan
            o = B.attention(cache, 0, MlaQuery(cp.asarray(lat), cp.asarray(qfull.reshape(n, -1))), pos, pos0, n,
                            "attn")
        B.synchronize()
        outs.append(cp.asnumpy(o))
    np.testing.assert_array_equal(outs[0], outs[1])
    got = outs[0].reshape(n, n_head, 512)
    assert np.isfinite(got).all()
    q = np.concatenate([lat, qfull[..., 128:]], axis=-1)
    want = _emulate_prefill_mla(q, rows, positions, hp.kq_scale * np.log2(np.e))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-3 * np.abs(want).max())
    # and against attention in float64 on the same rows, nothing rounded: the f16 error bar
    exact = np.empty_like(want)
    for t, lim in enumerate(positions):
        s = q[t].astype(np.float64) @ rows[:lim + 1].T.astype(np.float64) * hp.kq_scale
        p = np.exp(s - s.max(-1, keepdims=True))
        exact[t] = (p / p.sum(-1, keepdims=True)) @ rows[:lim + 1, :512].astype(np.float64)
    assert nmse(got, exact) <= 5e-4


@pytest.mark.parametrize("t", ["q8_0", "q4_0"])
def test_shared_experts_apart_add_themselves_at_decode(lite_models, monkeypatch, t):
    """Shared experts kept apart (as where their types differ from the routed ones'; forced
    here): at decode their down product adds itself to x (weight 1, one launch) and the
    dense route's buffers are filled once, so the captured step replays no memset. Against
    the product and an add apart: the same logits, bit for bit, at every step; against the
    numpy backend emulating the kernels, its bar."""
    from moeforge.runtime import arch
    paths, toks, seed = lite_models
    monkeypatch.setattr(arch, "shared_rides", lambda *a, **k: False)
    outs = []
    for fused in (True, False):
        m = load_model(paths[t], backend="cuda", n_ubatch=16)
        assert m.hp.gating.shared == 0 and m.weights.layers[1].shared is not None
        m.backend.fuse_down_combine = fused
        m.reset(len(toks))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            outs.append(np.concatenate([m.eval(toks[:20]), *(m.eval([x]) for x in toks[20:36])]))
        assert m.backend.graphs.captured("decode") and np.isfinite(outs[-1]).all()
    np.testing.assert_array_equal(outs[0], outs[1])
    ref = load_model(paths[t], backend="numpy", numerics="kernel", n_ubatch=16)
    ref.reset(len(toks))
    want = np.concatenate([ref.eval(toks[:20]), *(ref.eval([x]) for x in toks[20:36])])
    assert_matches_emulation(outs[0], want, t, seed)
