"""The f16 tensor-core path on the CPU: its specs, its reference, the runtime's rule."""
import dataclasses
import io

import numpy as np
import pytest

from moeforge import reference as ref
from moeforge.codegen.spec import KernelSpec, MmfSpec


@pytest.mark.parametrize("kw,msg", [
    (dict(qtype="q5_0"), "dequantizes"),
    (dict(qtype="q4_K"), "whole q4_K super-blocks"),
    (dict(x=12), "multiple of 8"),
    (dict(y=96, warps=4), "row warps"),
    (dict(kblocks=3), "kblocks"),
    (dict(stages=5), "stages"),
    (dict(qtype="mxfp4", kblocks=2), "4 scale bytes"),
])
def test_spec_refuses_what_cannot_be_built(kw, msg):
    base = dict(qtype="q4_0", x=64, y=128, warps=8, kblocks=4, stages=3)
    base.update(kw)
    with pytest.raises(ValueError, match=msg):
        MmfSpec(**base).check()


def test_spec_names_and_round_trip():
    s = MmfSpec("q8_0", x=128, y=128, warps=4, kblocks=4, stages=2, ids=False)
    assert s.name == "mmf-q8_0-x128y128w4k4s2" and s.symbol == "mmf_q8_0_x128y128w4k4s2"
    assert KernelSpec.from_dict(s.to_dict()) == s
    # x in f16 rows padded by 32 bytes, weight rows by 16: every region 16-byte aligned
    L = s.layout()
    assert L["x_row"] % 128 == 32 and all(L[r] % 16 == 0 for r in ("wq", "wm", "xh", "stage"))


@pytest.mark.parametrize("qtype", ["q4_0", "q8_0"])
def test_f16_weights_are_ggufs_dequantization_rounded_once(rng, qtype):
    """The reference's f16 weights: gguf's own dequantization (exact in float32) rounded to
    float16, which is what the kernel's exact (q - offset) times d, rounded once, gives."""
    raw = ref.random_blocks(qtype, 24, 160, rng)
    want = ref.dequantize(raw, qtype, (24, 160)).astype(np.float16)
    np.testing.assert_array_equal(ref.f16_weights(raw, qtype, 24, 160), want)


def test_q4_k_f16_weights_round_the_scales_then_the_fma(rng):
    """q4_K in f16: q * f16(d*sc) - f16(dmin*m), one rounding; within an f16 ulp or two of
    gguf's float32 weights, and bit for bit an independent float32 fma of the same."""
    raw = ref.random_blocks("q4_K", 12, 512, rng)
    got = ref.f16_weights(raw, "q4_K", 12, 512)
    ints, mul, add = ref._kernel_view(raw, ref.quant_type("q4_K"), 12, 512)
    s = np.repeat(mul.astype(np.float16).astype(np.float32), 32, axis=1)
    mn = np.repeat(add.astype(np.float16).astype(np.float32), 32, axis=1)
    fma32 = (ints.astype(np.float32) * s + mn)    # exact in float32 too: 4 x 11 bits, then one add
    np.testing.assert_array_equal(got, fma32.astype(np.float16))
    gguf_w = ref.dequantize(raw, "q4_K", (12, 512))
    assert np.abs(got.astype(np.float32) - gguf_w).max() <= 4e-3 * np.abs(gguf_w).max()


