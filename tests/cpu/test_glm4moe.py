"""glm4moe (GLM-4.5, GLM-4.5-Air) on the numpy backend: llama.cpp's logits on tiny fixtures
(tests/fixtures/parity: biased q/k/v, RoPE on half of each head, a dense first layer,
sigmoid routing with a selection bias, scaled weights, a shared expert, a prediction block
after the trunk; glm-qk-*: GLM-4.5's q/k norms too), the features each fixture rests on,
the shared expert kept apart where its types differ, and what loading refuses."""
import numpy as np
import pytest

from conftest import (F32_PARITY_BAR, assert_cache_consistent, assert_f32_matches_llama_cpp,
                      assert_top1_and_kl, error_after_rewrite, rewrite)
from moeforge.runtime.gguf_file import GGUFError
from moeforge.runtime.model import load_model
from moeforge.synth import preset, tensor_plan

QUANTIZED = ["glm-q8_0", "glm-q4_0", "glm-qk-q8_0"]


@pytest.mark.parametrize("name", ["glm-f32", "glm-qk-f32"])
def test_f32_matches_llama_cpp(parity_models, name):
    fx = parity_models[name]
    got = load_model(fx["path"], backend="numpy").logits(fx["tokens"])
    assert_f32_matches_llama_cpp(fx, got)


@pytest.mark.parametrize("name", QUANTIZED)
@pytest.mark.parametrize("numerics", ["float", "kernel"])
def test_quantized_close_to_llama_cpp(parity_models, name, numerics):
    """The GPU runtime's bar: the same top-1 everywhere, mean KL below 1e-3 (llama-cpp-python
    0.3.36: 1.2e-4 to 1.6e-4, either numerics)."""
    fx = parity_models[name]
    got = load_model(fx["path"], backend="numpy", numerics=numerics).logits(fx["tokens"])
    assert_top1_and_kl(fx["logits"], got)


CHANGES = {
    "whole-head rope": dict(kv={"glm4moe.rope.dimension_count": 32}),
    "softmax gating": dict(kv={"glm4moe.expert_gating_func": 1}),
    "no renormalising": dict(kv={"glm4moe.expert_weights_norm": False}),
    "no scale": dict(kv={"glm4moe.expert_weights_scale": 1.0}),
    "no selection bias": dict(zero="exp_probs_b.bias"),
    "no shared expert": dict(zero="ffn_down_shexp.weight"),
    "no qkv biases": dict(zero=("attn_q.bias", "attn_k.bias", "attn_v.bias")),
    "no dense layer": dict(zero="blk.0.ffn_down.weight"),
}


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_f32_fixture_depends_on_each_feature(parity_models, tmp_path, change):
    """Without any one of glm4moe's features the numpy backend is far off llama.cpp's F32
    logits: the bar holds because both apply each of them, the same way."""
    c = CHANGES[change]

    def tensors(name, a, t):
        if "zero" in c and name.endswith(c["zero"]):
            a = np.zeros_like(a)
        return [(name, a, t)]
    err = error_after_rewrite(parity_models["glm-f32"], tmp_path / "changed.gguf", tensors, c.get("kv"))
    assert err > 100 * F32_PARITY_BAR, f"{change}: max abs difference only {err:.2e}"


def test_kv_cache_consistency(parity_models):
    """All at once == token by token == in uneven chunks."""
    fx = parity_models["glm-q8_0"]
    m = load_model(fx["path"], backend="numpy")
    assert_cache_consistent(m, fx["tokens"][:20], (3, 4, 13, 20))


