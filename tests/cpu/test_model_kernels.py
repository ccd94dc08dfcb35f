"""The model graph's small CUDA kernels: rendered by codegen like every other family and
compiled with NVRTC (no GPU needed), every kernel the backend launches present."""
import re

import pytest

from moeforge.codegen.compile import compile_spec
from moeforge.codegen.render import render
from moeforge.codegen.spec import ModelSpec


@pytest.mark.parametrize("cache", ModelSpec.CACHE_TYPES)
@pytest.mark.parametrize("arch,wgmma", [("sm_80", False), ("sm_90", False), ("sm_90", True)])
def test_model_kernels_compile(arch, wgmma, cache, generated):
    """Both modules (a float32 and an f16 KV cache) build, with prompt attention on wgmma
    too on sm_90 (sm_90a), and the decode attention kernels and the f16 prompt kernels do
    not spill (the FMA prompt kernel spills 4 bytes on sm_80), nor has ptxas issued
    attn_prefill_wg128's MMAs one at a time (C7520). The compile plan builds them
    (~40 s each on 2 cores): found in its cache, read from it."""
    spec = ModelSpec(cache=cache, wgmma=wgmma)
    compiled = compile_spec(spec, arch, generated[0])
    assert compiled.cached
    assert compiled.cubin.stat().st_size > 0
    assert set(spec.kernels) <= set(compiled.info), sorted(set(spec.kernels) - set(compiled.info))
    for k in spec.kernels:
        if k.startswith(("attn_decode", "attn_prefill_fa", "attn_prefill_wg", "dense_f32_tiled",
                         "moe_combine_rms_norm_rows", "qk_norm_rope_store_h128")):
            assert compiled.info[k]["spill_stores"] == 0, (k, compiled.info[k])
        assert not compiled.info[k].get("wgmma_serialized"), k     # its pipeline kept (ptxas C7520)
    # two blocks an SM: the wide float tile's launch bounds, the prompt combine's registers
    assert compiled.info["dense_f32_tiled128"]["registers"] <= 128
    assert compiled.info["moe_combine_rms_norm_rows"]["registers"] <= 128


def test_the_wgmma_module_is_its_own_sm_90a_instance():
    """Prompt attention on wgmma lives in a module of its own (sm_90a); without it the
    module's source is what it was, so the default path's binary does not change."""
    plain, wg = ModelSpec(), ModelSpec(wgmma=True)
    assert wg.name == "model-e512h256-wg" and ModelSpec(cache="f16", wgmma=True).name == "model-e512h256-cf16-wg"
    assert set(wg.kernels) - set(plain.kernels) == {"attn_prefill_wg128", "kv_tiles_f16"}
    assert wg.nvrtc_arch("sm_90") == "sm_90a" and plain.nvrtc_arch("sm_90") == "sm_90"
    assert not wg.supports("sm_80") and plain.supports("sm_80")
    with pytest.raises(ValueError, match="sm_90 only"):
        wg.nvrtc_arch("sm_80")
    a, b = render(plain), render(wg)
    assert "attn_prefill_wg128" not in a and "wgmma.mma_async" not in a
    start = b.index("// Prompt attention on wgmma (sm_90a")
    end = b.index("// DeepSeek's latent attention before it", start)
    assert b[:start] + b[end:] == a


@pytest.mark.parametrize("wgmma", [False, True])
@pytest.mark.parametrize("cache", ModelSpec.CACHE_TYPES)
def test_every_kernel_is_listed(cache, wgmma):
    spec = ModelSpec(cache=cache, wgmma=wgmma)
    src = render(spec)
    for k in spec.kernels:
        assert re.search(rf'extern "C" __global__ void (RC_CLUSTER )?(__launch_bounds__\([\w, *]+\)\s+)?{k}\(', src), k
    assert src.count('extern "C" __global__') == len(spec.kernels)
    assert f"typedef {'u16' if cache == 'f16' else 'float'} kv_t;" in src


