"""Decode attention on tensor cores (attn_decode_gqa_tc_g*h*, attn_decode_gqa.cuh.j2) on the
GPU (pytest -m gpu): against the emulation of its own rounding points and tile layout
(decode_attention.emulate_tc) and against float64, at every group and width variant, tiles
partly before a window or past the current position, splits forced and chosen, sinks; its
own q/k norm, RoPE and KV store bit for bit the separate launch; an f16 cache the same bits
as a float32 cache holding the same rows."""
import numpy as np
import pytest
from conftest import attention64, attn_hparams, decode_cache_rows, decode_fused_is_separate, split_counters_ready

from moeforge.runtime import decode_attention
from moeforge.runtime.decode_attention import can_tc, emulate_tc

pytestmark = pytest.mark.gpu

HEADS = [
    (32, 4, 128),    # Qwen3-30B-A3B: groups of 8, 128 wide
    (64, 4, 128),    # Qwen3-235B-A22B: groups of 16 in two blocks of 8
    (64, 8, 64),     # gpt-oss: groups of 8, 64 wide
    (16, 2, 64),
    (6, 3, 80),      # groups of 2, the 128 variant with 48 dimensions past the head
    (8, 4, 32),      # the 64 variant with half a key row's loads past the head
    (48, 4, 128),    # groups of 12 in shares of 4
]
# 1, 2: a single tile, most positions masked; 16, 17: the current position first of a new
# tile; 700: more tiles than warps; 2000, 5000: several tiles a warp
N_KV = [1, 2, 15, 16, 17, 37, 129, 700, 2000]
SPLITS = [(n, None) for n in N_KV] + [(700, 1), (700, 3), (129, 2), (40, 5), (2000, 40), (5000, 128)]


def _setup(heads, n_kv, rng, cache_type="f32"):
    import cupy as cp

    from moeforge.runtime.backend_cuda import CudaBackend
    hp = attn_hparams(*heads)
    assert can_tc(hp)
    B = CudaBackend(hp, cache_type=cache_type)
    B.decode_attn_grouped, B.decode_attn_tc = True, True
    cache = B.new_cache(n_kv + 5)
    kc = rng.standard_normal((cache.n_ctx, hp.kv_dim)).astype(np.float32)
    vc = rng.standard_normal((cache.n_ctx, hp.kv_dim)).astype(np.float32)
    q = (2.0 * rng.standard_normal((1, hp.q_dim))).astype(np.float32)    # peaked rows too
    pos = cp.asarray(np.array([n_kv - 1], dtype=np.int32))
    return cp, hp, B, cache, kc, vc, q, pos


def _splits(B, hp, cache) -> int:
    return decode_attention.plan(hp, cache.n_ctx, B._device()["sm_count"], True, B.decode_attn_splits,
                                 B.cache_type, tc=True)[3]


def _nmse(got, want) -> float:
    return float(((got - want) ** 2).sum() / (want ** 2).sum())


def _check(cp, hp, B, cache, kc, vc, q, pos, n_kv, sinks=None, window=0):
    """Rows past the current position NaN (never read), rows before a window 1e4 (a tile
    partly before it reads and masks them), the output poisoned before each launch: the
    emulation as close as its rounding allows (_close_to_emulation), float64 within an NMSE
    of 1e-5 (f16's rounding gives ~1e-7), the same bits on a second launch (the other counter
    bank), every split counter ready for the next."""
    il = 1
    kc, vc = decode_cache_rows(kc, vc, n_kv, window, cache)
    extra = {} if sinks is None else {"sinks": cp.asarray(sinks)}
    runs = []
    with B.context():
        cache.k[il].set(kc)
        cache.v[il].set(vc)
        for _ in range(2):
            B.ws("attn", (1, hp.q_dim)).fill(cp.nan)
            runs.append(B.attention(cache, il, cp.asarray(q), pos, n_kv - 1, 1, "attn", window=window, **extra).get())
    got = runs[0]
    k32, v32 = kc.astype(np.float32), vc.astype(np.float32)
    emul = emulate_tc(q, k32, v32, hp, n_kv - 1, _splits(B, hp, cache), sinks=sinks, window=window)
    exact = attention64(q.astype(np.float64), k32.astype(np.float64), v32.astype(np.float64),
                        np.array([n_kv - 1]), hp, sinks=sinks, window=window)
    assert np.isfinite(got).all()
    np.testing.assert_array_equal(got, runs[1])
    assert split_counters_ready(B, hp)
    _close_to_emulation(got, emul, v32[max(0, n_kv - window) if window else 0:n_kv])
    assert _nmse(got, exact) < 1e-5, f"float64: NMSE {_nmse(got, exact):.2e}"
    return got


