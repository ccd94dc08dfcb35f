"""The numpy backend: the model graph on the CPU, the ground truth for CI.

Activations are float32 between ops (as on every ggml backend); each op computes in
float64 and rounds once, so its own error is far below the float32 rounding llama.cpp
makes. Two numerics for the quantized products:

  "float"   weights dequantized to float32, activations as they are: what the model
            means, and what llama.cpp computes with F32 weights;
  "kernel"  activations quantized to q8_1 blocks first and multiplied block by block
            against the integer quants, exactly as moeforge's GPU kernels do: the
            prediction of the CUDA backend's result, to float32 rounding. Where the
            GPU's prompt attention runs on f16 or tf32 tensor cores (quantized
            attention weights, or attn_precision), so does this one's
            (runtime.prompt_attention.attention_tc).
"""
from __future__ import annotations

import numpy as np
from gguf import quants

from ..codegen.quant import QUANT_TYPES
from .. import reference as ref
from . import prompt_attention
from .backend import Backend
from .kv_cache import rows_of

NUMERICS = ("float", "kernel")
_F64 = np.float64


class NpMatrix:
    """A weight (m, k) or (E, m, k): GGUF bytes kept as they are (a view of the mapped
    file), dequantized to float32 on first use."""

    def __init__(self, tref, numerics: str):
        self.name, self.qtype, self.shape = tref.name, tref.qtype, tref.shape
        self.raw = tref.load()
        self.numerics = numerics
        self._f32 = None
        self._kernel = None

    @property
    def quantized(self) -> bool:
        return self.qtype in QUANT_TYPES

    def rows_f32(self, idx: np.ndarray) -> np.ndarray:
        """Dequantize only the rows asked for (the embedding lookup)."""
        if self._f32 is not None:
            return self._f32.reshape(-1, self.shape[-1])[idx]
        flat = self.raw.reshape(-1, self.raw.shape[-1])[idx]
        if self.quantized:
            return quants.dequantize(flat, QUANT_TYPES[self.qtype].ggml_type).astype(np.float32)
        return _float_rows(flat, self.qtype)

    @property
    def f32(self) -> np.ndarray:
        if self._f32 is None:
            rows = int(np.prod(self.shape[:-1]))
            self._f32 = self.rows_f32(np.arange(rows)).reshape(self.shape)
        return self._f32

    def kernel_view(self):
        """(weights as the kernels scale them (rows, k) float64, per-block offsets (rows, nb))."""
        if self._kernel is None:
            q = QUANT_TYPES[self.qtype]
            rows, k = int(np.prod(self.shape[:-1])), self.shape[-1]
            ints, mul, add = ref._kernel_view(self.raw.reshape(rows, -1), q, rows, k)
            w = (ints.reshape(rows, k // 32, 32) * mul[..., None].astype(_F64)).reshape(rows, k)
            self._kernel = (w, add.astype(_F64))
        return self._kernel

    def product(self, x: np.ndarray, rows: slice | None = None) -> np.ndarray:
        """x (n, k) float32 times the weight rows (all, or one expert's), in float64."""
        if self.numerics == "kernel" and self.quantized:
            w, add = self.kernel_view()
            if rows is not None:
                w, add = w[rows], add[rows]
            xq, dx, sx = ref.quantize_q8_1(x)
            nb = x.shape[-1] // 32
            xdeq = (xq.reshape(-1, nb, 32).astype(_F64) * dx[..., None]).reshape(x.shape)
            return xdeq @ w.T + sx.astype(_F64) @ add.T
        w = self.f32.reshape(-1, self.shape[-1])
        if rows is not None:
            w = w[rows]
        return x.astype(_F64) @ w.T.astype(_F64)


def yarn_angles(theta: np.ndarray, yarn, n_dims: int, base: float):
    """ggml's YaRN angles (rope_yarn) from the unscaled ones (n, n_dims / 2), in float32 as
    there, and the factor on cos and sin."""
    low, high = yarn.corr_dims(n_dims, base)
    i = np.arange(theta.shape[-1], dtype=np.float32)
    ramp = 1.0 - np.clip((i - np.float32(low)) / np.float32(max(0.001, high - low)), 0.0, 1.0)
    mix = (ramp * np.float32(yarn.ext_factor)).astype(np.float32)
    interp = (np.float32(yarn.freq_scale) * theta).astype(np.float32)
    out = (interp * (np.float32(1) - mix) + theta * mix).astype(np.float32)
    return out, float(np.float32(yarn.mscale()))


def _float_rows(flat: np.ndarray, qtype: str) -> np.ndarray:
    if qtype == "bf16":
        return (flat.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    return flat.astype(np.float32)


class NumpyBackend(Backend):
    name = "numpy"
    xp = np

    def __init__(self, hp, numerics: str = "float", attn_precision: str | None = None, cache_type: str = "f32"):
        super().__init__(hp, attn_precision, cache_type)
        if numerics not in NUMERICS:
            raise ValueError(f"numerics must be one of {NUMERICS}, got {numerics!r}")
        self.numerics = numerics
        self.attn_tc = None          # the GPU's tensor-core prompt attention emulated; set by upload

    def matrix(self, tref, embedding: bool = False):
        return NpMatrix(tref, self.numerics)

    # -- ops ------------------------------------------------------------------------------------
    def embed(self, w: NpMatrix, tokens, name):
        return w.rows_f32(np.asarray(tokens))

    def rms_norm(self, x, w, eps, name):
        x64 = x.astype(_F64)
        scale = 1.0 / np.sqrt((x64 * x64).mean(axis=-1, keepdims=True) + eps)
        return (x64 * scale * w).astype(np.float32)

    def head_norm_(self, x, w, n_heads, eps):
        n = x.shape[0]
        x[...] = self.rms_norm(x.reshape(n * n_heads, -1), w, eps, None).reshape(x.shape)

    def rope_(self, x, pos, n_heads, base, yarn=None, n_rot=None, pairs="neox"):
        """NEOX: pairs (i, i + r/2) of each head's first r = n_rot dimensions (all where None)
        rotate by pos * base^(-2i/r); the rest stay; pairs="adjacent": pairs (2i, 2i + 1)
        (ggml's NORM mode, DeepSeek's). The angles follow ggml's float32
        recurrence (theta *= base^(-2/r)), which is what llama.cpp's CPU uses; with YaRN
        (runtime.arch.YaRN) each pair's angle mixes the interpolated and the original one by
        ggml's ramp, and cos and sin are scaled by its mscale."""
        n = x.shape[0]
        hd = x.shape[1] // n_heads
        rot = n_rot or hd
        half = rot // 2
        step = np.float32(base) ** np.float32(-2.0 / rot)
        theta = np.empty((n, half), dtype=np.float32)
        t = np.asarray(pos, dtype=np.float32)
        for i in range(half):
            theta[:, i] = t
            t = (t * step).astype(np.float32)
        mscale = 1.0
        if yarn is not None:
            theta, mscale = yarn_angles(theta, yarn, rot, base)
        c = np.cos(theta.astype(_F64))[:, None, :] * mscale
        s = np.sin(theta.astype(_F64))[:, None, :] * mscale
        xh = x.reshape(n, n_heads, hd).astype(_F64)
        if pairs == "adjacent":
            x0, x1 = xh[..., 0:rot:2], xh[..., 1:rot:2]
            out = xh.copy()
            out[..., 0:rot:2], out[..., 1:rot:2] = x0 * c - x1 * s, x0 * s + x1 * c
        else:
            x0, x1 = xh[..., :half], xh[..., half:rot]
            out = np.concatenate([x0 * c - x1 * s, x0 * s + x1 * c, xh[..., rot:]], axis=-1)
        x[...] = out.reshape(x.shape).astype(np.float32)

    def ring_layer(self, rows, n_ctx, kv_dim, dtype):
        """A ring of `rows` positions: kv_store_ and attention take positions mod rows."""
        return np.zeros((rows, kv_dim), dtype=dtype)

    def kv_store_(self, cache, il, k, v, pos, pos0):
        """(An f16 cache rounds to nearest even here, as cvt.rn.f16.f32 does on the GPU.)"""
        n = k.shape[0]
        for layer, x in ((cache.k[il], k), (cache.v[il], v)):
            layer[rows_of(layer, pos0, pos0 + n)] = x

    def upload(self, refs, progress=None):
        weights = super().upload(refs, progress)
        # numerics="kernel" follows the GPU's prompt attention onto tensor cores where it goes
        # there (on an sm_80+ card, the generations moeforge builds for: codegen.compile.ARCHS)
        on_tc = prompt_attention.tensor_core(prompt_attention.kernel_for(self.hp, "8.0", self.attn_precision,
                                                                         cache=self.cache_type))
        self.attn_tc = self.attn_precision if self.numerics == "kernel" and on_tc and not self.hp.mla else None
        return weights

    def attention(self, cache, il, q, pos, pos0, n, name, sinks=None, window: int = 0):
        """Causal attention over the cache; sinks (n_head,): a logit per head that joins
        each softmax's denominator with no value (gpt-oss); window > 0: a query at p sees
        only keys j with p - j < window."""
        hp = self.hp
        L, hd, dv, g = pos0 + n, hp.head_dim, hp.v_dim, hp.n_head // hp.n_head_kv
        # a ring's rows of positions before the window hold later ones: masked like any key
        kc, vc = cache.k[il][rows_of(cache.k[il], 0, L)], cache.v[il][rows_of(cache.v[il], 0, L)]
        if n > 1 and self.attn_tc:
            return prompt_attention.attention_tc(q, kc, vc, hp, pos0, self.attn_tc,
                                                 sinks=sinks, window=window).astype(np.float32)
        K = kc.reshape(L, hp.n_head_kv, hd).astype(_F64)
        V = vc.reshape(L, hp.n_head_kv, dv).astype(_F64)
        qh = q.reshape(n, hp.n_head_kv, g, hd).astype(_F64)
        s = np.einsum("nhgd,lhd->hgnl", qh, K) * hp.kq_scale
        gap = (pos0 + np.arange(n))[:, None] - np.arange(L)[None, :]
        s[..., (gap < 0) | (window > 0) & (gap >= window)] = -np.inf
        top = s.max(axis=-1, keepdims=True)
        extra = 0.0
        if sinks is not None:
            sk = np.asarray(sinks, dtype=_F64).reshape(hp.n_head_kv, g, 1, 1)
            top = np.maximum(top, sk)
            extra = np.exp(sk - top)[..., 0]
        p = np.exp(s - top)
        p /= (p.sum(axis=-1) + extra)[..., None]
        return np.einsum("hgnl,lhd->nhgd", p, V).reshape(n, hp.n_head * dv).astype(np.float32)

    def matmul(self, w, x, name, bias=None):
        """x @ w.T (+ bias: added to the float32 product, as ggml adds it)."""
        if not isinstance(w, NpMatrix):
            raise TypeError(f"not a weight: {type(w).__name__}")
        y = w.product(x).astype(np.float32)
        if bias is not None:
            y += bias
        return y

    def add_bias_(self, y, b):
        y += b

    def add_bias_id_(self, y, b, ids):
        """y (n, top_k, m) += b[ids]: each expert's own bias."""
        y += b[ids]

    def glu_id(self, g, u, gate_b, up_b, ids, act: str, name):
        """act(gate + gate_b[expert]) * (up + up_b[expert]) (runtime.fused's activations)."""
        from ..reference import activate
        g, u = g.astype(np.float32), u.astype(np.float32)
        if gate_b is not None:
            g, u = g + gate_b[ids], u + up_b[ids]
        return activate(g.astype(_F64), u.astype(_F64), act).astype(np.float32)

    def mul_mat_id(self, w: NpMatrix, x, ids, name):
        """out[t, j] = W[ids[t, j]] @ x[t, j or 0], one expert at a time."""
        n, top_k = ids.shape
        E, m, k = w.shape
        xs = np.repeat(x, top_k, axis=0) if x.ndim == 2 else x.reshape(n * top_k, k)
        out = np.empty((n * top_k, m), dtype=np.float32)
        flat = ids.reshape(-1)
        for e in np.unique(flat):
            sel = np.nonzero(flat == e)[0]
            out[sel] = w.product(xs[sel], slice(int(e) * m, (int(e) + 1) * m))
        return out.reshape(n, top_k, m)

    def route(self, logits, gating, sel_bias=None):
        """gating (runtime.arch.Gating): the probabilities (float32, as ggml keeps them), the
        top_k by them plus sel_bias (a float32 sum, as ggml's), ties to the lower expert;
        shared experts appended as slots top_k.. with weight 1."""
        p = _router_probs(logits, gating.func)
        key = p if sel_bias is None else (p + np.asarray(sel_bias, dtype=np.float32)).astype(np.float32)
        ids = np.argsort(-key, axis=-1, kind="stable")[:, :gating.top_k].astype(np.int32)
        return _with_shared(ids, _weights(p, ids, gating), gating, logits.shape[-1])

    def route_weights(self, logits, ids, gating):
        """The weights of the routed experts ids (n, top_k; shared slots after them are
        ignored), whichever chose them (tests route a float model on the experts that its
        kernel numerics picked, or the GPU's), shared slots appended."""
        p = _router_probs(logits, gating.func)
        ids = ids[:, :gating.top_k]
        return _with_shared(ids, _weights(p, ids, gating), gating, logits.shape[-1])[1]

    def swiglu(self, gu, name):
        ff = gu.shape[-1] // 2
        return self.swiglu_split(gu[..., :ff], gu[..., ff:], name)

    def swiglu_split(self, g, u, name):
        g64 = g.astype(_F64)
        return (g64 / (1.0 + np.exp(-g64)) * u).astype(np.float32)

    def moe_combine_(self, x, y, wts):
        s = np.einsum("ntd,nt->nd", y.astype(_F64), wts.astype(_F64))
        x[...] = (x.astype(_F64) + s).astype(np.float32)

    def add_(self, x, y):
        x += y


def _router_probs(logits, func: str = "softmax"):
    z = logits.astype(_F64)
    if func == "sigmoid":
        return (1.0 / (1.0 + np.exp(-z))).astype(np.float32)
    p = np.exp(z - z.max(axis=-1, keepdims=True))
    return (p / p.sum(axis=-1, keepdims=True)).astype(np.float32)


def _weights(p, ids, gating):
    w = np.take_along_axis(p, ids, axis=-1).astype(_F64)
    if gating.norm:
        w /= np.maximum(w.sum(axis=-1, keepdims=True), 6.103515625e-5)
    if gating.scale not in (0.0, 1.0):
        w *= gating.scale
    return w.astype(np.float32)


def _with_shared(ids, wts, gating, n_expert: int):
    if not gating.shared:
        return ids, wts
    n = ids.shape[0]
    shared = np.broadcast_to(np.arange(n_expert, n_expert + gating.shared, dtype=np.int32), (n, gating.shared))
    return (np.concatenate([ids, shared], axis=1),
            np.concatenate([wts, np.ones((n, gating.shared), dtype=np.float32)], axis=1))
