"""llama with experts (Mixtral's graph) on the CUDA backend (pytest -m gpu): llama.cpp's tiny
fixtures, prompts and decode steps, and a model with Mixtral's head layout (128-wide heads,
8 query heads a key head, 8 experts top-2) against the numpy backend that emulates the
kernels: the q and k rows permuted at load (NORM's pairs on the NEOX kernels), the RoPE
launch without biases, prompts in ubatches, decode steps in CUDA graphs."""
from dataclasses import replace

import numpy as np
import pytest

from conftest import (assert_matches_emulation, decode_on_cuda_and_emulation, assert_matches_llama_cpp, first_near_tie, kl_per_token,
                      record_router_gaps, run_seed)
from moeforge.runtime.model import load_model
from moeforge.synth import preset, write_model

pytestmark = pytest.mark.gpu

N_TOKENS = 96
NEAR_TIE_GAP = 1e-3     # router logits: gpt-oss's bar (conftest.record_router_gaps)
MID = replace(preset("tiny-mixtral"), n_vocab=512, n_embd=256, n_layer=3, n_head=16, n_head_kv=2, head_dim=128,
              n_ff_exp=128, n_expert=8, n_expert_used=2)


@pytest.mark.parametrize("name", ["mix-f32", "mix-q8_0", "mix-q4_0"])
def test_cuda_matches_llama_cpp(parity_models, name):
    """Issue 4's bar on llama.cpp's fixtures, the prompt in one pass and then 40 tokens and
    decode steps (captured): the same top-1 everywhere, mean KL < 1e-3; F32 elementwise."""
    fx = parity_models[name]
    got = load_model(fx["path"], backend="cuda").logits(fx["tokens"])
    assert_matches_llama_cpp(fx, got, name.endswith("f32"))
    m = load_model(fx["path"], backend="cuda")
    m.reset(len(fx["tokens"]))
    steps = np.concatenate([m.eval(fx["tokens"][:40]), *(m.eval([t]) for t in fx["tokens"][40:])])
    assert m.backend.graphs.captured("decode")
    assert (steps.argmax(-1) == fx["logits"].argmax(-1)).all()
    assert kl_per_token(fx["logits"], steps).mean() < 1e-3


@pytest.fixture(scope="module")
def mid_models(tmp_path_factory):
    d = tmp_path_factory.mktemp("mixtral")
    seed = run_seed()
    out = {}
    for t in ("f32", "q4_0"):
        out[t] = str(d / f"mid-{t}.gguf")
        write_model(out[t], MID, t, source="float", seed=seed)
    return out, np.random.default_rng(seed).integers(0, 500, N_TOKENS), seed


@pytest.mark.parametrize("name", ["f32", "q4_0"])
@pytest.mark.parametrize("cache_type", ["f32", "f16"])
def test_prompt_matches_emulation(mid_models, name, cache_type, monkeypatch):
    """A prompt in ubatches of 40."""
    paths, toks, seed = mid_models
    kw = dict(cache_type=cache_type, n_ubatch=40)
    got = load_model(paths[name], backend="cuda", **kw).logits(toks)
    gaps = record_router_gaps(monkeypatch)
    ref_model = load_model(paths[name], backend="numpy", numerics="kernel", **kw)
    ref = ref_model.logits(toks)
    assert_matches_emulation(got, ref, name, seed, first_near_tie(gaps, ref_model.hp.n_layer, NEAR_TIE_GAP))


@pytest.mark.parametrize("name", ["f32", "q4_0"])
@pytest.mark.parametrize("grouped", [None, True])
def test_decode_matches_emulation(mid_models, name, grouped, monkeypatch):
    """Decode steps (CUDA graph) after a 48-token prompt, a block per query head or per
    group of a key head's 8."""
    paths, toks, seed = mid_models
    gaps = record_router_gaps(monkeypatch)
    got, ref, m = decode_on_cuda_and_emulation(paths[name], toks, 48, {"decode_attn_grouped": grouped})
    exact = max(first_near_tie(gaps, m.hp.n_layer, NEAR_TIE_GAP) - 48, 0)
    assert_matches_emulation(got, ref, name, seed, exact)
