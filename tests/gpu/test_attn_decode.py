"""Decode attention (one token over the KV cache, attn_decode.cuh.j2) on the GPU (pytest -m
gpu): against float64 at every head width variant, contexts inside and past the rows it
requests before its wait, split over blocks, a block per query head or per key head (the
grouped kernel), and its own q/k norm, RoPE and KV store bit for bit the separate
qk_norm_rope_store launch."""
import numpy as np
import pytest
from conftest import attention64, attn_hparams, decode_cache_rows, decode_fused_is_separate, split_counters_ready

from moeforge.codegen.spec import ModelSpec
from moeforge.runtime.decode_attention import ATTN_DECODE_CHUNK, can_group

pytestmark = pytest.mark.gpu

HEADS = [
    (32, 4, 128),    # Qwen3-30B-A3B
    (8, 8, 32),      # no grouping, half a lane's pair slot empty (the parity fixtures' width)
    (16, 2, 64),
    (6, 3, 80),      # the 128 variant with a partly filled second pair slot
    (4, 1, 256),     # the widest variant: 3 positions a warp in a chunk (48 a block)
    (64, 4, 128),    # Qwen3-235B-A22B: groups of 16, grouped in two blocks of 8 a key head
]
# 1 and 2: most warps without a position; 128/129: the 64 and 128 variants' first chunk
# (before the wait) full and one past it; 700: more chunks than splits (each split's
# blocks loop), the splits merged by the last block of each head
N_KV = [1, 2, 37, 128, 129, 700]


def _setup(heads, n_kv, rng, cache_type="f32"):
    import cupy as cp

    from moeforge.runtime.backend_cuda import CudaBackend
    hp = attn_hparams(*heads)
    B = CudaBackend(hp, cache_type=cache_type)
    cache = B.new_cache(n_kv + 5)
    il = 1
    kc = rng.standard_normal((cache.n_ctx, hp.kv_dim)).astype(np.float32)
    vc = rng.standard_normal((cache.n_ctx, hp.kv_dim)).astype(np.float32)
    q = (2.0 * rng.standard_normal((1, hp.q_dim))).astype(np.float32)    # peaked rows too
    pos = cp.asarray(np.array([n_kv - 1], dtype=np.int32))
    return cp, hp, B, cache, il, kc, vc, q, pos


def _grouped(heads, cache="f32"):
    """The kernels that take these heads: per query head always, per key head where the
    grouped kernel has a variant."""
    return [False] + ([True] if can_group(attn_hparams(*heads), cache) else [])


GROUPED_HEADS = [h for h in HEADS if True in _grouped(h)] + [(16, 4, 128), (8, 4, 64)]
SPLITS = [(n, None) for n in N_KV] + [(700, 1), (700, 3), (129, 2), (40, 5)]


def _check_two_launches(cp, hp, B, cache, il, kc, vc, q, pos, n_kv, label, sinks=None, window=0):
    """q and the current row already in place (the separate q/k launch before it), rows past
    the current position NaN (never read), the output poisoned before the launch: float64
    within 2e-5, the same bits on a second launch, every split counter ready for
    the next launch (split_counters_ready). Rows
    before a window are 1e4 (a chunk partly before it is read and masked, so they must be
    finite, as a cache's old rows are; unmasked, their scores would take all the weight)."""
    kc, vc = decode_cache_rows(kc, vc, n_kv, window, cache)
    extra = {} if sinks is None else {"sinks": cp.asarray(sinks)}
    with B.context():
        cache.k[il].set(kc)
        cache.v[il].set(vc)
        B.ws("attn", (1, hp.q_dim)).fill(cp.nan)
        got = B.attention(cache, il, cp.asarray(q), pos, n_kv - 1, 1, "attn", window=window, **extra).get()
        again = B.attention(cache, il, cp.asarray(q), pos, n_kv - 1, 1, "attn", window=window, **extra).get()
    exact = attention64(q.astype(np.float64), kc.astype(np.float64), vc.astype(np.float64),
                        np.array([n_kv - 1]), hp, sinks=sinks, window=window)
    assert np.isfinite(got).all()
    np.testing.assert_array_equal(got, again)
    assert split_counters_ready(B, hp)
    err = np.abs(got - exact).max()
    assert err < 2e-5 * max(1.0, np.abs(exact).max()), f"{label}: max abs error {err:.2e}"
    return got


@pytest.mark.parametrize("heads,grouped,n_kv,splits", [
    (h, False, n, s) for h in HEADS for n, s in SPLITS] + [
    (h, True, n, s) for h in GROUPED_HEADS for n, s in SPLITS + [(2000, None)]])
def test_attn_decode_matches_float64(heads, grouped, n_kv, splits, rng):
    """q and the current row already in place (the separate q/k launch before it): float64
    within 2e-5; the output poisoned before the launch, the same bits on a second launch,
    every split counter ready for the next launch. splits: forced (None: the backend's choice);
    grouped: a block per key head (attn_decode_gqa) or per query head."""
    cp, hp, B, cache, il, kc, vc, q, pos = _setup(heads, n_kv, rng)
    B.decode_attn_splits = splits
    B.decode_attn_grouped = grouped
    _check_two_launches(cp, hp, B, cache, il, kc, vc, q, pos, n_kv, ModelSpec.decode_kernel(hp.head_dim))


@pytest.mark.parametrize("heads,grouped", [((64, 8, 64), False), ((64, 8, 64), True), ((16, 4, 128), True),
                                           ((32, 2, 64), True)])
