"""moeforge synth: valid, loadable files with llama.cpp's names and keys."""
import numpy as np
import pytest

from moeforge.bench_model import expert_loads
from moeforge.runtime.backend_numpy import NumpyBackend
from moeforge.runtime.gguf_file import GGUFFile
from moeforge.runtime.model import load_model
from moeforge.synth import PRESETS, preset, tensor_plan, write_qwen3moe


@pytest.mark.parametrize("qtype", ["q4_0", "q8_0", "q4_K", "f16"])
def test_blocks_source_writes_a_loadable_model(tmp_path, qtype):
    path = str(tmp_path / "m.gguf")
    r = write_qwen3moe(path, preset("tiny-k" if qtype == "q4_K" else "tiny"), qtype, seed=1)
    f = GGUFFile(path)
    assert r["tensors"] == len(f.tensors) == 27
    assert f.metadata["general.architecture"] == "qwen3moe"
    for key in ("block_count", "embedding_length", "expert_count", "expert_used_count", "attention.head_count",
                "attention.head_count_kv", "expert_feed_forward_length", "rope.freq_base",
                "attention.layer_norm_rms_epsilon", "context_length"):
        assert f"qwen3moe.{key}" in f.metadata
    assert f.metadata["tokenizer.ggml.model"] == "gpt2" and len(f.metadata["tokenizer.ggml.tokens"]) == 512
    m = load_model(path, backend="numpy")
    logits = m.logits(np.arange(16))
    assert np.isfinite(logits).all() and logits.std() > 0
    if qtype != "f16":
        from moeforge.codegen.quant import quant_type
        q = quant_type(qtype)
        assert f.tensors["blk.0.ffn_down_exps.weight"].qtype == q.name
        blocks = m.weights.layers[0].gate_up.raw.reshape(-1, q.block_bytes)
        d = blocks[:, :4 if qtype == "q4_K" else 2].copy()     # q4_K: d and dmin
        scales = np.abs(d.view(np.float16).astype(np.float32))
        assert np.isfinite(scales).all() and scales.min() > 0 and scales.max() < 0.1


def test_names_match_llama_cpp():
    """The names gguf-py (llama.cpp's own package) lists for qwen3moe."""
    import gguf
    arch = gguf.MODEL_ARCH.QWEN3MOE
    allowed = {gguf.TENSOR_NAMES[t] for t in gguf.MODEL_TENSORS[arch]}
    for name, _, _ in tensor_plan(PRESETS["qwen3-30b-a3b"], "q4_0"):
        base = name.rsplit(".", 1)[0]
        base = base.replace(base.split(".")[1], "{bid}", 1) if base.startswith("blk.") else base
        assert base in allowed, name


def test_real_shapes_of_the_30b_preset():
    plan = {n: (s, t) for n, s, t in tensor_plan(PRESETS["qwen3-30b-a3b"], "q4_0")}
    assert plan["token_embd.weight"][0] == (151936, 2048)
    assert plan["blk.47.ffn_gate_exps.weight"][0] == (128, 768, 2048)
    assert plan["blk.47.ffn_down_exps.weight"][0] == (128, 2048, 768)
    assert plan["blk.0.attn_q.weight"][0] == (4096, 2048)
    assert plan["blk.0.attn_k.weight"][0] == (512, 2048)
    assert plan["blk.0.ffn_gate_inp.weight"] == ((128, 2048), "f32")
    total = sum(np.prod(s) for s, _ in plan.values())
    assert 30.0e9 < total < 31.0e9


@pytest.mark.parametrize("name,total,active", [("gpt-oss-20b", 20.91e9, 3.61e9), ("gpt-oss-120b", 116.83e9, 5.13e9)])
def test_gpt_oss_presets_have_the_published_parameter_counts(name, total, active):
    """OpenAI's model card: 20.91B (3.61B active) and 116.83B (5.13B active) parameters; the
    active count takes top_k of the experts' weights and biases, the embedding not counted."""
    s = PRESETS[name]
    plan = {n: s_ for n, s_, _ in tensor_plan(s, "mxfp4_moe")}
    n = sum(int(np.prod(shape)) for shape in plan.values())
    experts = sum(int(np.prod(shape)) for k, shape in plan.items() if "_exps" in k)
    act = n - experts * (1 - s.n_expert_used / s.n_expert) - int(np.prod(plan["token_embd.weight"]))
    assert abs(n - total) / total < 2e-3 and abs(act - active) / active < 5e-3, (n, act)
    assert plan["blk.0.ffn_gate_exps.weight"] == (s.n_expert, 2880, 2880)


@pytest.mark.parametrize("qtype", ["q8_0", "q4_K"])
def test_skewed_router_concentrates_tokens(tmp_path, qtype):
    path = str(tmp_path / "s.gguf")
    write_qwen3moe(path, preset("tiny-k" if qtype == "q4_K" else "tiny"), qtype, seed=2, skewed_router=True)
    loads = expert_loads(load_model(path, backend="numpy"), np.arange(200) % 500)
    assert len(loads) == 2
    for c in loads:   # per layer: the two hottest experts take most slots (uniform: 25%)
        counts = np.sort(c)
        assert counts[-2:].sum() > 0.5 * counts.sum(), counts


