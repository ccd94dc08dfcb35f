"""numpy references for every kernel: the float64 truth and an emulation of the kernels'
own integer arithmetic (q8_1 activations times the weight quants, block by block), and of
the f16 tensor-core path's (weights and activations rounded to float16).

The float reference catches gross errors (ggml's bar: NMSE <= 5e-4 from rounding alone);
the emulation agrees with a correct kernel to float32 accumulation error (~1e-6), so it
catches subtle ones (a wrong scale, an off-by-one block, a lost partial sum).
"""
from __future__ import annotations

import numpy as np
from gguf import quants

from .codegen.quant import QuantType, quant_type
from .codegen.spec import MmfSpec


def _q(qtype) -> QuantType:
    return quant_type(qtype) if isinstance(qtype, str) else qtype


def dequantize(raw: np.ndarray, qtype, shape) -> np.ndarray:
    q = _q(qtype)
    return quants.dequantize(np.asarray(raw).reshape(-1, q.row_bytes(shape[-1])), q.ggml_type).reshape(shape)


def round_half_away(r: np.ndarray) -> np.ndarray:
    """C's roundf, in float64 where |r| + 0.5 is exact for float32 r."""
    r = r.astype(np.float64)
    return np.sign(r) * np.floor(np.abs(r) + 0.5)


