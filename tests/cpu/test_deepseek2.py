"""deepseek2 (DeepSeek-V2-Lite's graph) on the numpy backend: llama.cpp's logits on tiny
fixtures (tests/fixtures/parity: latent attention absorbed, RoPE on adjacent pairs with
YaRN, a dense first layer, softmax routing, two shared experts; ds-qlora-*: q through a low
rank), the features each fixture rests on, the one-row cache, and what loading refuses."""
import math
from dataclasses import replace

import numpy as np
import pytest

from conftest import (F32_PARITY_BAR, assert_cache_consistent, assert_f32_matches_llama_cpp,
                      assert_top1_and_kl, error_after_rewrite, rewrite)
from moeforge.runtime.gguf_file import GGUFError
from moeforge.runtime.model import load_model
from moeforge.synth import preset, tensor_plan, write_model


@pytest.mark.parametrize("name", ["ds-f32", "ds-qlora-f32"])
def test_f32_matches_llama_cpp(parity_models, name):
    fx = parity_models[name]
    got = load_model(fx["path"], backend="numpy").logits(fx["tokens"])
    assert_f32_matches_llama_cpp(fx, got)


@pytest.mark.parametrize("name", ["ds-q8_0", "ds-q4_0"])
@pytest.mark.parametrize("numerics", ["float", "kernel"])
def test_quantized_close_to_llama_cpp(parity_models, name, numerics):
    """The GPU runtime's bar: the same top-1 everywhere, mean KL below 1e-3 (llama-cpp-python
    0.3.36: 1.5e-4 to 1.9e-4, either numerics)."""
    fx = parity_models[name]
    got = load_model(fx["path"], backend="numpy", numerics=numerics).logits(fx["tokens"])
    assert_top1_and_kl(fx["logits"], got)


CHANGES = {
    # the softmax scale falls back to 1/sqrt(48) and RoPE keeps YaRN's own magnitude
    "no yarn log multiplier": dict(kv={"deepseek2.rope.scaling.yarn_log_multiplier": None}),
    "no yarn": dict(kv={"deepseek2.rope.scaling.type": "none"}),
    "renormalised weights": dict(kv={"deepseek2.expert_weights_norm": True}),
    "sigmoid routing": dict(kv={"deepseek2.expert_gating_func": 2}),
    "no latent norm": dict(one="attn_kv_a_norm.weight"),
    "no shared key": dict(zero_rows=("attn_kv_a_mqa.weight", 64)),
}


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_f32_fixture_depends_on_each_feature(parity_models, tmp_path, change):
    """Without any one of deepseek2's features the numpy backend is far off llama.cpp's F32
    logits: the bar holds because both apply each of them, the same way."""
    c = CHANGES[change]

    def tensors(name, a, t):
        if "one" in c and name.endswith(c["one"]):
            a = np.ones_like(a)
        if "zero_rows" in c and name.endswith(c["zero_rows"][0]):
            a = a.copy()
            a[c["zero_rows"][1]:] = 0
        return [(name, a, t)]
    err = error_after_rewrite(parity_models["ds-f32"], tmp_path / "changed.gguf", tensors, c.get("kv"))
    assert err > 100 * F32_PARITY_BAR, f"{change}: max abs difference only {err:.2e}"


def test_kv_cache_consistency(parity_models):
    """All at once == token by token == in uneven chunks."""
    fx = parity_models["ds-q8_0"]
    m = load_model(fx["path"], backend="numpy")
    assert_cache_consistent(m, fx["tokens"][:20], (3, 4, 13, 20))


def test_cache_holds_one_latent_row_a_token(parity_models):
    """A token and layer keep kv_lora_rank + rope_dim values (80 here, where the heads'
    keys and values would take 4 x (48 + 32) = 320); the value row is a view of the key
    row's first kv_lora_rank, not a copy."""
    fx = parity_models["ds-f32"]
    m = load_model(fx["path"], backend="numpy", n_ctx=64)
    hp = m.hp
    assert (hp.n_head_kv, hp.head_dim, hp.v_dim) == (1, 80, 64)
    k, v = m.cache.k[0], m.cache.v[0]
    assert k.shape == (64, 80) and v.shape == (64, 64) and np.shares_memory(k, v)
    assert m.cache.nbytes == 64 * 80 * 4 * hp.n_layer
    m.logits(fx["tokens"][:5])
    np.testing.assert_array_equal(v[:5], k[:5, :64])
    assert np.abs(k[:5]).min(axis=1).max() > 0 and not k[5:].any()


