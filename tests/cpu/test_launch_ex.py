"""The cuLaunchKernelEx path (PDL launches): the driver structs and argument packing, on
the CPU. Their use on a GPU is tested in tests/gpu/test_fused.py."""
import ctypes
import itertools
import re

import numpy as np
import pytest

from moeforge.codegen.render import render
from moeforge.codegen.spec import MmvqSpec
from moeforge.runtime import launch_ex


def test_driver_structs_have_the_driver_layout():
    # CUlaunchConfig: 7 uints, padding, stream, attrs, numAttrs (+ padding); CUlaunchAttribute: id,
    # 4 bytes of padding, a 64-byte value union
    assert ctypes.sizeof(launch_ex._Config) == 56
    assert launch_ex._Config.stream.offset == 32
    assert ctypes.sizeof(launch_ex._Attribute) == 72
    assert launch_ex._Attribute.value.offset == 8


def test_arguments_are_packed_by_type():
    class FakeArray:
        class data:
            ptr = 0xDEAD0000
    assert launch_ex._c_arg(np.uint64(7)).value == 7
    assert isinstance(launch_ex._c_arg(np.int32(-3)), ctypes.c_int32)
    assert launch_ex._c_arg(np.int32(-3)).value == -3
    assert launch_ex._c_arg(np.float32(1.5)).value == 1.5
    assert launch_ex._c_arg(FakeArray()).value == 0xDEAD0000
    with pytest.raises(TypeError, match="int"):
        launch_ex._c_arg(3)          # a bare Python int has no fixed width: refused


def test_pdl_and_streaming_loads_render_only_when_asked():
    base = MmvqSpec("q4_0", tokens=1, warps=4, rows=4, act="silu", per_pair=True)
    both = MmvqSpec("q4_0", tokens=1, warps=4, rows=4, act="silu", per_pair=True, evict_first=True, pdl=True)
    assert both.name == base.name + "-ef-pdl"
    a, b = render(base), render(both)
    assert "griddepcontrol" not in a and "__ldcs" not in a
    assert b.count("griddepcontrol.wait") == 1 and "__CUDA_ARCH__ >= 900" in b
    assert b.count("__ldcs(") == 2


def test_prequant_waits_for_x_after_requesting_its_weights():
    spec = MmvqSpec("q4_0", tokens=1, warps=4, rows=4, act="silu", per_pair=True, prequant=True,
                    evict_first=True, pdl=True)
    src = render(spec)
    body = src[src.index(spec.symbol + "("):]
    assert "quantize_row_to_smem(" not in body                  # x comes quantized
    assert body.count("griddepcontrol.wait") == 1
    assert body.index("load_w(A") < body.index("griddepcontrol.wait") < body.index("compute_unit(")
    assert spec.smem_bytes(2048) == 0
    with pytest.raises(ValueError, match="prequant"):
        MmvqSpec("q4_0", tokens=2, prequant=True).check()


def test_sixty_four_bit_integers_are_packed():
    assert isinstance(launch_ex._c_arg(np.int64(-(1 << 40))), ctypes.c_int64)
    assert launch_ex._c_arg(np.int64(-(1 << 40))).value == -(1 << 40)


def test_pdl_only_from_sm90_and_not_when_turned_off(monkeypatch):
    monkeypatch.delenv("MOEFORGE_PDL", raising=False)
    assert launch_ex.pdl_available("9.0") and launch_ex.pdl_available("10.0")
    assert not launch_ex.pdl_available("8.9")
    monkeypatch.setenv("MOEFORGE_PDL", "0")
    assert not launch_ex.pdl_available("9.0")


def _kernels(src: str) -> dict:
    """name -> body of every __global__ function of a rendered module."""
    import re
    out = {}
    for m in re.finditer(r'__global__ void (?:RC_CLUSTER )?(?:__launch_bounds__\([^)]*\) )?\s*(\w+)\(', src):
        start = src.index("{", m.end())
        out[m.group(1)] = src[start:start + 3000]
    return out


