"""Sliding-window layers' KV rings on the GPU (runtime.ring_memory, pytest -m gpu): the
memory repeats as promised, and a model whose sliding layers keep rings computes bit for
bit what the same model keeping every position does, through prompt passes and decode
steps well past the ring, on both cache types, and keeps or drops a prefix as the ring
allows."""
import numpy as np
import pytest

from moeforge.runtime.model import load_model
from moeforge.synth import preset, write_model

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def tiny_oss(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("ring") / "tiny-oss-q8_0.gguf")
    write_model(path, preset("tiny-oss"), "q8_0", seed=3)
    return path


@pytest.mark.parametrize("dtype,kv_dim", [(np.float32, 512), (np.float16, 640)])
def test_ring_rows_repeat(dtype, kv_dim, rng):
    import cupy as cp
    from moeforge.runtime import ring_memory
    from moeforge.runtime.kv_cache import ring_rows
    item = np.dtype(dtype).itemsize
    rows = ring_rows(128, 512, kv_dim * item, ring_memory.granularity(cp.cuda.Device().id))
    n_ctx = 3 * rows + 77                                          # a partial last repeat
    a = ring_memory.ring_array(cp, rows, n_ctx, kv_dim, dtype)
    assert a.shape == (n_ctx, kv_dim) and not cp.any(a[:rows])     # zeroed
    x = rng.standard_normal((rows, kv_dim)).astype(dtype)
    a[2 * rows:3 * rows] = cp.asarray(x)                           # written through the third repeat
    got = a.get()
    for r in range(3):
        np.testing.assert_array_equal(got[r * rows:(r + 1) * rows], x)
    np.testing.assert_array_equal(got[3 * rows:], x[:77])
    del a                                                          # unmapped; the device goes on
    cp.cuda.Device().synchronize()


@pytest.mark.parametrize("cache_type", ["f32", "f16"])
def test_ring_model_is_the_full_cache_model(tiny_oss, cache_type, rng):
    import cupy as cp
    from moeforge.runtime import ring_memory
    from moeforge.runtime.kv_cache import CACHE_TYPES, ring_rows
    hp_oss = preset("tiny-oss")
    row_bytes = hp_oss.n_head_kv * hp_oss.head_dim * np.dtype(CACHE_TYPES[cache_type]).itemsize
    rows = ring_rows(hp_oss.n_swa, 512, row_bytes, ring_memory.granularity(cp.cuda.Device().id))
    n_ctx = rows + 1200
    ring = load_model(tiny_oss, n_ctx=n_ctx, n_ubatch=512, cache_type=cache_type)
    full = load_model(tiny_oss, n_ctx=n_ctx, n_ubatch=512, cache_type=cache_type, swa_full=True)
    assert ring.cache.rows[0] == rows and ring.cache.rings == 2 and full.cache.rings == 0 and ring.cache.nbytes < full.cache.nbytes
    toks = rng.integers(0, preset("tiny-oss").n_vocab, size=rows + 1000)
    got = {}
    for name, m in (("ring", ring), ("full", full)):
        prompt = m.eval(toks[:-40])
        steps = [m.eval([int(t)]) for t in toks[-40:]]
        got[name] = np.concatenate([prompt, *steps])
    assert np.isfinite(got["ring"]).all()
    np.testing.assert_array_equal(got["ring"], got["full"])
    # a new turn that departs 100 positions back keeps its prefix: the same 7 tokens' pass
    turn = np.concatenate([toks[:-100], rng.integers(0, 512, size=7)])
    np.testing.assert_array_equal(ring._prefill(turn, 0), full._prefill(turn, 0))
    assert ring.n_past == full.n_past == len(turn)
    # one that departs at 300, long out of the ring, cannot: it is evaluated from the start,
    # as into an empty context (the full cache's prefix would give it another pass structure)
    turn = np.concatenate([toks[:300], rng.integers(0, 512, size=7)])
    got = ring._prefill(turn, 0)
    full.reset()
    np.testing.assert_array_equal(got, full._prefill(turn, 0))