def test_hparams_and_layers(parity_models):
    """Layer 0 dense (one expert), the two shared experts riding as experts E and E + 1
    (slots top_k and top_k + 1), no renormalising, softmax; llama.cpp's softmax scale for
    YaRN: (1 + 0.1 x 0.707 ln 4)^2 / sqrt(48)."""
    fx = parity_models["ds-f32"]
    m = load_model(fx["path"], backend="numpy")
    hp, spec = m.hp, fx["entry"]["spec"]
    assert m.arch == "deepseek2" and hp.n_layer == spec["n_layer"] == len(m.weights.layers)
    g = hp.gating
    assert (g.func, g.norm, g.scale, g.shared, g.slots) == ("softmax", False, 1.0, 2, hp.n_expert_used + 2)
    dense, moe = m.weights.layers[0], m.weights.layers[1]
    assert dense.router is None and dense.gate_up.shape == (1, 2 * hp.n_ff, hp.n_embd)
    E, ff = hp.n_expert, hp.n_ff_exp
    assert moe.shared is None and moe.gate_up.shape == (E + 2, 2 * ff, hp.n_embd)
    assert moe.down.shape == (E + 2, hp.n_embd, ff)
    assert moe.mla.k_b.shape == (4, 64, 32) and moe.mla.v_b.shape == (4, 32, 64) and moe.mla.q_a is None
    assert hp.mla.kq_scale == pytest.approx((1 + 0.0707 * math.log(4)) ** 2 / math.sqrt(48), rel=1e-6)
    assert hp.yarn.mscale() == pytest.approx(1.0, rel=1e-6)


@pytest.mark.parametrize("name", ["ds-f32", "ds-q4_0"])
def test_two_shared_experts_ride_as_two_experts(parity_models, monkeypatch, name):
    """The shared FFN (2 x ff wide) as experts E and E + 1: its gate and up rows halved, its
    down's columns gathered by half (whole quant blocks: the routed down's rows are ff wide,
    of the same type), each half a slot of weight 1. Kept apart as one FFN instead, as
    llama.cpp runs it, the same file gives the same logits within float32 rounding (the
    halves' down products are summed by the combine instead of in one dot)."""
    from moeforge.runtime import arch
    fx = parity_models[name]
    ride = load_model(fx["path"], backend="numpy")
    assert ride.hp.gating.shared == 2 and ride.weights.layers[1].shared is None
    monkeypatch.setattr(arch, "shared_rides", lambda *a, **k: False)
    apart = load_model(fx["path"], backend="numpy")
    assert apart.hp.gating.shared == 0 and apart.weights.layers[1].shared is not None
    assert apart.weights.layers[1].gate_up.shape[0] == apart.hp.n_expert
    got, want = ride.logits(fx["tokens"]), apart.logits(fx["tokens"])
    np.testing.assert_allclose(got, want, atol=2e-5 * np.abs(want).max(), rtol=0)


def test_v2_lite_softmax_scale(tmp_path):
    """DeepSeek-V2-Lite's YaRN (factor 40 from 4096, mscale_all_dim 0.707, 192-wide query
    heads) gives llama.cpp's softmax scale 0.1147214 (not 1/sqrt(192) = 0.0722); the
    preset's shapes on a model of two small layers."""
    spec = preset("deepseek-v2-lite", n_vocab=384, n_embd=128, n_layer=2, n_expert=4, n_expert_used=2,
                  n_ff_exp=64, n_ff=128, kv_lora_rank=64, n_head=2)
    path = str(tmp_path / "lite.gguf")
    write_model(path, spec, "q8_0")
    m = load_model(path, backend="numpy")
    assert m.hp.mla.kq_scale == pytest.approx(0.1147214, rel=1e-5)
    assert (m.hp.mla.nope_dim, m.hp.mla.rope_dim, m.hp.mla.v_dim) == (128, 64, 128)
    assert np.isfinite(m.logits([1, 2, 3])).all()


def test_v2_lite_preset_is_v2_lite_sized():
    """15.7B parameters, as DeepSeek-V2-Lite's card says."""
    n = sum(math.prod(shape) for _, shape, _ in tensor_plan(preset("deepseek-v2-lite"), "q4_0"))
    assert 15.5e9 < n < 16.0e9, n