@pytest.mark.parametrize("cache", ["f32", "f16"])
def test_every_model_kernel_waits_before_it_touches_memory(cache):
    """The model kernels are all launched with PDL: each must wait for the grid before it
    first thing, or it could read a buffer its predecessor is still writing (both KV cache
    types' modules)."""
    from moeforge.codegen.spec import ModelSpec
    spec = ModelSpec(cache=cache)
    bodies = _kernels(render(spec))
    assert set(bodies) == set(spec.kernels)
    # these request constant model weights (norm weights, the router), or the KV cache
    # of earlier steps, before the wait
    # (latent attention's decode kernel only requests rows into L2: its own case below)
    decode = {n for n in bodies if n.startswith("attn_decode_") and not n.startswith("attn_decode_mla")}
    assert len(decode) == len(ModelSpec.DECODE_WIDTHS) + 12      # + the grouped ones (FMA and tensor cores)
    prefetching = {"rms_norm", "add_rms_norm", "moe_combine_rms_norm", "router_route", "router_route_cluster",
                   "router_route_keyed", "router_route_cluster_keyed", "attn_decode_mla", "attn_prefill_mla",
                   "mla_rope_store"} | decode
    rows = render(spec)
    src_helper = rows[rows.index("void attn_rows("):]
    src_helper = src_helper[:src_helper.index("\n}\n")]
    assert "t < lim" in src_helper            # rows at lim and past it are zeros, never read
    ring_request = rows[rows.index("void request(kv_t* buf,"):]
    ring_request = ring_request[:ring_request.index("\n    }\n")]
    assert "if (base + row[k] < lim)" in ring_request     # the grouped kernel's ring: rows below lim only
    for name, body in bodies.items():
        pre = body[1:body.index("pdl_enter();")]
        if name not in prefetching:
            assert pre.strip() == "", f"{name} starts with {pre.strip()[:60]!r}"
            continue
        if name in ("attn_decode_mla", "attn_prefill_mla"):
            # L2 requests for the rows before the pass's first position (earlier passes stored
            # them; the kernel before writes this pass's), and nothing loaded or written
            assert ("const int stored = min(j1, pos[0]);" if name == "attn_decode_mla"
                    else "const int stored = min(hi, pos[0]);") in pre and "mla_prefetch_l2(kc, " in pre, name
            prefetch = rows[rows.index("void mla_prefetch_l2("):]
            assert 'prefetch.global.L2' in prefetch[:prefetch.index("\n}\n")]
            for touched in ("q_lat[", "q[", "part[", "out[", "qs[", "sc[", "Qs", "Kb", "__syncthreads", "kv_load2",
                            "copy16_async", "mlap_tile"):
                assert touched not in pre, f"{name} touches {touched!r} before its wait"
            continue
        if name == "mla_rope_store":
            # the latent norm's weights only: never q, kv, the position or the cache
            assert "norm_w[i0]" in pre and "norm_w[i1]" in pre, name
            for touched in ("q[", "q_nope", "row", "kv", "kc", "dst", "pos", "sh["):
                assert touched not in pre, f"{name} touches {touched!r} before its wait"
            continue
        if name == "moe_combine_rms_norm":
            # its norm weights, and with top_k 0 (the down product has added the experts' sum)
            # the chosen experts' down biases, ids and weights through L2; never x, y or out
            assert "norm_weights(w, d, wv);" in pre and "const bool early_bias = top_k == 0 && bias != nullptr;" in pre
            assert "__ldcg(wt + j) * __ldg(bias + (long)__ldcg(it + j) * d + i)" in pre
            code = re.sub(r"//[^\n]*", "", pre)
            for touched in ("x[", "xr", "yt", "y[", "out", "xq", "xds", "atomic", "__syncthreads", "sh["):
                assert touched not in code, f"{name} touches {touched!r} before its wait"
            continue
        if name in decode:
            # the position and the cache rows before it (earlier steps wrote them), never q
            # or the current position's row (the kernel just before writes those)
            assert "cur = n_kv - 1" in pre, name
            if name.startswith("attn_decode_gqa_tc"):
                # the warp's first tile (a sliding window's tiles from t0), rows clamped to
                # first .. cur and cur's read from shared memory (loaded again after the wait)
                assert "tile.load(kc, vc, ck, cv, (t0 + u) * TT, first, cur, head, kv_dim, hd, false);" in pre, name
                assert "const int p = min(max(tb + 8 * n + gr, first), cur);" in rows
                assert "const kv_t* row = p == cur ? ck : kc + (long)p * kv_dim + head;" in rows
                assert "tile.load(kc, vc, ck, cv, (t0 + u) * TT, first, cur, head, kv_dim, hd, true);" in rows
            elif name.startswith("attn_decode_gqa"):
                # from the split's first chunk (c0 + sp: a sliding window's from its first) up to cur
                assert "b0 = (c0 + sp) * T" in pre, name
                assert "slots.request(gqa_ring + i * stage, kc, vc, b0 + i * step, i < chunks ? cur : 0," in pre
            else:
                # from the block's first chunk (a sliding window's first, at c0) up to cur
                assert "start = (c0 + sp) * CHUNK" in pre and "attn_rows<U, V, NW>(kc, vc, start, cur," in pre, name
            assert "q[" not in pre and "k_new" not in pre.split(")", 1)[1], name
            continue
        assert "w" in pre, name
        for touched in ("x[", "xr", "yr", "yt", "xt[", "x4", "out", "logits", "ids", "wts", "counter",
                        "xq", "xds", "atomic", "__syncthreads", "sh["):
            assert touched not in pre, f"{name} touches {touched!r} before its wait"
    helper = rows[rows.index("void pdl_enter()"):]
    assert helper.index("griddepcontrol.wait") < helper.index("griddepcontrol.launch_dependents")


