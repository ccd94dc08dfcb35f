"""gpt-oss on the CPU: the numpy backend against llama.cpp's logits (tests/fixtures/parity,
the gpt-oss-* fixtures of scripts/make_parity_fixtures.py), what the loader refuses, and
the pieces that set it apart from qwen3moe, each against an independent float64 version:
YaRN RoPE, attention with sinks and a sliding window (exact and tensor-core numerics), and
the sliding window across chunks of a context."""
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest

from conftest import F32_PARITY_BAR, assert_f32_matches_llama_cpp, assert_top1_and_kl
from moeforge.runtime.arch import HParams, YaRN
from moeforge.runtime.backend_numpy import NumpyBackend
from moeforge.runtime.gguf_file import GGUFError
from moeforge.runtime.model import load_model
from moeforge.runtime.prompt_attention import attention_tc
from moeforge.synth import preset, write_model
from test_model_load import rewrite

QUANTIZED = ["gpt-oss-q8_0", "gpt-oss-mxfp4_moe"]


# -- llama.cpp parity ---------------------------------------------------------------------------
def test_fixtures_exercise_window_yarn_and_both_layer_kinds(parity_models):
    """The fixtures are only worth their bar if the sequence outruns the window and YaRN's
    original context, and both sliding and full layers exist."""
    fx = parity_models["gpt-oss-f32"]
    hp = load_model(fx["path"], backend="numpy").hp
    n = len(fx["tokens"])
    assert hp.yarn is not None and hp.yarn.freq_scale < 1 and hp.yarn.n_ctx_orig < n
    low, high = hp.yarn.corr_dims(hp.head_dim, hp.rope_base)
    assert high - low >= 2                          # pairs strictly inside the ramp
    windows = [hp.window(il) for il in range(hp.n_layer)]
    assert 0 in windows and 0 < hp.n_swa < n and hp.n_swa in windows


def test_f32_matches_llama_cpp(parity_models):
    fx = parity_models["gpt-oss-f32"]
    got = load_model(fx["path"], backend="numpy").logits(fx["tokens"])
    assert_f32_matches_llama_cpp(fx, got)


@pytest.mark.parametrize("change", ["no window", "no yarn", "no sinks", "no biases"])
def test_f32_fixture_depends_on_each_feature(parity_models, tmp_path, change):
    """Without any one of gpt-oss's features the numpy backend is far off llama.cpp's F32
    logits: the bar holds because both apply each of them, the same way."""
    fx = parity_models["gpt-oss-f32"]
    kv = {"no window": {"gpt-oss.attention.sliding_window": 1 << 20},
          "no yarn": {"gpt-oss.rope.scaling.type": "none"}}.get(change, {})

    def tensors(name, a, t):
        if change == "no sinks" and name.endswith("attn_sinks.weight"):
            a = np.full_like(a, -1e4)
        if change == "no biases" and name.endswith(".bias"):
            a = np.zeros_like(a)
        return [(name, a, t)]
    path = rewrite(fx["path"], str(tmp_path / "changed.gguf"), tensors=tensors, kv=lambda k, v, t: kv.get(k, v))
    got = load_model(path, backend="numpy").logits(fx["tokens"])
    err = np.abs(got - fx["logits"]).max()
    assert err > 100 * F32_PARITY_BAR, f"{change}: max abs difference only {err:.2e}"


@pytest.mark.parametrize("name", QUANTIZED)
@pytest.mark.parametrize("numerics", ["float", "kernel"])
def test_quantized_close_to_llama_cpp(parity_models, name, numerics):
    """llama.cpp rounds activations to q8_0 for its quantized products: the GPU runtime's
    bar, the same top-1 everywhere and mean KL below 1e-3 (measured with llama-cpp-python
    0.3.16: 1.2e-4 for q8_0, 1.1e-4 for mxfp4_moe, either numerics)."""
    fx = parity_models[name]
    got = load_model(fx["path"], backend="numpy", numerics=numerics).logits(fx["tokens"])
    assert_top1_and_kl(fx["logits"], got)


def test_ubatches_do_not_change_logits(parity_models):
    """Ubatches of 7 tokens: the window and the sinks hold across ubatch edges."""
    fx = parity_models["gpt-oss-f32"]
    m = load_model(fx["path"], backend="numpy", n_ubatch=7)
    np.testing.assert_allclose(m.logits(fx["tokens"]), fx["logits"], atol=F32_PARITY_BAR, rtol=0)


# -- loading ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_oss(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("oss") / "tiny-oss-f32.gguf")
    write_model(path, preset("tiny-oss"), "f32", source="float", seed=5)
    return path