def test_an_f16_cache_module_is_its_own_instance():
    assert ModelSpec(cache="f16").name == "model-e512h256-cf16" and ModelSpec().name == "model-e512h256"
    assert set(ModelSpec().kernels) - set(ModelSpec(cache="f16").kernels) == {"attn_prefill", "attn_prefill_tc", "kv_rows_f16"}
    with pytest.raises(ValueError, match="cache must be one of"):
        ModelSpec(cache="q8_0").check()


def test_the_limits_size_the_kernels():
    src = render(ModelSpec(max_experts=256, max_head_dim=128))
    assert "#define ROUTE_SLOTS (256 / 32)" in src
    with pytest.raises(ValueError, match="multiple of 32"):
        ModelSpec(max_experts=100).check()
    with pytest.raises(ValueError, match="widest decode attention"):
        ModelSpec(max_head_dim=512).check()


def test_decode_attention_takes_the_narrowest_variant_that_holds_the_head():
    assert [ModelSpec.decode_kernel(hd) for hd in (32, 64, 66, 128, 200, 256)] == [
        "attn_decode_h64", "attn_decode_h64", "attn_decode_h128", "attn_decode_h128", "attn_decode_h256",
        "attn_decode_h256"]
    with pytest.raises(ValueError, match="head_dim 258"):
        ModelSpec.decode_kernel(258)
    # each variant's shared memory holds a warp's partial output for its width, lanes
    # holding width/64 rotation pairs
    src = render(ModelSpec())
    for w in ModelSpec.DECODE_WIDTHS:
        body = src[src.index(f"attn_decode_h{w}("):]
        assert f"wacc[NW][{w}]" in body[:2000] and f"constexpr int P = {w // 64}," in body[:2000]


def test_decode_attention_splits_fill_one_wave_once_the_context_is_long():
    from conftest import attn_hparams

    from moeforge.runtime.decode_attention import ATTN_DECODE_CHUNK
    from moeforge.runtime.decode_attention import splits_per_head as decode_attn_splits
    qwen, few = attn_hparams(32, 4, 128), attn_hparams(4, 2, 64)
    assert decode_attn_splits(qwen, 100, 132) == 1                       # one chunk: one block a head
    assert decode_attn_splits(qwen, 3 * ATTN_DECODE_CHUNK, 132) == 3      # never more than the chunks
    assert decode_attn_splits(qwen, 4096, 132) == 4 and decode_attn_splits(qwen, 4096, 108) == 3
    assert decode_attn_splits(few, 32768, 132) == 33
    assert decode_attn_splits(attn_hparams(256, 8, 128), 4096, 132) == 1  # more heads than SMs
    # the kernel deals chunks of U * warps positions; the backend's estimate assumes 128
    src = render(ModelSpec())
    assert "#define ATTN_THREADS 512" in src and "{% set U = 8" not in src
    body = src[src.index("attn_decode_h128("):]
    assert "constexpr int P = 2, V = 4, U = 8, NW = ATTN_THREADS / 32, CHUNK = U * NW;" in body[:1500]
    assert 8 * 512 // 32 == ATTN_DECODE_CHUNK


