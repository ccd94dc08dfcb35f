"""The CUDA model runtime (pytest -m gpu): llama.cpp parity on the fixtures, agreement
with the numpy backend that emulates the kernels, and the decode step as a CUDA graph."""
import warnings

import numpy as np
import pytest

from conftest import kl_per_token
from moeforge.runtime.model import load_model

pytestmark = pytest.mark.gpu

FIXTURES = ["f32", "f16", "q8_0", "q4_0", "q4_0-tied"]


@pytest.mark.parametrize("name", FIXTURES)
def test_cuda_matches_llama_cpp(parity_models, name):
    """The issue's bar: the same top-1 token at every position, mean KL per token < 1e-3."""
    fx = parity_models[name]
    got = load_model(fx["path"], backend="cuda").logits(fx["tokens"])
    assert got.shape == fx["logits"].shape and got.dtype == np.float32 and np.isfinite(got).all()
    top = got.argmax(-1) == fx["logits"].argmax(-1)
    assert top.all(), f"top-1 differs at positions {np.nonzero(~top)[0].tolist()}"
    kl = kl_per_token(fx["logits"], got)
    assert kl.mean() < 1e-3, f"mean KL {kl.mean():.2e} (max {kl.max():.2e})"
    if name == "f32":
        assert np.abs(got - fx["logits"]).max() < 1e-3


@pytest.mark.parametrize("name", FIXTURES)
def test_cuda_matches_numpy_kernel_emulation(parity_models, name):
    """The numpy backend with numerics="kernel" quantizes activations to q8_1 exactly as
    the kernels do: what remains is float32 accumulation order."""
    fx = parity_models[name]
    toks = fx["tokens"]
    got = load_model(fx["path"], backend="cuda").logits(toks)
    ref = load_model(fx["path"], backend="numpy", numerics="kernel").logits(toks)
    _close(got, ref, name)


def _close(got, ref, name):
    """Float weights: elementwise. Quantized: each layer re-quantizes its input to q8_1,
    so a last-bit difference in one product (another summation order) can move a value
    across a rounding boundary of the next layer's quantizer; such flips add up to ~1e-2
    in the logits. There the bar is the issue's: same top-1 everywhere, small KL."""
    if name in ("f32", "f16"):
        err = np.abs(got - ref).max() / np.abs(ref).max()
        assert err < 1e-3, f"max abs difference {err:.2e} relative to the largest logit"
        return
    top = got.argmax(-1) == ref.argmax(-1)
    assert top.all(), f"top-1 differs at positions {np.nonzero(~top)[0].tolist()}"
    kl = kl_per_token(ref, got)
    assert kl.mean() < 1e-4, f"mean KL {kl.mean():.2e}"


@pytest.mark.parametrize("name", ["q4_0", "f32"])
def test_decode_steps_match_prefill(parity_models, name):
    """Token by token (decode kernel, CUDA graph) == all at once (cuBLAS attention)."""
    fx = parity_models[name]
    toks = fx["tokens"][:40]
    m = load_model(fx["path"], backend="cuda")
    whole = m.logits(toks)
    m.reset(len(toks))
    with warnings.catch_warnings():
        warnings.simplefilter("error")      # a failed capture warns and falls back: fail here
        steps = np.concatenate([m.eval([t]) for t in toks])
    assert m.backend.use_graphs and m.backend._graph is not None, "the decode step was not captured"
    _close(steps, whole, name)


def test_graph_replay_equals_eager_decode(parity_models):
    fx = parity_models["q4_0"]
    toks = fx["tokens"][:24]
    outs = []
    for graphs in (True, False):
        m = load_model(fx["path"], backend="cuda")
        m.backend.use_graphs = graphs
        m.reset(len(toks))
        outs.append(np.concatenate([m.eval([t]) for t in toks]))
    np.testing.assert_array_equal(outs[0], outs[1])


def test_graph_recaptured_after_buffers_grow(parity_models):
    """A longer prompt reallocates buffers the captured graph used: decoding must still
    be right (the graph is captured again, never replayed on freed memory)."""
    fx = parity_models["q4_0"]
    toks = fx["tokens"]
    m = load_model(fx["path"], backend="cuda")
    ref = load_model(fx["path"], backend="numpy", numerics="kernel")
    m.reset(len(toks))
    m.eval(toks[:2])
    for t in toks[2:6]:
        m.eval([t])
    m.eval(toks[6:70])                   # grows every named buffer
    got = np.concatenate([m.eval([t]) for t in toks[70:]])
    want = ref.logits(toks)[70:]
    _close(got, want, "q4_0")


def test_generate_matches_numpy(parity_models):
    fx = parity_models["q8_0"]
    prompt = fx["tokens"][:10]
    assert load_model(fx["path"], backend="cuda").generate(prompt, 12) == \
        load_model(fx["path"], backend="numpy", numerics="kernel").generate(prompt, 12)


def test_separate_gate_up_on_gpu(parity_models):
    fx = parity_models["q4_0"]
    a = load_model(fx["path"], backend="cuda", merge_gate_up=True).logits(fx["tokens"][:32])
    b = load_model(fx["path"], backend="cuda", merge_gate_up=False).logits(fx["tokens"][:32])
    np.testing.assert_allclose(a, b, atol=1e-4 * np.abs(a).max(), rtol=0)


def test_full_width_layers_run(tmp_path):
    """Qwen3-30B-A3B's real widths (2 layers): prefill in ubatches, decode in a graph."""
    from moeforge.synth import preset, write_qwen3moe
    path = str(tmp_path / "wide.gguf")
    write_qwen3moe(path, preset("qwen3-30b-a3b", n_layer=2), "q4_0", skewed_router=True)
    m = load_model(path, backend="cuda", n_ctx=1100)
    toks = np.random.default_rng(0).integers(0, m.hp.n_vocab, size=1030)
    last = m.eval(toks, last_only=True)
    assert last.shape == (1, m.hp.n_vocab) and np.isfinite(last).all()
    steps = np.concatenate([m.eval([t]) for t in toks[:8]])
    assert np.isfinite(steps).all() and m.backend._graph is not None


def test_bench_command_runs(tmp_path, capsys):
    from moeforge.cli import main
    path = str(tmp_path / "t.gguf")
    assert main(["synth", "--preset", "tiny", "--type", "q4_0", path, "--quiet"]) == 0
    capsys.readouterr()
    assert main(["bench", path, "-p", "64", "-n", "16", "-r", "2"]) == 0
    out = capsys.readouterr().out
    assert "moeforge CUDA" in out and "pp64" in out and "tg16" in out
    assert main(["bench", path, "--sweep", "--ctx", "256", "--sweep-pp", "64", "--sweep-tg", "8"]) == 0