def test_quantizer_waits_for_x_before_it_releases_the_product():
    """The mat-vec after it requests weights and expert ids before its own wait: that is
    safe only if the quantizer lets it launch after everything before has ended."""
    from moeforge.codegen.spec import UtilSpec
    src = render(UtilSpec())
    for name in ("quantize_q8_1", "prepare_moe"):
        body = _kernels(src)[name]
        assert 0 < body.index("pdl_wait_then_release();") < body.index("quantize_block8("), name
    helper = src[src.index("void pdl_wait_then_release()"):]
    assert helper.index("griddepcontrol.wait") < helper.index("griddepcontrol.launch_dependents")


def test_quantizer_only_prefetches_x_into_l2_before_its_wait():
    """x may still be being written when the quantizer starts: before its wait it may ask L2
    for x (L2 sees every write), never load it into registers or L1."""
    from moeforge.codegen.spec import UtilSpec
    src = render(UtilSpec())
    body = _kernels(src)["quantize_q8_1"]
    assert 0 < body.index("prefetch_act4(") < body.index("pdl_wait_then_release();")
    helper = src[src.index("void prefetch_act4("):]
    helper = helper[:helper.index("\n}\n")]
    assert helper.count("prefetch.global.L2") == 2
    for load in ("*(const", "__ldg", "__ldcg", "ld.global", "[col]", "[0]"):
        assert load not in helper, load