def _close_to_emulation(got, emul, v):
    """Not bit for bit: a probability within float32 noise of an f16 rounding boundary (the
    kernel's S sums in another order, its exp2 is float32's) can round the other way,
    moving its head's output by 2^-11 of that probability times v. So typical elements at
    float32 noise and none off by more than a few such flips (the prompt kernels' bars)."""
    err = np.abs(got - emul)
    median = np.median(err) / max(1.0, np.abs(emul).max())
    assert median < 1e-6, f"median error {median:.2e} (relative) against the emulation"
    assert err.max() < 2.0 ** -9 * np.abs(v).max(), f"max abs error {err.max():.2e} against the emulation"


@pytest.mark.parametrize("heads,n_kv,splits", [(h, n, s) for h in HEADS for n, s in SPLITS])
def test_tc_decode_matches_its_emulation_and_float64(heads, n_kv, splits, rng):
    cp, hp, B, cache, kc, vc, q, pos = _setup(heads, n_kv, rng)
    B.decode_attn_splits = splits
    _check(cp, hp, B, cache, kc, vc, q, pos, n_kv)


@pytest.mark.parametrize("heads", [(64, 8, 64), (32, 4, 128), (64, 4, 128)])
@pytest.mark.parametrize("n_kv,window,splits", [
    (1, 0, None), (700, 0, None), (700, 0, 3), (2000, 0, 40),
    (100, 128, None), (129, 128, None), (700, 128, None), (700, 128, 3), (2001, 128, 2), (2001, 100, None)])
def test_tc_decode_sinks_and_window(heads, n_kv, window, splits, rng):
    """gpt-oss's attention: a sink logit per head (some far above the scores, some far
    below) and sliding windows starting inside a tile and at one."""
    cp, hp, B, cache, kc, vc, q, pos = _setup(heads, n_kv, rng)
    B.decode_attn_splits = splits
    sinks = rng.standard_normal(hp.n_head).astype(np.float32)
    sinks[::5] += 12.0
    sinks[1::7] -= 40.0
    _check(cp, hp, B, cache, kc, vc, q, pos, n_kv, sinks, window)


@pytest.mark.parametrize("heads,n_kv,splits", [
    (h, n, s) for h in HEADS for n, s in [(1, None), (17, None), (700, None), (700, 3), (2000, None)]])
def test_tc_f16_cache_is_the_float32_kernel_on_its_rounded_rows(heads, n_kv, splits, rng):
    """The f16-cache kernel reads its rows as they are, the float32 one converts them to
    f16 when it forms a fragment: the same bits on the same (rounded) rows."""
    seed = int(rng.integers(2**31))
    outs = []
    for cache_type in ("f16", "f32"):
        cp, hp, B, cache, kc, vc, q, pos = _setup(heads, n_kv, np.random.default_rng(seed), cache_type)
        B.decode_attn_splits = splits
        kc, vc = kc.astype(np.float16).astype(np.float32), vc.astype(np.float16).astype(np.float32)
        outs.append(_check(cp, hp, B, cache, kc, vc, q, pos, n_kv))
    np.testing.assert_array_equal(outs[0], outs[1])


@pytest.mark.parametrize("n_kv", [1, 16, 17, 129, 700, 2001])
@pytest.mark.parametrize("heads,cache_type", [(h, c) for c in ("f32", "f16") for h in HEADS[:5]])
def test_tc_decode_own_norm_rope_and_store_are_the_separate_launch(heads, cache_type, n_kv, rng):
    """Fused (q, k and v straight from the projections): the output and the whole cache,
    bit for bit, those of qk_norm_rope_store followed by the attention; the current row in
    the cache poisoned before the fused launch (it comes from shared memory, put there by
    the block whose tile holds it; 3 splits)."""
    cp, hp, B, cache, kc, vc, q, pos = _setup(heads, n_kv, rng, cache_type)
    B.decode_attn_splits = 3
    out0, q_rot, k0, v0 = decode_fused_is_separate(B, cache, 1, kc, vc, q, pos, n_kv, rng)
    k32, v32 = k0.astype(np.float32), v0.astype(np.float32)
    _close_to_emulation(out0, emulate_tc(q_rot, k32, v32, hp, n_kv - 1, _splits(B, hp, cache)), v32[:n_kv])


def test_model_decode_takes_the_tc_kernel_at_f16_precision_only():
    """The backend's choice: tensor cores at f16 precision (quantized attention weights),
    float32 FMA at f32; forced either way by decode_attn_tc."""
    from moeforge.runtime.backend_cuda import CudaBackend
    hp = attn_hparams(32, 4, 128)
    assert CudaBackend(hp, attn_precision="f16")._decode_tc()
    assert not CudaBackend(hp, attn_precision="f32")._decode_tc()
    B = CudaBackend(hp, attn_precision="f32")
    B.decode_attn_tc = True
    assert B._decode_tc()
    assert not CudaBackend(attn_hparams(8, 8, 128), attn_precision="f16")._decode_tc()   # no group