def test_q3_k_f16_weights_round_the_scale_then_the_product(rng):
    """q3_K in f16: (q - 4) * f16(d*sc), the scale rounded to f16 and the product once more
    (the kernel's hmul2 of an exact small integer); within an f16 ulp or two of gguf's
    float32 weights, and bit for bit a float32 product of the same (exact: 3 x 11 bits)."""
    rows, k = 12, 512
    raw = ref.random_blocks("q3_K", rows, k, rng)
    got = ref.f16_weights(raw, "q3_K", rows, k)
    blocks = raw.reshape(rows, k // 256, 110)
    gguf_w = ref.dequantize(raw, "q3_K", (rows, k))
    d = blocks[..., 108:110].copy().view(np.float16).astype(np.float32)               # (rows, nsb, 1)
    from moeforge.runtime.array_blocks import q3_k_parts
    qv, sc, _ = q3_k_parts(raw.reshape(-1, 110))
    s16 = (d.reshape(-1, 1) * sc.astype(np.float32)).astype(np.float16).astype(np.float32)   # (blocks, 16)
    prod = (qv.reshape(-1, 16, 16).astype(np.float32) * s16[..., None]).reshape(rows, k)
    np.testing.assert_array_equal(got, prod.astype(np.float16))
    assert np.abs(got.astype(np.float32) - gguf_w).max() <= 4e-3 * np.abs(gguf_w).max()


def test_q6_k_f16_weights_round_the_scale_then_the_product(rng):
    """q6_K in f16: (q - 32) * f16(d*sc), as q3_K's, q decoded here from the GGUF bytes
    with ggml's loop (ql nibbles, qh pairs, a scale a 16 weights) rather than the split's."""
    rows, k = 10, 768
    raw = ref.random_blocks("q6_K", rows, k, rng)
    got = ref.f16_weights(raw, "q6_K", rows, k)
    b = raw.reshape(-1, 210)
    ql, qh, sc = b[:, :128].astype(np.int32), b[:, 128:192].astype(np.int32), b[:, 192:208].view(np.int8)
    d = b[:, 208:210].copy().view(np.float16).astype(np.float32)
    q = np.empty((len(b), 256), dtype=np.int32)
    for h in range(2):            # each 128-weight half: 64 ql bytes, 32 qh bytes
        L, H = ql[:, 64 * h:64 * h + 64], qh[:, 32 * h:32 * h + 32]
        for j, (lo, shift) in enumerate(((L[:, :32] & 15, 0), (L[:, 32:] & 15, 2), (L[:, :32] >> 4, 4),
                                         (L[:, 32:] >> 4, 6))):
            q[:, 128 * h + 32 * j:128 * h + 32 * j + 32] = (lo | (((H >> shift) & 3) << 4)) - 32
    s16 = (d * sc.astype(np.float32)).astype(np.float16).astype(np.float32)          # (blocks, 16)
    want = (q.reshape(-1, 16, 16).astype(np.float32) * s16[..., None]).reshape(rows, k)
    np.testing.assert_array_equal(got, want.astype(np.float16))
    gguf_w = ref.dequantize(raw, "q6_K", (rows, k))
    assert np.abs(got.astype(np.float32) - gguf_w).max() <= 4e-3 * np.abs(gguf_w).max()


def test_q2_k_f16_weights_round_the_scales_then_the_fma(rng):
    """q2_K in f16: q * f16(d*sc) - f16(dmin*m), one rounding (q4_K's form, with 16-weight
    scales and mins); bit for bit a float32 fma of the same (exact: 2 x 11 bits, then one
    add), within an f16 ulp or two of gguf's float32 weights."""
    from moeforge.runtime.array_blocks import q2_k_parts
    rows, k = 12, 512
    raw = ref.random_blocks("q2_K", rows, k, rng)
    got = ref.f16_weights(raw, "q2_K", rows, k)
    qv, sc, mn, d, dmin = q2_k_parts(raw.reshape(-1, 84))
    s16 = (d * sc.astype(np.float32)).astype(np.float16).astype(np.float32)
    m16 = (dmin * mn.astype(np.float32)).astype(np.float16).astype(np.float32)
    fma32 = qv.reshape(-1, 16, 16).astype(np.float32) * s16[..., None] - m16[..., None]
    np.testing.assert_array_equal(got, fma32.reshape(rows, k).astype(np.float16))
    gguf_w = ref.dequantize(raw, "q2_K", (rows, k))
    assert np.abs(got.astype(np.float32) - gguf_w).max() <= 4e-3 * np.abs(gguf_w).max()


def _mxfp4_blocks(rng, rows, k, scale_bytes):
    raw = ref.random_blocks("mxfp4", rows, k, rng).reshape(rows, k // 32, 17)
    raw[:, :, 0] = rng.choice(np.asarray(scale_bytes, dtype=np.uint8), size=raw.shape[:2])
    return raw.reshape(rows, -1)


def test_mxfp4_f16_weights_are_the_level_times_the_scale_as_f16(rng):
    """mxfp4 in f16: the level (an integer, exact) times the scale 2^(e - 128) converted to
    f16 (the kernel's cvt of the float32 scale: subnormal below 2^-14, zero below 2^-25),
    the product rounded once. Where the scale itself is an f16 that is gguf's weight
    rounded once; below it the block is gone, as the kernel's is."""
    rows, k = 16, 256
    raw = _mxfp4_blocks(rng, rows, k, range(95, 141))
    got = ref.f16_weights(raw, "mxfp4", rows, k)
    blocks = raw.reshape(rows, k // 32, 17)
    e = np.repeat(blocks[:, :, 0].astype(np.int64), 32, axis=1)
    codes = np.concatenate([blocks[:, :, 1:] & 15, blocks[:, :, 1:] >> 4], axis=-1).reshape(rows, k)
    level = np.asarray(ref.quant_type("mxfp4").codebook, dtype=np.float16)[codes]
    scale16 = np.ldexp(np.ones_like(e, dtype=np.float64), e - 128).astype(np.float16)
    np.testing.assert_array_equal(got, (level * scale16).astype(np.float16))
    gguf_w = ref.dequantize(raw, "mxfp4", (rows, k))
    exact = e >= 104                                     # 2^(e-128) is an f16
    np.testing.assert_array_equal(got[exact], gguf_w[exact].astype(np.float16))
    assert (got[e < 103] == 0).all() and (got[e >= 114] != 0).any()


def _host_tensor(raw, q, rows, k):
    """A QuantTensor on the host, built from its split buffer alone (f16_fits read back)."""
    from moeforge.runtime.block_split import split_blocks
    from moeforge.runtime.tensor import QuantTensor
    qs, meta = split_blocks(raw.reshape(rows, -1), q, rows, k)
    off = QuantTensor._meta_offset(rows, q.blocks_per_row(k), q)
    buf = np.zeros(off + meta.size, dtype=np.uint8)
    buf[:qs.size], buf[off:] = qs.reshape(-1), meta.reshape(-1)
    return QuantTensor(buf, q, (rows, k))


def test_mxfp4_tensors_say_whether_their_scales_fit_f16(rng):
    """QuantTensor.f16_fits, read from the meta bytes on the host as on the device: the
    largest scale byte in [114, 140] (no weight past 65504, the largest blocks normal)."""
    from moeforge.codegen.quant import quant_type
    q = quant_type("mxfp4")
    rows, k = 6, 96

    def tensor(raw, qt=q):
        return _host_tensor(raw, qt, rows, k)

    assert tensor(ref.random_blocks("mxfp4", rows, k, rng)).f16_fits
    for top, fits in ((140, True), (141, False), (114, True), (113, False)):
        raw = _mxfp4_blocks(rng, rows, k, [100, 104, 110])
        raw.reshape(rows, -1, 17)[rng.integers(rows), rng.integers(k // 32), 0] = top
        assert tensor(raw).f16_fits == fits, top
    assert tensor(ref.random_blocks("q4_0", rows, k, rng), quant_type("q4_0")).f16_fits


def test_every_f16_tile_format_says_how_its_weights_fit_f16():
    """A format with f16 tiles has its guard (QuantTensor.f16_fits): its f16 scales' places
    and factors, or mxfp4's window of e8m0 bytes; the places inside the block."""
    from moeforge.codegen.quant import quant_type
    for name in MmfSpec.QTYPES:
        q = quant_type(name)
        assert bool(q.f16_scales) != (q.f16_scale_bytes is not None), name
        assert all(0 <= at <= q.block_bytes - 2 and factor > 0 for at, factor in q.f16_scales), name


@pytest.mark.parametrize("qtype", ["q4_0", "q8_0", "q2_K", "q3_K", "q4_K", "q5_K", "q6_K", "iq4_xs"])
def test_f16_scaled_tensors_fit_f16_while_their_largest_weight_does(rng, qtype):
    """blocks_fit_f16 for the formats with f16 scales: random blocks fit; one scale raised
    until the largest weight it can make passes 65504 does not (nor a NaN or infinite
    scale). The bound holds gguf's own weights (every scale 1: no weight of random blocks
    past it) and is close to what they reach (within a third: q2_K's mins add to its
    scales' products only where d and dmin differ in sign). A QuantTensor built on the host
    from its buffer alone reads it the same way (the buffer joined back)."""
    from moeforge.codegen.quant import quant_type
    from moeforge.runtime.tensor import F16_MAX, QuantTensor, blocks_fit_f16
    q = quant_type(qtype)
    rows, k = 4, 256
    raw = ref.random_blocks(qtype, rows, k, rng)
    assert blocks_fit_f16(raw, q)
    at, factor = q.f16_scales[0]
    for d, fits in ((F16_MAX / factor * 0.999, True), (F16_MAX / factor * 1.01, False), (np.nan, False),
                    (np.inf, False)):
        big = raw.copy().reshape(-1, q.block_bytes)
        b = rng.integers(len(big))
        big[b, at:at + 2] = np.array([d], dtype=np.float16).view(np.uint8)
        for other, _ in q.f16_scales[1:]:
            big[:, other:other + 2] = np.zeros(len(big), dtype=np.float16).view(np.uint8).reshape(-1, 2)
        assert blocks_fit_f16(big, q) == fits, (d, fits)
    ones = ref.random_blocks(qtype, 64, 1024, rng).reshape(-1, q.block_bytes)
    for at, _ in q.f16_scales:
        ones[:, at:at + 2] = np.array([1.0], dtype=np.float16).view(np.uint8)
    top, bound = np.abs(ref.dequantize(ones.reshape(64, -1), qtype, (64, 1024))).max(), sum(f for _, f in q.f16_scales)
    assert top <= bound <= 1.34 * top, (top, bound)
    host = _host_tensor(raw, q, rows, k)
    assert host.f16_fits and not QuantTensor(host.buffer, q, (rows, k), f16_fits=False).f16_fits


def test_an_mxfp4_tensor_past_f16_takes_the_int8_tiles(monkeypatch):
    """choose(..., f16=False): never the f16 tiles, neither the rule's nor a profile's."""
    from moeforge.runtime import dispatch, profiles_hook
    monkeypatch.setattr(dispatch, "_device_cc_major", lambda: 9)
    monkeypatch.setattr(dispatch, "device_sm_count", lambda: 132)
    monkeypatch.delenv("MOEFORGE_MMF", raising=False)
    shape = (32, 4, 2880, 2880)
    assert dispatch.choose_mul_mat_id("mxfp4", *shape, 4096).path == "mmf_id"
    assert dispatch.choose_mul_mat_id("mxfp4", *shape, 4096, f16=False).path == "mmq_id"
    assert dispatch.choose_mul_mat("mxfp4", 2880, 2880, 1024).path == "mmf"
    assert dispatch.choose_mul_mat("mxfp4", 2880, 2880, 1024, f16=False).path == "mmq"
    tuned = dispatch.Choice("mmf_id", MmfSpec("mxfp4", 128, 128, 4, 4, 2), "profile", ("mmq_id", "mmf_id"),
                            wgmma_timed=True)
    monkeypatch.setattr(profiles_hook, "lookup", lambda *a: tuned)
    assert dispatch.choose_mul_mat_id("mxfp4", *shape, 4096) == tuned
    assert dispatch.choose_mul_mat_id("mxfp4", *shape, 4096, f16=False).path == "mmq_id"


@pytest.mark.parametrize("qtype", ["q4_0", "q8_0", "q4_K", "mxfp4"])
def test_f16_emulation_is_closer_to_float64_than_q8_1(rng, qtype):
    E, m, k, n, top_k = 8, 48, 256, 19, 2
    raw = ref.random_blocks(qtype, E * m, k, rng)
    x = rng.standard_normal((n, k)).astype(np.float32)
    ids = np.stack([rng.choice(E, top_k, replace=False) for _ in range(n)]).astype(np.int32)
    flt = ref.mul_mat_id_float(ref.dequantize(raw, qtype, (E, m, k)), x, ids)
    e16 = ref.nmse(ref.mul_mat_id_emulated_f16(raw, qtype, (E, m, k), x, ids), flt)
    e8 = ref.nmse(ref.mul_mat_id_emulated(raw, qtype, (E, m, k), x, ids), flt)
    assert 0 < e16 < e8 / 10 and e16 < 1e-6


def test_rule_applies_on_hopper_past_its_thresholds(monkeypatch):
    from moeforge.runtime import dispatch
    monkeypatch.setattr(dispatch, "_device_cc_major", lambda: 9)
    monkeypatch.setattr(dispatch, "device_sm_count", lambda: 132)
    monkeypatch.delenv("MOEFORGE_MMF", raising=False)
    dense = dispatch.choose_mul_mat("q4_0", 5120, 2048, 512)
    assert dense.path == "mmf" and dense.source == "rule" and not dense.spec.ids and dense.spec.x == 128
    assert dense.spec.splits == 1                                          # 160 tiles: enough blocks
    assert dispatch.choose_mul_mat("q4_0", 2048, 4096, 512).spec.splits == 4     # 64 tiles
    assert dispatch.choose_mul_mat("q4_0", 4096, 2048, 512).spec.splits == 2     # 128
    assert dispatch.choose_mul_mat("q8_0", 2048, 4096, 2048).spec.splits == 1    # 256
    monkeypatch.setattr(dispatch, "device_sm_count", lambda: 64)
    assert dispatch.choose_mul_mat("q4_0", 2048, 4096, 512).spec.splits == 2     # a smaller card
    assert dispatch.choose_mul_mat("q8_0", 2048, 4096, 2048).spec.x == 128
    assert dispatch.choose_mul_mat("q4_0", 5120, 2048, 127).path != "mmf"
    short = dispatch.choose_mul_mat("q4_0", 5120, 2048, 128)                  # dense from 128 tokens
    assert short.path == "mmf" and short.spec.x == 128 and short.spec.splits == 3   # 40 tiles, 64 SMs
    assert dispatch.choose_mul_mat("q4_K", 5120, 2048, 512).spec.kblocks == 4      # wgmma: half a super-block
    assert dispatch.choose_mul_mat("q4_K", 2048, 4096, 512).spec.kblocks == 8      # split: whole ones
    moe = dispatch.choose_mul_mat_id("q8_0", 128, 8, 768, 2048, 4096)   # 256 an expert
    assert moe.path == "mmf_id" and moe.spec.ids and moe.spec.x == 128
    # q4_0 at 128 an expert: the wgmma tile (its mma.sync tiles only tie the int8 ones there)
    assert dispatch.choose_mul_mat_id("q4_0", 128, 8, 768, 2048, 2048).spec.wgmma
    monkeypatch.setattr(dispatch, "WGMMA", False)
    assert dispatch.choose_mul_mat_id("q4_0", 128, 8, 768, 2048, 2048).path != "mmf_id"
    monkeypatch.setattr(dispatch, "WGMMA", True)
    # q8_0, q4_K and iq4_xs from 64 tokens an expert, on the wgmma tiles: the 256-row one
    # where its tiles fill 4 waves of an H200's 132 SMs (768 tiles at 4096 tokens, 384 at
    # 2048 and 1024); the super-block formats' stages hold half of one
    monkeypatch.setattr(dispatch, "device_sm_count", lambda: 132)
    for qtype in ("q8_0", "q4_K", "iq4_xs"):
        tiles = [dispatch.choose_mul_mat_id(qtype, 128, 8, 768, 2048, n) for n in (512, 1024, 2048, 4096, 16384)]
        assert [c.path for c in tiles] == ["mmq_id"] + ["mmf_id"] * 4
        assert [(c.spec.x, c.spec.y, c.spec.kblocks) for c in tiles[1:]] == [(128, 128, 4), (128, 128, 4),
                                                                             (128, 256, 4), (128, 256, 4)]
        assert all(c.spec.wgmma for c in tiles[1:])
        wide = dispatch.choose_mul_mat(qtype, 2048, 4096, 2048).spec
        assert wide.x == 128 and wide.wgmma                                    # dense: the wide tile's
        with monkeypatch.context() as mp:                                        # without wgmma: mma.sync
            mp.setattr(dispatch, "WGMMA", False)
            spec = dispatch.choose_mul_mat_id(qtype, 128, 8, 768, 2048, 4096).spec
            assert not spec.wgmma and (spec.x, spec.y) == ((128, 128) if qtype == "q8_0" else (64, 256))
    # q5_K on the wgmma tiles from 64 tokens an expert too (its own tile there without them)
    assert [dispatch.choose_mul_mat_id("q5_K", 128, 8, 768, 2048, n).spec.wgmma for n in (1024, 2048)] == \
        [True, True]
    # q3_K's and q2_K's int8 tiles pay two products a block: their f16 tiles from 16 tokens an
    # expert, narrower below 64
    for qtype in ("q2_K", "q3_K"):
        tiles = [dispatch.choose_mul_mat_id(qtype, 128, 8, 768, 2048, n) for n in (128, 256, 512, 1024, 4096)]
        assert [c.path for c in tiles] == ["mmq_id"] + ["mmf_id"] * 4
        assert [(c.spec.x, c.spec.y) for c in tiles[1:]] == [(32, 256), (64, 256), (128, 128), (128, 256)]
        assert [c.spec.wgmma for c in tiles[1:]] == [False, False, True, True]
    assert dispatch.choose_mul_mat_id("q4_0", 128, 8, 768, 2048, 1024).spec.wgmma    # 64 an expert
    assert dispatch.choose_mul_mat_id("q4_0", 128, 8, 768, 2048, 1016).path != "mmf_id"   # under 64
    monkeypatch.setenv("MOEFORGE_MMF", "0")
    assert dispatch.choose_mul_mat("q4_0", 5120, 2048, 512).path != "mmf"
    monkeypatch.delenv("MOEFORGE_MMF")
    # sm_90's warpgroup tiles in place of the unsplit wide tile; the split forms stay mma.sync
    monkeypatch.setattr(dispatch, "device_sm_count", lambda: 132)
    assert dense.spec.wgmma and (dense.spec.y, dense.spec.warps) == (128, 8)
    assert not dispatch.choose_mul_mat("q4_0", 2048, 4096, 512).spec.wgmma
    gate = dispatch.choose_mul_mat_id("q4_0", 8, 2, 28672, 4096, 2048)   # Mixtral's: 3584 tiles of 256 rows
    down = dispatch.choose_mul_mat_id("q4_0", 8, 2, 4096, 14336, 2048)   # 512: under 4 waves
    assert gate.spec.wgmma and gate.spec.y == 256 and down.spec.wgmma and down.spec.y == 128
    # Qwen3-30B-A3B's down at 1024 and 2048 tokens: 1024 tiles of 256 rows, 7.8 waves
    assert [dispatch.choose_mul_mat_id("q4_0", 128, 8, 2048, 768, n).spec.y for n in (1024, 2048)] == [256, 256]
    # gpt-oss-20b's down at 1024 tokens: 384 tiles, 2.9 waves; at 2048 5.8
    assert [dispatch.choose_mul_mat_id("q4_0", 32, 4, 2880, 2880, n).spec.y for n in (1024, 2048)] == [128, 256]
    monkeypatch.setenv("MOEFORGE_WGMMA", "0")
    assert dispatch.choose_mul_mat_id("q4_0", 8, 2, 28672, 4096, 2048).spec == \
        MmfSpec("q4_0", *dispatch.MMF_WIDE_TILE, ids=True)
    monkeypatch.delenv("MOEFORGE_WGMMA")
    monkeypatch.setattr(dispatch, "_device_cc_major", lambda: 8)
    assert dispatch.choose_mul_mat("q4_0", 5120, 2048, 512).path != "mmf"
    monkeypatch.setattr(dispatch, "_device_cc_major", lambda: None)   # no GPU
    assert dispatch.choose_mul_mat("q4_0", 5120, 2048, 512).path != "mmf"


def test_the_rules_tiles_are_generated(monkeypatch):
    """The runtime may only choose what `moeforge generate` builds."""
    from moeforge.codegen.enumerate import all_specs
    from moeforge.codegen.quant import parse_types
    from moeforge.runtime import dispatch
    built = set(all_specs(parse_types("all")))
    monkeypatch.setattr(dispatch, "_device_cc_major", lambda: 9)
    for sms in (132, 114, 78, 46):      # H100 SXM, H100 PCIe, an L40S-sized and a small card
        monkeypatch.setattr(dispatch, "device_sm_count", lambda: sms)
        for qtype in MmfSpec.QTYPES:
            for n, tpe, m in ((128, None, 2048), (256, None, 6144), (512, None, 2048), (512, None, 512),
                              (512, None, 5120), (4096, None, 2048),
                              (4096, 256.0, None), (8192, 1024.0, None)):
                c = dispatch.mmf_choice(qtype, n, tpe, m)
                assert c is not None and c.spec in built, c


def test_a_tile_past_sm90s_shared_memory_comes_with_one_stage_fewer(monkeypatch):
    """q5_K's x64y256 (three stages of whole super-blocks: 251904 bytes) cannot launch on an
    H100 or H200; its two-stage form is built, fits, and is what q5_K's expert rule takes
    from 64 tokens an expert where there are no wgmma tiles (below that, its int8 tiles)."""
    from moeforge.codegen.enumerate import SM90_SMEM_PER_BLOCK, mmf_specs
    from moeforge.codegen.quant import quant_type
    from moeforge.runtime import dispatch
    built = mmf_specs(quant_type("q5_K"))
    three = MmfSpec("q5_K", 64, 256, 8, 8, 3, ids=True)
    two = MmfSpec("q5_K", 64, 256, 8, 8, 2, ids=True)
    assert three in built and three.smem_bytes() > SM90_SMEM_PER_BLOCK
    assert two in built and two.smem_bytes() <= SM90_SMEM_PER_BLOCK
    assert all(s.smem_bytes() <= SM90_SMEM_PER_BLOCK for s in mmf_specs(quant_type("q4_K")) if s.stages == 2)
    # every other format: nothing added (the wgmma tiles' stages are their own)
    assert len([s for s in mmf_specs(quant_type("q4_K")) if not s.wgmma]) == len([s for s in built if not s.wgmma]) - 2
    monkeypatch.setattr(dispatch, "_device_cc_major", lambda: 9)
    assert dispatch.mmf_choice("q5_K", 1024, 64.0).spec.wgmma        # the wgmma tiles from 64
    monkeypatch.setattr(dispatch, "WGMMA", False)
    assert dispatch.mmf_choice("q5_K", 1024, 64.0).spec == two
    assert dispatch.mmf_choice("q5_K", 2048, 128.0).spec == two
    assert dispatch.mmf_choice("q5_K", 512, 32.0) is None


def test_dense_split_counts():
    from moeforge.runtime.dispatch import mmf_dense_splits
    assert [mmf_dense_splits(n, 2048, 132) for n in (128, 256, 512, 1024, 2048, 4096)] == [4, 4, 4, 2, 1, 1]
    assert mmf_dense_splits(512, 151936, 132) == 1                   # a vocabulary head: tiles enough
    assert mmf_dense_splits(512, 2048, 16) == 1


def test_a_tuned_entry_that_timed_the_f16_path_stands_over_the_rule(monkeypatch):
    from moeforge.codegen.spec import MmqSpec
    from moeforge.runtime import dispatch, profiles_hook
    monkeypatch.setattr(dispatch, "_device_cc_major", lambda: 9)
    int8 = MmqSpec("q4_0", x=32, y=128, warps=4, ids=False)
    older = dispatch.Choice("mmq", int8, "profile")                      # tuned before f16 tiles existed
    newer = dispatch.Choice("mmq", int8, "profile", ("mmq", "mmf"))      # timed them, kept int8
    newest = dispatch.Choice("mmq", int8, "profile", ("mmq", "mmf"), wgmma_timed=True)
    monkeypatch.setattr(profiles_hook, "lookup", lambda *a: older)
    assert dispatch.choose_mul_mat("q4_0", 5120, 2048, 512).path == "mmf"
    monkeypatch.setattr(profiles_hook, "lookup", lambda *a: newer)
    # on sm_90 a study that timed the mma.sync f16 tiles only gives way to the wgmma tile
    assert dispatch.choose_mul_mat("q4_0", 5120, 2048, 512).spec.wgmma
    monkeypatch.setattr(profiles_hook, "lookup", lambda *a: newest)
    assert dispatch.choose_mul_mat("q4_0", 5120, 2048, 512) == newest
    monkeypatch.setenv("MOEFORGE_WGMMA", "0")
    monkeypatch.setattr(profiles_hook, "lookup", lambda *a: newer)
    assert dispatch.choose_mul_mat("q4_0", 5120, 2048, 512) == newer


def test_bench_paths_include_the_f16_tiles_past_decode_sizes():
    from moeforge.bench import _choices
    qwen = (128, 8, 768, 2048)
    assert "mmf_id" in [c.path for c in _choices("all", "q4_0", qwen, 512)]
    assert "mmf_id" not in [c.path for c in _choices("all", "q4_0", qwen, 4)]
    with pytest.raises(ValueError, match="unknown expert-product path 'mmf'"):
        _choices("mmf", "q4_0", qwen, 512)


def test_bench_sweep_times_every_generated_f16_tile(monkeypatch):
    """`moeforge bench --paths sweep` puts the f16 tiles next to the int8 ones past decode
    sizes (for the types that have them), each an instance `moeforge generate` builds."""
    from moeforge.bench import _choices
    from moeforge.codegen.enumerate import MMF_TILES, all_specs, mmf_wgmma_specs
    from moeforge.codegen.quant import quant_type
    from moeforge.runtime import dispatch
    monkeypatch.setattr(dispatch, "_device_cc_major", lambda: 9)
    monkeypatch.setattr(dispatch, "device_sm_count", lambda: 132)
    qwen = (128, 8, 768, 2048)
    for qtype in ("q2_K", "q3_K", "q6_K"):
        built = {s for s in all_specs([quant_type(qtype)])}
        choices = _choices("sweep", qtype, qwen, 512)
        f16 = [c for c in choices if c.path == "mmf_id"]
        wgmma = [s for s in mmf_wgmma_specs(quant_type(qtype)) if s.ids]     # sm_90 (cc 9 above)
        assert len(f16) == len(MMF_TILES) + len(wgmma)
        assert {c.spec for c in f16} >= set(wgmma) and wgmma
        assert all(c.spec in built for c in choices)
        assert not [c for c in _choices("sweep", qtype, qwen, 8) if c.path == "mmf_id"]


def test_split_k_is_a_named_gated_form():
    """splits=1 renders the kernel every profile entry was tuned with; a split form names its
    splits, takes the stride of its partial copies and brings the in-order sum."""
    from moeforge.codegen.render import render
    plain, split = MmfSpec("q4_0", 128, 128, 4, 4, 2, ids=False), MmfSpec("q4_0", 128, 128, 4, 4, 2, ids=False, splits=3)
    assert split.name == "mmf-q4_0-x128y128w4k4s2-k3" and plain.name == "mmf-q4_0-x128y128w4k4s2"
    a, b = render(plain), render(split)
    assert "split_stride" not in a and "mmf_split_sum" not in a
    assert "long long split_stride)" in b and "mmf_split_sum(" in b and "#define SPLITS 3" in b
    with pytest.raises(ValueError, match="splits must be 1 to 4"):
        MmfSpec("q4_0", 128, 128, 4, 4, 2, ids=False, splits=5).check()


@pytest.mark.parametrize("splits", [2, 3, 4])
def test_split_k_chunks_cover_k_once(splits):
    """The k-chunk runs of the splits, as the rendered kernel computes them, cover every chunk
    of every row exactly once, in order (a split may get none: k of one chunk)."""
    import re
    from moeforge.codegen.render import render
    src = render(MmfSpec("q8_0", 128, 128, 4, 4, 2, ids=False, splits=splits))
    m = re.search(r"const int kc0 = (.+?), I = (.+?) - kc0;", src)
    assert m and "#define SPLITS %d" % splits in src
    for chunks in range(1, 70):
        covered = []
        for split in range(splits):
            env = dict(split=split, chunks=chunks, SPLITS=splits)
            kc0 = eval(m.group(1).replace("/", "//"), {}, env)          # noqa: S307 - int division, as in C
            count = eval(m.group(2).replace("/", "//"), {}, env) - kc0  # noqa: S307
            assert count >= 0
            covered += range(kc0, kc0 + count)
        assert covered == list(range(chunks)), (chunks, covered)


def test_wgmma_tiles_are_sm90_instances_with_aligned_swizzled_panels(tmp_path):
    """MmfSpec.wgmma: its own name, sm_90 only (`moeforge generate` skips it elsewhere;
    NVRTC compiles it for sm_90a, whose wgmma it uses), panels 1024-byte aligned (the
    128-byte swizzle is of absolute addresses), nothing beside the stages (the rows are in
    registers), one tile a row count, the deepest that fits, and only the shapes its
    template is written for."""
    from moeforge.codegen.compile import compile_spec
    from moeforge.codegen.enumerate import SM90_SMEM_PER_BLOCK, mmf_wgmma_specs
    from moeforge.codegen.generate import generate
    from moeforge.codegen.quant import parse_types, quant_type
    spec = MmfSpec("q4_0", 128, 256, 8, 4, 3, ids=True, wgmma=True)
    assert spec.name == "mmf_id-q4_0-x128y256w8k4s3-wg"
    assert spec.supports("sm_90") and not spec.supports("sm_80") and spec.nvrtc_arch("sm_90") == "sm_90a"
    with pytest.raises(ValueError, match="sm_90 only"):
        spec.nvrtc_arch("sm_89")
    L = spec.layout()
    assert L["xh"] % 1024 == 0 and L["stage"] % 1024 == 0 and spec.smem_bytes() == 3 * L["stage"]
    assert L["stage"] - L["xh"] == 128 * 4 * 64                      # x: 128 tokens of 4 blocks
    for bad in (dict(warps=4), dict(y=192), dict(x=32), dict(kblocks=3), dict(stages=2), dict(wn=2)):
        with pytest.raises(ValueError):
            dataclasses.replace(spec, **bad).check()
    built = {q: mmf_wgmma_specs(quant_type(q)) for q in MmfSpec.QTYPES}
    assert spec in built["q4_0"] and all(s.smem_bytes() <= SM90_SMEM_PER_BLOCK for v in built.values() for s in v)
    for q, v in built.items():
        assert sorted((s.ids, s.y) for s in v) == [(False, 128), (False, 256), (True, 128), (True, 256)], q
        # five stages of 128 rows where they fit, else four (q8_0, q5_K, q6_K: 53-55 KB a stage)
        stages = 4 if q in ("q8_0", "q5_K", "q6_K") else 5
        assert [s.stages for s in v if s.y == 128] == [stages, stages], q
        assert MmfSpec(q, 128, 128, 8, 4, stages + 1, ids=True, wgmma=True).smem_bytes() > SM90_SMEM_PER_BLOCK \
            or stages == 5
    # stages of whole super-blocks leave room for few: the super-block formats' hold half of
    # one and its scales, whole (MmfSpec.part_super)
    for q in ("q4_K", "q5_K", "iq4_xs"):
        sb = quant_type(q).sub_blocks
        assert {(s.kblocks, s.part_super, s.meta_kblocks) for s in built[q]} == {(4, True, sb)}
        assert all(s.layout()["wm_row"] >= sb * quant_type(q).meta_bytes for s in built[q])
    with pytest.raises(ValueError, match="whole q4_K super-blocks"):
        MmfSpec("q4_K", 128, 128, 4, 4, 2, ids=True).check()       # the mma.sync tiles' stages hold whole ones
    dense = MmfSpec("q8_0", 128, 128, 8, 4, 4, ids=False, wgmma=True)
    assert dense in built["q8_0"]
    ck = compile_spec(dense, "sm_90", tmp_path)
    assert ck.info[dense.symbol]["spill_stores"] == 0 and ck.cubin.exists()
    summary = generate(parse_types("q8_0"), ("sm_80",), tmp_path, progress=False, out=io.StringIO(),
                       subset={"sm_80": [dense, MmfSpec("q8_0", 128, 128, 4, 4, 2, ids=False)]})
    assert summary["total"] == 1 and summary["failures"] == []


def test_glu_tiles_are_named_expert_wgmma_instances_with_room_for_their_epilogue(tmp_path):
    """MmfSpec.glu: an expert wgmma tile that writes act(gate) * up as the down product's
    f16 x. Its own name and round trip; refused off the expert wgmma tiles and for other
    activations; built for every format's expert tiles (so `moeforge generate` compiles
    them) and not among the tiles the rules pick from; its epilogue fits in its stages'
    memory; the plain tiles' source does not carry it; compiled for sm_90 without spills."""
    from moeforge.codegen.compile import compile_spec
    from moeforge.codegen.enumerate import mmf_glu_specs, mmf_specs, mmf_wgmma_specs
    from moeforge.codegen.quant import quant_type
    from moeforge.codegen.render import render
    base = MmfSpec("q4_0", 128, 256, 8, 4, 3, ids=True, wgmma=True)
    silu, oai = (dataclasses.replace(base, glu=a) for a in ("silu", "swiglu_oai"))
    assert silu.name == "mmf_id-q4_0-x128y256w8k4s3-wg-silu" and oai.name.endswith("-wg-oai")
    assert KernelSpec.from_dict(oai.to_dict()) == oai and KernelSpec.from_dict(base.to_dict()) == base
    for bad, msg in [(dict(glu="gelu"), "glu must be one of"), (dict(wgmma=False, x=64, y=128, warps=8), "expert wgmma"),
                     (dict(ids=False), "expert wgmma")]:
        with pytest.raises(ValueError, match=msg):
            dataclasses.replace(silu, **bad).check()
    # both warpgroups' accumulators (x/2 floats an m64 slice a thread), the rows, the biases
    assert silu.epilogue_smem_bytes() == 256 * 2 * 64 * 4 + 128 * 4 + 256 * 4
    assert base.epilogue_smem_bytes() == 256 * 2 * 64 * 4 + 128 * 4
    assert dataclasses.replace(base, ids=False).epilogue_smem_bytes() == 0    # stores from registers
    small = dataclasses.replace(base, kblocks=2)    # stages of 98304 bytes
    with pytest.raises(ValueError, match="epilogue needs 131584 bytes"):
        small.check()
    dataclasses.replace(small, ids=False).check()
    for q in MmfSpec.QTYPES:
        glu = mmf_glu_specs(quant_type(q))
        assert sorted((s.y, s.glu) for s in glu) == [(128, "silu"), (128, "swiglu_oai"), (256, "silu"),
                                                     (256, "swiglu_oai")], q
        assert all(s.epilogue_smem_bytes() <= s.smem_bytes() for s in glu)
        assert set(glu) <= set(mmf_specs(quant_type(q)))
        assert all(s.glu is None for s in mmf_wgmma_specs(quant_type(q)))
    src = render(base)
    assert "glu_store(d" not in src and "tile_store(d, smem" in src and "float* __restrict__ out" in src
    assert "tile_store(d" not in render(dataclasses.replace(base, ids=False))
    for s in (silu, oai):
        text = render(s)
        assert "glu_store(d, smem" in text and "tile_store(d" not in text and "int okp" in text and ("swiglu_oai(" in text) == (s is oai)
    ck = compile_spec(oai, "sm_90", tmp_path)
    assert ck.info[oai.symbol]["spill_stores"] == 0 and ck.cubin.exists()
