"""GGUF loading: validation before any upload, clear errors, gate/up merging."""
import numpy as np
import pytest

from conftest import rewrite  # noqa: F401 (the other tests import it from here too)
from moeforge.runtime.gguf_file import GGUFError, GGUFFile
from moeforge.runtime.model import load_model
from moeforge.synth import preset, write_qwen3moe


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny") / "tiny-q4_0.gguf")
    write_qwen3moe(path, preset("tiny"), "q4_0", source="float", seed=3)
    return path


def test_loads_and_runs(tiny):
    m = load_model(tiny, backend="numpy")
    assert m.hp.n_layer == 2 and m.hp.n_expert == 8 and m.hp.n_vocab == 512
    assert m.logits([1, 2, 3]).shape == (3, 512)


def test_rewrite_is_faithful(tiny, tmp_path):
    same = rewrite(tiny, str(tmp_path / "same.gguf"))
    toks = [5, 6, 7, 8]
    np.testing.assert_array_equal(load_model(same, backend="numpy").logits(toks),
                                  load_model(tiny, backend="numpy").logits(toks))


def test_missing_tensor(tiny, tmp_path):
    bad = rewrite(tiny, str(tmp_path / "bad.gguf"),
                  tensors=lambda n, a, t: [] if n == "blk.1.attn_k_norm.weight" else [(n, a, t)])
    with pytest.raises(GGUFError, match=r"'blk.1.attn_k_norm.weight' is missing"):
        load_model(bad, backend="numpy")


def test_wrong_shape(tiny, tmp_path):
    bad = rewrite(tiny, str(tmp_path / "bad.gguf"),
                  tensors=lambda n, a, t: [(n, a[:-1], t)] if n == "blk.0.ffn_norm.weight" else [(n, a, t)])
    with pytest.raises(GGUFError, match=r"'blk.0.ffn_norm.weight' has shape \(127,\), expected \(128,\)"):
        load_model(bad, backend="numpy")


def test_wrong_type(tiny, tmp_path):
    import gguf
    f16 = lambda n, a, t: [(n, a.astype(np.float16), gguf.GGMLQuantizationType.F16)] \
        if n == "blk.0.attn_norm.weight" else [(n, a, t)]  # noqa: E731
    bad = rewrite(tiny, str(tmp_path / "bad.gguf"), tensors=f16)
    with pytest.raises(GGUFError, match=r"'blk.0.attn_norm.weight' is f16, expected one of f32"):
        load_model(bad, backend="numpy")


def test_unexpected_tensor(tiny, tmp_path):
    extra = lambda n, a, t: [(n, a, t)] + ([("blk.0.ffn_gate_shexp.weight", a, t)] \
        if n == "blk.0.ffn_norm.weight" else [])  # noqa: E731
    bad = rewrite(tiny, str(tmp_path / "bad.gguf"), tensors=extra)
    with pytest.raises(GGUFError, match="unexpected tensors.*ffn_gate_shexp"):
        load_model(bad, backend="numpy")


def test_missing_and_bad_metadata(tiny, tmp_path):
    bad = rewrite(tiny, str(tmp_path / "a.gguf"),
                  kv=lambda k, v, t: None if k == "qwen3moe.expert_used_count" else v)
    with pytest.raises(GGUFError, match="qwen3moe.expert_used_count' is missing"):
        load_model(bad, backend="numpy")
    bad = rewrite(tiny, str(tmp_path / "b.gguf"),
                  kv=lambda k, v, t: 16 if k == "qwen3moe.expert_used_count" else v)
    with pytest.raises(GGUFError, match="expert_used_count \\(16\\) exceeds expert_count \\(8\\)"):
        load_model(bad, backend="numpy")


def test_wrong_architecture(tiny, tmp_path):
    import gguf
    w = gguf.GGUFWriter(str(tmp_path / "x.gguf"), arch="mamba")
    w.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(GGUFError, match="architecture 'mamba' is not supported"):
        load_model(str(tmp_path / "x.gguf"), backend="numpy")


@pytest.mark.parametrize("cut", [10, 3000, -100])
def test_truncated_file(tiny, tmp_path, cut):
    data = open(tiny, "rb").read()
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(data[:cut])
    with pytest.raises(GGUFError, match="truncated"):
        load_model(str(bad), backend="numpy")


def test_not_a_gguf(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"hello world, this is not a model" * 10)
    with pytest.raises(GGUFError, match="not a GGUF file"):
        load_model(str(bad), backend="numpy")
    with pytest.raises(GGUFError, match="no such file"):
        load_model(str(tmp_path / "absent.gguf"), backend="numpy")


def test_bad_backend_and_tokens(tiny):
    with pytest.raises(ValueError, match="backend must be one of"):
        load_model(tiny, backend="metal")
    m = load_model(tiny, backend="numpy")
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 512\)"):
        m.logits([1, 512])


def test_gate_up_merge_bytes(tiny):
    """Merged rows per expert: the gate's rows, then the up's, bytes unchanged."""
    from moeforge.runtime.arch_qwen3moe import open_model
    f = GGUFFile(tiny)
    refs = open_model(f)
    L = refs.layers[1]
    gate, up = f.tensors["blk.1.ffn_gate_exps.weight"], f.tensors["blk.1.ffn_up_exps.weight"]
    E, ff, k = gate.shape
    merged = L.gate_up.load().reshape(E, 2 * ff, -1)
    assert L.gate_up.shape == (E, 2 * ff, k) and L.gate_up.qtype == "q4_0"
    np.testing.assert_array_equal(merged[:, :ff], gate.load().reshape(E, ff, -1))
    np.testing.assert_array_equal(merged[:, ff:], up.load().reshape(E, ff, -1))