def test_guessed_expert_ids_are_read_from_l2_and_checked_after_the_wait():
    """The one-token expert form requests weights for the ids it reads before its wait (the
    kernel writing them may be in flight): through L2, clamped, and read again after the
    wait, where a different value sends the pair to settle_pair before anything is written."""
    import dataclasses
    spec = MmvqSpec.decode("q4_0", act="silu", rows=2, guess=True)
    assert spec.name.endswith("-g")
    src = render(spec)
    body = src[src.index(spec.symbol + "("):]
    wait = body.index("griddepcontrol.wait")
    assert body.index("__ldcg(guess + tt)") < body.index("load_w(A") < wait < body.index("__ldcg(rows + tt)")
    assert "n_exp - 1" in body[:wait]
    assert wait < body.index("if (settled != ti.expert)") < body.index("settle_pair(") < body.index("flush_rows(")
    # the forms that do not guess render as the shipped profiles timed them
    for other in (MmvqSpec.decode("q4_0", act="silu", rows=2), MmvqSpec.decode("q4_0", ids=False),
                  dataclasses.replace(MmvqSpec.decode("q4_0"), warps=8, combine=True)):
        assert "settle_pair" not in render(other) and "guess" not in render(other), other.name
    for bad in (dict(wait_first=True), dict(ids=False)):
        with pytest.raises(ValueError, match="guess"):
            dataclasses.replace(spec, **bad).check()
    with pytest.raises(ValueError, match="guess"):
        dataclasses.replace(MmvqSpec.decode("q4_0"), combine=True, guess=True).check()
    plain = render(MmvqSpec("q4_0", tokens=1, warps=4, rows=4, per_pair=True))
    assert "__ldcg" not in plain


def test_k_split_over_the_warps_is_the_models_long_dense_one_token_form():
    """MmvqSpec.ksplit: a block's warps take the same rows, each every WARPS-th k-unit, and
    add their partial sums in warp order; the model's one-token dense products pick it from
    KSPLIT_MIN_UNITS units a row up to KSPLIT_MAX_ROWS rows (not the tuner's baseline, nor
    experts or more tokens), and
    the form without it renders as the shipped profiles timed it."""
    import dataclasses
    from moeforge.codegen.enumerate import mmvq_specs
    from moeforge.codegen.quant import QUANT_TYPES
    from moeforge.runtime import dispatch
    plain = MmvqSpec.decode("q4_0", ids=False)
    split = dataclasses.replace(plain, ksplit=True)
    assert split.name == plain.name + "-ks"
    body = render(split)
    body = body[body.index(split.symbol + "("):]
    assert "lane + 32 * (warp + WARPS * (u + 1))" in body and "s += part[w][threadIdx.x]" in body
    assert "WARPS * " not in render(plain) and "part[" not in render(plain)
    for q in QUANT_TYPES.values():
        assert dispatch.default_mmvq(q.name, 1, False, 12288, 4096).name in {s.name for s in mmvq_specs(q)}
    assert not dispatch.default_mmvq("q4_0", 1, False, 2048).ksplit
    assert dispatch.default_mmvq("q4_0", 1, False, 4096).ksplit
    assert dispatch.default_mmvq("q4_K", 1, False, 12288, 4096).ksplit
    assert dispatch.default_mmvq("q4_K", 1, False, 12288, 4096).warps == dispatch.KSPLIT_WARPS
    # products with rows enough for the card stay unsplit (GLM-4.5-Air's qkv, its output head)
    assert not dispatch.default_mmvq("q4_0", 1, False, 4096, 14336).ksplit
    assert not dispatch.default_mmvq("q4_0", 1, False, 4096, 151552).ksplit
    assert not dispatch.default_mmvq("q4_0", 2, False, 12288).ksplit
    assert not dispatch.default_mmvq("q4_0", 1, True, 12288).ksplit
    assert not dispatch.default_mul_mat("q4_0", 4096, 12288, 1).spec.ksplit
    for bad in (dict(ids=True, guess=True), dict(per_pair=False, prequant=False)):
        with pytest.raises(ValueError, match="ksplit"):
            dataclasses.replace(split, **bad).check()
    # the model's wait-first expert gate/up: rows of four units and more, over 4 warps
    fused = {k: dispatch.default_fused("q4_0", 1, "silu", False, ids=True, k=k, wait_first=True)
             for k in (2048, 2880, 4096, 5120)}
    assert not fused[2048].ksplit and not fused[2880].ksplit
    # below the split, gpt-oss's rows of three units: one row with two units in flight for
    # 16-byte blocks; q8_0's and the super-block formats' keep two rows of one unit
    assert (fused[2048].rows, fused[2048].units) == (2, 1) and (fused[2880].rows, fused[2880].units) == (1, 2)
    for qtype, form in (("mxfp4", (1, 2)), ("iq4_xs", (2, 1)), ("q8_0", (2, 1)), ("q4_K", (2, 1))):
        spec = dispatch.default_fused(qtype, 1, "swiglu_oai", True, ids=True, k=2880, wait_first=True)
        assert (spec.rows, spec.units) == form, qtype
        assert spec.name in {s.name for s in mmvq_specs(QUANT_TYPES[qtype])}
    assert fused[4096].ksplit and fused[5120].ksplit and fused[4096].warps == 4
    assert fused[4096].name.endswith("-wf-u1-ks")
    assert not dispatch.default_fused("q4_0", 1, "silu", False, ids=True, k=4096).ksplit   # the guessing form
    names = {s.name for s in mmvq_specs(QUANT_TYPES["q4_0"])}
    assert {f.name for f in fused.values()} <= names
    body = render(fused[4096])
    assert "su += part_u[w][threadIdx.x]" in body and "s = activate(s, su)" in body


