"""gpt-oss on the CUDA backend (pytest -m gpu): sinks, sliding windows, YaRN RoPE, biases
and SwiGLU-OAI experts, against the numpy backend that emulates the kernels, through every
attention kernel (decode with and without splits, the three prompt kernels, cuBLAS's path),
both cache types, prompts over several ubatches and decode past the window."""

import numpy as np
import pytest

from conftest import assert_matches_emulation, decode_on_cuda_and_emulation, assert_matches_llama_cpp, first_near_tie, record_router_gaps, run_seed
from moeforge.codegen.quant import quant_type
from moeforge.runtime.model import load_model
from moeforge.synth import preset, write_model

pytestmark = pytest.mark.gpu

# tiny-oss: 4 layers (0 and 2 slide over 8 tokens), YaRN x4 past 64 positions, hd 32, g 2
N_TOKENS = 150


@pytest.fixture(scope="module")
def oss_models(tmp_path_factory):
    d = tmp_path_factory.mktemp("oss")
    seed = run_seed()
    out = {}
    for t in ("f32", "q8_0", "mxfp4_moe"):
        p = d / f"tiny-oss-{t}.gguf"
        write_model(p, preset("tiny-oss"), t, source="float", seed=seed)
        out[t] = str(p)
    toks = np.random.default_rng(seed).integers(0, 512, N_TOKENS)
    return out, toks, seed


def _emulate_with_router_gaps(path, toks, monkeypatch, **kw):
    """The emulation's logits, and the first position of a near-tie (conftest.record_router_gaps)."""
    gaps = record_router_gaps(monkeypatch)
    model = load_model(path, backend="numpy", numerics="kernel", **kw)
    ref = model.logits(toks)
    return ref, first_near_tie(gaps, model.hp.n_layer, 1e-3)


@pytest.mark.parametrize("name", ["gpt-oss-f32", "gpt-oss-q8_0", "gpt-oss-mxfp4_moe"])
def test_cuda_matches_llama_cpp(parity_models, name):
    """Issue 4's bar on llama.cpp's gpt-oss fixtures (tests/fixtures/parity: windows, sinks,
    YaRN past its original context, all the biases): the same top-1 at every position,
    mean KL per token < 1e-3; float weights also elementwise."""
    fx = parity_models[name]
    got = load_model(fx["path"], backend="cuda").logits(fx["tokens"])
    assert_matches_llama_cpp(fx, got, name.endswith("f32"))


@pytest.mark.parametrize("name", ["f32", "q8_0", "mxfp4_moe"])
@pytest.mark.parametrize("cache_type", ["f32", "f16"])
def test_prompt_matches_emulation(oss_models, name, cache_type, monkeypatch):
    """A prompt in ubatches of 64 (windows that start inside a ubatch and before it)."""
    paths, toks, seed = oss_models
    kw = dict(cache_type=cache_type, n_ubatch=64)
    got = load_model(paths[name], backend="cuda", **kw).logits(toks)
    ref, exact_until = _emulate_with_router_gaps(paths[name], toks, monkeypatch, **kw)
    assert_matches_emulation(got, ref, name, seed, exact_until if cache_type == "f16" else None)


@pytest.mark.parametrize("precision", ["f32", "tf32", "f16", "cublas"])
def test_every_prompt_attention_kernel(oss_models, precision, monkeypatch):
    """attn_prefill, attn_prefill_tc, attn_prefill_fa, and the cuBLAS path's softmax."""
    paths, toks, seed = oss_models
    if precision == "cublas":
        from moeforge.runtime import prompt_attention
        monkeypatch.setattr(prompt_attention, "kernel_for", lambda *a, **k: None)
        got = load_model(paths["f32"], backend="cuda", attn_precision="f32").logits(toks)
        ref = load_model(paths["f32"], backend="numpy", numerics="kernel", attn_precision="f32").logits(toks)
    else:
        got = load_model(paths["f32"], backend="cuda", attn_precision=precision).logits(toks)
        ref, exact_until = _emulate_with_router_gaps(paths["f32"], toks, monkeypatch, attn_precision=precision)
        assert_matches_emulation(got, ref, "f32", seed, exact_until if precision != "f32" else None)
        return
    assert_matches_emulation(got, ref, "f32", seed)