def test_hparams_and_layers(parity_models):
    """The trunk's 3 layers of the file's 4 blocks (the prediction block is not loaded); the
    dense layer as one expert, the shared expert as expert E of the routed ones."""
    fx = parity_models["glm-q8_0"]
    m = load_model(fx["path"], backend="numpy")
    hp, spec = m.hp, fx["entry"]["spec"]
    assert m.arch == "glm4moe" and hp.n_layer == spec["n_layer"] and len(m.weights.layers) == hp.n_layer
    assert hp.rot_dim == spec["n_rot"] < hp.head_dim and hp.n_dense_lead == 1 and hp.n_ff == spec["n_ff"]
    g = hp.gating
    assert (g.func, g.norm, g.scale, g.shared, g.slots) == ("sigmoid", True, 2.5, 1, hp.n_expert_used + 1)
    dense, moe = m.weights.layers[0], m.weights.layers[1]
    assert dense.router is None and dense.gate_up.shape == (1, 2 * hp.n_ff, hp.n_embd)
    assert dense.down.shape == (1, hp.n_embd, hp.n_ff)
    E, ff = hp.n_expert, hp.n_ff_exp
    assert moe.gate_up.shape == (E + 1, 2 * ff, hp.n_embd) and moe.down.shape == (E + 1, hp.n_embd, ff)
    assert moe.exp_probs_b.shape == (E,) and moe.bq.shape == (hp.q_dim,) and moe.q_norm is None
    ids, wts = m.backend.route(np.random.default_rng(0).standard_normal((5, E)).astype(np.float32), g,
                               moe.exp_probs_b)
    assert (ids[:, -1] == E).all() and (wts[:, -1] == 1.0).all()
    np.testing.assert_allclose(wts[:, :-1].sum(-1), 2.5, rtol=1e-6)


def test_shared_expert_of_other_type_runs_apart(parity_models, tmp_path):
    """A file whose shared expert has other types than the routed experts (here F32 from
    the q8_0 fixture's blocks: the same weights) keeps it as a one-expert FFN of its own:
    the same logits as riding with the experts, within float32 rounding."""
    from gguf import GGMLQuantizationType as T
    from gguf.quants import dequantize
    fx = parity_models["glm-q8_0"]

    def tensors(name, a, t):
        if "_shexp." in name:
            return [(name, dequantize(a, t).astype(np.float32), T.F32)]
        return [(name, a, t)]
    path = rewrite(fx["path"], str(tmp_path / "apart.gguf"), tensors=tensors)
    apart = load_model(path, backend="numpy")
    assert apart.hp.gating.shared == 0 and apart.weights.layers[1].shared is not None
    assert apart.weights.layers[1].gate_up.shape[0] == apart.hp.n_expert
    ride = load_model(fx["path"], backend="numpy")
    np.testing.assert_allclose(apart.logits(fx["tokens"]), ride.logits(fx["tokens"]), atol=2e-5, rtol=0)


# -- loading ------------------------------------------------------------------------------------
def _bad(parity_models, tmp_path, kv=None, drop=None):
    """The F32 fixture with kv's keys changed (None: dropped) or added, or a tensor dropped."""
    from gguf import GGUFValueType as V
    src = parity_models["glm-f32"]["path"]
    kv = kv or {}
    have = set(load_model(src, backend="numpy").file.metadata)
    add = [(k, v, V.ARRAY, V.INT32) if isinstance(v, list) else (k, v, V.UINT32)
           for k, v in kv.items() if k not in have and v is not None]
    return rewrite(src, str(tmp_path / "bad.gguf"), kv=lambda k, v, t: kv.get(k, v), add=add,
                   tensors=(lambda n, a, t: [] if n == drop else [(n, a, t)]) if drop else None)


@pytest.mark.parametrize("drop", ["blk.1.exp_probs_b.bias", "blk.2.post_attention_norm.weight",
                                  "blk.0.ffn_up.weight", "blk.2.ffn_down_shexp.weight"])
def test_missing_tensor_is_named(parity_models, tmp_path, drop):
    with pytest.raises(GGUFError, match=rf"'{drop}' is missing"):
        load_model(_bad(parity_models, tmp_path, drop=drop), backend="numpy")


