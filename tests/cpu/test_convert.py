"""GGUF types without kernels (q6_K, ...) converted to q8_0 as they load (runtime/convert.py),
and the q6_K quantizer that writes them (runtime/quantize.py)."""
import warnings

import numpy as np
import pytest

from conftest import kquant_blocks
from moeforge.runtime import convert
from moeforge.runtime.quantize import quantize_q6_k


def _dequantize(raw, name, k):
    import gguf
    from gguf import quants
    return quants.dequantize(raw, getattr(gguf.GGMLQuantizationType, name.upper())).reshape(-1, k)


def test_q6_k_blocks_are_ggmls_layout(rng):
    """gguf's dequantizer reads the quantizer's blocks back within half a step of each
    16-weight group (d * scale / 2): a wrong nibble or high-bit order would be off by far
    more."""
    x = (rng.standard_normal((5, 512)) * rng.uniform(0.01, 2.0)).astype(np.float32)
    x[0, :16] = 0.0                                   # a group with nothing in it
    raw = quantize_q6_k(x)
    assert raw.shape == (5, 2 * 210) and raw.dtype == np.uint8
    w = _dequantize(raw, "q6_K", 512)
    blocks = raw.reshape(5, 2, 210)
    d = blocks[..., 208:210].copy().view(np.float16)[..., 0].astype(np.float64)     # (5, 2)
    sc = blocks[..., 192:208].copy().view(np.int8).astype(np.float64)               # (5, 2, 16)
    half_step = np.repeat((np.abs(d[..., None] * sc) / 2).reshape(5, 32), 16, axis=1)
    assert (np.abs(w - x) <= half_step * (1 + 1e-3) + 1e-12).all()
    assert (w[0, :16] == 0).all()
    assert ((w - x) ** 2).mean() / (x ** 2).mean() < 1e-3