def test_loads_gpt_oss_hparams(tiny_oss):
    spec = preset("tiny-oss")
    m = load_model(tiny_oss, backend="numpy")
    hp = m.hp
    assert m.arch == "gpt-oss" and hp.expert_act == "swiglu_oai" and hp.n_swa == spec.n_swa
    assert hp.yarn == YaRN(freq_scale=1 / spec.yarn_factor, n_ctx_orig=spec.yarn_orig_ctx)
    assert [hp.window(il) for il in range(hp.n_layer)] == [spec.n_swa, 0] * (hp.n_layer // 2)
    L = m.weights.layers[0]
    assert L.sinks.shape == (hp.n_head,) and L.gate_b.shape == (hp.n_expert, hp.n_ff_exp)
    assert L.down_b.shape == (hp.n_expert, hp.n_embd) and L.router_b.shape == (hp.n_expert,)


@pytest.mark.parametrize("bias", ["blk.1.attn_v.bias", "blk.0.attn_output.bias", "blk.2.ffn_gate_inp.bias",
                                  "blk.3.ffn_down_exps.bias"])
def test_missing_bias_is_named(tiny_oss, tmp_path, bias):
    bad = rewrite(tiny_oss, str(tmp_path / "bad.gguf"), tensors=lambda n, a, t: [] if n == bias else [(n, a, t)])
    with pytest.raises(GGUFError, match=rf"'{bias}' is missing"):
        load_model(bad, backend="numpy")


def test_wrong_sink_shape_is_named(tiny_oss, tmp_path):
    sinks = "blk.2.attn_sinks.weight"
    bad = rewrite(tiny_oss, str(tmp_path / "bad.gguf"),
                  tensors=lambda n, a, t: [(n, np.concatenate([a, a]), t)] if n == sinks else [(n, a, t)])
    with pytest.raises(GGUFError, match=rf"'{sinks}' has shape \(8,\), expected \(4,\)"):
        load_model(bad, backend="numpy")


def test_bad_rope_scaling_type_is_reported(tiny_oss, tmp_path):
    bad = rewrite(tiny_oss, str(tmp_path / "bad.gguf"),
                  kv=lambda k, v, t: "longrope" if k == "gpt-oss.rope.scaling.type" else v)
    with pytest.raises(GGUFError, match=r"gpt-oss.rope.scaling.type 'longrope' is not supported"):
        load_model(bad, backend="numpy")


def test_missing_sliding_window_is_reported(tiny_oss, tmp_path):
    bad = rewrite(tiny_oss, str(tmp_path / "bad.gguf"),
                  kv=lambda k, v, t: None if k == "gpt-oss.attention.sliding_window" else v)
    with pytest.raises(GGUFError, match=r"gpt-oss.attention.sliding_window"):
        load_model(bad, backend="numpy")


# -- YaRN RoPE ----------------------------------------------------------------------------------
def yarn_rope64(x, pos, n_heads, base, freq_scale, n_ctx_orig, ext_factor=1.0, attn_factor=1.0,
                beta_fast=32.0, beta_slow=1.0):
    """ggml's rope_yarn (NEOX pairs i, i + d/2) written out in float64 from its definition."""
    n, hd = x.shape[0], x.shape[1] // n_heads
    half = hd // 2

    def corr_dim(n_rot):
        return hd * np.log(n_ctx_orig / (n_rot * 2 * np.pi)) / (2 * np.log(base))
    low = max(0.0, np.floor(corr_dim(beta_fast)))
    high = min(hd - 1.0, np.ceil(corr_dim(beta_slow)))
    i = np.arange(half, dtype=np.float64)
    ramp = 1 - np.clip((i - low) / max(0.001, high - low), 0, 1)
    extrap = np.asarray(pos, dtype=np.float64)[:, None] * base ** (-2 * i / hd)
    mix = ramp * ext_factor
    theta = freq_scale * extrap * (1 - mix) + extrap * mix
    mscale = attn_factor * (1 + 0.1 * np.log(1 / freq_scale)) if ext_factor else attn_factor
    xh = x.astype(np.float64).reshape(n, n_heads, hd)
    c, s = np.cos(theta)[:, None] * mscale, np.sin(theta)[:, None] * mscale
    x0, x1 = xh[..., :half], xh[..., half:]
    return np.concatenate([x0 * c - x1 * s, x0 * s + x1 * c], axis=-1).reshape(n, -1), ramp


@pytest.mark.parametrize("hd,base,factor,orig,attn_factor", [
    (64, 150000.0, 32.0, 4096, 1.0),     # gpt-oss-20b's
    (32, 150000.0, 8.0, 64, 1.0),        # the parity fixtures'
    (64, 10000.0, 4.0, 2048, 0.9),
])
def test_yarn_rope_matches_ggml_formula(rng, hd, base, factor, orig, attn_factor):
    n_heads, n = 3, 40
    pos = np.sort(rng.choice(4 * orig, size=n, replace=False))
    x = rng.standard_normal((n, n_heads * hd)).astype(np.float32)
    yarn = YaRN(freq_scale=1 / factor, n_ctx_orig=orig, attn_factor=attn_factor)
    want, ramp = yarn_rope64(x, pos, n_heads, base, 1 / factor, orig, attn_factor=attn_factor)
    if orig > 1000:      # all three regimes: extrapolated, mixed, interpolated pairs
        assert ramp[0] == 1 and ramp[-1] == 0 and ((ramp > 0) & (ramp < 1)).any()
    got = x.copy()
    NumpyBackend(None).rope_(got, pos, n_heads, base, yarn)
    # float32 angles (ggml's recurrence) at positions up to ~16k: ~1e-3 rad at worst
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-3 * np.abs(x).max())
    near = pos < 2048
    np.testing.assert_allclose(got[near], want[near], rtol=0, atol=2e-4 * np.abs(x).max())
    plain = x.copy()
    NumpyBackend(None).rope_(plain, pos, n_heads, base)
    assert np.abs(plain - got).max() > 0.1          # YaRN changed something


