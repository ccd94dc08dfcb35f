import numpy as np
import pytest

from moeforge import reference as ref
from moeforge.codegen.quant import QUANT_TYPES, quant_type


def test_q8_1_rounds_like_c_roundf():
    # halves round away from zero (numpy's round would go to even)
    x = np.zeros((1, 32), np.float32)
    x[0, :4] = [127.0, 0.5, -0.5, 2.5]
    q, d, s = ref.quantize_q8_1(x)
    assert d[0, 0] == np.float32(1.0)
    assert list(q[0, :4]) == [127, 1, -1, 3]
    assert s[0, 0] == np.float32(130.0)


def test_q8_1_properties(rng):
    x = (rng.standard_normal((5, 256)) * rng.uniform(0.01, 100)).astype(np.float32)
    x[2, 32:64] = 0.0
    q, d, s = ref.quantize_q8_1(x)
    assert np.abs(q.astype(int)).max() <= 127
    assert d[2, 1] == 0 and not q[2, 32:64].any() and s[2, 1] == 0
    back = q.reshape(5, 8, 32) * d[..., None]
    assert np.all(np.abs(back - x.reshape(5, 8, 32)) <= d[..., None] * 0.5001)
    assert np.allclose(s, d * q.reshape(5, 8, 32).astype(np.int64).sum(-1), rtol=1e-6)