@pytest.mark.parametrize("name", ["q6_K", "q5_0"])
def test_conversion_moves_a_weight_by_half_a_q8_0_step_at_most(rng, name, monkeypatch):
    from gguf import GGMLQuantizationType, quants
    k = 512
    x = (rng.standard_normal((37, k)) * 0.05).astype(np.float32)
    raw = quantize_q6_k(x) if name == "q6_K" else quants.quantize(x, GGMLQuantizationType.Q5_0)
    src = _dequantize(raw, name, k)
    out = convert.to_q8_0(raw, name, k)
    assert out.shape == (37, k // 32 * 34)
    # bit for bit gguf's own entry points (which the converter bypasses for speed)
    np.testing.assert_array_equal(out, quants.quantize(src, GGMLQuantizationType.Q8_0))
    got = _dequantize(out, "q8_0", k)
    # q = round(x / d) with d = amax / 127 in float32, then d stored as f16 (ggml's reference)
    amax = np.abs(src.reshape(37, -1, 32)).max(-1).astype(np.float64)
    d_exact = amax / 127
    d16 = (amax.astype(np.float32) / np.float32(127)).astype(np.float16).astype(np.float64)
    bound = d_exact / 2 + 127 * np.abs(d16 - d_exact) + 1e-9
    assert (np.abs(got - src).reshape(37, -1, 32) <= bound[..., None] * (1 + 1e-6)).all()
    # the chunked, threaded path writes the same bytes as one chunk
    monkeypatch.setattr(convert, "CHUNK_WEIGHTS", 3 * k)
    np.testing.assert_array_equal(convert.to_q8_0(raw, name, k, threads=3), out)


@pytest.mark.parametrize("name", sorted(convert.DEVICE_DEQUANTIZE))
def test_array_op_converters_are_ggufs_bit_for_bit(rng, name):
    """The K-quant dequantizers and the q8_0 quantizer written for numpy or CuPy (the
    device-side conversion, runtime/array_blocks.py) give gguf's own bits on the host;
    tests/gpu/test_upload.py checks the device gives the host's."""
    import gguf
    from gguf import quants
    from moeforge.runtime import array_blocks
    raw = kquant_blocks(rng, name, 300)
    w = convert.DEVICE_DEQUANTIZE[name](raw)
    want = getattr(quants, name.upper()).dequantize_blocks(raw)
    assert w.dtype == np.float32 and w.shape == (304, 256)
    assert np.array_equal(w.view(np.uint32), want.view(np.uint32))
    assert (w[-4:] == 0).all() and np.abs(w[:-4]).max() > 0
    w = w.reshape(-1, 32)
    np.testing.assert_array_equal(array_blocks.quantize_q8_0(w), quants.Q8_0.quantize_blocks(w))
    assert name in convert.FOREIGN + convert.CONVERTIBLE
    assert convert.block_size(name) == gguf.GGML_QUANT_SIZES[convert.ggml_type(name)]


@pytest.mark.parametrize("name", convert.FOREIGN)
def test_every_listed_type_converts(rng, name):
    """gguf's dequantizer knows every type the loader promises to convert."""
    values, nbytes = convert.block_size(name)
    k = 2 * max(values, 32)
    raw = rng.integers(0, 256, size=(3, k // values * nbytes), dtype=np.uint8)
    with np.errstate(all="ignore"):        # random bytes make some f16 scales inf or nan
        out = convert.to_q8_0(raw, name, k)
    assert out.shape == (3, k // 32 * 34)


def test_q3_k_m_plan_is_llama_cpps_and_loads_as_it_is(tmp_path, monkeypatch):
    """llama.cpp's Q3_K_M on an MoE of 128 experts (llama-quant.cpp): attn_v q5_K in the first
    two layers and q4_K after, attn_output q4_K, ffn_down q5_K in the first sixteenth and
    q4_K after, the head q6_K, everything else q3_K; every tensor loads as it is, and q3_K
    converts to q8_0 only when MOEFORGE_CONVERT asks."""
    from moeforge.runtime.arch_qwen3moe import open_model
    from moeforge.runtime.gguf_file import GGUFFile
    from moeforge.runtime.model import load_model
    from moeforge.synth import preset, tensor_plan, write_qwen3moe
    types = {name: t for name, _, t in tensor_plan(preset("qwen3-30b-a3b"), "q3_K_M")}
    assert [types[f"blk.{i}.attn_v.weight"] for i in (0, 1, 2, 47)] == ["q5_K", "q5_K", "q4_K", "q4_K"]
    assert [types[f"blk.{i}.ffn_down_exps.weight"] for i in (0, 2, 3, 47)] == ["q5_K", "q5_K", "q4_K", "q4_K"]
    assert {types[f"blk.{i}.attn_output.weight"] for i in range(48)} == {"q4_K"}
    assert types["output.weight"] == "q6_K" and types["token_embd.weight"] == "q3_K"
    assert {types[f"blk.5.{t}.weight"] for t in ("attn_q", "attn_k", "ffn_gate_exps", "ffn_up_exps")} == {"q3_K"}
    path = str(tmp_path / "m.gguf")
    write_qwen3moe(path, preset("tiny-k"), "q3_K_M", seed=3)
    f = GGUFFile(path)
    assert convert.note(f) is None and open_model(f).layers[1].wq.qtype == "q3_K"
    native = load_model(path, backend="numpy").logits([1, 2, 3])
    monkeypatch.setenv("MOEFORGE_CONVERT", "q3_K")
    refs = open_model(f)
    assert refs.layers[1].wq.qtype == "q8_0" and refs.tok_embd.qtype == "q8_0"
    want = _dequantize(f.tensors["blk.1.attn_q.weight"].load(), "q3_K", 256)
    got = _dequantize(refs.layers[1].wq.load(), "q8_0", 256)
    assert np.abs(got - want).max() <= np.abs(want).max() / 127
    with pytest.warns(UserWarning, match=r"9 q3_K tensors .* run as q8_0, converted as they load \(MOEFORGE_CONVERT"):
        converted = load_model(path, backend="numpy").logits([1, 2, 3])
    assert 0 < np.abs(converted - native).max() < 0.05 * np.abs(native).max()


def test_q2_k_mix_plan_is_llama_cpps_and_loads_as_it_is(tmp_path):
    """llama.cpp's Q2_K on Qwen3-30B-A3B (8 query heads a key head): attn_v q4_K, attn_output
    and ffn_down q3_K, the head q6_K, everything else q2_K; every tensor loads as it is and
    the numpy backend runs it."""
    from moeforge.runtime.gguf_file import GGUFFile
    from moeforge.runtime.model import load_model
    from moeforge.synth import preset, tensor_plan, write_qwen3moe
    types = {name: t for name, _, t in tensor_plan(preset("qwen3-30b-a3b"), "q2_K_mix")}
    assert {types[f"blk.{i}.attn_v.weight"] for i in range(48)} == {"q4_K"}
    assert {types[f"blk.{i}.{t}.weight"] for i in range(48) for t in ("attn_output", "ffn_down_exps")} == {"q3_K"}
    assert types["output.weight"] == "q6_K" and types["token_embd.weight"] == "q2_K"
    assert {types[f"blk.7.{t}.weight"] for t in ("attn_q", "attn_k", "ffn_gate_exps", "ffn_up_exps")} == {"q2_K"}
    path = str(tmp_path / "m.gguf")
    write_qwen3moe(path, preset("tiny-k"), "q2_K_mix", seed=4)
    f = GGUFFile(path)
    assert convert.note(f) is None
    assert np.isfinite(load_model(path, backend="numpy").logits([1, 2, 3])).all()


@pytest.mark.parametrize("mix, base", [("q4_K_M", "q4_K"), ("q5_K_M", "q5_K")])
def test_a_k_m_file_loads_its_tensors_as_they_are_or_as_q8_0_on_request(tmp_path, monkeypatch, mix, base):
    from moeforge.runtime.arch_qwen3moe import open_model
    from moeforge.runtime.gguf_file import GGUFFile
    from moeforge.runtime.model import load_model
    from moeforge.synth import preset, tensor_plan, write_qwen3moe
    path = str(tmp_path / "m.gguf")
    write_qwen3moe(path, preset("tiny-k"), mix, seed=3)
    f = GGUFFile(path)
    q6 = sorted(n for n, t in f.tensors.items() if t.qtype == "q6_K")
    # llama.cpp's K_M mixes on two layers: layer 1 (the last eighth) gets the extra bits
    assert q6 == ["blk.1.attn_v.weight", "blk.1.ffn_down_exps.weight", "output.weight"]
    assert {t for _, _, t in tensor_plan(preset("tiny-k"), mix)} == {"f32", base, "q6_K"}
    refs = open_model(f)
    assert refs.output.qtype == "q6_K" and refs.layers[1].wv.qtype == "q6_K" and refs.layers[0].wv.qtype == base
    assert convert.note(f) is None
    m = load_model(path, backend="numpy")
    native = m.logits([1, 2, 3])
    # MOEFORGE_CONVERT=q6_K: the kernels' q8_0 in its place (to compare), said as it loads
    monkeypatch.setenv("MOEFORGE_CONVERT", "q6_K")
    refs = open_model(f)
    assert refs.output.qtype == "q8_0" and refs.layers[1].wv.qtype == "q8_0" and refs.layers[0].wv.qtype == base
    want = _dequantize(f.tensors["output.weight"].load(), "q6_K", 256)
    got = _dequantize(refs.output.load(), "q8_0", 256)
    assert np.abs(got - want).max() <= np.abs(want).max() / 127     # half a step, with room for f16's d
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        m = load_model(path, backend="numpy")
    assert any("3 q6_K tensors" in str(w.message) and "q8_0" in str(w.message) for w in caught)
    assert m.n_bytes == sum(t.nbytes for t in f.tensors.values())
    assert f.tensors["output.weight"].nbytes == 512 * 210          # the file's bytes, not q8_0's
    converted = m.logits([1, 2, 3])
    assert np.isfinite(converted).all() and np.isfinite(native).all()
    assert 0 < np.abs(converted - native).max() < 0.05 * np.abs(native).max()
    if base == "q5_K":   # q5_K converts on request too
        monkeypatch.setenv("MOEFORGE_CONVERT", "q5_K,q6_K")
        refs = open_model(f)
        assert refs.layers[0].wv.qtype == refs.layers[0].down.qtype == refs.output.qtype == "q8_0"
        want = _dequantize(f.tensors["blk.0.attn_v.weight"].load(), "q5_K", 256)
        got = _dequantize(refs.layers[0].wv.load(), "q8_0", 256)
        assert np.abs(got - want).max() <= np.abs(want).max() / 127
    monkeypatch.setenv("MOEFORGE_CONVERT", "q4_K")
    with pytest.raises(ValueError, match="MOEFORGE_CONVERT: q4_K cannot be converted"):
        open_model(f)


def test_more_bits_follows_llama_cpp():
    from moeforge.synth import more_bits
    # 48 layers (Qwen3-30B-A3B): the first and last six, and 8, 11, ..., 41
    want = set(range(6)) | set(range(42, 48)) | set(range(8, 42, 3))
    assert {i for i in range(48) if more_bits(i, 48)} == want


def test_a_row_that_is_not_whole_blocks_is_refused():
    """A q6_K row of 128 weights (half a super-block) is named before anything loads."""
    from types import SimpleNamespace
    from moeforge.runtime.gguf_file import Expect, GGUFError, TensorRef, check_tensors
    f = SimpleNamespace(path="bad.gguf", architecture="qwen3moe",
                        tensors={"x.weight": TensorRef("x.weight", "q6_K", (4, 128), lambda: None)})
    with pytest.raises(GGUFError, match="x.weight.*row length 128.*q6_K"):
        check_tensors(f, {"x.weight": Expect((4, 128))})