@pytest.mark.parametrize("n_kv,window,splits", [
    (1, 0, None), (700, 0, None), (700, 0, 3), (2000, 0, None), (2000, 0, 40),
    (100, 128, None), (129, 128, None), (700, 128, None), (700, 128, 3), (2001, 128, 2), (2001, 100, None)])
def test_attn_decode_sinks_and_window(heads, grouped, n_kv, window, splits, rng):
    """gpt-oss's attention (its heads: 64 query heads in groups of 8, 64 wide): a sink
    logit per head in the denominator (some far above the scores, so that the sink takes most
    of the weight; some far below), and sliding windows, starting inside a block's chunk and
    at one, on both kernels."""
    cp, hp, B, cache, il, kc, vc, q, pos = _setup(heads, n_kv, rng)
    B.decode_attn_splits, B.decode_attn_grouped = splits, grouped
    sinks = rng.standard_normal(hp.n_head).astype(np.float32)
    sinks[::5] += 12.0
    sinks[1::7] -= 40.0
    _check_two_launches(cp, hp, B, cache, il, kc, vc, q, pos, n_kv, f"grouped={grouped}", sinks, window)


F16_SPLITS = [(1, None), (37, None), (129, None), (700, None), (700, 3), (40, 5), (2000, None)]


@pytest.mark.parametrize("heads,grouped,n_kv,splits", [
    (h, g, n, s) for h in HEADS + [(16, 4, 128), (8, 4, 64)] for g in _grouped(h, "f16") for n, s in F16_SPLITS])
def test_f16_cache_is_the_float32_kernel_on_its_rounded_rows(heads, grouped, n_kv, splits, rng):
    """The kernels built for an f16 cache convert each element exactly and then compute as
    the float32 cache's do: the same bits as those on a float32 cache holding the same
    (rounded) rows, and float64 on those rows within 2e-5 (the usual checks)."""
    seed = int(rng.integers(2**31))           # fresh every run, the same inputs for both caches
    outs = []
    for cache_type in ("f16", "f32"):
        cp, hp, B, cache, il, kc, vc, q, pos = _setup(heads, n_kv, np.random.default_rng(seed), cache_type)
        B.decode_attn_splits, B.decode_attn_grouped = splits, grouped
        kc, vc = kc.astype(np.float16).astype(np.float32), vc.astype(np.float16).astype(np.float32)
        outs.append(_check_two_launches(cp, hp, B, cache, il, kc, vc, q, pos, n_kv, cache_type))
    np.testing.assert_array_equal(outs[0], outs[1])


@pytest.mark.parametrize("cache_type", ["f32", "f16"])
@pytest.mark.parametrize("heads,stages,n_kv,splits", [
    ((32, 4, 128), 2, 5000, 128),   # 128 splits' records in 8 batches of 16 (what two buffers hold)
    ((16, 2, 64), 2, 2000, 40),     # 40 in three batches of 16 (f16: a ring of 4, raised to hold the sums)
    ((16, 2, 64), 3, 2000, 3),      # 21 chunks a block through a ring of 3
    ((8, 4, 64), 5, 777, 1),        # one block per key head, the ring wrapping 5 times
])
def test_grouped_ring_wraps_and_the_merge_goes_in_batches(heads, stages, n_kv, splits, cache_type, rng):
    """The grouped kernel with fewer ring buffers than the card holds (as on cards with less
    shared memory): chunks through a wrapping ring, and the last block of a key head merging
    the splits' records in batches of what the ring holds: float64 within 2e-5, the same
    bits on a second launch (the other counter bank), the counters ready."""
    cp, hp, B, cache, il, kc, vc, q, pos = _setup(heads, n_kv, rng, cache_type)
    B.decode_attn_grouped, B.decode_attn_splits, B.decode_attn_stages = True, splits, stages
    _check_two_launches(cp, hp, B, cache, il, kc, vc, q, pos, n_kv, "attn_decode_gqa")


@pytest.mark.parametrize("n_kv", [1, 37, 129, 700, 4 * ATTN_DECODE_CHUNK + 1])
@pytest.mark.parametrize("heads,grouped,cache_type", [
    (h, g, c) for c in ("f32", "f16") for h in [(32, 4, 128), (6, 3, 80), (4, 2, 256), (8, 8, 32), (16, 4, 128),
                                                (64, 4, 128)]
    for g in _grouped(h, c)])
def test_attn_decode_own_norm_rope_and_store_are_the_separate_launch(heads, grouped, cache_type, n_kv, rng):
    """Fused (q, k and v straight from the projections): the output and the whole cache,
    bit for bit, those of qk_norm_rope_store followed by the attention; the current row in
    the cache is poisoned before the fused launch (it must come from the registers; with
    splits, of the block whose chunk holds it: 5 chunks, the current position the first
    of the last). An f16 cache: the row the attention uses from its registers is rounded
    as the cache holds it, so both still agree bit for bit."""
    cp, hp, B, cache, il, kc, vc, q, pos = _setup(heads, n_kv, rng, cache_type)
    B.decode_attn_splits = 3 if n_kv > ATTN_DECODE_CHUNK else None
    B.decode_attn_grouped = grouped
    out0, q_rot, k0, v0 = decode_fused_is_separate(B, cache, il, kc, vc, q, pos, n_kv, rng)
    exact = attention64(q_rot.astype(np.float64), k0.astype(np.float64), v0.astype(np.float64),
                        np.array([n_kv - 1]), hp)
    err = np.abs(out0 - exact).max()
    assert err < 2e-5 * max(1.0, np.abs(exact).max()), f"max abs error {err:.2e}"
