"""Weights reach the device as GGUF bytes and are split (and merged) there: the result is
bit for bit the host's split (runtime.tensor.split_blocks on numpy), padding included, for
every quant type, and a model's merged gate/up and stacked q/k/v equal the host's merges
(pytest -m gpu)."""
import numpy as np
import pytest

from moeforge import reference as ref
from moeforge.codegen.quant import QUANT_TYPES, quant_type
from moeforge.runtime.tensor import QuantTensor, split_blocks

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
    from moeforge.runtime.arch_qwen3moe import merge_rows, open_model
    from moeforge.runtime.gguf_file import GGUFFile
    from moeforge.synth import preset, write_qwen3moe
    path = str(tmp_path / f"tiny-{qtype}.gguf")
    write_qwen3moe(path, preset("tiny-k" if qtype == "q4_K" else "tiny"), qtype, seed=5)
    refs = open_model(GGUFFile(path))
    for L in refs.layers:
        qkv = merge_rows([L.wq, L.wk, L.wv], "qkv")
        for r in (L.gate_up, qkv):
            assert np.array_equal(r.load(cp).get(), r.load())
