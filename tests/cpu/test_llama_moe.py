"""llama with experts (Mixtral's graph) on the numpy backend: llama.cpp's logits on tiny
fixtures (tests/fixtures/parity mix-*: no q/k norms, RoPE on adjacent pairs, softmax
routing renormalised), the row permutation that lets the NEOX kernels turn NORM's pairs,
and what loading refuses."""
import numpy as np
import pytest

from conftest import (F32_PARITY_BAR, assert_cache_consistent, assert_f32_matches_llama_cpp,
                      assert_top1_and_kl, rewrite)
from moeforge.runtime import arch_llama
from moeforge.runtime.gguf_file import GGUFError, TensorRef
from moeforge.runtime.model import load_model
from moeforge.synth import preset, tensor_plan


def test_f32_matches_llama_cpp(parity_models):
    fx = parity_models["mix-f32"]
    got = load_model(fx["path"], backend="numpy").logits(fx["tokens"])
    assert_f32_matches_llama_cpp(fx, got)


@pytest.mark.parametrize("name", ["mix-q8_0", "mix-q4_0"])
@pytest.mark.parametrize("numerics", ["float", "kernel"])
def test_quantized_close_to_llama_cpp(parity_models, name, numerics):
    """The GPU runtime's bar: the same top-1 everywhere, mean KL below 1e-3 (llama-cpp-python
    0.3.36: 6e-5 to 8e-5, either numerics)."""
    fx = parity_models[name]
    got = load_model(fx["path"], backend="numpy", numerics=numerics).logits(fx["tokens"])
    assert_top1_and_kl(fx["logits"], got)


def test_without_the_permutation_the_pairs_are_neox_and_wrong(parity_models, monkeypatch):
    """The fixture tells NORM's pairs from NEOX's: loading q and k unpermuted is far off."""
    monkeypatch.setattr(arch_llama, "norm_to_neox_rows", lambda t, n_heads, head_dim: t)
    fx = parity_models["mix-f32"]
    err = np.abs(load_model(fx["path"], backend="numpy").logits(fx["tokens"]) - fx["logits"]).max()
    assert err > 100 * F32_PARITY_BAR, f"max abs difference only {err:.2e}"