def test_router_rows_staged_past_the_registers():
    """router_route_cluster holds 2048 floats of a row in registers; the next ones (4096-wide
    routers: GLM-4.5-Air, Qwen3-235B-A22B) go to shared memory before the wait, as far as
    ROUTER_STAGE_BYTES for the block's 16 rows allow."""
    from moeforge.runtime.moe_cuda import ROUTER_STAGE_BYTES, router_staged4
    assert [router_staged4(k) for k in (130, 2048, 2880, 4096, 4098, 5120)] == [0, 0, 208, 512, 0, 768]
    assert 16 * 16 * router_staged4(1 << 16) <= ROUTER_STAGE_BYTES < 16 * 16 * (router_staged4(1 << 16) + 1)
    # a card that gives a block less shared memory (sm_120: 99 KiB) stages less, never more
    assert router_staged4(4096, 99 * 1024 - 4096) == (99 * 1024 - 4096) // 256 < 512
    assert router_staged4(4096, 0) == 0


def test_one_unit_in_flight_only_for_the_one_token_expert_forms():
    """units=1: each lane requests one k-unit at a time (one buffer, the next unit after
    the current one is computed), so that two rows of 32-byte blocks (or of q4_K's blocks
    with their raw 16 scale bytes) fit one wave. The guessing form requests its first unit
    before the wait; the model's wait-first form after it."""
    import dataclasses
    from moeforge.runtime import dispatch
    for qtype, wait_first in itertools.product(("q8_0", "q4_K"), (False, True)):
        spec = dispatch.default_fused(qtype, 1, "silu", False, ids=True, k=2048, wait_first=wait_first)
        assert (spec.rows, spec.units, spec.guess, spec.wait_first) == (2, 1, not wait_first, wait_first)
        assert spec.name.endswith("-wf-u1" if wait_first else "-g-u1")
        body = render(spec)
        body = body[body.index(spec.symbol + "("):]
        assert "WBuf A;" in body and "WBuf A, B;" not in body and "load_w(B" not in body
        first, wait = body.index("load_w(A, P, erow, r, lane);"), body.index("griddepcontrol.wait")
        assert (wait < first) if wait_first else (first < wait)
        assert max(first, wait) < body.index("if (u > 0) load_w(A, P, erow, r, lane + 32 * u);")
        assert body.count("griddepcontrol.wait") == 1
        assert "__launch_bounds__(NTHREADS, 6)" in render(spec)
    # the wait-first form takes one unit for every type; two units in flight wherever two
    # rows of them fit, and past one token
    assert dispatch.default_fused("q4_0", 1, "silu", False, ids=True, k=2048, wait_first=True).units == 1
    assert dispatch.default_fused("q4_0", 1, "silu", False, ids=True, k=2048).units == 2
    for wait_first in (False, True):
        assert dispatch.default_fused("q8_0", 2, "silu", False, ids=True, k=2048, wait_first=wait_first).units == 2
        assert dispatch.default_fused("q4_K", 2, "silu", False, ids=True, k=2048, wait_first=wait_first).rows == 2
    # the plain one-token expert product guesses where its buffers fit the bound; q4_K's do not
    assert dispatch.default_mmvq("q4_0", 1, ids=True).guess and dispatch.default_mmvq("q8_0", 1, ids=True).guess
    assert not dispatch.default_mmvq("q4_K", 1, ids=True).guess
    for bad in (dict(units=3), dict(units=1, guess=False, wait_first=False)):
        with pytest.raises(ValueError, match="unit"):
            dataclasses.replace(spec, **bad).check()