def test_file_with_gate_up_exps_used_as_is(tiny, tmp_path):
    """A file that already holds ffn_gate_up_exps loads, and computes what the separate
    tensors compute."""
    def merge(n, a, t):
        if n.endswith("ffn_gate_exps.weight"):
            merge.gate = a
            return []
        if n.endswith("ffn_up_exps.weight"):
            return [(n.replace("ffn_up_exps", "ffn_gate_up_exps"), np.concatenate([merge.gate, a], axis=1), t)]
        return [(n, a, t)]
    merged = rewrite(tiny, str(tmp_path / "merged.gguf"), tensors=merge)
    f = GGUFFile(merged)
    assert "blk.0.ffn_gate_up_exps.weight" in f.tensors and "blk.0.ffn_gate_exps.weight" not in f.tensors
    toks = [3, 1, 4, 1, 5, 9, 2, 6]
    np.testing.assert_array_equal(load_model(merged, backend="numpy").logits(toks),
                                  load_model(tiny, backend="numpy").logits(toks))


def test_mixed_gate_up_types_stay_separate(tiny, tmp_path):
    import gguf
    from gguf import quants

    def requant(n, a, t):
        if n == "blk.0.ffn_up_exps.weight":
            w = quants.dequantize(a, t)
            return [(n, quants.quantize(w.reshape(-1, w.shape[-1]), gguf.GGMLQuantizationType.Q8_0).reshape(
                *w.shape[:-1], -1), gguf.GGMLQuantizationType.Q8_0)]
        return [(n, a, t)]
    mixed = rewrite(tiny, str(tmp_path / "mixed.gguf"), tensors=requant)
    m = load_model(mixed, backend="numpy")
    assert m.weights.layers[0].gate_up is None and m.weights.layers[0].up.qtype == "q8_0"
    assert m.weights.layers[1].gate_up is not None
    assert np.isfinite(m.logits([1, 2, 3])).all()


def test_prompt_attention_precision(tiny):
    """The numpy backend's kernel numerics follow the GPU's prompt attention: f16 tensor cores
    by default where the attention weights are quantized, tf32 or float32 on request; the
    three differ, and a precision that does not exist is refused before anything loads."""
    toks = list(range(3, 40))
    got = {}
    for prec in (None, "f16", "tf32", "f32"):
        m = load_model(tiny, backend="numpy", numerics="kernel", attn_precision=prec)
        assert m.backend.attn_precision == (prec or "f16")
        assert m.backend.attn_tc == (None if prec == "f32" else prec or "f16")
        got[prec] = m.logits(toks)
    np.testing.assert_array_equal(got[None], got["f16"])
    assert not np.array_equal(got["f16"], got["tf32"]) and not np.array_equal(got["f16"], got["f32"])
    # the activations' q8_1 rounding amplifies any difference to ~1% of the logits (as far as
    # kernel numerics are from float ones); a broken emulation is far past that
    rel = np.sqrt(((got["f16"] - got["f32"]) ** 2).mean() / (got["f32"] ** 2).mean())
    assert rel < 5e-2, rel
    assert load_model(tiny, backend="numpy").backend.attn_tc is None      # float numerics: float64
    with pytest.raises(ValueError, match="attn_precision must be one of"):
        load_model(tiny, backend="numpy", attn_precision="bf16")


def test_f16_cache_on_the_numpy_backend(tiny):
    """An f16 KV cache holds half the bytes, each value numpy's float16 of the float32
    cache's (nearest even): the logits move a little (they must move: the rounding happened)
    and keep every top-1 token; it takes f16 attention and refuses anything else."""
    toks = list(range(3, 40))
    runs = {}
    for cache_type in ("f32", "f16"):
        m = load_model(tiny, backend="numpy", cache_type=cache_type)
        runs[cache_type] = (m.logits(toks), m.cache)
        assert m.backend.attn_precision == "f16" and f"{cache_type} KV cache" in m.describe()
    (l32, c32), (l16, c16) = runs["f32"], runs["f16"]
    assert c16.dtype == np.float16 and c16.nbytes * 2 == c32.nbytes
    n = len(toks)
    # the first layer's rows (later layers' inputs already differ by the rounding)
    np.testing.assert_array_equal(c16.k[0][:n], c32.k[0][:n].astype(np.float16))
    np.testing.assert_array_equal(c16.v[0][:n], c32.v[0][:n].astype(np.float16))
    assert not np.array_equal(l16, l32)
    assert (l16.argmax(-1) == l32.argmax(-1)).all()
    rel = np.abs(l16 - l32).max() / np.abs(l32).max()
    assert rel < 1e-2, rel
    with pytest.raises(ValueError, match="attn_precision must be f16"):
        load_model(tiny, backend="numpy", cache_type="f16", attn_precision="f32")
    with pytest.raises(ValueError, match="cache_type must be one of"):
        load_model(tiny, backend="numpy", cache_type="q8_0")