def test_merged_gate_up_file(tmp_path):
    path = str(tmp_path / "g.gguf")
    write_qwen3moe(path, preset("tiny"), "q4_0", seed=1, merged_gate_up=True, tied_output=True)
    f = GGUFFile(path)
    assert "blk.0.ffn_gate_up_exps.weight" in f.tensors and "output.weight" not in f.tensors
    assert np.isfinite(load_model(path, backend="numpy").logits([1, 2, 3])).all()


def test_float_source_is_deterministic(tmp_path):
    a, b = str(tmp_path / "a.gguf"), str(tmp_path / "b.gguf")
    write_qwen3moe(a, preset("tiny"), "q4_0", source="float", seed=5)
    write_qwen3moe(b, preset("tiny"), "q4_0", source="float", seed=5)
    assert open(a, "rb").read() == open(b, "rb").read()


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="synth writes"):
        write_qwen3moe(str(tmp_path / "x.gguf"), preset("tiny"), "q4_1")
    with pytest.raises(ValueError, match="not whole q5_K blocks"):
        write_qwen3moe(str(tmp_path / "x.gguf"), preset("tiny"), "q5_K_M")
    with pytest.raises(ValueError, match="unknown preset"):
        preset("llama-7b")


def logits_on_the_kernels_routes(path, toks, monkeypatch):
    """The numpy backend's logits at kernel numerics, and at float numerics on the experts
    the kernel numerics chose. Where a token's k-th and (k+1)-th router logits nearly tie,
    q8_1's rounding may pick the other expert; a tiny model's logits then part at that token
    (KL up to 0.2) and at the tokens that attend to it. Routed alike, the two differ only by
    their arithmetic, which is what a numerics bar is about."""
    routes, choose = [], NumpyBackend.route

    def recording(self, logits, gating, sel_bias=None):
        ids, w = choose(self, logits, gating, sel_bias)
        routes.append(ids)
        return ids, w

    def replaying(self, logits, gating, sel_bias=None):
        ids = routes.pop(0)
        return ids, self.route_weights(logits, ids, gating)

    monkeypatch.setattr(NumpyBackend, "route", recording)
    emu = load_model(path, backend="numpy", numerics="kernel").logits(toks)
    monkeypatch.setattr(NumpyBackend, "route", replaying)
    flt = load_model(path, backend="numpy", numerics="float").logits(toks)
    assert not routes                # the two graphs routed as often
    return emu, flt


@pytest.mark.parametrize("qtype", ["q2_K_mix", "q3_K_M", "q4_K", "q5_K_M", "iq4_xs", "mxfp4_moe"])
def test_k_quant_model_kernel_numerics_close_to_float(tmp_path, monkeypatch, rng, qtype):
    """A model whose every matrix is q4_K (q5_K with q6_K in places; iq4_xs; the Q2_K and
    Q3_K_M mixes; MXFP4_MOE) on the numpy backend: the emulation of the kernels (q8_1
    activations, integer block dots, the super-block scale formulas) stays close to float64
    on gguf's dequantized weights at every token, as it does for q4_0. Both are routed on the
    kernel numerics' experts: left to choose, they swapped an expert at a near-tie in up to
    a third of the models (a token's KL up to 0.2, the median up to 8.6e-4 of 300 iq4_xs
    models). The weights are quantized floats, as real models' are: random blocks give q4_K
    sub-block minimums far beyond a real model's, rows with a large common part, and a token
    whose hidden state cancels it loses ten times its relative error a layer (one of 300
    had a KL of 37). Routed alike, of 300 models of each format made from floats the largest
    KL of any token was 2.2e-4 and the mean at most 7.3e-5 (CPU, 2026-11-29)."""
    from conftest import kl_per_token
    path = str(tmp_path / "k.gguf")
    write_qwen3moe(path, preset("tiny-k"), qtype, seed=int(rng.integers(2**31)), source="float")
    toks = rng.integers(0, 512, size=24)
    emu, flt = logits_on_the_kernels_routes(path, toks, monkeypatch)
    kl = kl_per_token(flt, emu)
    print(f"mean KL {kl.mean():.2e}, median {np.median(kl):.2e}, max {kl.max():.2e}")
    assert np.isfinite(emu).all()
    assert kl.max() < 1e-3 and kl.mean() < 3e-4
    assert np.abs(emu - flt).max() > 0     # the two numerics really differ


def test_mxfp4_moe_plan_is_llama_cpps():
    """MXFP4_MOE: every expert tensor (gate, up, merged gate/up, down) mxfp4, every other
    matrix q8_0 (the head and the embedding too), the router and norms float32."""
    for merged in (False, True):
        plan = tensor_plan(preset("tiny"), "mxfp4_moe", merged_gate_up=merged)
        types = {name: t for name, _, t in plan}
        assert {t for name, t in types.items() if "_exps" in name} == {"mxfp4"}
        assert {t for name, t in types.items() if "_exps" not in name and len(dict((n, s) for n, s, _ in plan)[name]) == 2
                and "gate_inp" not in name} == {"q8_0"}
        assert types["blk.0.ffn_gate_inp.weight"] == "f32"


