"""gpt-oss (gpt-oss-20b, gpt-oss-120b) as GGUF stores it: hyperparameters from the
`gpt-oss.*` metadata, the tensors each layer must hold, biases and attention sinks
included, and the expert gate and up merged where their types agree.

What sets it apart from qwen3moe, in llama.cpp's graph for it: every product has a bias
(q, k, v, output, router, each expert's gate, up and down); attention has a learned sink
logit per head (in the softmax's denominator, with no value) and every other layer, from
the first, sees only a sliding window of keys; RoPE is YaRN-scaled; no q/k norm; the
norm before the FFN is called post_attention_norm; the router's top-k logits are
softmaxed among themselves (the same weights as softmax over all, renormalised over the
chosen); the experts use SwiGLU-OAI (runtime.arch.HParams.expert_act).
"""
from __future__ import annotations

from .arch import HParams, LayerRefs, ModelRefs, YaRN, common_hparams, open_layers
from .gguf_file import Expect, GGUFError, GGUFFile

ARCH = "gpt-oss"
F32 = ("f32",)
ROUTER_TYPES = ("f32", "f16")
SWA_PATTERN = 2        # llama.cpp: layers 0, 2, 4, ... slide, 1, 3, 5, ... see everything


def read_hparams(f: GGUFFile) -> HParams:
    a = ARCH
    c = common_hparams(f, a, ("expert_feed_forward_length",))
    n_swa = f.get(f"{a}.attention.sliding_window", required=True, kind=int)
    if n_swa < 1:
        raise GGUFError(f"{f.path}: {a}.attention.sliding_window must be positive, got {n_swa}")
    n_ctx_train = f.get(f"{a}.context_length", 4096, kind=int)
    # llama.cpp's reading: no type means linear, no factor (or 0) means no scaling; linear
    # scaling is YaRN without the ramp (ext_factor 0: every angle interpolated, mscale 1)
    scaling = str(f.get(f"{a}.rope.scaling.type", "linear"))
    if scaling not in ("none", "linear", "yarn"):
        raise GGUFError(f"{f.path}: {a}.rope.scaling.type {scaling!r} is not supported (none, linear, yarn)")
    factor = f.get(f"{a}.rope.scaling.factor", 0.0, kind=float)
    if factor < 0:
        raise GGUFError(f"{f.path}: {a}.rope.scaling.factor must not be negative, got {factor}")
    yarn = None
    if scaling != "none" and factor > 0:
        yarn = YaRN(freq_scale=1.0 / factor, ext_factor=1.0 if scaling == "yarn" else 0.0,
                    n_ctx_orig=f.get(f"{a}.rope.scaling.original_context_length", n_ctx_train, kind=int),
                    attn_factor=f.get(f"{a}.rope.scaling.attn_factor", 1.0, kind=float))
    n_ff = c.pop("expert_feed_forward_length")
    return HParams(
        **c, n_ff_exp=n_ff,
        rms_eps=f.get(f"{a}.attention.layer_norm_rms_epsilon", required=True, kind=float),
        rope_base=f.get(f"{a}.rope.freq_base", 10000.0, kind=float), n_ctx_train=n_ctx_train,
        yarn=yarn, n_swa=n_swa, swa_pattern=SWA_PATTERN, expert_act="swiglu_oai")


def expected_tensors(hp: HParams, f: GGUFFile) -> dict[str, Expect]:
    d, E, ff = hp.n_embd, hp.n_expert, hp.n_ff_exp
    ex = {
        "token_embd.weight": Expect((hp.n_vocab, d)),
        "output_norm.weight": Expect((d,), F32),
        "output.weight": Expect((hp.n_vocab, d), required=False),
    }
    for i in range(hp.n_layer):
        b = f"blk.{i}."
        ex.update({
            b + "attn_norm.weight": Expect((d,), F32),
            b + "attn_q.weight": Expect((hp.q_dim, d)),
            b + "attn_k.weight": Expect((hp.kv_dim, d)),
            b + "attn_v.weight": Expect((hp.kv_dim, d)),
            b + "attn_output.weight": Expect((d, hp.q_dim)),
            b + "attn_q.bias": Expect((hp.q_dim,), F32),
            b + "attn_k.bias": Expect((hp.kv_dim,), F32),
            b + "attn_v.bias": Expect((hp.kv_dim,), F32),
            b + "attn_output.bias": Expect((d,), F32),
            b + "attn_sinks.weight": Expect((hp.n_head,), F32),
            b + "post_attention_norm.weight": Expect((d,), F32),
            b + "ffn_gate_inp.weight": Expect((E, d), ROUTER_TYPES),
            b + "ffn_gate_inp.bias": Expect((E,), F32),
            b + "ffn_gate_exps.weight": Expect((E, ff, d)),
            b + "ffn_up_exps.weight": Expect((E, ff, d)),
            b + "ffn_down_exps.weight": Expect((E, d, ff)),
            b + "ffn_gate_exps.bias": Expect((E, ff), F32),
            b + "ffn_up_exps.bias": Expect((E, ff), F32),
            b + "ffn_down_exps.bias": Expect((E, d), F32),
        })
    return ex


def open_model(f: GGUFFile, merge: bool = True) -> ModelRefs:
    """Validate everything, read nothing: a wrong file fails before any upload. The file
    holds expert gate and up apart (the merged name is not among the expected)."""
    hp = read_hparams(f)

    def layer(T, b):
        return LayerRefs(T[b + "attn_norm.weight"], T[b + "attn_q.weight"], T[b + "attn_k.weight"],
                         T[b + "attn_v.weight"], T[b + "attn_output.weight"], None, None,
                         T[b + "post_attention_norm.weight"], T[b + "ffn_gate_inp.weight"],
                         T[b + "ffn_down_exps.weight"],
                         bq=T[b + "attn_q.bias"], bk=T[b + "attn_k.bias"], bv=T[b + "attn_v.bias"],
                         bo=T[b + "attn_output.bias"], sinks=T[b + "attn_sinks.weight"],
                         router_b=T[b + "ffn_gate_inp.bias"], gate_b=T[b + "ffn_gate_exps.bias"],
                         up_b=T[b + "ffn_up_exps.bias"], down_b=T[b + "ffn_down_exps.bias"])
    return open_layers(f, hp, expected_tensors(hp, f), layer, merge)
