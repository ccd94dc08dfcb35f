"""What a model graph needs from a backend, and the parts numpy and CuPy share.

A backend owns its weights' device form (`matrix`, `vector`), the KV cache, and the ops
the graph calls. Ops take a buffer name: a backend may hand back the same preallocated
buffer for the same name and shape every time (CUDA, for graph capture) or a fresh array
(numpy). Methods ending in `_` work in place on their first argument.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np

from . import prompt_attention
from .arch import HParams, ModelRefs
from .kv_cache import KVCache, check_cache_type


@dataclass
class LayerWeights:
    attn_norm: object
    wq: object
    wk: object
    wv: object
    wo: object
    q_norm: object
    k_norm: object
    ffn_norm: object
    router: object
    down: object
    gate_up: object = None
    gate: object = None
    up: object = None
    wqkv: object = None        # q, k, v rows stacked, where the backend runs them as one product
    # gpt-oss (runtime.arch.LayerRefs): float32 vectors, None where the model has none
    bq: object = None
    bk: object = None
    bv: object = None
    bqkv: object = None        # bq, bk, bv stacked, beside wqkv
    bo: object = None
    sinks: object = None
    router_b: object = None
    gate_b: object = None      # (E, ff)
    up_b: object = None
    down_b: object = None      # (E, d)
    exp_probs_b: object = None  # (E,): the router's selection bias (runtime.arch.Gating)
    shared: "LayerWeights | None" = None   # a shared expert of its own (runtime.arch.LayerRefs.shared)
    mla: "MlaWeights | None" = None         # deepseek2's latent attention (runtime.arch.MlaRefs)


@dataclass
class MlaWeights:
    kv_a: object
    kv_a_norm: object
    k_b: object
    v_b: object
    q_a: object = None
    q_a_norm: object = None


@dataclass
class Weights:
    tok_embd: object
    output_norm: object
    output: object
    layers: list[LayerWeights]


# Prompt tokens a forward pass takes where the caller names no ubatch (Model's n_ubatch=None):
# the largest of these whose buffers fit (Backend.auto_ubatch). A larger ubatch gives a MoE
# model's experts more tokens each, for the wider tiles: on an H200 (2026-11-29) 4096 against
# 512 ran pp4096 of Qwen3-30B-A3B q4_0 at 25198 t/s against 19420, q4_K_M 21020 against
# 16022, gpt-oss-20b MXFP4 26994 against 16406; 8192 added 0-2% to pp8192 beyond 4096's.
AUTO_UBATCHES = (4096, 2048, 1024, 512)


def prompt_bytes_per_token(hp: HParams, scores_ctx: int = 0) -> int:
    """A bound on what a prompt pass's buffers take for each of its tokens (measured on an
    H200: Qwen3-30B-A3B 315-341 KB, gpt-oss-20b 460 KB; this gives 344 and 530 KB).
    scores_ctx: the context whose attention scores a pass holds (cuBLAS's path), else 0.
    The expert term counts every slot (glm4moe's shared one too) and a dense layer's FFN."""
    ffn = max(hp.gating.slots * hp.n_ff_exp, hp.n_ff if hp.n_dense_lead else 0)
    return 4 * (30 * hp.n_embd + 4 * ffn + 2 * hp.n_head * scores_ctx)


def choose_ubatch(free_bytes: int, per_token: int) -> int:
    """The largest AUTO_UBATCHES whose buffers take at most a quarter of the free memory
    (the estimate's error, the logits, other processes), at least the smallest."""
    return next((n for n in AUTO_UBATCHES if n * per_token <= free_bytes // 4), AUTO_UBATCHES[-1])


class Backend:
    name = "?"
    xp = np
    ring_unit = 1        # a sliding layer's ring: its size granularity in bytes, and
    ring_layer = None    # (rows, n_ctx, kv_dim, dtype) -> the layer as this backend's ops read it

    def __init__(self, hp: HParams, attn_precision: str | None = None, cache_type: str = "f32"):
        self.hp = hp
        self.cache_type = check_cache_type(cache_type)
        # the prompt attention's precision (runtime.prompt_attention); None until upload
        # resolves it: f16 where the attention weights are quantized or the cache is f16, else f32
        self.attn_request = None if attn_precision is None else prompt_attention.check_precision(attn_precision)
        if cache_type == "f16" and self.attn_request not in (None, "f16"):
            raise ValueError(f"an f16 KV cache holds keys and values at f16 precision: attn_precision must be f16 "
                             f"(or left to the default), not {self.attn_request!r}")
        self.attn_precision = self.attn_request
        self._head_id_rows: dict[int, object] = {}   # mla: per-head product ids by token count

    def auto_ubatch(self, n_ctx: int) -> int:
        """The prompt ubatch where the caller names none (AUTO_UBATCHES); numpy's is the
        smallest: the host gains nothing from more, and its memory is the CI machine's."""
        return AUTO_UBATCHES[-1]

    def auto_ubatch_limit(self) -> int:
        """The largest ubatch auto_ubatch may choose (a ring must hold a pass of it)."""
        return AUTO_UBATCHES[-1]

    def decoding(self):
        """Context of a one-token step (the CUDA backend chains its launches there)."""
        return contextlib.nullcontext()

    # -- weights ---------------------------------------------------------------------------
    def matrix(self, ref):
        raise NotImplementedError

    def vector(self, ref):
        return self.xp.asarray(np.asarray(ref.load(), dtype=np.float32).reshape(ref.shape))

    def upload(self, refs: ModelRefs, progress=None) -> Weights:
        """Layer by layer, so that at most one layer's merged host copy exists at a time."""
        quantized = refs.attention_quantized() or self.cache_type == "f16"
        self.attn_precision = self.attn_request or ("f16" if quantized else "f32")
        M, V = self.matrix, self.vector
        tok = M(refs.tok_embd, embedding=True)
        out = tok if refs.output is refs.tok_embd else M(refs.output)
        layers = []
        for i, L in enumerate(refs.layers):
            layers.append(self._layer(L))
            if progress:
                progress(i + 1, len(refs.layers))
        return Weights(tok, V(refs.output_norm), out, layers)

    def _layer(self, L) -> LayerWeights:
        M, V = self.matrix, self.vector

        def opt(ref, make=V):
            return None if ref is None else make(ref)

        if L.attn_norm is None:   # a shared expert's own FFN: only its products
            return LayerWeights(None, None, None, None, None, None, None, None, None, M(L.down),
                                gate_up=opt(L.gate_up, M), gate=opt(L.gate, M), up=opt(L.up, M))
        wqkv = None if L.mla else self.stacked_qkv(L)
        wq, wk, wv = (None, None, None) if wqkv is not None else (M(L.wq), opt(L.wk, M), opt(L.wv, M))
        mla = None
        if L.mla is not None:
            A = L.mla
            mla = MlaWeights(M(A.kv_a), V(A.kv_a_norm), M(A.k_b), M(A.v_b), opt(A.q_a, M), opt(A.q_a_norm))
        bq, bk, bv = opt(L.bq), opt(L.bk), opt(L.bv)
        return LayerWeights(
            V(L.attn_norm), wq, wk, wv, M(L.wo), opt(L.q_norm), opt(L.k_norm),
            V(L.ffn_norm), opt(L.router, M), M(L.down),
            gate_up=opt(L.gate_up, M), gate=opt(L.gate, M), up=opt(L.up, M), wqkv=wqkv,
            bq=bq, bk=bk, bv=bv, bqkv=None if wqkv is None or bq is None else self.xp.concatenate([bq, bk, bv]),
            bo=opt(L.bo), sinks=opt(L.sinks), router_b=opt(L.router_b), gate_b=opt(L.gate_b),
            up_b=opt(L.up_b), down_b=opt(L.down_b), exp_probs_b=opt(L.exp_probs_b),
            shared=None if L.shared is None else self._layer(L.shared), mla=mla)

    def new_cache(self, n_ctx: int, max_pass: int | None = None) -> KVCache:
        """max_pass: the most tokens a pass will store; with it, sliding-window layers keep
        a ring (runtime.kv_cache) where the backend has a form for one (ring_layer)."""
        return KVCache(self.xp, self.hp, n_ctx, self.cache_type, max_pass, self.ring_unit, self.ring_layer)

    def stacked_qkv(self, L):
        """q, k and v as one stacked matrix, or None to keep three (the default)."""
        return None

    # -- ops every backend composes the same way -------------------------------------------
    # A backend with fused kernels overrides these; the compositions here are the reference.
    def qkv(self, L: LayerWeights, x, bias: bool = True):
        """The three attention projections of x, with their biases where the model has them
        (bias False: without, rope_store_ adds them)."""
        if bias and L.bq is not None:
            return (self.matmul(L.wq, x, "q", bias=L.bq), self.matmul(L.wk, x, "k", bias=L.bk),
                    self.matmul(L.wv, x, "v", bias=L.bv))
        return self.matmul(L.wq, x, "q"), self.matmul(L.wk, x, "k"), self.matmul(L.wv, x, "v")

    def rope_store_(self, cache, il, q, k, v, pos, pos0, L: LayerWeights | None = None):
        """The biases of L's q, k and v projections added (where L is given and has them),
        RoPE of q and k in place (NEOX over each head's first hp.rot_dim dimensions,
        YaRN-scaled where hp.yarn says); k and v into the cache."""
        hp = self.hp
        if L is not None and L.bq is not None:
            for y, b in ((q, L.bq), (k, L.bk), (v, L.bv)):
                self.add_bias_(y, b)
        self.rope_(q, pos, hp.n_head, hp.rope_base, hp.yarn, hp.rot_dim)
        self.rope_(k, pos, hp.n_head_kv, hp.rope_base, hp.yarn, hp.rot_dim)
        self.kv_store_(cache, il, k, v, pos, pos0)

    def qk_norm_rope_store_(self, cache, il, q, k, v, L: LayerWeights, pos, pos0):
        """Per-head RMSNorm and NEOX RoPE of q and k in place; k and v into the cache."""
        hp = self.hp
        self.head_norm_(q, L.q_norm, hp.n_head, hp.rms_eps)
        self.head_norm_(k, L.k_norm, hp.n_head_kv, hp.rms_eps)
        self.rope_(q, pos, hp.n_head, hp.rope_base)
        self.rope_(k, pos, hp.n_head_kv, hp.rope_base)
        self.kv_store_(cache, il, k, v, pos, pos0)

    # -- deepseek2's latent attention (runtime.arch.MLA) --------------------------------------
    def mla_query(self, L: LayerWeights, x):
        """Each head's query (n, H (dn + dr)): from x, or through the low-rank q_a and its norm."""
        A = L.mla
        if A.q_a is None:
            return self.matmul(L.wq, x, "q")
        return self.matmul(L.wq, self.rms_norm(self.matmul(A.q_a, x, "q_a"), A.q_a_norm, self.hp.rms_eps, "q_a_n"), "q")

    def mla_rope_store_(self, cache, il, q, kv, L: LayerWeights, pos, pos0):
        """RoPE (adjacent pairs, YaRN where hp.yarn says) of each head's last dr query values
        in place and of kv's shared key (its last dr); kv's latent RMS-normed; the key row
        [latent, key] into the cache, the latent as the value row."""
        hp, xp = self.hp, self.xp
        m, n = hp.mla, q.shape[0]
        r, dn, dr = m.kv_lora_rank, m.nope_dim, m.rope_dim
        qh = q.reshape(n, hp.n_head, dn + dr)
        q_pe = xp.ascontiguousarray(qh[..., dn:]).reshape(n, hp.n_head * dr)
        self.rope_(q_pe, pos, hp.n_head, hp.rope_base, hp.yarn, pairs="adjacent")
        qh[..., dn:] = q_pe.reshape(n, hp.n_head, dr)
        k_pe = xp.ascontiguousarray(kv[:, r:])
        self.rope_(k_pe, pos, 1, hp.rope_base, hp.yarn, pairs="adjacent")
        latent = self.rms_norm(xp.ascontiguousarray(kv[:, :r]), L.mla.kv_a_norm, hp.rms_eps, "latent")
        self.kv_store_(cache, il, xp.concatenate([latent, k_pe], axis=1), latent, pos, pos0)

    def _head_ids(self, n: int):
        """Each token's heads as the experts of a per-head product (k_b, v_b): 0..H-1, made
        once per token count (the CUDA backend's outside any captured pass)."""
        ids = self._head_id_rows.get(n)
        if ids is None:
            ids = self._head_id_rows[n] = self.xp.tile(self.xp.arange(self.hp.n_head, dtype=np.int32), (n, 1))
        return ids

    def mla_join(self, lat, q):
        """The heads' absorbed queries [lat[h], q_pe[h]], (n, H (r + dr)), from their latent
        parts lat (n, H, r) and q (n, H (dn + dr))."""
        m, n = self.hp.mla, q.shape[0]
        qh = q.reshape(n, self.hp.n_head, m.q_head)
        return self.xp.concatenate([lat.reshape(n, self.hp.n_head, -1), qh[..., m.nope_dim:]], axis=-1).reshape(n, -1)

    def mla_absorb(self, L: LayerWeights, q, name):
        """Each head's query in the latent's space: [k_b[h] q_nope[h], q_pe[h]], (n, H (r + dr))."""
        hp, xp = self.hp, self.xp
        m, n = hp.mla, q.shape[0]
        qh = q.reshape(n, hp.n_head, m.q_head)
        lat = self.mul_mat_id(L.mla.k_b, xp.ascontiguousarray(qh[..., :m.nope_dim]), self._head_ids(n), name)
        return self.mla_join(lat, q)

    def mla_expand(self, L: LayerWeights, a, name):
        """Each head's attention output (n, H r) out of the latent's space: (n, H dv)."""
        n = a.shape[0]
        return self.mul_mat_id(L.mla.v_b, a.reshape(n, self.hp.n_head, -1), self._head_ids(n), name).reshape(n, -1)

    def route_tokens(self, router, x, gating, bias=None, sel_bias=None):
        """Router logits (plus their bias), then each token's experts and weights as gating
        (runtime.arch.Gating) says: (n, gating.slots) ids and weights, shared experts last."""
        return self.route(self.matmul(router, x, "router", bias=bias), gating, sel_bias)

    def dense_route(self, n: int):
        """A dense FFN layer's ids and weights: its one expert, weight 1, for each token."""
        xp = self.xp
        return xp.zeros((n, 1), dtype=np.int32), xp.ones((n, 1), dtype=np.float32)

    def shared_expert_(self, S: LayerWeights, x, h):
        """x += the shared FFN S of h (an expert of its own: its types differ from the routed ones')."""
        n = h.shape[0]
        ids, _ = self.dense_route(n)
        act = self.expert_gate_up(S, h, ids, "shared_act")
        y = self.mul_mat_id(S.down, act, ids, "shared_down")
        self.add_(x, y.reshape(n, -1))

    def add_rms_norm_(self, x, y, w, eps, name, bias=None):
        """x += y (+ bias: added to y first); returns rms_norm(x) * w."""
        if bias is not None:
            self.add_bias_(y, bias)
        self.add_(x, y)
        return self.rms_norm(x, w, eps, name)

    def moe_combine_rms_norm_(self, x, y, wts, w, eps, name):
        """x += sum_j wts[:, j] * y[:, j]; returns rms_norm(x) * w (the next layer's input)."""
        self.moe_combine_(x, y, wts)
        return self.rms_norm(x, w, eps, name)

    def moe_down_combine_rms_norm_(self, L: LayerWeights, x, act, ids, wts, w, eps, name):
        """The experts' down products (plus each expert's bias), x += their weighted sum;
        returns rms_norm(x) * w."""
        y = self.mul_mat_id(L.down, act, ids, "down")
        if L.down_b is not None:
            self.add_bias_id_(y, L.down_b, ids)
        return self.moe_combine_rms_norm_(x, y, wts, w, eps, name)

    def expert_gate_up(self, L: LayerWeights, x, ids, name):
        """act(gate) * up of each token's chosen experts, (n, top_k, n_ff): SiLU, or
        SwiGLU-OAI with each expert's gate and up biases added first (hp.expert_act). A
        backend with a fused kernel overrides this; the composition here is its reference."""
        if L.gate_b is None and self.hp.expert_act == "silu":
            if L.gate_up is not None:
                return self.swiglu(self.mul_mat_id(L.gate_up, x, ids, "gate_up"), name)
            return self.swiglu_split(self.mul_mat_id(L.gate, x, ids, "gate"),
                                     self.mul_mat_id(L.up, x, ids, "up"), name)
        if L.gate_up is not None:
            gu = self.mul_mat_id(L.gate_up, x, ids, "gate_up")
            ff = gu.shape[-1] // 2
            g, u = gu[..., :ff], gu[..., ff:]
        else:
            g, u = self.mul_mat_id(L.gate, x, ids, "gate"), self.mul_mat_id(L.up, x, ids, "up")
        return self.glu_id(g, u, L.gate_b, L.up_b, ids, self.hp.expert_act, name)

    # -- host <-> device ---------------------------------------------------------------------
    def context(self):
        """Entered around every evaluation (the CUDA backend's stream)."""
        return contextlib.nullcontext()

    def to_device(self, a: np.ndarray, name: str):
        return self.xp.asarray(a)

    def to_host(self, a) -> np.ndarray:
        return np.asarray(a)

    def to_host_reused(self, a) -> np.ndarray:
        """a on the host in a buffer the next call may overwrite (generation's logits row,
        read once before the next step)."""
        return self.to_host(a)

    def synchronize(self) -> None:
        pass