def test_wait_first_waits_before_the_expert_ids():
    """After the router (which wrote the ids) nothing may be read before the wait."""
    spec = MmvqSpec.decode("q4_0", rows=2, act="silu", wait_first=True)
    assert spec.name == MmvqSpec.decode("q4_0", rows=2, act="silu").name + "-wf"
    body = render(spec)
    body = body[body.index(spec.symbol + "("):]
    assert body.count("griddepcontrol.wait") == 1
    assert body.index("griddepcontrol.wait") < body.index("ti.expert = IDS ?") < body.index("load_w(A")
    with pytest.raises(ValueError, match="wait_first"):
        MmvqSpec("q4_0", tokens=1, per_pair=True, prequant=True, wait_first=True).check()


def test_quantizer_releases_first_only_when_asked():
    """release_first lets the product launch before the quantizer's wait: only for products
    that read nothing but weights (or settled ids) before their own wait (ops._mmvq)."""
    from moeforge.codegen.spec import UtilSpec
    body = _kernels(render(UtilSpec()))["quantize_q8_1"]
    early = body.index("if (release_first) asm volatile(\"griddepcontrol.launch_dependents;\");")
    assert early < body.index("pdl_wait_then_release();") < body.index("quantize_block8(")


def test_norms_can_write_their_output_quantized():
    from moeforge.codegen.spec import ModelSpec
    src = render(ModelSpec())
    for name in ("rms_norm", "add_rms_norm", "moe_combine_rms_norm"):
        body = src.split(f"void {name}(")[1]
        assert "norm_out(" in body[:body.index("\n}\n")]


def test_mmq_launch_forms_render_only_when_asked_and_compile():
    from moeforge.codegen.compile import compile_spec
    from moeforge.codegen.spec import MmqSpec
    base = MmqSpec("q4_0", x=8, y=128, warps=8, kblocks=16, stages=2, stream_k=False)
    twin = MmqSpec("q4_0", x=8, y=128, warps=8, kblocks=16, stages=2, stream_k=False, evict_first=True, pdl=True)
    assert twin.name == base.name + "-ef-pdl"
    a, b = render(base), render(twin)
    assert "griddepcontrol" not in a and "evict_first" not in a
    body = b[b.index(twin.symbol + "("):]
    assert body.index("griddepcontrol.wait") < body.index("load_unit(")
    assert b.count("cp_async16_stream(") == 2          # defined once, used for the weight quants
    for arch in ("sm_80", "sm_90"):
        assert compile_spec(twin, arch).cubin.exists()


def test_mmq_launch_form_streams_weights_only_when_read_once():
    from moeforge.codegen.spec import MmqSpec
    from moeforge.runtime import ops
    spec = MmqSpec("q4_0", x=16, y=128, warps=4, kblocks=8, stages=2, stream_k=False)
    E = 128
    assert ops.mmq_launch_form(spec, 8 * E, E, True) == MmqSpec(**{**spec.__dict__, "evict_first": True, "pdl": True})
    assert ops.mmq_launch_form(spec, 16 * E, E, False).evict_first and not ops.mmq_launch_form(spec, 16 * E, E, False).pdl
    assert ops.mmq_launch_form(spec, 32 * E, E, True) is spec          # rows read by two tile columns: as tuned
    dense = MmqSpec("q4_0", x=16, y=128, warps=4, kblocks=8, stages=2, ids=False)
    assert ops.mmq_launch_form(dense, E, E, True) is dense