@pytest.mark.parametrize("grouped", [None, True])
@pytest.mark.parametrize("splits", [None, 1, 3])
@pytest.mark.parametrize("cache_type", ["f32", "f16"])
def test_decode_past_the_window(oss_models, splits, cache_type, grouped, monkeypatch):
    """Decode steps (CUDA graph) after a 100-token prompt, at positions past the window and
    past a block's chunk of 128 positions (the window's first chunk is then not the
    context's), with one or several blocks per head, a block per query head (short
    contexts) or per key head (grouped: long ones), elementwise against the numpy backend
    doing the same steps (the f32 model: with an f32 cache nothing rounds but float32
    order; an f16 cache rounds, so from a router's near-tie on only the quantized bar holds:
    seed 40938917 had a gap of 2.5e-4 at prompt position 77, and every step attends to it)."""
    paths, toks, seed = oss_models
    gaps = record_router_gaps(monkeypatch)
    got, ref, m = decode_on_cuda_and_emulation(paths["f32"], toks, 100, {"decode_attn_splits": splits,
                                                                         "decode_attn_grouped": grouped},
                                               cache_type=cache_type)
    exact_until = max(first_near_tie(gaps, m.hp.n_layer, 1e-3) - 100, 0) if cache_type == "f16" else None
    assert_matches_emulation(got, ref, "f32", seed, exact_until)


def test_decode_matches_numpy_token_by_token(oss_models):
    paths, toks, seed = oss_models
    got = load_model(paths["mxfp4_moe"], backend="cuda")
    ref = load_model(paths["mxfp4_moe"], backend="numpy", numerics="kernel")
    for m in (got, ref):
        m.reset(40)
    a = np.concatenate([got.eval([t]) for t in toks[:40]])
    b = np.concatenate([ref.eval([t]) for t in toks[:40]])
    assert_matches_emulation(a, b, "mxfp4_moe", seed)


def test_batches_past_decode_sizes_take_the_grouped_products(oss_models, monkeypatch):
    """9 to 64 tokens a step: grouped expert products, the SwiGLU-OAI kernel with biases
    (glu_oai_id), the down biases (in moe_combine_rms_norm); with gate and up kept separate too."""
    paths, toks, seed = oss_models
    for merge in (True, False):
        got = load_model(paths["q8_0"], backend="cuda", merge_gate_up=merge, n_ubatch=9).logits(toks[:45])
        ref = load_model(paths["q8_0"], backend="numpy", numerics="kernel", n_ubatch=9).logits(toks[:45])
        assert_matches_emulation(got, ref, "q8_0", seed)


def test_generate_matches_numpy(oss_models):
    paths, toks, seed = oss_models
    prompt = toks[:12]
    a = load_model(paths["f32"], backend="cuda").generate(prompt, 16)
    b = load_model(paths["f32"], backend="numpy", numerics="kernel").generate(prompt, 16)
    assert a == b, f"seed {seed}: {a} vs {b}"


