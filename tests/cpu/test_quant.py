import gguf
import numpy as np
import pytest

from moeforge import reference as ref
from moeforge.codegen.quant import QUANT_TYPES, parse_types, quant_type, type_name
from moeforge.runtime.block_split import join_blocks, split_blocks


@pytest.mark.parametrize("name", list(QUANT_TYPES))
def test_table_agrees_with_gguf(name):
    q = quant_type(name)
    block_values, block_bytes = gguf.GGML_QUANT_SIZES[q.ggml_type]
    assert (q.block_values, q.block_bytes) == (block_values, block_bytes)
    span = q.qs_bytes * q.sub_blocks
    if q.inline_meta:
        # q3_K: each kernel block's 16 bytes hold all of it, at most 16 bytes a 32 weights
        assert q.qs_bytes == 16 and q.meta_bytes == 0 and span >= q.block_bytes
        assert q.two_scales != q.half_mins      # q3_K folds two scales; q2_K has mins
        assert not q.super_meta and q.meta_stride(4096) == 0
        return
    assert q.qs_bytes % 16 == 0 and 0 <= q.qs_offset and q.qs_offset + span <= q.block_bytes
    if q.own_meta_bytes:
        # each kernel block's meta of its own (q6_K: its high bits, two scales, d again):
        # at least the bytes outside qs, shared among the kernel blocks
        assert q.meta_bytes * q.sub_blocks >= q.block_bytes - span and q.meta_bytes % 4 == 0
    else:
        assert q.meta_bytes * q.sub_blocks + span == q.block_bytes
    assert q.name == quant_type(name.upper()).name == type_name(q.ggml_type)