def test_mmq_launch_form_routes_in_the_tile_only_for_few_tokens_per_expert_with_pdl():
    from moeforge.codegen.spec import MmqSpec
    from moeforge.runtime import ops
    spec = MmqSpec("q4_0", x=8, y=128, warps=4, kblocks=8, stages=2, stream_k=False)
    E = 128
    assert ops.mmq_launch_form(spec, 16 * 8, E, True).direct               # n=16, top_k=8: 1 token each
    assert ops.mmq_launch_form(spec, 32 * 8, E, True).direct               # 2 each
    assert not ops.mmq_launch_form(spec, 64 * 8, E, True).direct           # 4 each: lost to skew
    assert not ops.mmq_launch_form(spec, 16 * 8, E, False).direct          # no PDL: nothing to overlap
    sk = MmqSpec("q4_0", x=8, y=128, warps=4, kblocks=8, stages=2, stream_k=True)
    assert not ops.mmq_launch_form(sk, 16 * 8, E, True).direct             # stream-k splits tiles
    huge = 1 + spec.smem_bytes() // 4                                      # no room to count experts
    assert not ops.mmq_launch_form(spec, huge, huge, True).direct


def test_direct_routing_renders_only_when_asked_and_compiles():
    from moeforge.codegen.compile import compile_spec
    from moeforge.codegen.spec import MmqSpec
    base = MmqSpec("q4_0", x=8, y=128, warps=4, kblocks=8, stages=2, stream_k=False, evict_first=True, pdl=True)
    direct = MmqSpec(**{**base.__dict__, "direct": True})
    assert direct.name == base.name + "-dr"
    assert "expert_column" not in render(base)
    body = render(direct)[render(direct).index(direct.symbol + "("):]
    # the early weight copies go before the wait, the activations after it
    assert body.index("load_unit_w(") < body.index("griddepcontrol.wait") < body.index("load_unit_x(")
    for arch in ("sm_80", "sm_90"):
        assert compile_spec(direct, arch).cubin.exists()
    with pytest.raises(ValueError, match="stream-k"):
        MmqSpec("q4_0", x=8, y=128, warps=4, stream_k=True, direct=True).check()
    with pytest.raises(ValueError, match="MUL_MAT_ID"):
        MmqSpec("q4_0", x=8, y=128, warps=4, stream_k=False, ids=False, direct=True).check()


def test_lean_form_rule_and_source():
    """Every MMQ tile launches in its lean form unless its x rows take more than
    LEAN_MAX_ROW_SLOTS registers a thread; the lean source differs only in the unit walk
    and compiles for sm_80 and sm_90 without spilling."""
    import dataclasses
    from moeforge.codegen import compile as cmod
    from moeforge.codegen.spec import MmqSpec
    from moeforge.runtime import ops
    small = MmqSpec("q4_0", x=32, y=128, warps=4, kblocks=8, stages=2, stream_k=False)
    big = MmqSpec("q8_0", x=128, y=128, warps=8, kblocks=8, stages=2, stream_k=False)
    assert small.x_row_slots == 5 and big.x_row_slots == 10
    assert ops.lean_form(small) == dataclasses.replace(small, lean=True)
    assert ops.lean_form(big) is big
    assert ops.lean_form(ops.lean_form(small)) == ops.lean_form(small)
    lean = ops.lean_form(small)
    assert lean.name == small.name + "-ln"
    assert "Cursor" in cmod.render(lean) and "Cursor" not in cmod.render(small)
    for spec in (lean, dataclasses.replace(lean, ids=False, stream_k=True),
                 dataclasses.replace(lean, x=8, direct=True, pdl=True, evict_first=True)):
        for arch in ("sm_80", "sm_90"):
            _, log = cmod.nvrtc_compile(cmod.render(spec), spec.name, arch)
            info = cmod.parse_ptxas(log)[spec.symbol]
            assert info["spill_stores"] == 0, (spec.name, arch, info)