@pytest.mark.parametrize("wgmma", [True, False], ids=["wgmma", "mma_sync"])
@pytest.mark.parametrize("name", ["q8_0", "mxfp4_moe"])
def test_swiglu_oai_into_the_f16_tiles_changes_no_bit(oss_models, monkeypatch, name, wgmma):
    """Past decode sizes, with the down product on the f16 tiles, glu_oai_id_f16 writes its
    f16 activations from the gate|up products and the biases (no glu_oai_id launch, no
    float32 buffer between): a prompt's logits must be those of glu_oai_id and the
    conversion after it, bit for bit, in both tile forms' k orders, and the fused kernel must
    really have run. Every expert product is held on one f16 tile form here."""
    from dataclasses import replace

    from moeforge.codegen.enumerate import mmf_wgmma_specs
    from moeforge.codegen.spec import MmfSpec
    from moeforge.runtime import dispatch
    if wgmma and not dispatch.wgmma_available():
        pytest.skip("the wgmma tiles need an sm_90 device (H100, H200)")
    qtype = {"q8_0": "q8_0", "mxfp4_moe": "mxfp4"}[name]
    spec = ([s for s in mmf_wgmma_specs(quant_type(qtype)) if s.ids][0] if wgmma
            else MmfSpec(qtype, x=64, y=128, warps=8))
    real = dispatch.choose_mul_mat_id

    def held(q, E, top_k, m, k, n, f16=True):
        if n <= dispatch.MMVQ_MAX_TOKENS or q != qtype:
            return real(q, E, top_k, m, k, n, f16)
        return dispatch.Choice("mmf_id", replace(spec, qtype=q))
    monkeypatch.setattr(dispatch, "choose_mul_mat_id", held)
    paths, toks, seed = oss_models
    outs = []
    for fused in (True, False):
        m = load_model(paths[name], backend="cuda", n_ubatch=64)
        m.backend.fuse_glu_quant = fused
        m.backend.fuse_glu_tiles = False     # test_swiglu_oai_in_the_glu_tiles_changes_no_bit's
        calls = {"glu_id": 0, "f16": 0}
        glu_id, glu_f16 = m.backend.glu_id, m.backend._glu_oai_f16

        def count(key, fn):
            def counted(*a):
                calls[key] += 1
                return fn(*a)
            return counted
        m.backend.glu_id, m.backend._glu_oai_f16 = count("glu_id", glu_id), count("f16", glu_f16)
        outs.append(m.logits(toks[:140]))
        assert np.isfinite(outs[-1]).all()
        if fused:
            assert calls["glu_id"] == 0 and calls["f16"] > 0, calls
        else:
            assert calls["glu_id"] > 0 and calls["f16"] == 0, calls
    np.testing.assert_array_equal(outs[0], outs[1], err_msg=f"seed {seed}")


@pytest.mark.parametrize("name", ["q8_0", "mxfp4_moe"])
def test_swiglu_oai_in_the_glu_tiles_changes_no_bit(oss_models, monkeypatch, name):
    """With gate|up and down both on wgmma tiles, the gate|up tiles write SwiGLU-OAI of
    their products and the experts' biases as the down's f16 x themselves (MmfSpec.glu): a
    prompt's logits must be those of glu_oai_id_f16's path and of glu_oai_id's, bit for bit,
    and the glu tiles must really have run."""
    from dataclasses import replace

    from moeforge.codegen.enumerate import mmf_wgmma_specs
    from moeforge.runtime import dispatch, mmf
    if not dispatch.wgmma_available():
        pytest.skip("the wgmma tiles need an sm_90 device (H100, H200)")
    qtype = {"q8_0": "q8_0", "mxfp4_moe": "mxfp4"}[name]
    tiles = {s.y: s for s in mmf_wgmma_specs(quant_type(qtype)) if s.ids}
    real = dispatch.choose_mul_mat_id

    def held(q, E, top_k, m, k, n, f16=True):
        if n <= dispatch.MMVQ_MAX_TOKENS or q != qtype:
            return real(q, E, top_k, m, k, n, f16)
        return dispatch.Choice("mmf_id", replace(tiles[256 if k > m // 2 else 128], qtype=q))
    monkeypatch.setattr(dispatch, "choose_mul_mat_id", held)
    glu_runs = []
    run_glu = mmf.run_mmf_glu
    monkeypatch.setattr(mmf, "run_mmf_glu", lambda spec, *a: glu_runs.append(spec) or run_glu(spec, *a))
    paths, toks, seed = oss_models
    outs = []
    for tiles_on, f16_conv in ((True, True), (False, True), (False, False)):
        glu_runs.clear()
        m = load_model(paths[name], backend="cuda", n_ubatch=64)
        m.backend.fuse_glu_tiles, m.backend.fuse_glu_quant = tiles_on, f16_conv
        outs.append(m.logits(toks[:140]))
        assert np.isfinite(outs[-1]).all()
        assert bool(glu_runs) == tiles_on and all(s.glu == "swiglu_oai" for s in glu_runs), glu_runs
    np.testing.assert_array_equal(outs[0], outs[1], err_msg=f"seed {seed}")
    np.testing.assert_array_equal(outs[0], outs[2], err_msg=f"seed {seed}")