def test_prediction_block_is_optional(parity_models, tmp_path):
    """The prediction block is checked where present, not required (llama.cpp loads a trunk alone)."""
    fx = parity_models["glm-f32"]
    path = _bad(parity_models, tmp_path, drop="blk.3.nextn.eh_proj.weight")
    np.testing.assert_allclose(load_model(path, backend="numpy").logits(fx["tokens"][:8]), fx["logits"][:8],
                               atol=F32_PARITY_BAR, rtol=0)


@pytest.mark.parametrize("kv,match", [
    ({"glm4moe.rope.dimension_sections": [8, 8, 0, 0]}, "M-RoPE"),
    ({"glm4moe.expert_shared_count": 2}, "one shared expert"),
    ({"glm4moe.nextn_predict_layers": 4}, "leaves no layer"),
    ({"glm4moe.rope.dimension_count": 40}, "dimension_count"),
    ({"glm4moe.expert_gating_func": 3}, "expert_gating_func 3"),
    ({"glm4moe.expert_shared_count": None}, "expert_shared_count"),
])
def test_bad_metadata_is_reported(parity_models, tmp_path, kv, match):
    with pytest.raises(GGUFError, match=match):
        load_model(_bad(parity_models, tmp_path, kv=kv), backend="numpy")


def test_half_the_qkv_biases_are_refused(parity_models, tmp_path):
    with pytest.raises(GGUFError, match="biases for some of q, k, v"):
        load_model(_bad(parity_models, tmp_path, drop="blk.1.attn_k.bias"), backend="numpy")


def test_glm_air_preset_is_glm_air_sized():
    """synth's glm-4.5-air: 46 layers and a prediction block, ~110 B parameters with it."""
    plan = tensor_plan(preset("glm-4.5-air"), "q4_0")
    names = {n for n, _, _ in plan}
    assert "blk.46.nextn.eh_proj.weight" in names and "blk.47.attn_norm.weight" not in names
    assert "blk.0.ffn_gate.weight" in names and "blk.0.ffn_gate_inp.weight" not in names
    assert {"blk.1.ffn_gate_shexp.weight", "blk.1.exp_probs_b.bias", "blk.45.attn_q.bias"} <= names
    assert "blk.1.attn_q_norm.weight" not in names and "blk.1.attn_q_norm.weight" in {
        n for n, _, _ in tensor_plan(preset("glm-4.5"), "q4_0")}
    params = sum(int(np.prod(s)) for _, s, _ in plan)
    assert 105e9 < params < 112e9, params


def test_tune_model_products_are_the_runtimes(parity_models):
    """`moeforge tune --model` tunes what the runtime asks for: the routed experts with the
    shared one riding (E + 1 experts, top_k + 1 slots), the dense layer as one expert, and
    nothing of the prediction block."""
    from moeforge.tuning.shapes import model_products
    fx = parity_models["glm-q4_0"]
    m = load_model(fx["path"], backend="numpy")
    want = set()
    for L in m.weights.layers:
        slots = 1 if L.router is None else m.hp.gating.slots
        E, rows, d = L.gate_up.shape
        want |= {((E, slots, rows, d), L.gate_up.qtype), ((E, slots, d, L.down.shape[2]), L.down.qtype)}
    assert set(model_products(fx["path"])) == want and len(want) == 4


def test_end_of_message_ends_a_generation(parity_models):
    """GLM's files name <|endoftext|> the end of sequence, <|user|> the end of turn and
    <|observation|> the end of message (a tool's answer would follow): all three stop a
    generation, as in llama.cpp."""
    m = load_model(parity_models["glm-f32"]["path"], backend="numpy")
    md = m.file.metadata
    md["tokenizer.ggml.eos_token_id"], md["tokenizer.ggml.eot_token_id"] = 5, 6
    md["tokenizer.ggml.eom_token_id"] = 7
    assert set(m.eos_ids) == {5, 6, 7}
    del md["tokenizer.ggml.eom_token_id"]
    assert set(m.eos_ids) == {5, 6}