@pytest.mark.parametrize("qtype", ["f32", "q8_0"])
def test_permuted_rows_under_neox_are_norm_rope(rng, qtype):
    """What the loader relies on, on one projection: NEOX RoPE of the permuted rows' output
    is NORM RoPE of the file's, permuted the same way (any type: rows are whole blocks), and
    a dot product of two heads so turned is the file's."""
    from moeforge.runtime.backend_numpy import NumpyBackend
    from moeforge.codegen.quant import QUANT_TYPES
    from moeforge.reference import dequantize
    from moeforge.runtime.quantize import quantize
    H, D, k, n = 3, 16, 64, 5
    w = rng.standard_normal((H * D, k)).astype(np.float32)
    raw = w if qtype == "f32" else quantize(w, QUANT_TYPES[qtype]).reshape(H * D, -1)
    perm = arch_llama.norm_to_neox_rows(TensorRef("attn_q.weight", qtype, (H * D, k), lambda xp=np: raw), H, D)
    loaded = perm.load()
    dense = (lambda a: a) if qtype == "f32" else (lambda a: dequantize(a, qtype, (H * D, k)))
    x = rng.standard_normal((n, k)).astype(np.float32)
    pos = np.arange(7, 7 + n, dtype=np.int32)
    B = NumpyBackend.__new__(NumpyBackend)
    norm = x @ dense(raw).T
    B.rope_(norm, pos, H, 1e4, pairs="adjacent")
    neox = x @ dense(loaded).T
    B.rope_(neox, pos, H, 1e4)
    within = np.concatenate([np.arange(0, D, 2), np.arange(1, D, 2)])
    order = (np.arange(H)[:, None] * D + within).reshape(-1)
    np.testing.assert_allclose(neox, norm[:, order], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(neox[:, :D] @ neox[:, D:2 * D].T, norm[:, :D] @ norm[:, D:2 * D].T, rtol=1e-4, atol=1e-4)


def test_kv_cache_consistency(parity_models):
    fx = parity_models["mix-q8_0"]
    m = load_model(fx["path"], backend="numpy")
    assert_cache_consistent(m, fx["tokens"][:20], (3, 4, 13, 20))


def test_hparams_and_layers(parity_models):
    """feed_forward_length is the experts' width; softmax routing renormalised; no norms."""
    fx = parity_models["mix-q4_0"]
    m = load_model(fx["path"], backend="numpy")
    hp, spec = m.hp, fx["entry"]["spec"]
    assert m.arch == "llama" and hp.n_ff_exp == spec["n_ff_exp"] and hp.rot_dim == hp.head_dim
    g = hp.gating
    assert (g.func, g.norm, g.scale, g.shared) == ("softmax", True, 0.0, 0)
    L = m.weights.layers[0]
    assert L.q_norm is None and L.bq is None and L.router is not None
    assert L.gate_up.shape == (hp.n_expert, 2 * hp.n_ff_exp, hp.n_embd)
    assert "llama.expert_feed_forward_length" not in m.file.metadata


def test_tune_model_products_are_the_runtimes(parity_models):
    from moeforge.tuning.shapes import model_products
    fx = parity_models["mix-q4_0"]
    s = fx["entry"]["spec"]
    E, k, ff, d = s["n_expert"], s["n_expert_used"], s["n_ff_exp"], s["n_embd"]
    assert set(model_products(fx["path"])) == {((E, k, 2 * ff, d), "q4_0"), ((E, k, d, ff), "q4_0")}


# -- loading ------------------------------------------------------------------------------------
def _rewritten(parity_models, tmp_path, kv=None, tensors=None):
    from gguf import GGUFValueType as V
    src = parity_models["mix-f32"]["path"]
    kv = kv or {}
    have = set(load_model(src, backend="numpy").file.metadata)
    add = [(k, v, V.FLOAT32 if isinstance(v, float) else V.UINT32) for k, v in kv.items()
           if k not in have and v is not None]
    return rewrite(src, str(tmp_path / "bad.gguf"), kv=lambda k, v, t: kv.get(k, v), add=add, tensors=tensors)


def _plus(extra):
    """A tensors callback adding `extra` (name, array) after output_norm.weight."""
    from gguf import GGMLQuantizationType as T

    def tensors(name, a, t):
        return [(name, a, t)] + ([(extra[0], extra[1], T.F32)] if name == "output_norm.weight" else [])
    return tensors


@pytest.mark.parametrize("what,kv,tensors,match", [
    ("dense", {"llama.expert_count": None, "llama.expert_used_count": None}, None, "a dense llama model"),
    ("rope dims", {"llama.rope.dimension_count": 16}, None, "dimension_count"),
    ("scaled rope", {"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0}, None, "scaled RoPE"),
    ("attention scale", {"llama.attention.scale": 0.5}, None, "softmax scale"),
    ("rope factors", None, ("rope_freqs.weight", np.ones(16, np.float32)), "per-dimension factors"),
    ("split experts", None, ("blk.0.ffn_gate.0.weight", np.ones((64, 128), np.float32)), "one tensor each"),
    ("biases", None, ("blk.0.attn_q.bias", np.ones(128, np.float32)), "biases"),
])
def test_what_loading_refuses(parity_models, tmp_path, what, kv, tensors, match):
    if what == "scaled rope":
        from gguf import GGUFValueType as V
        src = parity_models["mix-f32"]["path"]
        path = rewrite(src, str(tmp_path / "bad.gguf"), add=[("llama.rope.scaling.type", "linear", V.STRING),
                                                            ("llama.rope.scaling.factor", 4.0, V.FLOAT32)])
    else:
        path = _rewritten(parity_models, tmp_path, kv=kv, tensors=_plus(tensors) if tensors else None)
    with pytest.raises(GGUFError, match=match):
        load_model(path, backend="numpy")


def test_missing_tensor_is_named(parity_models, tmp_path):
    path = _rewritten(parity_models, tmp_path, tensors=lambda n, a, t: [] if n == "blk.1.ffn_up_exps.weight"
                      else [(n, a, t)])
    with pytest.raises(GGUFError, match="'blk.1.ffn_up_exps.weight' is missing"):
        load_model(path, backend="numpy")


def test_mixtral_preset_is_mixtral_sized():
    """synth's mixtral-8x7b: 32 layers of 8 experts, ~46.7 B parameters, no q/k norms."""
    plan = tensor_plan(preset("mixtral-8x7b"), "q4_0")
    names = {n for n, _, _ in plan}
    assert "blk.31.ffn_down_exps.weight" in names and "blk.32.attn_norm.weight" not in names
    assert not any("attn_q_norm" in n or n.endswith(".bias") for n in names)
    params = sum(int(np.prod(s)) for _, s, _ in plan)
    assert 46e9 < params < 47.5e9, params
    big = sum(int(np.prod(s)) for _, s, _ in tensor_plan(preset("mixtral-8x22b"), "q4_0"))
    assert 140e9 < big < 142e9, big