@pytest.mark.parametrize("qtype", ["q4_0", "q8_0"])
def test_emulation_matches_brute_force_integer_dot(rng, qtype):
    E, m, k, n, top_k = 4, 9, 128, 3, 2
    q = quant_type(qtype)
    raw = ref.random_blocks(qtype, E * m, k, rng)
    x = rng.standard_normal((n, k)).astype(np.float32)
    ids = np.array([[0, 3], [2, 1], [3, 2]], dtype=np.int32)
    emu = ref.mul_mat_id_emulated(raw, qtype, (E, m, k), x, ids)
    xq, dx, sx = ref.quantize_q8_1(x)
    blocks = raw.reshape(E * m, k // 32, q.block_bytes)
    for t in range(n):
        for j in range(top_k):
            e = ids[t, j]
            for r in range(m):
                acc = 0.0
                for b in range(k // 32):
                    blk = blocks[e * m + r, b]
                    dw = float(blk[:2].view(np.float16)[0])
                    xi = xq[t, 32 * b:32 * b + 32].astype(np.int64)
                    if qtype == "q4_0":
                        wi = np.concatenate([blk[2:18] & 15, blk[2:18] >> 4]).astype(np.int64)
                        acc += dw * (float(dx[t, b]) * int(wi @ xi) - 8 * float(sx[t, b]))
                    else:
                        wi = blk[2:34].view(np.int8).astype(np.int64)
                        acc += dw * float(dx[t, b]) * int(wi @ xi)
                assert emu[t, j, r] == pytest.approx(acc, rel=1e-12, abs=1e-12)


def _q6_k_ints(blk: np.ndarray) -> np.ndarray:
    """One q6_K super-block's (q - 32) * scale per weight, ggml's dequantize loop written out."""
    ql, qh, sc = blk[:128].astype(np.int64), blk[128:192].astype(np.int64), blk[192:208].view(np.int8)
    out = np.empty(256, dtype=np.int64)
    for n in range(2):
        for ll in range(32):
            s = 8 * n + ll // 16
            qs = ((ql[64 * n + ll] & 15) | ((qh[32 * n + ll] & 3) << 4),
                  (ql[64 * n + ll + 32] & 15) | (((qh[32 * n + ll] >> 2) & 3) << 4),
                  (ql[64 * n + ll] >> 4) | (((qh[32 * n + ll] >> 4) & 3) << 4),
                  (ql[64 * n + ll + 32] >> 4) | (((qh[32 * n + ll] >> 6) & 3) << 4))
            for p in range(4):
                out[128 * n + 32 * p + ll] = (qs[p] - 32) * int(sc[s + 2 * p])
    return out


def test_q6_k_emulation_matches_brute_force_integer_dot(rng):
    """q6_K: each 32-weight block's two scales folded into its integer dot, d alone as
    the float multiplier (quant_q6_K.cuh.j2)."""
    E, m, k, n = 3, 5, 512, 2
    raw = ref.random_blocks("q6_K", E * m, k, rng)
    x = rng.standard_normal((n, k)).astype(np.float32)
    ids = np.array([[2], [0]], dtype=np.int32)
    emu = ref.mul_mat_id_emulated(raw, "q6_K", (E, m, k), x, ids)
    xq, dx, _ = ref.quantize_q8_1(x)
    blocks = raw.reshape(E * m, k // 256, 210)
    for t in range(n):
        e = ids[t, 0]
        for r in range(m):
            acc = 0.0
            for sb in range(k // 256):
                blk = blocks[e * m + r, sb]
                ints, d = _q6_k_ints(blk), float(blk[208:210].view(np.float16)[0])
                for b in range(8):
                    i0 = 256 * sb + 32 * b
                    acc += d * float(dx[t, i0 // 32]) * int(ints[32 * b:32 * b + 32] @ xq[t, i0:i0 + 32].astype(np.int64))
            assert emu[t, 0, r] == pytest.approx(acc, rel=1e-12, abs=1e-12)
    w = ref.dequantize(raw, "q6_K", (E * m, k)).reshape(E * m, k // 256, 256)
    d = blocks[:, :, 208:210].copy().view(np.float16).astype(np.float64)
    ints = np.stack([[_q6_k_ints(b) for b in row] for row in blocks])
    np.testing.assert_allclose(w, d * ints, rtol=1e-6)


@pytest.mark.parametrize("qtype", list(QUANT_TYPES))
def test_emulation_is_close_to_float(rng, qtype):
    E, m, k, n, top_k = 8, 40, 512, 17, 3
    raw = ref.random_blocks(qtype, E * m, k, rng)
    x = rng.standard_normal((n, top_k, k)).astype(np.float32)
    ids = np.stack([rng.choice(E, top_k, replace=False) for _ in range(n)]).astype(np.int32)
    emu = ref.mul_mat_id_emulated(raw, qtype, (E, m, k), x, ids)
    flt = ref.mul_mat_id_float(ref.dequantize(raw, qtype, (E, m, k)), x, ids)
    assert 0 < ref.nmse(emu, flt) <= 5e-4


def test_random_blocks_are_valid_and_finite(rng):
    for qtype in QUANT_TYPES:
        w = ref.dequantize(ref.random_blocks(qtype, 16, 256, rng), qtype, (16, 256))
        assert np.isfinite(w).all() and np.abs(w).max() > 0


@pytest.mark.parametrize("qtype", [q for q in QUANT_TYPES if QUANT_TYPES[q].f16_scales])
def test_random_blocks_scales_take_both_signs(qtype, rng):
    """Negative scales reach every kernel, and the weights are zero-mean (positive scales
    alone give q4_0's a mean of -d/2, a bias every product would sum over k)."""
    q = QUANT_TYPES[qtype]
    rows, k = 256, 4096
    raw = ref.random_blocks(qtype, rows, k, rng).reshape(rows, -1, q.block_bytes)
    for at, _ in q.f16_scales:
        d = raw[:, :, at:at + 2].copy().view(np.float16)
        assert 0.3 < np.mean(d < 0) < 0.7, (qtype, at)
    w = ref.dequantize(raw.reshape(rows, -1), qtype, (rows, k))
    # positive-only scales: q4_0's mean is -0.085 of its RMS, q4_K's 0.52; with random
    # signs a super-block format's mean wanders ~1% at 4096 super-blocks
    assert abs(w.mean()) < 0.04 * np.sqrt(np.mean(w.astype(np.float64) ** 2))


def test_activations_reference():
    g = np.array([-20.0, -1.0, 0.0, 1.0, 9.0])
    u = np.array([2.0, -9.0, 1.0, 0.5, 3.0])
    assert np.allclose(ref.activate(g, u, "silu"), g / (1 + np.exp(-g)) * u)
    oai = ref.activate(g, u, "swiglu_oai")
    assert oai[-1] == pytest.approx(7 / (1 + np.exp(-1.702 * 7)) * 4)   # gate clamped at 7
    assert oai[1] == pytest.approx(-1 / (1 + np.exp(1.702)) * (-6))     # up clamped at -7
    with pytest.raises(ValueError):
        ref.activate(g, u, "relu")
