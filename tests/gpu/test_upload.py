"""Weights reach the device as GGUF bytes and are split (and merged, and converted) there:
the result is bit for bit the host's split (runtime.tensor.split_blocks on numpy), padding
included, for every quant type; a model's merged gate/up and stacked q/k/v equal the host's
merges; the K-quants of llama.cpp's mixes convert to the host's q8_0 bytes (pytest -m gpu)."""
import numpy as np
import pytest

from moeforge import reference as ref
from moeforge.codegen.quant import QUANT_TYPES, quant_type
from moeforge.runtime.block_split import split_blocks
from moeforge.runtime.tensor import QuantTensor

pytestmark = pytest.mark.gpu


def _host_image(raw, q, rows, k):
    """The buffer from_blocks must build, made on the host."""
    qs, meta = split_blocks(raw, q, rows, k)
    off = QuantTensor._meta_offset(rows, q.blocks_per_row(k), q)
    img = np.zeros(off + meta.size, dtype=np.uint8)
    img[:qs.size] = qs.reshape(-1)
    img[off:] = meta.reshape(-1)
    return img


@pytest.mark.parametrize("name", list(QUANT_TYPES))
@pytest.mark.parametrize("shape", [(7, 1), (3, 5, 33), (2, 64, 90)])   # (E,) m, blocks a row
def test_device_split_is_the_host_split(rng, name, shape):
    import cupy as cp
    q = quant_type(name)
    *lead, blocks = shape
    k = blocks * q.block_values
    rows = int(np.prod(lead))
    raw = ref.random_blocks(name, rows, k, rng)
    want = _host_image(raw, q, rows, k)
    for src in (raw, cp.asarray(raw), raw.reshape(-1)):       # host, device, flat
        t = QuantTensor.from_blocks(src, q, (*lead, k))
        assert np.array_equal(t.buffer.get(), want)
        assert np.array_equal(t.to_blocks().reshape(rows, -1), raw)


def test_bad_bytes_are_refused_before_upload(rng):
    import cupy as cp
    raw = ref.random_blocks("q4_K", 4, 512, rng)
    with pytest.raises(ValueError, match="needs"):
        QuantTensor.from_blocks(raw[:, :-1], "q4_K", (4, 512))
    with pytest.raises(ValueError, match="uint8"):
        QuantTensor.from_blocks(cp.asarray(raw).view(cp.int8), "q4_K", (4, 512))


@pytest.mark.parametrize("qtype", ["q4_0", "q4_K"])
def test_model_merges_on_the_device_equal_the_host(tmp_path, qtype):
    import cupy as cp
    from moeforge.runtime.arch import merge_rows
    from moeforge.runtime.arch_qwen3moe import open_model
    from moeforge.runtime.gguf_file import GGUFFile
    from moeforge.synth import preset, write_qwen3moe
    path = str(tmp_path / f"tiny-{qtype}.gguf")
    write_qwen3moe(path, preset("tiny-k" if qtype == "q4_K" else "tiny"), qtype, seed=5)
    refs = open_model(GGUFFile(path))
    for L in refs.layers:
        qkv = merge_rows([L.wq, L.wk, L.wv], "qkv")
        for r in (L.gate_up, qkv):
            assert np.array_equal(r.load(cp).get(), r.load())


@pytest.mark.parametrize("name", ["q2_K", "q3_K", "q5_K", "q6_K", "iq4_xs"])
def test_k_quants_convert_on_the_device_to_the_hosts_bytes(rng, monkeypatch, name):
    import cupy as cp
    from conftest import kquant_blocks
    from moeforge.runtime import convert
    assert name in convert.DEVICE_DEQUANTIZE
    raw = kquant_blocks(rng, name, 4 * 3 - 4).reshape(4, -1)         # 4 rows of 3 super-blocks
    want = convert.to_q8_0(raw, name, 768)
    monkeypatch.setattr(convert, "DEVICE_CHUNK_BLOCKS", 5)           # several chunks, a short last one
    got = convert.to_q8_0_device(cp.asarray(raw), name, 768)
    assert isinstance(got, cp.ndarray) and np.array_equal(got.get(), want)


def test_q4_k_m_model_converts_on_the_device(tmp_path, monkeypatch):
    """MOEFORGE_CONVERT=q6_K (q6_K has kernels now): the conversion on the device."""
    import cupy as cp
    from moeforge.runtime.arch_qwen3moe import open_model
    from moeforge.runtime.gguf_file import GGUFFile
    from moeforge.synth import preset, write_qwen3moe
    path = str(tmp_path / "m.gguf")
    write_qwen3moe(path, preset("tiny-k"), "q4_K_M", seed=7)
    f = GGUFFile(path)
    monkeypatch.setenv("MOEFORGE_CONVERT", "q6_K")
    refs = open_model(f)
    names = [n for n, t in f.tensors.items() if t.qtype == "q6_K"]
    assert names and refs.output.qtype == "q8_0"
    for r in (refs.output, refs.layers[1].wv, refs.layers[1].down):
        assert np.array_equal(r.load(cp).get(), r.load())