@pytest.mark.parametrize("name", list(QUANT_TYPES))
@pytest.mark.parametrize("blocks", [1, 3, 32, 90])
def test_split_layout_round_trips_and_aligns(rng, name, blocks):
    q = quant_type(name)
    k = blocks * q.block_values
    rows = 7
    raw = ref.random_blocks(name, rows, k, rng)
    qs, meta = split_blocks(raw, q, rows, k)
    assert qs.shape[1] % 16 == 0 and meta.shape[1] % 16 == 0
    assert np.array_equal(join_blocks(qs, meta, q, rows, k), raw)
    nb = k // 32
    # padding of the meta rows is zero: a k-chunk past the row end reads zero scales
    assert not meta[:, nb * q.meta_bytes:].any()
    assert meta.shape[1] >= -(-nb // q.pad_blocks) * q.pad_blocks * q.meta_bytes


def test_q6_k_split_layout_is_what_the_kernels_read(rng):
    """The q6_K kernels' reading of the split bytes (quant_q6_K.cuh.j2, get_rows_q6_K):
    block b's low nibbles in q4_0's order, meta word h (values 16h..16h+15) byte j & 3 bits
    2*(j >> 2)+1.. the high part of value 16h + j with its top bit flipped, then the scales
    of values 0..15 and 16..31, then d; (d * sc) * (q - 32) is gguf's dequantization bit for
    bit, and the bytes the kernels build, nibble << 2 | flipped high part << 6, are the
    int8 4 * (q - 32)."""
    q = quant_type("q6_K")
    rows, k = 5, 768
    raw = ref.random_blocks("q6_K", rows, k, rng)
    qs, meta = split_blocks(raw, q, rows, k)
    nb = k // 32
    qb = qs.reshape(rows, nb, 16)
    m = meta[:, :nb * 12].reshape(rows, nb, 12)
    low = np.concatenate([qb & 15, qb >> 4], axis=-1).astype(np.int32)              # value j
    words = m[..., :8].reshape(rows, nb, 2, 4)                                        # (h, byte)
    high = np.stack([(words >> (2 * i)) & 3 for i in range(4)], axis=-2)             # (h, i, byte)
    high = high.reshape(rows, nb, 32).astype(np.int32)
    v = (low | ((high ^ 2) << 4)) - 32
    as_int8 = ((low << 2) | (high << 6)).astype(np.uint8).view(np.int8)
    assert np.array_equal(as_int8.astype(np.int32), 4 * v)
    sc = np.repeat(m[..., 8:10].copy().view(np.int8).astype(np.float32), 16, axis=-1)
    d = m[..., 10:12].copy().view(np.float16).astype(np.float32)
    w = ((d * sc) * v.astype(np.float32)).reshape(rows, k)
    want = ref.dequantize(raw, "q6_K", (rows, k))
    assert np.array_equal(w.view(np.uint32), want.view(np.uint32))


def _inline_blocks(rng, name, rows, k):
    """Random GGUF rows of an inline-meta format, and their split: (raw, the kernel blocks'
    16 bytes (rows, nb, 16), their four words as uint64 (rows, nb, 4)); no meta region."""
    raw = ref.random_blocks(name, rows, k, rng)
    qs, meta = split_blocks(raw, quant_type(name), rows, k)
    assert meta.size == 0
    b = qs.reshape(rows, k // 32, 16)
    return raw, b, b.view(np.uint32).reshape(rows, k // 32, 4).astype(np.uint64)


def test_q3_k_split_layout_is_what_the_kernels_read(rng):
    """The q3_K kernels' reading of a block's 16 bytes (quant_q3_K.cuh.j2, get_rows_q3_K),
    written as the kernels' word operations: for lane i, ((lo >> 2i) << 5) & 0x60606060 |
    (h << (7 - i)) & 0x80808080 (h << (3 - i) for values 16..31) is the int8 32 * (q - 4) of
    values 4i..4i+3 of the half; (d * sc) * (q - 4) with the block's scale bytes is gguf's
    dequantization bit for bit."""
    rows, k, nb = 5, 768, 24
    raw, b, words = _inline_blocks(rng, "q3_K", rows, k)
    v = np.zeros((rows, nb, 32), dtype=np.int32)
    for half in range(2):
        for i in range(4):
            w = (((words[..., half] >> (2 * i)) << 5) & 0x60606060) | ((words[..., 2] << (7 - i - 4 * half)) & 0x80808080)
            as_int8 = (w & 0xFFFFFFFF).astype(np.uint32)[..., None].view(np.uint8).view(np.int8)
            v[..., 16 * half + 4 * i:16 * half + 4 * i + 4] = as_int8.astype(np.int32)
    assert not (v % 32).any() and v.min() >= -128 and v.max() <= 96
    sc = np.repeat(b[..., 12:14].view(np.int8).astype(np.float32), 16, axis=-1)
    d = b[..., 14:16].copy().view(np.float16).astype(np.float32)
    w = ((d * sc) * (v // 32).astype(np.float32)).reshape(rows, k)
    want = ref.dequantize(raw, "q3_K", (rows, k))
    assert np.array_equal(w.view(np.uint32), want.view(np.uint32))


def test_q2_k_split_layout_is_what_the_kernels_read(rng):
    """The q2_K kernels' reading of a block's 16 bytes (quant_q2_K.cuh.j2, get_rows_q2_K):
    lane i's quants of a half are (word >> 2i) & 0x03030303, and that word times the half's
    scale is the bytes q * sc (no carries); (d * sc) * q - dmin * m with the block's (scale,
    min) bytes and d, dmin is gguf's dequantization bit for bit."""
    rows, k, nb = 5, 768, 24
    raw, b, words = _inline_blocks(rng, "q2_K", rows, k)
    sm = b[..., 8:10].astype(np.uint64)
    v = np.zeros((rows, nb, 32), dtype=np.int64)
    for half in range(2):
        for i in range(4):
            w = (words[..., half] >> (2 * i)) & 0x03030303
            scaled = (w * (sm[..., half] & 15)).astype(np.uint32)
            qb = w.astype(np.uint32)[..., None].view(np.uint8).astype(np.int64)
            assert np.array_equal(scaled[..., None].view(np.uint8), (qb * (sm[..., half:half + 1] & 15)).astype(np.uint8))
            v[..., 16 * half + 4 * i:16 * half + 4 * i + 4] = qb
    sc = np.repeat((b[..., 8:10] & 15).astype(np.float32), 16, axis=-1)
    mn = np.repeat((b[..., 8:10] >> 4).astype(np.float32), 16, axis=-1)
    d = b[..., 12:14].copy().view(np.float16).astype(np.float32)
    dmin = b[..., 14:16].copy().view(np.float16).astype(np.float32)
    w = ((d * sc) * v.astype(np.float32) - dmin * mn).reshape(rows, k)
    want = ref.dequantize(raw, "q2_K", (rows, k))
    assert np.array_equal(w.view(np.uint32), want.view(np.uint32))


def test_q5_k_split_layout_is_what_the_kernels_read(rng):
    """The q5_K kernels' reading of the split bytes (quant_q5_K.cuh.j2, get_rows_q5_K): block
    b's nibbles in q4_0's order; its super-block's 48 meta bytes at 6 * (b & ~7), the 16
    scale bytes of q4_K and then a word of fifth bits a block, which the kernels' shift and
    mask put under nibble word w (bit w of byte j for the low nibbles, bit 4 + w for the
    high ones); (d * sc) * q - dmin * m is gguf's dequantization bit for bit."""
    q = quant_type("q5_K")
    rows, k = 5, 768
    raw = ref.random_blocks("q5_K", rows, k, rng)
    qs, meta = split_blocks(raw, q, rows, k)
    nb = k // 32
    words = qs.reshape(rows, nb, 16).copy().view(np.uint32).astype(np.uint64)      # (rows, nb, w)
    sb = meta[:, :nb * 6].reshape(rows, nb // 8, 48)
    high = sb[..., 16:].copy().view(np.uint32).reshape(rows, nb, 1).astype(np.uint64)
    w_idx = np.arange(4, dtype=np.uint64)
    lo = (words & 0x0F0F0F0F) | ((high << (4 - w_idx)) & 0x10101010)
    hi = ((words >> 4) & 0x0F0F0F0F) | ((high >> w_idx) & 0x10101010)
    as_bytes = lambda v: v.astype(np.uint32).view(np.uint8).reshape(rows, nb, 16)  # noqa: E731
    v = np.concatenate([as_bytes(lo), as_bytes(hi)], axis=-1).astype(np.float32)    # values 0..31
    assert v.max() == 31
    sc, mn = ref.q4_k_scales(sb[..., 4:16])                                         # (rows, nsb, 8)
    d = sb[..., 0:2].copy().view(np.float16).astype(np.float32)
    dmin = sb[..., 2:4].copy().view(np.float16).astype(np.float32)
    mul = (d * sc).reshape(rows, nb, 1)
    off = (dmin * mn).reshape(rows, nb, 1)
    w = (mul * v - off).reshape(rows, k)
    want = ref.dequantize(raw, "q5_K", (rows, k))
    assert np.array_equal(w.view(np.uint32), want.view(np.uint32))


def _prmt(a, b, s):
    """PTX prmt.b32 in its default mode: byte n of the result is byte (bits 0-2 of nibble n
    of s) of b:a, or, where bit 3 of that nibble is set, that byte's sign repeated."""
    src = (b.astype(np.uint64) << np.uint64(32)) | a.astype(np.uint64)
    s = np.asarray(s, dtype=np.uint64)
    out = np.zeros_like(a, dtype=np.uint64)
    for n in range(4):
        nib = (s >> np.uint64(4 * n)) & np.uint64(15)
        byte = (src >> ((nib & np.uint64(7)) * np.uint64(8))) & np.uint64(0xFF)
        fill = np.where(byte & np.uint64(0x80), np.uint64(0xFF), np.uint64(0))
        out |= np.where(nib & np.uint64(8), fill, byte) << np.uint64(8 * n)
    return out.astype(np.uint32)


def _word_levels(v, table):
    """quant_iq4_xs.cuh.j2's qt_word_levels, word for word: the levels of values 4w..4w+3 and
    16+4w..16+4w+3 of nibble word v, looked up in table (four words)."""
    t0, t1, t2, t3 = (np.full_like(v, t) for t in table)

    def levels(s):
        lo, hi = _prmt(t0, t1, s & 0x7777), _prmt(t2, t3, s & 0x7777)
        return _prmt(lo, hi, 0x3210 | ((s >> 1) & 0x4444))
    a, b = levels(v), levels(v >> 16)
    return _prmt(a, b, 0x6420), _prmt(a, b, 0x7531)


@pytest.mark.parametrize("bias", [0, 128])
def test_iq4_xs_split_layout_is_what_the_kernels_read(rng, bias):
    """The iq4_xs kernels' reading of the split bytes (quant_iq4_xs.cuh.j2; bias 128: the f16
    tiles' table, mmf.cu.j2): block b's indices as they are, their levels by the byte-permute
    lookup; its super-block's 8 meta bytes at b & ~7, ls from nibble i of the second word and
    bits 16 + 2i of the first; (d * (ls - 32)) * level is gguf's dequantization bit for bit."""
    q = quant_type("iq4_xs")
    rows, k = 5, 768
    raw = ref.random_blocks("iq4_xs", rows, k, rng)
    qs, meta = split_blocks(raw, q, rows, k)
    nb = k // 32
    words = qs.reshape(rows, nb, 16).copy().view(np.uint32)                        # (rows, nb, w)
    lo, hi = _word_levels(words, q.codebook_words(bias))
    as_bytes = lambda v: v.view(np.uint8).reshape(rows, nb, 16)  # noqa: E731
    levels = np.concatenate([as_bytes(lo), as_bytes(hi)], axis=-1)
    levels = (levels.astype(np.int32) - bias).astype(np.uint8).view(np.int8)      # values 0..31
    assert levels.min() == -127 and levels.max() == 113
    sb = meta[:, :nb].reshape(rows, nb // 8, 2, 4).copy().view(np.uint32)[..., 0]  # (rows, nsb, 2)
    i = np.arange(8, dtype=np.uint32)
    ls = ((sb[..., 1:2] >> (4 * i)) & 15) | (((sb[..., 0:1] >> (16 + 2 * i)) & 3) << 4)
    d = (sb[..., 0] & 0xFFFF).astype(np.uint16).view(np.float16).astype(np.float32)
    mul = (d[..., None] * (ls.astype(np.float32) - 32)).reshape(rows, nb, 1)
    w = (mul * levels.astype(np.float32)).reshape(rows, k)
    want = ref.dequantize(raw, "iq4_xs", (rows, k))
    assert np.array_equal(w.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("name", [q.name for q in QUANT_TYPES.values() if q.codebook])
def test_codebook_split_lookups_sum_to_the_levels(rng, name):
    """quant_codebook.cuh.j2's mat-vec and int8-tile lookup, word for word: a code looked up
    as it is in L and with bit 3 flipped in U gives two bytes (one a sign where the table
    does not hold the code) whose sum is the code's level; the bytes come in the permute's
    order (4w, 16+4w, 4w+1, 17+4w | 4w+2, ...) and qt_order_x puts x in the same order."""
    q = quant_type(name)
    v = np.asarray(q.codebook)
    L0, L1, U0, U1 = (np.full(64, w, dtype=np.uint32) for w in q.codebook_halves())
    words = rng.integers(0, 2 ** 32, size=64, dtype=np.uint64).astype(np.uint32)
    words[0] = 0x76543210
    words[1] = 0xFEDCBA98                                           # every code once
    codes = np.stack([(words >> np.uint32(4 * i)) & 15 for i in range(8)], axis=1)   # nibble order
    flipped = words ^ np.uint32(0x88888888)
    total = np.zeros((64, 8), dtype=np.int32)
    for half in range(2):
        a = _prmt(L0, L1, words >> np.uint32(16 * half))
        b = _prmt(U0, U1, flipped >> np.uint32(16 * half))
        total[:, 4 * half:4 * half + 4] = (a.view(np.uint8).view(np.int8).reshape(64, 4).astype(np.int32)
                                           + b.view(np.uint8).view(np.int8).reshape(64, 4))
    assert np.array_equal(total, v[codes])
    # nibble k of word w is value 4w + k // 2 + 16 * (k % 2), as qt_order_x's selectors place x
    x = rng.integers(-127, 128, size=(32,)).astype(np.int8)
    xw = x.view(np.uint32)                                          # words 0..7: values 4i..4i+3
    for w in range(4):
        lo = _prmt(xw[w:w + 1], xw[4 + w:5 + w], 0x5140).view(np.int8)
        hi = _prmt(xw[w:w + 1], xw[4 + w:5 + w], 0x7362).view(np.int8)
        want = [4 * w + k // 2 + 16 * (k % 2) for k in range(8)]
        assert np.array_equal(np.concatenate([lo, hi]), x[want])


def test_bad_k_and_unknown_type_are_named():
    with pytest.raises(ValueError, match="k=100"):
        quant_type("q4_0").blocks_per_row(100)
    with pytest.raises(ValueError, match="q3_x"):
        quant_type("q3_x")
    assert [q.name for q in parse_types("q8_0, q4_0")] == ["q8_0", "q4_0"]
    assert len(parse_types(None)) == len(QUANT_TYPES)


@pytest.mark.parametrize("name", list(QUANT_TYPES))
def test_kernel_view_is_ggufs_dequantization(rng, name):
    """The emulation's weights (ints * mul + add per 32-weight block) are gguf's own
    dequantized weights, exactly: the kernels' scale formula reads the format right."""
    q = quant_type(name)
    rows, k = 5, 4 * q.block_values
    raw = ref.random_blocks(name, rows, k, rng)
    ints, mul, add = ref._kernel_view(raw, q, rows, k)
    # add * sx = add * dx * sum(q_x): per weight, add is the offset every value carries
    w = ints.reshape(rows, -1, 32) * mul[..., None].astype(np.float64) + add[..., None]
    got = w.reshape(rows, k)
    want = gguf.quants.dequantize(raw, q.ggml_type).reshape(rows, k)
    np.testing.assert_array_equal(got.astype(np.float32), want)


def test_q4_k_split_puts_each_sub_block_in_q4_0_order(rng):
    """Kernel block b of a q4_K row: its 16 quant bytes hold values j (low nibble) and j+16
    (high) of sub-block b; its scales are its super-block's 16 bytes, 2 bytes a block."""
    q = quant_type("q4_K")
    rows, k = 3, 768
    raw = ref.random_blocks(q, rows, k, rng)
    qs, meta = split_blocks(raw, q, rows, k)
    ints, _, _ = ref._kernel_view(raw, q, rows, k)
    b = qs.reshape(rows, k // 32, 16)
    np.testing.assert_array_equal(np.concatenate([b & 15, b >> 4], axis=2).reshape(rows, k), ints)
    sb = raw.reshape(rows, k // 256, 144)
    np.testing.assert_array_equal(meta[:, :k // 256 * 16].reshape(rows, -1, 16), sb[:, :, :16])
    assert q.meta_bytes == 2 and q.qs_bytes == 16 and q.blocks_per_row(k) == k // 32
    with pytest.raises(ValueError, match="k=288"):
        q.blocks_per_row(288)


def test_q4_k_scales_unpack_like_ggml():
    """The 6-bit (scale, min) pairs: sub-blocks 0-3 in the low bits of bytes 0-7, 4-7 in
    the nibbles of bytes 8-11 plus the top bits of bytes 0-7 (ggml's get_scale_min_k4)."""
    packed = np.zeros(12, dtype=np.uint8)
    want_sc, want_mn = [5, 63, 0, 17, 40, 1, 62, 33], [9, 0, 63, 2, 21, 60, 7, 48]
    for j in range(4):
        packed[j] |= want_sc[j]
        packed[j + 4] |= want_mn[j]
    for j in range(4, 8):
        packed[j + 4] = (want_sc[j] & 15) | ((want_mn[j] & 15) << 4)
        packed[j - 4] |= (want_sc[j] >> 4) << 6
        packed[j] |= (want_mn[j] >> 4) << 6
    sc, mn = ref.q4_k_scales(packed)
    assert sc.tolist() == want_sc and mn.tolist() == want_mn


@pytest.mark.parametrize("name, bar", [("q4_K", 0.12), ("q5_K", 0.06)])
def test_k_quantizers_write_valid_close_blocks(rng, name, bar):
    """moeforge's own q4_K and q5_K quantizers (gguf-py has none): gguf dequantizes their
    blocks to within 4-bit (5-bit) rounding of the input, the 6-bit scale packing is the one
    reference.q4_k_scales (and ggml) reads, all-zero and one-signed rows are fine, and they
    are deterministic."""
    from moeforge.runtime.quantize import pack_q4_k_scales
    _quantizer_writes_close_blocks(rng, quant_type(name), bar)
    sc, mn = rng.integers(0, 64, size=(2, 7, 8))
    got_sc, got_mn = ref.q4_k_scales(pack_q4_k_scales(sc, mn))
    assert np.array_equal(got_sc, sc) and np.array_equal(got_mn, mn)


def _quantizer_writes_close_blocks(rng, q, bar):
    """moeforge's quantizer for q: rows of either sign, all-zero and of any scale quantize
    deterministically to blocks gguf dequantizes to within bar (relative RMS) of the input,
    and a k of no whole block is refused. Returns the blocks of the 9 x 768 rows."""
    from moeforge.runtime.quantize import quantize
    x = (rng.standard_normal((9, 768)) * rng.uniform(0.01, 3.0, size=(9, 1))).astype(np.float32)
    x[1] = 0.0
    x[2] = np.abs(x[2])
    x[3] = -np.abs(x[3])
    raw = quantize(x, q)
    assert raw.shape == (9, q.row_bytes(768)) and np.array_equal(raw, quantize(x, q))
    w = gguf.quants.dequantize(raw, q.ggml_type).reshape(x.shape)
    assert np.isfinite(w).all() and not w[1].any()
    for row in (0, 2, 3, 4, 8):
        err = np.sqrt(((w[row] - x[row]) ** 2).mean() / (x[row] ** 2).mean())
        assert err < bar, (row, err)
    with pytest.raises(ValueError, match="k=320"):
        quantize(np.ones((2, 320), np.float32), q)
    return raw


def test_q2_k_quantizer_writes_valid_close_blocks(rng):
    """moeforge's own plain q2_K quantizer (gguf-py has none): within 2-bit rounding of the
    input, every scale and min in 4 bits by construction, deterministic."""
    _quantizer_writes_close_blocks(rng, quant_type("q2_K"), 0.45)


def test_q3_k_quantizer_writes_valid_close_blocks(rng):
    """moeforge's own plain q3_K quantizer (gguf-py has none): within 3-bit rounding of the
    input; the scales' 6-bit packing is the one gguf reads (q3_k_parts gives back the s - 32
    it packed, each in [-32, 31]), and the largest 16 of a super-block gets s - 32 = -32."""
    from moeforge.runtime.array_blocks import q3_k_parts
    from moeforge.runtime.quantize import pack_q3_k
    raw = _quantizer_writes_close_blocks(rng, quant_type("q3_K"), 0.25)
    _, sc, _ = q3_k_parts(raw.reshape(-1, 110))
    assert (sc.reshape(9, 3, 16)[[0, 2, 3, 4, 8]].min(axis=-1) == -32).all()
    val = rng.integers(-4, 4, size=(6, 256)).astype(np.int8)
    s = rng.integers(-32, 32, size=(6, 16)).astype(np.int8)
    d = rng.integers(0, 256, size=(6, 2)).astype(np.uint8)
    got_v, got_s, _ = q3_k_parts(pack_q3_k(val, s, d))
    assert np.array_equal(got_v, val) and np.array_equal(got_s, s)


def test_iq4_xs_quantizer_writes_valid_close_blocks(rng):
    """moeforge's own plain iq4_xs quantizer (gguf-py has none): gguf dequantizes its blocks
    to within the 16 levels' rounding of the input, for rows of either sign and all-zero
    ones, deterministically; every sub-block scale ls - 32 lies in [-32, 31] by construction
    (6 bits), and the sub-block with the super-block's largest scale gets ls = 0."""
    from moeforge.runtime.array_blocks import iq4_xs_parts
    raw = _quantizer_writes_close_blocks(rng, quant_type("iq4_xs"), 0.12)
    _, ls, _ = iq4_xs_parts(raw.reshape(-1, 136))
    assert (ls.reshape(9, 3, 8)[[0, 2, 3, 4, 8]].min(axis=-1) == -32).all()


@pytest.mark.parametrize("name", ["q4_0", "q8_0"])
def test_quantize_is_ggufs_for_the_formats_gguf_has(rng, name):
    from moeforge.runtime.quantize import quantize
    q = quant_type(name)
    x = rng.standard_normal((3, 4, 64)).astype(np.float32)
    assert np.array_equal(quantize(x, q), gguf.quants.quantize(x.reshape(-1, 64), q.ggml_type))
