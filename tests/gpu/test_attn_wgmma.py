"""Prompt attention on wgmma (attn_prefill_wg128, in the model module built with
ModelSpec.wgmma for sm_90a) against attn_prefill_fa128, which it replaces where it is on:
the same bits (on an H200 the two gave the same bits on every case tried), and both
references' bars (runtime.prompt_attention.attention_tc's emulation, float64), outputs and
the tile images it reads poisoned before the launch; a model's logits the same with and
without it. Needs an sm_90 card (H100, H200); skips elsewhere."""
import numpy as np
import pytest
from conftest import attention64, attn_hparams

from moeforge.runtime import prompt_attention
from moeforge.runtime.prompt_attention import attention_tc, kernel_for

pytestmark = pytest.mark.gpu


def _sm90():
    from moeforge.runtime.device import device_info
    import cupy as cp
    if device_info(cp.cuda.Device().id)["cc"].split(".")[0] != "9":
        pytest.skip("wgmma runs on sm_90 (H100, H200) only")


def _backend(hp, cache_type, wgmma):
    from moeforge.runtime.backend_cuda import CudaBackend
    B = CudaBackend(hp, cache_type=cache_type, attn_wgmma=wgmma)
    B.attn_precision = "f16"
    return B


def _poison(B, ctx, hp):
    import cupy as cp
    tile = prompt_attention.WG_TILE_BYTES // 2
    B.ws("attn_tiles_f16", (hp.n_head_kv, -(-ctx // prompt_attention.KEYS), tile), np.float16).fill(cp.nan)


@pytest.mark.parametrize("cache_type", ["f32", "f16"])
@pytest.mark.parametrize("heads,pos0,n,window,sinks", [
    ((32, 4, 128), 0, 77, 0, False),       # Qwen3-30B-A3B's heads from the start
    ((32, 4, 128), 301, 45, 0, False),     # a later ubatch, a partial last tile
    ((32, 4, 128), 1000, 64, 0, False),
    ((32, 4, 128), 0, 2, 0, False),        # two tokens (one is the decode step's kernel)
    ((64, 4, 128), 33, 19, 0, False),      # groups of 16: two blocks a key head
    ((40, 8, 128), 0, 200, 0, False),      # groups of 5: one token tile a block, 3 warps only fill MMAs
    ((24, 8, 128), 5, 70, 0, False),       # groups of 3: two token tiles a block, 2 warps fill
    ((16, 16, 128), 200, 300, 0, False),   # no grouping: 128 tokens a block, a warpgroup 64 of them
    ((8, 2, 128), 70, 130, 0, False),      # groups of 4: a warpgroup's warps on two token tiles
    ((32, 4, 128), 0, 150, 128, True),     # sliding windows and sinks (gpt-oss's, at 128 wide)
    ((32, 4, 128), 700, 90, 128, True),    # a window that starts before the ubatch
    ((32, 4, 128), 37, 64, 8, True),       # windows inside 64-key tiles
])
def test_wgmma_prompt_attention_is_attn_prefill_fa(heads, pos0, n, window, sinks, cache_type):
    import cupy as cp
    _sm90()
    hp = attn_hparams(*heads)
    rng = np.random.default_rng()
    ctx = pos0 + n + 7
    kc = rng.standard_normal((ctx, hp.kv_dim)).astype(np.float32)
    vc = rng.standard_normal((ctx, hp.kv_dim)).astype(np.float32)
    if cache_type == "f16":      # what the f16 cache holds, so that the references see it too
        kc, vc = kc.astype(np.float16).astype(np.float32), vc.astype(np.float16).astype(np.float32)
    q = (2.0 * rng.standard_normal((n, hp.q_dim))).astype(np.float32)
    sk = rng.uniform(-2.0, 4.0, hp.n_head).astype(np.float32) if sinks else None
    pos = np.arange(pos0, pos0 + n, dtype=np.int32)
    outs = {}
    for wgmma in (True, False):
        B = _backend(hp, cache_type, wgmma)
        info = B._device()
        want = "attn_prefill_wg128" if wgmma else "attn_prefill_fa128"
        assert kernel_for(hp, info["cc"], "f16", info["smem_per_block_optin"], cache_type, wgmma) == want
        cache = B.new_cache(ctx)
        with B.context():
            cache.k[1].set(kc.astype(cache.dtype))
            cache.v[1].set(vc.astype(cache.dtype))
            args = (cache, 1, cp.asarray(q), cp.asarray(pos), pos0, n, "attn")
            extra = dict(sinks=None if sk is None else cp.asarray(sk), window=window)
            runs = []
            for _ in range(2):
                B.ws("attn", (n, hp.q_dim)).fill(cp.nan)
                _poison(B, ctx, hp)
                runs.append(B.attention(*args, **extra).get())
        assert np.isfinite(runs[0]).all(), want
        np.testing.assert_array_equal(runs[0], runs[1])
        outs[wgmma] = runs[0]
    got = outs[True]
    emul = attention_tc(q, kc, vc, hp, pos0, "f16", sinks=sk, window=window)
    err = np.abs(got - emul)
    assert np.median(err) / max(1.0, np.abs(emul).max()) < 1e-6
    assert err.max() < 2.0 ** -9 * np.abs(vc).max(), f"max abs error {err.max():.2e} against the emulation"
    exact = attention64(q.astype(np.float64), kc.astype(np.float64), vc.astype(np.float64), pos, hp,
                        sinks=sk, window=window)
    assert ((got - exact) ** 2).sum() / (exact ** 2).sum() < 5e-4
    np.testing.assert_array_equal(got, outs[False])       # the fa kernel's bits


def test_a_model_gives_the_same_logits_with_wgmma_attention(tmp_path, monkeypatch):
    """A qwen3moe of 128-wide heads (synthetic, q8_0): the prompt pass's logits with prompt
    attention on wgmma (MOEFORGE_ATTN_WGMMA=1) are the fa kernel's, bit for bit, over
    ubatches of 128 (keys from earlier ones), eager and replayed as graphs."""
    _sm90()
    from moeforge.runtime.model import load_model
    from moeforge.synth import SynthSpec, write_model
    path = str(tmp_path / "h128.gguf")
    write_model(path, SynthSpec(n_vocab=512, n_embd=256, n_layer=2, n_head=8, n_head_kv=2, head_dim=128,
                                n_ff_exp=64, n_expert=8, n_expert_used=2, n_ctx=1024, rope_base=1e4, n_ff=256),
                "q8_0", seed=3)
    toks = np.random.default_rng(0).integers(0, 512, size=300)
    logits = {}
    for on in ("1", "0"):
        monkeypatch.setenv("MOEFORGE_ATTN_WGMMA", on)
        m = load_model(path, backend="cuda", n_ctx=1024, n_ubatch=128)
        assert m.backend.spec.wgmma == (on == "1")
        first = m.logits(toks)
        again = m.logits(toks)            # the pass replayed (a graph from its second run)
        np.testing.assert_array_equal(first, again)
        logits[on] = first
    np.testing.assert_array_equal(logits["1"], logits["0"])
