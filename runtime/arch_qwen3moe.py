"""qwen3moe (the Qwen3-30B-A3B family) as GGUF stores it: hyperparameters from the
`qwen3moe.*` metadata, the tensors each layer must hold, and the weights as the graph
uses them (expert gate and up merged into one tensor where their types agree).

Names and keys are those llama.cpp's converter writes, so a real Qwen3-MoE GGUF and a
file from `moeforge synth` load alike.
"""
from __future__ import annotations

from .arch import HParams, LayerRefs, ModelRefs, common_hparams, open_layers
from .gguf_file import Expect, GGUFError, GGUFFile

ARCH = "qwen3moe"
NORM_TYPES = ("f32",)
ROUTER_TYPES = ("f32", "f16")


def read_hparams(f: GGUFFile) -> HParams:
    a = ARCH
    c = common_hparams(f, a)
    head_dim = c["head_dim"]
    rot = f.get(f"{a}.rope.dimension_count", head_dim, kind=int)
    if rot != head_dim:
        raise GGUFError(f"{f.path}: {a}.rope.dimension_count ({rot}) must equal the head size ({head_dim})")
    n_ff = f.get(f"{a}.expert_feed_forward_length", None, kind=int)
    if n_ff is None:  # llama.cpp's fallback for files without the expert key
        n_ff = f.get(f"{a}.feed_forward_length", required=True, kind=int) // c["n_expert_used"]
    return HParams(
        **c, n_ff_exp=n_ff,
        rms_eps=f.get(f"{a}.attention.layer_norm_rms_epsilon", required=True, kind=float),
        rope_base=f.get(f"{a}.rope.freq_base", 10000.0, kind=float),
        n_ctx_train=f.get(f"{a}.context_length", 4096, kind=int),
        expert_weights_scale=f.get(f"{a}.expert_weights_scale", 0.0, kind=float),
    )


def expected_tensors(hp: HParams, f: GGUFFile, qk_norm: bool = True) -> dict[str, Expect]:
    """qk_norm False: llama's layers with experts (Mixtral's), the same without the norms."""
    d, E, ff = hp.n_embd, hp.n_expert, hp.n_ff_exp
    ex = {
        "token_embd.weight": Expect((hp.n_vocab, d)),
        "output_norm.weight": Expect((d,), NORM_TYPES),
        "output.weight": Expect((hp.n_vocab, d), required=False),   # absent: tied to the embedding
    }
    for i in range(hp.n_layer):
        b = f"blk.{i}."
        ex.update({
            b + "attn_norm.weight": Expect((d,), NORM_TYPES),
            b + "attn_q.weight": Expect((hp.q_dim, d)),
            b + "attn_k.weight": Expect((hp.kv_dim, d)),
            b + "attn_v.weight": Expect((hp.kv_dim, d)),
            b + "attn_output.weight": Expect((d, hp.q_dim)),
            b + "ffn_norm.weight": Expect((d,), NORM_TYPES),
            b + "ffn_gate_inp.weight": Expect((E, d), ROUTER_TYPES),
            b + "ffn_down_exps.weight": Expect((E, d, ff)),
        })
        if qk_norm:
            ex[b + "attn_q_norm.weight"] = Expect((hp.head_dim,), NORM_TYPES)
            ex[b + "attn_k_norm.weight"] = Expect((hp.head_dim,), NORM_TYPES)
        if b + "ffn_gate_up_exps.weight" in f.tensors:
            ex[b + "ffn_gate_up_exps.weight"] = Expect((E, 2 * ff, d))
        else:
            ex[b + "ffn_gate_exps.weight"] = Expect((E, ff, d))
            ex[b + "ffn_up_exps.weight"] = Expect((E, ff, d))
    return ex


def open_model(f: GGUFFile, merge: bool = True) -> ModelRefs:
    """Validate everything, read nothing: a wrong file fails before any upload."""
    hp = read_hparams(f)

    def layer(T, b):
        return LayerRefs(T[b + "attn_norm.weight"], T[b + "attn_q.weight"], T[b + "attn_k.weight"],
                         T[b + "attn_v.weight"], T[b + "attn_output.weight"], T[b + "attn_q_norm.weight"],
                         T[b + "attn_k_norm.weight"], T[b + "ffn_norm.weight"], T[b + "ffn_gate_inp.weight"],
                         T[b + "ffn_down_exps.weight"])
    return open_layers(f, hp, expected_tensors(hp, f), layer, merge)