def test_combining_down_product_keeps_one_unit_in_flight_on_short_rows():
    """dispatch.default_combine: a warp a slot, one k-unit in flight on rows of up to two
    units (Qwen3-30B-A3B's down, k = 768; DeepSeek-V2-Lite's, k = 1408), two units of two
    rows a warp on longer ones (gpt-oss-20b's, k = 2880), each form among the generated
    instances.
    The one-unit form carries launch bounds of 32 warps an SM and fits them without
    spilling, for every quant type and both targets: that is what puts a 2048-row product's
    512 blocks in one wave."""
    from moeforge.codegen import compile as cmod
    from moeforge.codegen.quant import QUANT_TYPES
    from moeforge.runtime import dispatch
    short, long_ = dispatch.default_combine("q4_0", 1408, 6), dispatch.default_combine("mxfp4", 2880, 4)
    assert (short.warps, short.units, short.combine_blocks) == (8, 1, 4)
    assert (long_.warps, long_.units, long_.rows, long_.combine_blocks) == (4, 2, 2, 0)
    assert short.rows == 4
    from moeforge.codegen.enumerate import all_specs
    built = set(all_specs([QUANT_TYPES["mxfp4"], QUANT_TYPES["q4_0"]]))
    assert short in built and long_ in built
    assert dispatch.default_combine("q8_0", 1024, 3).warps == 4
    assert dispatch.default_combine("q8_0", 1024, 1).combine_blocks == 32
    with pytest.raises(ValueError, match="8 slots"):
        dispatch.default_combine("q4_0", 768, 9)
    assert "__launch_bounds__(NTHREADS, 4)" in cmod.render(short)
    assert "__launch_bounds__(NTHREADS)" in cmod.render(long_)
    for q in QUANT_TYPES:
        spec = dispatch.default_combine(q, 256, 8)
        spec.check()
        for arch in ("sm_80", "sm_90"):
            _, log = cmod.nvrtc_compile(cmod.render(spec), spec.name, arch)
            info = cmod.parse_ptxas(log)[spec.symbol]
            assert info["spill_stores"] == 0 and info["registers"] <= 64, (spec.name, arch, info)


def test_combining_down_product_splits_long_rows_over_warps():
    """Rows of COMBINE_KSPLIT_MIN_UNITS k-units and more (Mixtral-8x7B's down: 14 units, 2
    slots; a top-1 model's with 11 units): each slot's units over
    COMBINE_KSPLIT_WAYS warps, a block of top_k x ways warps, in COMBINE_KSPLIT_FORM's rows
    and units; shorter rows, and slots whose warps would not make a block of 2, 4 or 8,
    keep a warp a slot. The form is generated and renders the slot-major split."""
    from moeforge.codegen import compile as cmod
    from moeforge.codegen.enumerate import all_specs
    from moeforge.codegen.quant import QUANT_TYPES
    from moeforge.runtime import dispatch
    ways = dispatch.COMBINE_KSPLIT_WAYS
    mix = dispatch.default_combine("q4_0", 14336, 2)
    assert mix.combine and mix.ksplit and mix.warps == 2 * ways
    assert (mix.rows, mix.units) == dispatch.COMBINE_KSPLIT_FORM
    lead = dispatch.default_combine("q8_0", 10944, 1)
    assert lead.ksplit and lead.warps == ways
    built = set(all_specs([QUANT_TYPES["q4_0"], QUANT_TYPES["q8_0"]]))
    assert mix in built and lead in built
    assert not dispatch.default_combine("q4_0", 7168, 2).ksplit          # 7 units
    assert not dispatch.default_combine("q4_0", 14336, 3).ksplit         # 6 warps
    assert not dispatch.default_combine("q4_0", 14336, 8).ksplit         # 16 warps
    src = cmod.render(mix)
    assert "warp % top_k" in src and "ksub + kways * " in src and "part[w * top_k + j]" in src
    import dataclasses
    plain = dataclasses.replace(mix, ksplit=False)
    assert "ksub" not in cmod.render(plain)