def test_yarn_without_ext_factor_is_linear_scaling(rng):
    x = rng.standard_normal((5, 64)).astype(np.float32)
    pos = np.arange(5) * 37
    got, lin = x.copy(), x.copy()
    NumpyBackend(None).rope_(got, pos, 2, 1e4, YaRN(freq_scale=0.25, n_ctx_orig=512, ext_factor=0.0))
    NumpyBackend(None).rope_(lin, pos / 4, 2, 1e4)
    np.testing.assert_allclose(got, lin, rtol=0, atol=1e-4)


# -- attention with sinks and a window -----------------------------------------------------------
def _hp(n_head, n_head_kv, head_dim):
    return HParams(n_vocab=32, n_embd=64, n_layer=1, n_head=n_head, n_head_kv=n_head_kv, head_dim=head_dim,
                   n_ff_exp=64, n_expert=8, n_expert_used=2, rms_eps=1e-5, rope_base=1e4, n_ctx_train=4096)


def attention_naive(q, k, v, hp, pos0, sinks=None, window=0):
    """One query and head at a time, float64: the keys a query at p sees are j <= p (and
    p - j < window); the sink joins the softmax's denominator and has no value."""
    n, g, hd = q.shape[0], hp.n_head // hp.n_head_kv, hp.head_dim
    out = np.zeros((n, hp.q_dim))
    for t in range(n):
        p = pos0 + t
        lo = max(0, p - window + 1) if window else 0
        for h in range(hp.n_head):
            c = slice((h // g) * hd, (h // g + 1) * hd)
            s = k[lo:p + 1, c].astype(np.float64) @ q[t, h * hd:(h + 1) * hd].astype(np.float64) / np.sqrt(hd)
            top = s.max() if sinks is None else max(s.max(), float(sinks[h]))
            e = np.exp(s - top)
            den = e.sum() + (0.0 if sinks is None else np.exp(float(sinks[h]) - top))
            out[t, h * hd:(h + 1) * hd] = e @ v[lo:p + 1, c].astype(np.float64) / den
    return out


CASES = [  # n, pos0, window, sinks
    (1, 0, 0, "none"), (9, 0, 4, "normal"), (13, 20, 8, "normal"), (1, 70, 16, "large"),
    (24, 45, 5, "small"), (30, 10, 200, "normal"), (17, 3, 0, "normal"),
]


def _sinks(kind, n_head, rng):
    return {"none": None, "normal": rng.standard_normal(n_head), "large": 4 + rng.standard_normal(n_head),
            "small": -20 + rng.standard_normal(n_head)}[kind]


@pytest.mark.parametrize("n,pos0,window,kind", CASES)
def test_numpy_attention_with_sinks_and_window(rng, n, pos0, window, kind):
    hp = _hp(8, 2, 16)
    L = pos0 + n
    q = (2 * rng.standard_normal((n, hp.q_dim))).astype(np.float32)
    k = rng.standard_normal((L + 3, hp.kv_dim)).astype(np.float32)     # rows past L: not read
    v = rng.standard_normal((L + 3, hp.kv_dim)).astype(np.float32)
    sinks = _sinks(kind, hp.n_head, rng)
    sk = None if sinks is None else sinks.astype(np.float32)
    cache = SimpleNamespace(k=k[None], v=v[None])
    got = NumpyBackend(hp).attention(cache, 0, q, pos0 + np.arange(n), pos0, n, "attn", sinks=sk, window=window)
    assert got.dtype == np.float32 and got.shape == (n, hp.q_dim)
    want = attention_naive(q, k, v, hp, pos0, sk, window)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    if kind == "small":       # a sink far below every score changes nothing
        np.testing.assert_allclose(got, attention_naive(q, k, v, hp, pos0, None, window), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("precision", ["f16", "tf32"])
@pytest.mark.parametrize("n,pos0,window,kind", CASES)
def test_tensor_core_attention_with_sinks_and_window(rng, precision, n, pos0, window, kind):
    """attention_tc's rounding (f16 or tf32 q, k, v and probabilities) against the exact
    float64 attention, as test_prompt_attention checks it without sinks; windows that leave
    one of a row's two online softmaxes without a key included."""
    hp = _hp(8, 2, 32)
    L = pos0 + n
    q = (2 * rng.standard_normal((n, hp.q_dim))).astype(np.float32)
    k = rng.standard_normal((L, hp.kv_dim)).astype(np.float32)
    v = rng.standard_normal((L, hp.kv_dim)).astype(np.float32)
    sinks = _sinks(kind, hp.n_head, rng)
    sk = None if sinks is None else sinks.astype(np.float32)
    got = attention_tc(q, k, v, hp, pos0, precision, sinks=sk, window=window)
    assert np.isfinite(got).all()
    exact = attention_naive(q, k, v, hp, pos0, sk, window)
    nmse = ((got - exact) ** 2).sum() / (exact ** 2).sum()
    assert nmse < 1e-5, nmse
    if kind == "large" or 0 < window < L:     # the sink or the window is no no-op
        plain = attention_naive(q, k, v, hp, pos0, None, 0)
        assert ((plain - exact) ** 2).sum() / (exact ** 2).sum() > 1e-3


# -- the window across chunks, ubatches and models ---------------------------------------------
def test_chunks_equal_one_pass(tiny_oss, rng):
    """Eval in uneven chunks (and one token at a time) equals the whole prompt at once:
    the sliding window (8 here) reaches back across chunk edges into the cache."""
    m = load_model(tiny_oss, backend="numpy")
    toks = rng.integers(0, m.hp.n_vocab, 30)
    whole = m.logits(toks)
    m.reset(len(toks))
    chunks = np.concatenate([m.eval(toks[a:b]) for a, b in ((0, 5), (5, 6), (6, 17), (17, 19), (19, 30))])
    np.testing.assert_allclose(chunks, whole, atol=1e-5, rtol=0)
    m.reset()
    one = np.concatenate([m.eval([t]) for t in toks])
    np.testing.assert_allclose(one, whole, atol=1e-5, rtol=0)
    small = load_model(tiny_oss, backend="numpy", n_ubatch=3)
    np.testing.assert_allclose(small.logits(toks), whole, atol=1e-5, rtol=0)


def test_window_and_yarn_change_the_model_as_expected(tiny_oss, tmp_path, rng):
    """The same weights with a window past the sequence: the same logits until the window
    is full, different after it; without YaRN, different everywhere past position 0."""
    spec = preset("tiny-oss")
    toks = rng.integers(0, spec.n_vocab, 20)
    base = load_model(tiny_oss, backend="numpy").logits(toks)
    wide = str(tmp_path / "wide.gguf")
    write_model(wide, replace(spec, n_swa=1000), "f32", source="float", seed=5)
    got = load_model(wide, backend="numpy").logits(toks)
    np.testing.assert_allclose(got[:spec.n_swa], base[:spec.n_swa], atol=1e-5, rtol=0)
    assert (np.abs(got - base).max(axis=-1)[spec.n_swa:] > 1e-3).all()
    plain = str(tmp_path / "plain.gguf")
    write_model(plain, replace(spec, yarn_factor=0.0), "f32", source="float", seed=5)
    got = load_model(plain, backend="numpy").logits(toks)
    assert load_model(plain, backend="numpy").hp.yarn is None
    assert (np.abs(got - base).max(axis=-1)[1:] > 1e-3).all()


def test_harmony_vocabulary_ends_a_reply_at_return_or_call(tiny_oss):
    """gpt-oss's <|end|> closes the reasoning message, not the reply: with <|return|> and
    <|call|> in the vocabulary those two end a generation and <|end|> does not (llama.cpp's
    rule for the harmony tokenizer); without them the metadata's end of turn stands."""
    m = load_model(tiny_oss, backend="numpy")
    md = m.file.metadata
    tokens = list(md["tokenizer.ggml.tokens"])
    md["tokenizer.ggml.eos_token_id"], md["tokenizer.ggml.eot_token_id"] = 11, 13
    assert set(m.eos_ids) == {11, 13}
    tokens[11], tokens[12], tokens[13] = "<|return|>", "<|call|>", "<|end|>"
    md["tokenizer.ggml.tokens"] = tokens
    assert set(m.eos_ids) == {11, 12}