def test_decode_attention_plan_per_query_head_or_per_key_head():
    from conftest import attn_hparams

    from moeforge.runtime.decode_attention import can_group
    from moeforge.runtime.decode_attention import plan as decode_attn_plan
    qwen = attn_hparams(32, 4, 128)
    assert decode_attn_plan(qwen, 8192, 132, False) == ("attn_decode_h128", 32, 512, 4)
    assert decode_attn_plan(qwen, 8192, 132, True) == ("attn_decode_gqa_g8h128", 4, 256, 32)
    assert decode_attn_plan(qwen, 100, 132, True) == ("attn_decode_gqa_g8h128", 4, 256, 4)   # the cache's chunks
    assert decode_attn_plan(qwen, 8192, 132, True, splits=3)[3] == 3
    assert decode_attn_plan(attn_hparams(4, 2, 32), 256, 132, True)[0] == "attn_decode_gqa_g2h64"
    assert decode_attn_plan(attn_hparams(6, 3, 80), 256, 132, True)[0] == "attn_decode_gqa_g2h128"
    # groups of 16 (Qwen3-235B): blocks of 8 of them, two a key head, each its own splits
    assert decode_attn_plan(attn_hparams(64, 4, 128), 8192, 132, True) == ("attn_decode_gqa_g8h128", 8, 256, 16)
    assert decode_attn_plan(attn_hparams(32, 1, 64), 8192, 132, True) == ("attn_decode_gqa_g8h64", 4, 256, 32)
    for heads in ((8, 8, 32), (48, 4, 128), (4, 1, 256), (12, 4, 64)):    # groups of 1, 12, 4 (256 wide), 3
        assert not can_group(attn_hparams(*heads))
        with pytest.raises(ValueError, match="grouped decode attention takes"):
            decode_attn_plan(attn_hparams(*heads), 4096, 132, True)
        assert decode_attn_plan(attn_hparams(*heads), 4096, 132, False)[0].startswith("attn_decode_h")
    # every kernel a plan names is rendered
    src = render(ModelSpec())
    for g in (2, 4, 8):
        for w in (64, 128):
            assert f"void __launch_bounds__(GQA_THREADS, 1) attn_decode_gqa_g{g}h{w}(" in src


def test_grouped_decode_ring_fills_the_block_and_holds_the_outputs():
    from conftest import attn_hparams

    from moeforge.runtime.decode_attention import GQA_CHUNK, GQA_MAX_STAGES, GQA_SPLIT_CAP, can_group, plan, ring
    qwen = attn_hparams(32, 4, 128)
    chunk = 4 * GQA_CHUNK * (2 * 128 + 4)                      # keys padded by 4 floats a row
    assert ring(qwen, 232448) == (6, 6 * chunk)                # H100: 227 KiB a block, ~14 KiB static
    assert ring(qwen, 101376) == (2, 2 * chunk)                # sm_86's 99 KiB
    assert ring(qwen, 10**7)[0] == GQA_MAX_STAGES
    assert ring(qwen, 232448, stages=3) == (3, 3 * chunk)      # forced fewer (tests)
    assert ring(qwen, 101376, stages=5)[0] == 2                # never more than fit
    with pytest.raises(ValueError, match="needs 2 buffers"):
        ring(qwen, 49152)
    for heads in ((16, 2, 16), (16, 2, 64), (8, 4, 68), (32, 4, 128)):    # the phases' sums fit two buffers
        g, hd = heads[0] // heads[1], heads[2]
        phases = 256 // ((64 if hd <= 64 else 128) // 4)
        assert 2 * 4 * GQA_CHUNK * (2 * hd + 4) >= 4 * phases * g * hd
        assert ring(attn_hparams(*heads), 10**7, stages=2)[0] == 2
    assert not can_group(attn_hparams(8, 4, 66))              # rows copied 16 bytes at a time
    assert plan(qwen, 8192, 132, True, splits=10**4)[3] == GQA_SPLIT_CAP


