"""What every architecture's loader hands the backends: hyperparameters, the tensors of
each layer (optional ones None where an architecture has no such tensor), and the merges
made at load time. Architectures: runtime.arch_qwen3moe, runtime.arch_gptoss,
runtime.arch_glm4moe, runtime.arch_deepseek2, runtime.arch_llama.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from .convert import converted, converted_types
from .gguf_file import Expect, GGUFError, GGUFFile, TensorRef, check_tensors


@dataclass(frozen=True)
class YaRN:
    """RoPE with YaRN context extension, in ggml's terms (ggml_rope_ext): frequencies
    interpolated by freq_scale except for the fastest-turning dimensions (a ramp between
    the correction dimensions beta_fast and beta_slow pick), and cos and sin scaled by
    attn_factor * (1 + 0.1 ln(1 / freq_scale))."""
    freq_scale: float
    n_ctx_orig: int
    ext_factor: float = 1.0
    attn_factor: float = 1.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0

    def corr_dims(self, n_dims: int, base: float) -> tuple[float, float]:
        def dim(rot):
            return n_dims * math.log(self.n_ctx_orig / (rot * 2 * math.pi)) / (2 * math.log(base))
        return max(0.0, math.floor(dim(self.beta_fast))), min(n_dims - 1.0, math.ceil(dim(self.beta_slow)))

    def mscale(self) -> float:
        m = self.attn_factor
        if self.ext_factor != 0.0:
            m *= 1.0 + 0.1 * math.log(1.0 / self.freq_scale)
        return m


@dataclass(frozen=True)
class MLA:
    """DeepSeek's multi-head latent attention as llama.cpp runs it (absorbed): each token's
    keys and values are one latent of kv_lora_rank values (RMS-normed) and one RoPE key of
    rope_dim values that every head shares; a head's query (nope_dim + rope_dim) reaches the
    latent through k_b (its nope part) and its output leaves it through v_b (v_dim values).
    So the cache holds one key row of kv_lora_rank + rope_dim a token and layer, the value
    row being its first kv_lora_rank values: attention of n_head queries over one kv head.
    RoPE turns adjacent pairs (ggml's NORM mode), not NEOX's halves. kq_scale: the softmax
    scale, YaRN's mscale squared over sqrt(nope_dim + rope_dim)."""
    kv_lora_rank: int
    nope_dim: int
    rope_dim: int
    v_dim: int
    kq_scale: float
    q_lora_rank: int = 0          # 0: q straight from the input (attn_q)

    @property
    def q_head(self) -> int:
        return self.nope_dim + self.rope_dim


@dataclass(frozen=True)
class Gating:
    """How a MoE layer's router turns logits into experts and weights (llama.cpp's
    build_moe_ffn): softmax or sigmoid of the logits; the top_k chosen by those
    probabilities plus a per-expert selection bias where the layer has one (exp_probs_b:
    it picks, it never weighs); their probabilities renormalised to sum to one (norm; the
    sum clamped below at 2^-14), then scaled (scale, unless 0 or 1). `shared` experts
    follow as slots top_k.. of every token, experts E.. with weight 1: the shared FFN
    stored as more experts (runtime.arch.append_shared), so it rides the same products."""
    top_k: int
    func: str = "softmax"          # or "sigmoid"
    norm: bool = True
    scale: float = 0.0
    shared: int = 0

    FUNCS = ("softmax", "sigmoid")

    @property
    def slots(self) -> int:
        return self.top_k + self.shared


@dataclass(frozen=True)
class HParams:
    n_vocab: int
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff_exp: int
    n_expert: int
    n_expert_used: int
    rms_eps: float
    rope_base: float
    n_ctx_train: int
    expert_weights_scale: float = 0.0   # 0 or 1: no scaling (llama.cpp's convention)
    # gpt-oss: YaRN-scaled RoPE, a sliding window on some layers, its own expert activation
    yarn: YaRN | None = None
    n_swa: int = 0                      # the sliding window's length in tokens (0: none)
    swa_pattern: int = 0                # layer il slides where il % swa_pattern < swa_pattern - 1
    expert_act: str = "silu"            # or "swiglu_oai"
    # glm4moe: RoPE on the first n_rot dimensions of a head only (0: all), sigmoid routing
    # with a selection bias and a shared expert, dense FFNs (n_ff wide) in the first layers
    n_rot: int = 0
    expert_gating: str = "softmax"
    expert_weights_norm: bool = True
    shared_slots: int = 0               # shared experts riding with the routed ones (Gating.shared)
    n_dense_lead: int = 0
    n_ff: int = 0
    # deepseek2: latent attention (head_dim is then the latent key row, n_head_kv 1)
    mla: MLA | None = None

    @property
    def rot_dim(self) -> int:
        """The dimensions of a head that RoPE turns (the first ones)."""
        return self.n_rot or self.head_dim

    @property
    def gating(self) -> Gating:
        return Gating(self.n_expert_used, self.expert_gating, self.expert_weights_norm, self.expert_weights_scale,
                      self.shared_slots)

    def window(self, il: int) -> int:
        """Layer il's sliding window (a query at p sees keys p - window < j <= p), 0: all."""
        if self.n_swa and self.swa_pattern and il % self.swa_pattern < self.swa_pattern - 1:
            return self.n_swa
        return 0

    @property
    def q_dim(self) -> int:
        return self.n_head * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_head_kv * self.head_dim

    @property
    def v_dim(self) -> int:
        """A value head's width (MLA: the latent, the first values of the key row)."""
        return self.mla.kv_lora_rank if self.mla else self.head_dim

    @property
    def kq_scale(self) -> float:
        return self.mla.kq_scale if self.mla else 1.0 / math.sqrt(self.head_dim)


def common_hparams(f: GGUFFile, arch: str, more: tuple[str, ...] = (), equal_kv: bool = True) -> dict:
    """What every architecture's loader reads and checks alike: the file's architecture,
    the positive integers (and `more` of them, returned too), whole groups of query heads,
    top_k within the experts, equal even key and value widths, the embedding matrix. The
    HParams fields they give, keyed by their names, and `more` by their keys (equal_kv False:
    the architecture checks key and value widths itself; v_dim is returned then)."""
    if f.architecture != arch:
        raise GGUFError(f"{f.path}: general.architecture is {f.architecture!r}, expected {arch!r}")
    a = arch
    keys = ("embedding_length", "block_count", "attention.head_count", "attention.head_count_kv", "expert_count",
            "expert_used_count") + more
    vals = {key: f.get(f"{a}.{key}", required=True, kind=int) for key in keys}
    for key, v in vals.items():
        if v <= 0:
            raise GGUFError(f"{f.path}: metadata key {a}.{key} must be positive, got {v}")
    n_head, n_head_kv = vals["attention.head_count"], vals["attention.head_count_kv"]
    n_expert, n_used = vals["expert_count"], vals["expert_used_count"]
    if n_head % n_head_kv:
        raise GGUFError(f"{f.path}: {a}.attention.head_count ({n_head}) is not a multiple of "
                        f"head_count_kv ({n_head_kv})")
    if n_used > n_expert:
        raise GGUFError(f"{f.path}: {a}.expert_used_count ({n_used}) exceeds expert_count ({n_expert})")
    n_embd = vals["embedding_length"]
    head_dim = f.get(f"{a}.attention.key_length", n_embd // n_head, kind=int)
    v_dim = f.get(f"{a}.attention.value_length", head_dim, kind=int)
    if equal_kv and (v_dim != head_dim or head_dim % 2):
        raise GGUFError(f"{f.path}: {a}.attention.key_length ({head_dim}) and value_length ({v_dim}) must be "
                        f"equal and even")
    tok = f.tensors.get("token_embd.weight")
    if tok is None or len(tok.shape) != 2:
        raise GGUFError(f"{f.path}: tensor 'token_embd.weight' is missing or not a matrix")
    return dict(n_vocab=tok.shape[0], n_embd=n_embd, n_layer=vals["block_count"], n_head=n_head, n_head_kv=n_head_kv,
                head_dim=head_dim, n_expert=n_expert, n_expert_used=n_used, **{k: vals[k] for k in more},
                **({} if equal_kv else {"v_dim": v_dim}))


def refuse_scaled_rope(f: GGUFFile, arch: str) -> None:
    """Architectures whose RoPE runs unscaled: a file that scales it is refused by name."""
    scaling = str(f.get(f"{arch}.rope.scaling.type", "none"))
    if scaling != "none" and f.get(f"{arch}.rope.scaling.factor", 0.0, kind=float) not in (0.0, 1.0):
        raise GGUFError(f"{f.path}: {arch}.rope.scaling.type {scaling!r}: scaled RoPE is not supported for {arch}")


def merge_gate_up(gate: TensorRef, up: TensorRef, name: str) -> TensorRef:
    """(E, ff, k) gate and up -> (E, 2*ff, k), gate rows first: one GEMM instead of two.
    The concatenation is made where the bytes are loaded to (load(cupy): on the device)."""
    E, ff, k = gate.shape

    def load(xp=np):
        g, u = gate.load(xp), up.load(xp)
        return xp.concatenate([g.reshape(E, ff, -1), u.reshape(E, ff, -1)], axis=1).reshape(E * 2 * ff, -1)

    return TensorRef(name, gate.qtype, (E, 2 * ff, k), load)


def append_shared(exps: TensorRef, shexp: TensorRef, name: str, n: int = 1) -> TensorRef:
    """(E, rows, k) experts and n shared experts stored as one FFN -> (E + n, rows, k):
    shared expert j as expert E + j (Gating.shared). The FFN's gate and up, (n*ff, k), are
    the n experts' rows one after the other; its down, (d, n*ff), holds expert j's in
    columns j*ff.. of every row, gathered here. Those columns start on a quant block:
    the routed down's rows are ff wide, of the same type (shared_rides)."""
    E, rows, k = exps.shape
    columns = shexp.shape[0] != n * rows

    def load(xp=np):
        a, b = exps.load(xp), shexp.load(xp)
        if columns:
            b = b.reshape(rows, n, -1).transpose(1, 0, 2)
        return xp.concatenate([a.reshape(E * rows, -1), b.reshape(n * rows, -1)], axis=0)

    return TensorRef(name, exps.qtype, (E + n, rows, k), load)


def as_one_expert(t: TensorRef) -> TensorRef:
    """A dense FFN's (m, k) matrix as (1, m, k): an expert every token takes."""
    return TensorRef(t.name, t.qtype, (1, *t.shape), t.load)


def file_tensors(f: GGUFFile) -> dict[str, TensorRef]:
    """The file's tensors as the backends load them: types without kernels (q3_K, ...) as
    q8_0 (check_tensors allowed only those, ours and floats, checked as the file has them)."""
    convert = converted_types()
    return {name: converted(ref) if ref.qtype in convert else ref for name, ref in f.tensors.items()}


def set_gate_up(L: "LayerRefs", T: dict[str, TensorRef], b: str, merge: bool) -> None:
    """L's expert gate and up: the file's merged tensor, or its two merged at load time
    where their types agree (merge), else the two as they are."""
    if b + "ffn_gate_up_exps.weight" in T:
        L.gate_up = T[b + "ffn_gate_up_exps.weight"]
        return
    pick_gate_up(L, T[b + "ffn_gate_exps.weight"], T[b + "ffn_up_exps.weight"], merge, b + "ffn_gate_up_exps.weight")


def pick_gate_up(L: "LayerRefs", g: TensorRef, u: TensorRef, merge: bool, name: str) -> None:
    if merge and g.qtype == u.qtype:
        L.gate_up = merge_gate_up(g, u, name)
    else:
        L.gate, L.up = g, u


def ffn_refs(L: "LayerRefs", T: dict[str, TensorRef], b: str, dense: bool, ride: bool, apart: bool,
             merge: bool) -> "LayerRefs":
    """A glm4moe or deepseek2 layer's FFN into L: a dense layer's as one expert; else the
    router, its selection bias where the file has one, the down experts, and the shared
    expert riding with the routed ones (append_shared) or apart (a LayerRefs of its own)."""
    if dense:
        L.down = as_one_expert(T[b + "ffn_down.weight"])
        pick_gate_up(L, as_one_expert(T[b + "ffn_gate.weight"]), as_one_expert(T[b + "ffn_up.weight"]),
                     merge, b + "ffn_gate_up.weight")
        return L
    L.router, L.exp_probs_b = T[b + "ffn_gate_inp.weight"], T.get(b + "exp_probs_b.bias")
    if ride:
        n = T[b + "ffn_gate_shexp.weight"].shape[0] // T[b + "ffn_gate_exps.weight"].shape[1]
        L.down = append_shared(T[b + "ffn_down_exps.weight"], T[b + "ffn_down_shexp.weight"],
                               b + "ffn_down_exps.weight", n)
        pick_gate_up(L, append_shared(T[b + "ffn_gate_exps.weight"], T[b + "ffn_gate_shexp.weight"],
                                      b + "ffn_gate_exps.weight", n),
                     append_shared(T[b + "ffn_up_exps.weight"], T[b + "ffn_up_shexp.weight"],
                                   b + "ffn_up_exps.weight", n), merge, b + "ffn_gate_up_exps.weight")
        return L
    L.down = T[b + "ffn_down_exps.weight"]
    if apart:
        S = LayerRefs(None, None, None, None, None, None, None, None, None,
                      as_one_expert(T[b + "ffn_down_shexp.weight"]))
        pick_gate_up(S, as_one_expert(T[b + "ffn_gate_shexp.weight"]), as_one_expert(T[b + "ffn_up_shexp.weight"]),
                     merge, b + "ffn_gate_up_shexp.weight")
        L.shared = S
    return L   # the routed gate and up: open_layers (set_gate_up)


def shared_rides(types: dict[str, str], layers: range, n_shared: int) -> bool:
    """Whether the shared experts join the routed ones (Gating.shared is the model's, so in
    every one of `layers` or in none): there are some (several, stored as one FFN of their
    total width, become as many experts: append_shared), each of their gate, up and down
    has the type of the routed tensor it joins, and gate and up are separate (a file's
    merged ffn_gate_up_exps has no gate rows to append to). types: tensor name -> type (the
    loaders', the tuner's)."""
    if n_shared < 1:
        return False
    for i in layers:
        b = f"blk.{i}."
        if b + "ffn_gate_up_exps.weight" in types:
            return False
        for p in ("gate", "up", "down"):
            s, e = types.get(f"{b}ffn_{p}_shexp.weight"), types.get(f"{b}ffn_{p}_exps.weight")
            if s is not None and e is not None and s != e:
                return False
    return True


def place_shared(f: GGUFFile, hp: HParams) -> tuple[HParams, bool, bool]:
    """Where glm4moe's and deepseek2's shared experts run (shared_rides): the hyperparameters
    the graph runs (Gating.shared only where they ride), ride, apart (a FFN of their own)."""
    ride = shared_rides({n: t.qtype for n, t in f.tensors.items()}, range(hp.n_dense_lead, hp.n_layer),
                        hp.shared_slots)
    return replace(hp, shared_slots=hp.shared_slots if ride else 0), ride, hp.shared_slots > 0 and not ride


def open_layers(f: GGUFFile, hp: HParams, expected: dict[str, Expect], layer_refs, merge: bool) -> ModelRefs:
    """What both loaders do once an architecture has read its hyperparameters: every tensor
    checked against `expected` before anything is read, then layer_refs(T, "blk.i.") for
    each layer, its expert gate and up set (set_gate_up), the head tied to the embedding
    where the file has none."""
    check_tensors(f, expected)
    T = file_tensors(f)
    layers = []
    for i in range(hp.n_layer):
        L = layer_refs(T, f"blk.{i}.")
        if L.gate_up is None and L.gate is None:   # else the architecture chose them (pick_gate_up)
            set_gate_up(L, T, f"blk.{i}.", merge)
        layers.append(L)
    output = T.get("output.weight", T["token_embd.weight"])
    return ModelRefs(hp, T["token_embd.weight"], T["output_norm.weight"], output, layers)


def merge_rows(parts: list[TensorRef], name: str) -> TensorRef:
    """2-D tensors of one type and width stacked by rows (q, k and v: one product)."""
    rows = sum(p.shape[0] for p in parts)

    def load(xp=np):
        return xp.concatenate([p.load(xp).reshape(p.shape[0], -1) for p in parts], axis=0)

    return TensorRef(name, parts[0].qtype, (rows, parts[0].shape[1]), load)


@dataclass
class LayerRefs:
    attn_norm: TensorRef
    wq: TensorRef
    wk: TensorRef
    wv: TensorRef
    wo: TensorRef
    q_norm: TensorRef | None      # qwen3moe's per-head RMSNorm of q and k
    k_norm: TensorRef | None
    ffn_norm: TensorRef
    router: TensorRef | None     # None: a dense FFN layer (its one expert always taken)
    down: TensorRef
    gate_up: TensorRef | None = None      # merged, gate rows first
    gate: TensorRef | None = None         # separate, where types differ
    up: TensorRef | None = None
    # gpt-oss: biases of every product, the attention sinks (a logit per head)
    bq: TensorRef | None = None
    bk: TensorRef | None = None
    bv: TensorRef | None = None
    bo: TensorRef | None = None
    sinks: TensorRef | None = None
    router_b: TensorRef | None = None
    gate_b: TensorRef | None = None       # (E, ff); with gate_up merged: gate_up_b (E, 2 ff)
    up_b: TensorRef | None = None
    down_b: TensorRef | None = None       # (E, d)
    # glm4moe: the router's selection bias (E,); a dense layer has no router and one expert
    # (its FFN, as_one_expert); `shared` a shared expert that could not join the experts
    # (another type): a LayerRefs of its own with gate/up/down (1, ff, k) and (1, d, ff)
    exp_probs_b: TensorRef | None = None
    shared: "LayerRefs | None" = None
    # deepseek2: the latent attention's own tensors (wq is attn_q or q_b; wk, wv None)
    mla: "MlaRefs | None" = None


@dataclass
class MlaRefs:
    """A layer's latent attention (runtime.arch.MLA): kv_a (r + dr, d) gives the latent and
    the shared RoPE key, kv_a_norm (r,) norms the latent, k_b (H, r, dn) takes each head's
    nope query into the latent, v_b (H, dv, r) each head's output out of it; q_a (q_lora,
    d) and q_a_norm where q is low-rank (then the layer's wq is q_b)."""
    kv_a: TensorRef
    kv_a_norm: TensorRef
    k_b: TensorRef
    v_b: TensorRef
    q_a: TensorRef | None = None
    q_a_norm: TensorRef | None = None


@dataclass
class ModelRefs:
    hp: HParams
    tok_embd: TensorRef
    output_norm: TensorRef
    output: TensorRef          # the embedding itself when the file ties them
    layers: list[LayerRefs]

    def attention_quantized(self) -> bool:
        """Every q, k, v and output projection quantized: the prompt attention may then run
        on f16 tensor cores (runtime.prompt_attention)."""
        return all(t.quantized for L in self.layers for t in (L.wq, L.wk, L.wv, L.wo) if t is not None)