def test_float_source_writes_k_quants_of_the_same_model(tmp_path):
    """With float weights, the q4_K, q5_K and iq4_xs files are more versions of the f32 model
    (moeforge's own quantizers): deterministic, and their logits as close to the f32 file's
    as the q4_0 file's are (q5_K's closer than q4_K's)."""
    from conftest import kl_per_token
    paths = {t: str(tmp_path / f"{t}.gguf") for t in ("f32", "q4_0", "q4_K", "q5_K", "iq4_xs")}
    for t, p in paths.items():
        write_qwen3moe(p, preset("tiny-k"), t, source="float", seed=11)
    again = str(tmp_path / "again.gguf")
    write_qwen3moe(again, preset("tiny-k"), "q4_K", source="float", seed=11)
    assert open(again, "rb").read() == open(paths["q4_K"], "rb").read()
    toks = np.arange(1, 33) * 13 % 512
    lg = {t: load_model(p, backend="numpy").logits(toks) for t, p in paths.items()}
    kl_k, kl_0, kl_5, kl_i = (kl_per_token(lg["f32"], lg[t]).mean() for t in ("q4_K", "q4_0", "q5_K", "iq4_xs"))
    print(f"mean KL to f32: q4_K {kl_k:.2e}, q4_0 {kl_0:.2e}, q5_K {kl_5:.2e}, iq4_xs {kl_i:.2e}")
    assert 0 < kl_k < 2 * kl_0 and 0 < kl_5 < kl_k and 0 < kl_i < 2 * kl_0


# 16 layers of 32 experts, top-4: deep enough for random layers' shared component to take
# the routers over (it did at every depth before synth's write gain and signed scales)
DEEP = dict(n_vocab=2048, n_embd=256, n_layer=16, n_head=4, n_head_kv=2, head_dim=64, n_ff_exp=64, n_expert=32,
            n_expert_used=4, n_ctx=1024, rope_base=1e6, n_ff=512)


@pytest.mark.parametrize("qtype", ["q4_0", "q8_0"])
def test_block_source_routes_like_a_trained_model_at_every_depth(tmp_path, qtype):
    """A synthetic prompt's expert loads stay near the mean in every layer (a trained router
    keeps them so): no expert idle, none past 2.5x the mean. Random blocks with positive
    scales (a biased mean summed over k) and random layers' writes as large as the token's
    embedding sent every token to the same experts, and the GPU benchmarks timed a few
    dense products where a model runs many small ones (DESIGN-NOTES "Synthetic models'
    routing")."""
    from moeforge.synth import SynthSpec, write_model
    path = str(tmp_path / "deep.gguf")
    write_model(path, SynthSpec(**DEEP), qtype, seed=4)
    m = load_model(path, backend="numpy", n_ctx=520)
    for layer, c in enumerate(expert_loads(m, np.random.default_rng(0).integers(0, m.hp.n_vocab, size=512))):
        assert c.min() > 0 and c.max() < 2.5 * c.mean(), (layer, np.sort(c)[::-1].tolist())


@pytest.mark.parametrize("qtype", ["q4_0", "q8_0", "q2_K", "q3_K", "q4_K", "q5_K", "q6_K", "iq4_xs", "mxfp4", "f16"])
def test_block_pools_are_zero_mean_at_the_scale_asked(qtype):
    """Each pool block's f16 scales have random signs (positive ones alone make q4_0's
    weights average -d/2), and the pool is scaled to the tensor's RMS: the
    embedding's unit, a matrix's 1/sqrt(k), the writes' WRITE_GAIN times that (mxfp4's
    power-of-two scales: within a factor of sqrt(2))."""
    from moeforge import reference as ref
    from moeforge.codegen.quant import QUANT_TYPES
    from moeforge.synth import _BlockPool, _Weights

    def values(pool):
        if qtype == "f16":
            return pool.pool.view(np.float16).astype(np.float64)
        q = QUANT_TYPES[qtype]
        n = 8192
        return ref.dequantize(pool.pool[:n * q.block_bytes].reshape(1, -1), qtype, (1, n * q.block_values)).ravel()

    w = _Weights(None, 0, False)
    want = {"token_embd.weight": 1.0, "blk.0.ffn_up_exps.weight": 2048 ** -0.5,
            "blk.0.ffn_down_exps.weight": w.WRITE_GAIN * 768 ** -0.5}
    for name, shape in (("blk.0.ffn_up_exps.weight", (8, 768, 2048)), ("token_embd.weight", (512, 2048)),
                        ("blk.0.ffn_down_exps.weight", (8, 2048, 768))):
        rms = w.pool_rms(name, shape)
        assert rms == pytest.approx(want[name])
        v = values(_BlockPool(qtype, np.random.default_rng(1), rms))
        got = np.sqrt(np.mean(v ** 2))
        assert abs(v.mean()) < 0.03 * got, (name, v.mean(), got)
        assert abs(np.log(got / rms)) < (np.log(2) / 2 if qtype == "mxfp4" else 0.05), (name, got, rms)