def test_grouped_decode_ring_of_an_f16_cache():
    """Half the bytes a chunk (keys padded by 8 halves a row): more buffers fit, but the
    phases' float32 sums, which the ring takes after the sweep, may need more than two."""
    from conftest import attn_hparams

    from moeforge.runtime.decode_attention import GQA_CHUNK, GQA_MAX_STAGES, can_group, ring
    qwen = attn_hparams(32, 4, 128)
    chunk = 2 * GQA_CHUNK * (2 * 128 + 8)
    assert ring(qwen, 232448, cache="f16") == (GQA_MAX_STAGES, GQA_MAX_STAGES * chunk)
    assert ring(qwen, 101376, cache="f16") == (5, 5 * chunk)
    assert ring(qwen, 232448, stages=2, cache="f16") == (2, 2 * chunk)        # 8 x 8 x 128 floats: 2 hold them
    narrow = attn_hparams(16, 2, 64)                             # 16 phases x 8 heads x 64 floats = 32 KiB
    chunk = 2 * GQA_CHUNK * (2 * 64 + 8)
    assert ring(narrow, 232448, stages=2, cache="f16") == (4, 4 * chunk)      # raised to what holds them
    with pytest.raises(ValueError, match="needs 4 buffers"):
        ring(narrow, 4 * chunk + 11000, cache="f16")
    assert can_group(attn_hparams(8, 4, 68)) and not can_group(attn_hparams(8, 4, 68), "f16")   # 16 bytes: 8 halves
    assert can_group(attn_hparams(8, 4, 72), "f16")


def test_the_step_takes_the_grouped_kernel_from_its_position():
    from conftest import attn_hparams

    from moeforge.runtime.decode_attention import grouped_at, grouped_min_kv
    qwen, oss = attn_hparams(32, 4, 128), attn_hparams(64, 8, 64)
    assert grouped_min_kv(qwen, 132) == 2048 and grouped_min_kv(oss, 132) == 1024   # 4 and 2 splits a head
    assert grouped_min_kv(qwen, 16) == 512                                           # fewer SMs than heads
    assert not grouped_at(qwen, 2046, 132) and grouped_at(qwen, 2047, 132)          # pos0 + 1 attended
    assert not grouped_at(oss, 1022, 132) and grouped_at(oss, 1023, 132)
    assert not grouped_at(attn_hparams(8, 8, 128), 20480, 132)                      # no group to share
    assert grouped_at(qwen, 20480, 84, smem_limit=101376)                           # sm_86: two buffers fit
    assert not grouped_at(qwen, 20480, 84, smem_limit=65536)                        # they don't: per head


def test_float_products_take_the_wide_tile_past_64_rows():
    """128-row tiles for Qwen3's and GLM's 128-expert routers; 64-row ones up to 64 rows
    (Mixtral's 8, gpt-oss's 32, DeepSeek's 64 experts), which a wide tile would leave mostly
    empty; both forms rendered from the spec's sizes."""
    from moeforge.runtime.backend_cuda import dense_tile_form
    assert dense_tile_form(8) == dense_tile_form(64) == ("dense_f32_tiled", 64, 16)
    assert dense_tile_form(65) == dense_tile_form(128) == ("dense_f32_tiled128", 128, 8)
    src = render(ModelSpec())
    assert "dense_tiled<1, 16>(w, x, out, m, k, n, kc);" in src
    assert "dense_tiled<2, 8>(w, x, out, m, k, n, kc);" in src


def test_a_prompt_combine_takes_the_float4_rows_where_they_fit():
    """moe_combine_rms_norm_rows: 1 to 8 slots, d a multiple of 4 up to 4 float4 groups of
    256 threads, every row 16-byte aligned; anything else keeps the one-column kernel."""
    from types import SimpleNamespace

    from moeforge.runtime.moe_cuda import CudaMoeOps
    buf = lambda addr=0: SimpleNamespace(data=SimpleNamespace(ptr=addr))   # noqa: E731
    fit = lambda d=2048, top_k=8, y=buf(), bias=None, x=buf(): CudaMoeOps._combine_rows_fit(  # noqa: E731
        x, y, buf(), buf(), bias, d, top_k)
    assert fit() and fit(d=2880, top_k=4, bias=buf(4096)) and fit(d=4096, top_k=1) and fit(d=4)
    assert not fit(top_k=9) and not fit(top_k=0) and not fit(y=None)
    assert not fit(d=4100) and not fit(d=2050)
    assert not fit(x=buf(8)) and not fit(bias=buf(4100))
