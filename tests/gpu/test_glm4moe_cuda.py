"""glm4moe on the CUDA backend (pytest -m gpu): llama.cpp's tiny fixtures, and a model with
GLM-4.5's head layout (12 query heads a key head, RoPE on half of each 64-wide head) and 8
routed experts plus the shared one a token (9 slots: past the fused one-token down
product's 8), against the numpy backend that emulates the kernels: prompts in ubatches,
decode steps in CUDA graphs (per-head and grouped attention), batches past decode sizes,
a shared expert of another type kept apart."""
from dataclasses import replace

import numpy as np
import pytest

from conftest import (assert_matches_emulation, decode_on_cuda_and_emulation, assert_matches_llama_cpp, first_near_tie, kl_per_token,
                      record_router_gaps, rewrite, run_seed)
from moeforge.runtime.model import load_model
from moeforge.synth import preset, write_model

pytestmark = pytest.mark.gpu

N_TOKENS = 120
MID = replace(preset("tiny-glm"), n_vocab=512, n_embd=256, n_layer=3, n_head=24, n_head_kv=2, head_dim=64,
              n_rot=32, n_ff_exp=128, n_expert=16, n_expert_used=8, n_ff=384, routed_scale=1.0)


@pytest.mark.parametrize("name", ["glm-f32", "glm-q8_0", "glm-q4_0", "glm-qk-f32", "glm-qk-q8_0"])
def test_cuda_matches_llama_cpp(parity_models, name):
    """Issue 4's bar on llama.cpp's glm4moe fixtures: the same top-1 at every position, mean
    KL per token < 1e-3; float weights also elementwise."""
    fx = parity_models[name]
    got = load_model(fx["path"], backend="cuda").logits(fx["tokens"])
    assert_matches_llama_cpp(fx, got, name.endswith("f32"))


@pytest.fixture(scope="module")
def mid_models(tmp_path_factory):
    d = tmp_path_factory.mktemp("glm")
    seed = run_seed()
    out = {}
    for qk in (False, True):
        for t in ("f32", "q8_0", "q4_0"):
            p = d / f"mid-{t}-{qk}.gguf"
            write_model(p, replace(MID, qk_norm=qk), t, source="float", seed=seed)
            out[t, qk] = str(p)
    return out, np.random.default_rng(seed).integers(0, 500, N_TOKENS), seed


@pytest.mark.parametrize("name", ["f32", "q8_0", "q4_0"])
@pytest.mark.parametrize("qk", [False, True])
@pytest.mark.parametrize("cache_type", ["f32", "f16"])
def test_prompt_matches_emulation(mid_models, name, qk, cache_type, monkeypatch):
    """A prompt in ubatches of 48."""
    paths, toks, seed = mid_models
    kw = dict(cache_type=cache_type, n_ubatch=48)
    got = load_model(paths[name, qk], backend="cuda", **kw).logits(toks)
    gaps = record_router_gaps(monkeypatch)
    ref_model = load_model(paths[name, qk], backend="numpy", numerics="kernel", **kw)
    ref = ref_model.logits(toks)
    exact = first_near_tie(gaps, ref_model.hp.n_layer - ref_model.hp.n_dense_lead, 1e-4)
    assert_matches_emulation(got, ref, name, seed, exact)


@pytest.mark.parametrize("name", ["f32", "q4_0"])
@pytest.mark.parametrize("grouped", [None, True])
@pytest.mark.parametrize("qk", [False, True])
def test_decode_matches_emulation(mid_models, name, grouped, qk, monkeypatch):
    """Decode steps (CUDA graph) after a 64-token prompt: the router kernels with sigmoid,
    selection bias and the shared slot, 9 slots a token through the expert products, the
    partial RoPE with biases, a block per query head or per share of a key head's 12."""
    paths, toks, seed = mid_models
    if grouped and name == "f32":
        # float32 attention groups by 2, 4, 8 or multiples of 8; the automatic plan keeps a
        # block per query head for 12, and a forced grouping says so before any launch
        m = load_model(paths[name, qk], backend="cuda")
        m.backend.decode_attn_grouped = True
        m.eval(toks[:8])
        with pytest.raises(ValueError, match="grouped decode attention takes groups of"):
            m.eval(toks[8:9])
        return
    gaps = record_router_gaps(monkeypatch)
    got, ref, m = decode_on_cuda_and_emulation(paths[name, qk], toks, 64, {"decode_attn_grouped": grouped})
    exact = max(first_near_tie(gaps, m.hp.n_layer - m.hp.n_dense_lead, 1e-4) - 64, 0)
    assert_matches_emulation(got, ref, name, seed, exact)


def test_batches_past_decode_sizes(mid_models, monkeypatch):
    """9 to 48 tokens a pass: the grouped expert products with 9 slots a token, the dense
    layer's one expert; gate and up merged and kept separate."""
    paths, toks, seed = mid_models
    for merge in (True, False):
        got = load_model(paths["q8_0", False], backend="cuda", merge_gate_up=merge, n_ubatch=9).logits(toks[:45])
        ref = load_model(paths["q8_0", False], backend="numpy", numerics="kernel", n_ubatch=9).logits(toks[:45])
        assert_matches_emulation(got, ref, "q8_0", seed)


def test_shared_expert_apart_on_the_gpu(parity_models, tmp_path):
    """The q8_0 fixture with its shared expert in F32 (the same weights): a one-expert FFN of
    its own on the GPU, llama.cpp's bar against the fixture's logits."""
    from gguf import GGMLQuantizationType as T
    from gguf.quants import dequantize
    fx = parity_models["glm-q8_0"]
    path = rewrite(fx["path"], str(tmp_path / "apart.gguf"), tensors=lambda n, a, t: (
        [(n, dequantize(a, t).astype(np.float32), T.F32)] if "_shexp." in n else [(n, a, t)]))
    m = load_model(path, backend="cuda")
    assert m.weights.layers[1].shared is not None and m.hp.gating.shared == 0
    m.reset(len(fx["tokens"]))
    got = np.concatenate([m.eval(fx["tokens"][:40]), *(m.eval([t]) for t in fx["tokens"][40:])])
    assert (got.argmax(-1) == fx["logits"].argmax(-1)).all()
    assert kl_per_token(fx["logits"], got).mean() < 1e-3


def test_down_and_combine_fused_changes_no_bit(parity_models):
    """The decode down product adding its weighted sum to the residual itself at 4 slots a
    token (the fixture's 3 experts and the shared one) against the product and
    moe_combine_rms_norm apart: the same logits, bit for bit, at every step."""
    fx = parity_models["glm-q4_0"]
    toks = fx["tokens"][:16]
    outs = []
    for fused in (True, False):
        m = load_model(fx["path"], backend="cuda")
        m.backend.fuse_down_combine = fused
        m.reset(len(toks))
        outs.append(np.concatenate([m.eval([t]) for t in toks]))
        assert m.backend.graphs.captured("decode") and np.isfinite(outs[-1]).all()
    np.testing.assert_array_equal(outs[0], outs[1])