def quantize_q8_1(x: np.ndarray):
    """Float32 rows (.., k) -> (q int8 (.., k), d float32 (.., k/32), s float32 (.., k/32)),
    bit for bit what the quantize_q8_1 kernel writes: d = amax/127, q = roundf(x/d),
    s = d * sum(q)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    k = x.shape[-1]
    if k % 32:
        raise ValueError(f"k={k} is not a multiple of 32")
    xb = x.reshape(*x.shape[:-1], k // 32, 32)
    amax = np.abs(xb).max(axis=-1)
    d = (amax / np.float32(127.0)).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        r = (xb / d[..., None]).astype(np.float32)
    q = np.where(amax[..., None] == 0, 0, round_half_away(r)).astype(np.int8)
    s = (d * q.astype(np.int32).sum(axis=-1).astype(np.float32)).astype(np.float32)
    return q.reshape(x.shape), d, s


def _kernel_view(raw: np.ndarray, q: QuantType, rows: int, k: int):
    """Weights as the kernels multiply them: integer quants (rows, k), the per-block
    multiplier (rows, nb) and the per-block offset multiplier (rows, nb) such that
    contribution = mul * dx * idot + add * sx (nb kernel blocks of 32 a row)."""
    nb = k // 32
    nsb = k // q.block_values
    blocks = np.asarray(raw, dtype=np.uint8).reshape(rows, nsb, q.block_bytes)
    d = blocks[:, :, 0:2].copy().view(np.float16).reshape(rows, nsb).astype(np.float32)
    if q.name == "q4_0":
        b = blocks[:, :, 2:18]
        ints = np.concatenate([b & 0x0F, b >> 4], axis=2).astype(np.int32)
        return ints.reshape(rows, k), d, -8.0 * d
    if q.name == "q8_0":
        ints = blocks[:, :, 2:34].view(np.int8).astype(np.int32)
        return ints.reshape(rows, k), d, np.zeros_like(d)
    if q.name in ("q4_K", "q5_K"):
        dmin = blocks[:, :, 2:4].copy().view(np.float16).reshape(rows, nsb).astype(np.float32)
        sc, mn = q4_k_scales(blocks[:, :, 4:16])
        if q.high_bits:   # q5_K: the nibble and the fifth bit
            from .runtime.array_blocks import q5_k_quants
            ints = q5_k_quants(blocks.reshape(rows * nsb, q.block_bytes)).astype(np.int32)
        else:
            c = blocks[:, :, 16:144].reshape(rows, nsb, 4, 32)
            ints = np.stack([c & 0x0F, c >> 4], axis=3).astype(np.int32)    # sub-blocks 2i, 2i+1
        mul = (d[..., None] * sc).astype(np.float32)                     # exact: 11 x 6 bits
        add = (-(dmin[..., None] * mn)).astype(np.float32)
        return ints.reshape(rows, k), mul.reshape(rows, nb), add.reshape(rows, nb)
    if q.name == "q6_K":
        # The kernels fold the two scales of a 32-weight block into its integer dot, so
        # ints are (q - 32) * sc and the block's multiplier is d alone.
        from .runtime.array_blocks import q6_k_parts
        qv, sc, d6 = q6_k_parts(blocks.reshape(rows * nsb, q.block_bytes))
        ints = qv.astype(np.int32).reshape(-1, 16, 16) * sc.astype(np.int32)[..., None]
        mul = np.repeat(d6.reshape(rows, nsb), 8, axis=1)
        return ints.reshape(rows, k), mul, np.zeros_like(mul)
    if q.name == "q2_K":
        # Its mins are per 16 weights, finer than the offset form's 32 (contribution = mul *
        # dx * idot + add * sx): the "ints" are the exact weights d * sc * q - dmin * m
        # (float64: 11 x 4 x 2 bits and 11 x 4, exact), mul 1. The kernels' two integer dots
        # combined in float32 differ from that by float32 rounding, as every format's do.
        from .runtime.array_blocks import q2_k_parts
        qv, sc, mn, d2, m2 = q2_k_parts(blocks.reshape(rows * nsb, q.block_bytes))
        w = (d2.astype(np.float64) * sc)[..., None] * qv.reshape(-1, 16, 16) - (m2.astype(np.float64) * mn)[..., None]
        mul = np.ones((rows, nb), dtype=np.float32)
        return w.reshape(rows, k), mul, np.zeros_like(mul)
    if q.name == "q3_K":
        # as q6_K: the two scales folded into the integer dot, d alone the multiplier
        from .runtime.array_blocks import q3_k_parts
        qv, sc, d3 = q3_k_parts(blocks.reshape(rows * nsb, q.block_bytes))
        ints = qv.astype(np.int32).reshape(-1, 16, 16) * sc.astype(np.int32)[..., None]
        mul = np.repeat(d3.reshape(rows, nsb), 8, axis=1)
        return ints.reshape(rows, k), mul, np.zeros_like(mul)
    if q.name == "iq4_xs":
        # the levels are the integers; a sub-block's multiplier d * (ls - 32) (exact: 11 x 6 bits)
        from .runtime.array_blocks import iq4_xs_parts
        levels, ls, dx = iq4_xs_parts(blocks.reshape(rows * nsb, q.block_bytes))
        mul = (dx * ls.astype(np.float32)).astype(np.float32).reshape(rows, nb)
        return levels.astype(np.int32).reshape(rows, k), mul, np.zeros_like(mul)
    if q.name == "mxfp4":
        # the levels are the integers; a block's multiplier its e8m0 scale (exact, a power of 2)
        b = blocks.reshape(rows, nb, q.block_bytes)
        codes = np.concatenate([b[..., 1:] & 0x0F, b[..., 1:] >> 4], axis=-1)
        levels = np.asarray(q.codebook, dtype=np.int32)[codes]
        mul = quants.MXFP4.e8m0_to_fp32_half(b[..., 0].copy()).astype(np.float32)
        return levels.reshape(rows, k), mul, np.zeros_like(mul)
    raise NotImplementedError(f"no kernel emulation for {q.name}")


def q4_k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A q4_K super-block's 12 scale bytes (.., 12) -> (scales, mins) (.., 8) as float32
    (runtime.array_blocks.scale_min_k4, the device-side converter's unpacking)."""
    from .runtime.array_blocks import scale_min_k4
    sc, mn = scale_min_k4(np.asarray(packed, dtype=np.uint8))
    return sc.astype(np.float32), mn.astype(np.float32)


def _expert_groups(ids: np.ndarray):
    flat = ids.reshape(-1)
    for e in np.unique(flat):
        yield int(e), np.nonzero(flat == e)[0]