@pytest.mark.parametrize("change,match", [
    (dict(drop_kv="deepseek2.attention.key_length_mla"), "convert the model again"),
    (dict(drop="blk.1.attn_k_b.weight"), "attn_k_b"),
    (dict(kv={"deepseek2.attention.head_count_kv": 4}), "head_count_kv 1"),
    (dict(kv={"deepseek2.rope.scaling.type": "linear"}), "not supported"),
    (dict(kv={"deepseek2.expert_gating_func": 3}), "expert_gating_func 3"),
    (dict(add=[("deepseek2.expert_group_count", 2)]), "group-limited"),
])
def test_bad_files_are_reported(parity_models, tmp_path, change, match):
    from gguf import GGUFValueType
    fx = parity_models["ds-q8_0"]
    kv = change.get("kv", {})

    def edit(k, v, t):
        if k == change.get("drop_kv"):
            return None
        return kv.get(k, v)

    def tensors(name, a, t):
        return [] if name == change.get("drop") else [(name, a, t)]
    add = [(k, v, GGUFValueType.UINT32) for k, v in change.get("add", [])]
    path = rewrite(fx["path"], str(tmp_path / "bad.gguf"), tensors=tensors, kv=edit, add=add)
    with pytest.raises(GGUFError, match=match):
        load_model(path, backend="numpy")


@pytest.mark.parametrize("name", ["ds-q4_0", "qlora-q8_0"])
def test_tune_model_reads_the_runtimes_products(parity_models, tmp_path, name):
    """`moeforge tune --model` finds what the runtime runs: the routed experts with the two
    shared ones riding (E + 2 experts, top_k + 2 slots), k_b and v_b as expert products with every head a
    slot, and the latent projections among the dense ones (q or q_a and q_b, kv_a)."""
    from moeforge.tuning.shapes import model_dense_shapes, model_products
    if name in parity_models:
        path = parity_models[name]["path"]
    else:                            # q through a low rank, its products quantized
        path = str(tmp_path / "qlora.gguf")
        write_model(path, replace(preset("tiny-deepseek"), q_lora_rank=32), "q8_0", source="float", seed=3)
    m = load_model(path, backend="numpy")
    hp = m.hp
    want = set()
    for L in m.weights.layers:
        if L.router is None:
            want.add(((1, 1) + L.gate_up.shape[1:], L.gate_up.qtype))
            want.add(((1, 1) + L.down.shape[1:], L.down.qtype))
        else:
            E, rows, d = L.gate_up.shape
            assert E == hp.n_expert + 2
            want |= {((E, hp.gating.slots, rows, d), L.gate_up.qtype),
                     ((E, hp.gating.slots, d, L.down.shape[2]), L.down.qtype)}
        want |= {((hp.n_head, hp.n_head) + L.mla.k_b.shape[1:], L.mla.k_b.qtype),
                 ((hp.n_head, hp.n_head) + L.mla.v_b.shape[1:], L.mla.v_b.qtype)}
    got = set(model_products(path))
    assert want <= got and (hp.n_head, hp.n_head, hp.mla.kv_lora_rank, hp.mla.nope_dim) in {s for s, _ in got}
    dense = {(mm, k) for mm, k, _ in model_dense_shapes(path)}
    L0 = m.weights.layers[0]
    latent = [L0.mla.kv_a] + ([L0.mla.q_a, L0.wq] if L0.mla.q_a is not None else [L0.wq])
    assert {tuple(t.shape) for t in latent} <= dense


def test_cuda_latent_limits_are_checked_before_any_kernel(parity_models):
    """The CUDA backend's latent attention limits (attention_cuda.check_mla, called as the
    backend is made): the fixtures' and V2-Lite's heads pass, a wider latent, an odd part or
    a second kv head is named."""
    from moeforge.runtime.attention_cuda import check_mla
    hp = load_model(parity_models["ds-f32"]["path"], backend="numpy").hp
    check_mla(hp)
    lite = replace(hp, head_dim=576, mla=replace(hp.mla, kv_lora_rank=512, rope_dim=64, nope_dim=128))
    check_mla(lite)
    for bad, what in ((replace(lite, head_dim=1088, mla=replace(lite.mla, kv_lora_rank=1024)), "a latent of 1024"),
                      (replace(lite, head_dim=578), "rows of 578"),
                      (replace(lite, mla=replace(lite.mla, nope_dim=126)), "126 nope values"),
                      (replace(lite, n_head_kv=2), "2 kv heads")):
        with pytest.raises(ValueError, match=what):
            check_mla(bad)


def test_runtime_counts_the_tensor_core_kernels_key_tile():
    """The merge learns a decode split's tile from the runtime (MLA_TC_KEYS) while
    attn_prefill_mla splits by its own MLAP_KEYS, and mla_prefill_smem sizes its tiles by the
    runtime's: a tile changed in one place only would merge the wrong splits or overrun
    shared memory."""
    import re
    from moeforge.codegen.render import render
    from moeforge.codegen.spec import ModelSpec
    from moeforge.runtime.attention_cuda import MLA_MAX_D, MLA_TC_KEYS, mla_prefill_smem
    src = render(ModelSpec(cache="f16"))
    assert int(re.search(r"#define MLAP_KEYS (\d+)", src).group(1)) == MLA_TC_KEYS
    assert "mla_rows_per_split(hi, gridDim.z, min_rows, MLAP_KEYS)" in src
    ls = MLA_MAX_D + 8       # the row stride the template pads to (MLAP_LS)
    assert re.search(r"#define MLAP_LS \(MLA_MAX_D \+ 8\)", src)
    assert mla_prefill_smem(2) - mla_prefill_smem(1) == 2 * MLA_TC_KEYS * ls