def mul_mat_id_float(w: np.ndarray, x: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """float64 MUL_MAT_ID: w (E, m, k) float, x (n, k) or (n, top_k, k), ids (n, top_k)."""
    n, top_k = ids.shape
    xs = _entry_rows(x, n, top_k).astype(np.float64)
    out = np.empty((n * top_k, w.shape[1]), dtype=np.float64)
    for e, entries in _expert_groups(ids):
        out[entries] = xs[entries] @ w[e].astype(np.float64).T
    return out.reshape(n, top_k, w.shape[1])


def _entry_rows(x: np.ndarray, n: int, top_k: int) -> np.ndarray:
    if x.ndim == 2:
        return np.repeat(x, top_k, axis=0)
    return x.reshape(n * top_k, x.shape[-1])


def mul_mat_id_emulated(raw: np.ndarray, qtype, shape, x: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """What the kernels compute, in float64: q8_1 activations, integer block dots, the
    kernels' scale formula. raw: GGUF blocks of w (E, m, k)."""
    q = _q(qtype)
    E, m, k = shape
    n, top_k = ids.shape
    ints, mul, add = _kernel_view(raw, q, E * m, k)
    ints, mul, add = ints.reshape(E, m, k), mul.reshape(E, m, -1), add.reshape(E, m, -1)
    xq, dx, sx = quantize_q8_1(_entry_rows(x, n, top_k))
    nb = k // 32
    xdeq = (xq.reshape(-1, nb, 32).astype(np.float64) * dx[..., None]).reshape(-1, k)
    out = np.empty((n * top_k, m), dtype=np.float64)
    for e, entries in _expert_groups(ids):
        wk = (ints[e].reshape(m, nb, 32) * mul[e][..., None].astype(np.float64)).reshape(m, k)
        out[entries] = xdeq[entries] @ wk.T + sx[entries].astype(np.float64) @ add[e].astype(np.float64).T
    return out.reshape(n, top_k, m)


def f16_weights(raw: np.ndarray, qtype, rows: int, k: int) -> np.ndarray:
    """Weights as the f16 tensor-core path (MmfSpec) multiplies them: d * (q - offset)
    rounded once to float16 (the product is exact in float32); K-quants and the codebook
    formats below."""
    q = _q(qtype)
    if q.name not in MmfSpec.QTYPES:
        raise ValueError(f"{q.name} has no f16 tiles (MmfSpec.QTYPES)")
    if q.name == "q2_K":
        # q * f16(d * sc) - f16(dmin * m), rounded once (the kernel's f16 fma)
        from .runtime.array_blocks import q2_k_parts
        nsb = k // q.block_values
        qv, sc, mn, d2, m2 = q2_k_parts(np.asarray(raw, dtype=np.uint8).reshape(rows * nsb, q.block_bytes))
        s = (d2.astype(np.float64) * sc).astype(np.float16).astype(np.float64)[..., None]
        m = (m2.astype(np.float64) * mn).astype(np.float16).astype(np.float64)[..., None]
        return (qv.reshape(-1, 16, 16).astype(np.float64) * s - m).astype(np.float16).reshape(rows, k)
    if q.name in ("q3_K", "q6_K"):
        # (q - 4) * f16(d * sc) (q6_K: q - 32), the product rounded once (the kernel's f16 multiply)
        from .runtime.array_blocks import q3_k_parts, q6_k_parts
        nsb = k // q.block_values
        parts = q3_k_parts if q.name == "q3_K" else q6_k_parts
        qv, sc, d3 = parts(np.asarray(raw, dtype=np.uint8).reshape(rows * nsb, q.block_bytes))
        s = (d3.astype(np.float64) * sc).astype(np.float16).astype(np.float64)[..., None]
        return (qv.reshape(-1, 16, 16).astype(np.float64) * s).astype(np.float16).reshape(rows, k)
    ints, mul, add = _kernel_view(raw, q, rows, k)
    nb = k // 32
    if q.sub_blocks > 1 or q.codebook:
        # K-quants: q * f16(d*sc) - f16(dmin*m), rounded once (the kernel's f16 fma); the
        # float64 value of the exact product and sum is exact, so one cast rounds as fma does.
        # Codebook formats: level * f16(scale) (iq4_xs's d*(ls-32), mxfp4's 2^(e-128): zero
        # past f16's smallest subnormal, as the kernel's conversion of it)
        s = mul.astype(np.float16).astype(np.float64)[..., None]
        mn = add.astype(np.float16).astype(np.float64)[..., None]
        w = ints.reshape(rows, nb, 32).astype(np.float64) * s + mn
        return w.astype(np.float16).reshape(rows, k)
    offset = np.where(mul != 0, add / np.where(mul != 0, mul, 1), 0).astype(np.float32)  # -8 or 0
    w = (ints.reshape(rows, nb, 32).astype(np.float32) + offset[..., None]) * mul[..., None]
    return w.astype(np.float32).astype(np.float16).reshape(rows, k)


def mul_mat_id_emulated_f16(raw: np.ndarray, qtype, shape, x: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """What the f16 path computes, in float64: f16 weights (f16_weights) times x rounded
    to float16. A correct kernel differs by its float32 accumulation only."""
    E, m, k = shape
    n, top_k = ids.shape
    w = f16_weights(raw, qtype, E * m, k).astype(np.float64).reshape(E, m, k)
    xs = _entry_rows(np.asarray(x, dtype=np.float32), n, top_k).astype(np.float16).astype(np.float64)
    out = np.empty((n * top_k, m), dtype=np.float64)
    for e, entries in _expert_groups(ids):
        out[entries] = xs[entries] @ w[e].T
    return out.reshape(n, top_k, m)

def mul_mat_float(w: np.ndarray, x: np.ndarray) -> np.ndarray:
    return x.astype(np.float64) @ w.astype(np.float64).T


def mul_mat_emulated(raw: np.ndarray, qtype, shape, x: np.ndarray) -> np.ndarray:
    m, k = shape
    ids = np.zeros((x.shape[0], 1), dtype=np.int32)
    return mul_mat_id_emulated(raw, qtype, (1, m, k), x, ids)[:, 0, :]


# Hopper's f16 MMA rounds its float32 sums toward zero: the error of a k-long dot grows in
# proportion to k, not to its square root, and its NMSE with k^2. A numpy model of that (f16
# operands of random signs, one rounding toward zero a k16 step) gives 2.1e-11 at k = 2880,
# 3.8e-11 at 4096 and 5.1e-10 at 14336 (rounding to nearest: 3e-13 at most); an H200 gave
# 2.8e-10 at Mixtral's k = 14336, which the tuner's gate had refused under a flat bar.
NMSE_EMULATED = 1e-10
F16_EMULATED_K = 4096


def nmse_emulated_bar(k: int, f16: bool) -> float:
    """The bar of a kernel's NMSE against its own emulation: float32 accumulation error
    only. The int8 paths sum exact integer block dots (one rounding a block); past
    F16_EMULATED_K the f16 tiles' truncating accumulators are given room in k^2."""
    return NMSE_EMULATED * max(1.0, (k / F16_EMULATED_K) ** 2) if f16 else NMSE_EMULATED


def nmse(out, ref) -> float:
    out, ref = np.asarray(out, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    return float(np.sum((out - ref) ** 2) / max(np.sum(ref ** 2), 1e-300))


def random_blocks(qtype, rows: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Valid random GGUF blocks: random quants, scales drawn like real weights' (finite,
    never zero, both signs where the format has them)."""
    q = _q(qtype)
    nb = k // q.block_values
    blocks = rng.integers(0, 256, size=(rows, nb, q.block_bytes), dtype=np.uint8)
    if q.name == "mxfp4":   # e8m0 scales 2^-11..2^-6 times levels up to 12: q4_0's weights
        blocks[:, :, 0] = rng.integers(117, 123, size=(rows, nb))
        return blocks.reshape(rows, nb * q.block_bytes)
    # the f16 scales (QuantType.f16_scales): q4_K's and q5_K's d, then dmin, at the block's
    # start; q2_K's d and dmin, q3_K's and q6_K's d at its end
    for at, _ in q.f16_scales:
        d = (rng.uniform(0.5, 1.5, size=(rows, nb)) * 2.0 ** rng.integers(-9, -5, size=(rows, nb)))
        if q.name == "q4_K":
            d /= 32   # times 6-bit sub-block scales and mins: weights of the same size
        if q.name == "q5_K":
            d /= 64   # the same, with quants up to 31
        if q.name == "q2_K":
            d /= 2    # times 4-bit scales and quants up to 3 (mins up to 15): the same
        if q.name == "q3_K":
            d /= 16   # times s - 32 and q - 4 (up to 128): the same
        if q.name == "q6_K":
            d /= 256  # times int8 scales and q - 32: weights of the same size
        if q.name == "iq4_xs":
            d /= 256  # times ls - 32 and levels up to 127: the same
        # random signs: ggml's quantizers give q4_0's and q6_K's d and q4_1's m either sign,
        # and a positive-only d biases every weight one way (q4_0's mean -d/2); every
        # format's kernel must read a negative scale right, so every scale gets one
        d *= rng.choice((-1.0, 1.0), size=(rows, nb))
        blocks[:, :, at:at + 2] = d.astype(np.float16).view(np.uint8).reshape(rows, nb, 2)
    return blocks.reshape(rows, nb * q.block_bytes)


def activate(g: np.ndarray, u: np.ndarray, act: str) -> np.ndarray:
    """The fused kernels' activations, in float64."""
    g, u = g.astype(np.float64), u.astype(np.float64)
    if act == "silu":
        return g / (1 + np.exp(-g)) * u
    if act == "gelu":
        return 0.5 * g * (1 + np.tanh(0.7978845608028654 * (g + 0.044715 * g ** 3))) * u
    if act == "swiglu_oai":
        g = np.minimum(g, 7.0)
        u = np.clip(u, -7.0, 7.0)
        return g / (1 + np.exp(-1.702 * g)) * (u + 1)
    raise ValueError(f"unknown activation {act!r}")