def test_append_shared_gathers_each_shared_experts_rows_and_columns():
    """append_shared(..., n=2) on rows as the loaders give them (quantized: uint8 rows of
    blocks; float: typed rows): gate/up's (2 ff, k) rows split in two experts, down's
    (d, 2 ff) columns gathered by half, after the E routed experts, whole blocks intact."""
    from moeforge.runtime.arch import append_shared
    from moeforge.runtime.gguf_file import TensorRef
    rng = np.random.default_rng(5)
    E, ff, d, bb = 3, 64, 96, 18                     # q4_0: 32 weights in 18 bytes
    ex_gate = rng.integers(0, 256, (E * ff, d // 32 * bb), dtype=np.uint8)
    sh_gate = rng.integers(0, 256, (2 * ff, d // 32 * bb), dtype=np.uint8)
    g = append_shared(TensorRef("g", "q4_0", (E, ff, d), lambda xp=np: ex_gate),
                      TensorRef("s", "q4_0", (2 * ff, d), lambda xp=np: sh_gate), "g", 2)
    assert g.shape == (E + 2, ff, d)
    got = g.load().reshape(E + 2, ff, -1)
    np.testing.assert_array_equal(got[:E].reshape(E * ff, -1), ex_gate)
    np.testing.assert_array_equal(got[E], sh_gate[:ff])
    np.testing.assert_array_equal(got[E + 1], sh_gate[ff:])
    ex_down = rng.integers(0, 256, (E * d, ff // 32 * bb), dtype=np.uint8)
    sh_down = rng.integers(0, 256, (d, 2 * ff // 32 * bb), dtype=np.uint8)
    dn = append_shared(TensorRef("d", "q4_0", (E, d, ff), lambda xp=np: ex_down),
                       TensorRef("s", "q4_0", (d, 2 * ff), lambda xp=np: sh_down), "d", 2)
    assert dn.shape == (E + 2, d, ff)
    got = dn.load().reshape(E + 2, d, -1)
    half = ff // 32 * bb
    np.testing.assert_array_equal(got[E], sh_down[:, :half])
    np.testing.assert_array_equal(got[E + 1], sh_down[:, half:])
    fl = rng.standard_normal((d, 2 * ff)).astype(np.float32)
    fdn = append_shared(TensorRef("d", "f32", (E, d, ff), lambda xp=np: np.zeros((E * d, ff), np.float32)),
                        TensorRef("s", "f32", (d, 2 * ff), lambda xp=np: fl), "d", 2)
    out = fdn.load().reshape(E + 2, d, ff)
    np.testing.assert_array_equal(out[E], fl[:, :ff])
    np.testing.assert_array_equal(out[E + 1], fl[:, ff:])
    one = append_shared(TensorRef("d", "f32", (E, d, ff), lambda xp=np: np.zeros((E * d, ff), np.float32)),
                        TensorRef("s", "f32", (d, ff), lambda xp=np: fl[:, :ff]), "d")
    np.testing.assert_array_equal(one.load().reshape(E + 1, d, ff)[E], fl[:, :ff])


def test_runtime_launches_the_latent_kernels_with_the_templates_sizes():
    """The runtime's MLA sizes (its launch blocks, the heads a group, the row width and the
    merge's split bound) are written twice, in attention_cuda and as the template's
    #defines: mla_rope_store launched with another block than it was built for would leave
    latent values unnormed, a group of other heads would read the wrong queries."""
    import re
    from moeforge.codegen.render import render
    from moeforge.codegen.spec import ModelSpec
    from moeforge.runtime import attention_cuda as ac
    src = render(ModelSpec())
    defined = {k: int(v) for k, v in re.findall(r"#define (MLA_\w+) (\d+)", src)}
    for name in ("MLA_STORE_THREADS", "MLA_THREADS", "MLA_HEADS", "MLA_MAX_D", "MLA_MAX_SPLITS"):
        assert defined[name] == getattr(ac, name), name
    assert ac.MLA_MAX_R == 2 * defined["MLA_THREADS"] == 2 * defined["MLA_STORE_THREADS"]   # two latent values a thread
