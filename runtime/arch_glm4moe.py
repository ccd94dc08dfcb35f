"""glm4moe (GLM-4.5, GLM-4.5-Air, GLM-4.6) as GGUF stores it: hyperparameters from the
`glm4moe.*` metadata, the tensors of its trunk layers, and the weights as the graph uses them.

What sets it apart from qwen3moe, in llama.cpp's graph for it: q, k and v have biases
(no output bias), q/k RMSNorm only where the file has it (GLM-4.5, not Air), NEOX RoPE on
the first rope.dimension_count dimensions of each head only (half of them); the first
leading_dense_block_count layers have a dense SwiGLU FFN, the others route with sigmoid
probabilities, a per-expert selection bias (exp_probs_b: it picks, it never weighs),
renormalised and scaled weights (expert_weights_norm, expert_weights_scale), and add a
shared expert's output to the routed ones'. The norm before the FFN is called
post_attention_norm. The file's last nextn_predict_layers blocks are a multi-token-
prediction head that the forward pass does not run: checked, never loaded.

How the graph runs it (runtime.graph_glm4moe): a dense layer is a MoE layer with one
expert that every token takes with weight 1 (as_one_expert), and the shared expert is one
more expert that every token takes with weight 1 (append_shared, Gating.shared), so both
ride the expert products and their fusions. Where a file gives the shared expert other
types than the routed ones, it stays a one-expert FFN of its own (LayerRefs.shared).
"""
from __future__ import annotations


from .arch import (HParams, LayerRefs, ModelRefs, common_hparams, ffn_refs, open_layers, place_shared,
                   refuse_scaled_rope)
from .gguf_file import Expect, GGUFError, GGUFFile

ARCH = "glm4moe"
F32 = ("f32",)
ROUTER_TYPES = ("f32", "f16")
GATING_FUNCS = {1: "softmax", 2: "sigmoid"}   # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_*


def read_hparams(f: GGUFFile) -> tuple[HParams, int]:
    """The hyperparameters and the number of blocks in the file (the trunk's and the
    prediction head's)."""
    a = ARCH
    c = common_hparams(f, a)
    n_blocks, head_dim, n_used = c["n_layer"], c["head_dim"], c["n_expert_used"]
    nextn = f.get(f"{a}.nextn_predict_layers", 0, kind=int)
    if nextn >= n_blocks:
        raise GGUFError(f"{f.path}: {a}.nextn_predict_layers ({nextn}) leaves no layer of the "
                        f"{n_blocks} blocks to run")
    n_rot = f.get(f"{a}.rope.dimension_count", head_dim, kind=int)
    if n_rot % 2 or not 0 < n_rot <= head_dim:
        raise GGUFError(f"{f.path}: {a}.rope.dimension_count ({n_rot}) must be even and in (0, {head_dim}]")
    sections = f.get(f"{a}.rope.dimension_sections", None)
    if sections is not None and any(int(s) for s in sections):
        raise GGUFError(f"{f.path}: {a}.rope.dimension_sections: multimodal RoPE (M-RoPE) is not supported")
    refuse_scaled_rope(f, a)
    if f.get(f"{a}.expert_group_count", 1, kind=int) > 1:
        raise GGUFError(f"{f.path}: {a}.expert_group_count: group-limited routing is not supported")
    func = f.get(f"{a}.expert_gating_func", 2, kind=int) or 2    # none: llama.cpp's default for glm4moe
    if func not in GATING_FUNCS:
        raise GGUFError(f"{f.path}: {a}.expert_gating_func {func}: supported are "
                        + ", ".join(f"{k} ({v})" for k, v in GATING_FUNCS.items()))
    shared = f.get(f"{a}.expert_shared_count", required=True, kind=int)
    if shared > 1:
        raise GGUFError(f"{f.path}: {a}.expert_shared_count {shared}: moeforge runs one shared expert at most")
    dense = f.get(f"{a}.leading_dense_block_count", 0, kind=int)
    if dense > n_blocks - nextn:
        raise GGUFError(f"{f.path}: {a}.leading_dense_block_count ({dense}) exceeds the {n_blocks - nextn} layers")
    n_ff = f.get(f"{a}.feed_forward_length", 0, kind=int)
    if dense and n_ff <= 0:
        raise GGUFError(f"{f.path}: {a}.feed_forward_length must be positive where layers are dense")
    n_ff_exp = f.get(f"{a}.expert_feed_forward_length", None, kind=int)
    if n_ff_exp is None:   # llama.cpp's fallback
        n_ff_exp = n_ff // n_used
    if n_ff_exp <= 0:
        raise GGUFError(f"{f.path}: {a}.expert_feed_forward_length must be positive")
    norm = f.get(f"{a}.expert_weights_norm", False)
    if not isinstance(norm, bool):
        raise GGUFError(f"{f.path}: {a}.expert_weights_norm must be a boolean, got {norm!r}")
    c["n_layer"] = n_blocks - nextn
    hp = HParams(
        **c, n_ff_exp=n_ff_exp,
        rms_eps=f.get(f"{a}.attention.layer_norm_rms_epsilon", required=True, kind=float),
        rope_base=f.get(f"{a}.rope.freq_base", 10000.0, kind=float),
        n_ctx_train=f.get(f"{a}.context_length", 4096, kind=int),
        expert_weights_scale=f.get(f"{a}.expert_weights_scale", 0.0, kind=float),
        n_rot=n_rot, expert_gating=GATING_FUNCS[func], expert_weights_norm=norm,
        shared_slots=shared, n_dense_lead=dense, n_ff=n_ff)
    return hp, n_blocks


def _layer_tensors(hp: HParams, b: str, dense: bool, required: bool, f: GGUFFile) -> dict[str, Expect]:
    d, E, ff, q, kv = hp.n_embd, hp.n_expert, hp.n_ff_exp, hp.q_dim, hp.kv_dim
    sh = hp.shared_slots * ff

    def ex(shape, types=None, req=required):
        return Expect(shape, types, req) if types else Expect(shape, required=req)
    out = {
        b + "attn_norm.weight": ex((d,), F32),
        b + "attn_q.weight": ex((q, d)), b + "attn_k.weight": ex((kv, d)), b + "attn_v.weight": ex((kv, d)),
        b + "attn_q.bias": ex((q,), F32, False), b + "attn_k.bias": ex((kv,), F32, False),
        b + "attn_v.bias": ex((kv,), F32, False),
        b + "attn_output.weight": ex((d, q)),
        b + "attn_q_norm.weight": ex((hp.head_dim,), F32, False),
        b + "attn_k_norm.weight": ex((hp.head_dim,), F32, False),
        b + "post_attention_norm.weight": ex((d,), F32),
    }
    if dense:
        out.update({b + "ffn_gate.weight": ex((hp.n_ff, d)), b + "ffn_up.weight": ex((hp.n_ff, d)),
                    b + "ffn_down.weight": ex((d, hp.n_ff))})
        return out
    out.update({
        b + "ffn_gate_inp.weight": ex((E, d), ROUTER_TYPES),
        b + "exp_probs_b.bias": ex((E,), F32),
        b + "ffn_down_exps.weight": ex((E, d, ff)),
    })
    if b + "ffn_gate_up_exps.weight" in f.tensors:
        out[b + "ffn_gate_up_exps.weight"] = ex((E, 2 * ff, d))
    else:
        out.update({b + "ffn_gate_exps.weight": ex((E, ff, d)), b + "ffn_up_exps.weight": ex((E, ff, d))})
    if sh:
        out.update({b + "ffn_gate_shexp.weight": ex((sh, d)), b + "ffn_up_shexp.weight": ex((sh, d)),
                    b + "ffn_down_shexp.weight": ex((d, sh))})
    return out


def expected_tensors(hp: HParams, n_blocks: int, f: GGUFFile) -> dict[str, Expect]:
    d = hp.n_embd
    ex = {
        "token_embd.weight": Expect((hp.n_vocab, d)),
        "output_norm.weight": Expect((d,), F32),
        "output.weight": Expect((hp.n_vocab, d), required=False),   # absent: tied to the embedding
    }
    for i in range(n_blocks):
        b = f"blk.{i}."
        head = i >= hp.n_layer          # the multi-token-prediction head: checked if there, not run
        ex.update(_layer_tensors(hp, b, i < hp.n_dense_lead, not head, f))
        if head:
            ex.update({b + "nextn.eh_proj.weight": Expect((d, 2 * d), required=False),
                       b + "nextn.enorm.weight": Expect((d,), F32, False),
                       b + "nextn.hnorm.weight": Expect((d,), F32, False),
                       b + "nextn.embed_tokens.weight": Expect((hp.n_vocab, d), required=False),
                       b + "nextn.shared_head_head.weight": Expect((hp.n_vocab, d), required=False),
                       b + "nextn.shared_head_norm.weight": Expect((d,), F32, False)})
    return ex


def _check_biases(f: GGUFFile, hp: HParams) -> None:
    for i in range(hp.n_layer):
        have = [f"blk.{i}.attn_{p}.bias" in f.tensors for p in "qkv"]
        if any(have) and not all(have):
            raise GGUFError(f"{f.path}: layer {i} has biases for some of q, k, v but not all")
        norms = [f"blk.{i}.attn_{p}_norm.weight" in f.tensors for p in "qk"]
        if norms[0] != norms[1]:
            raise GGUFError(f"{f.path}: layer {i} has a norm for one of q and k but not the other")


def open_model(f: GGUFFile, merge: bool = True) -> ModelRefs:
    """Validate everything, read nothing: a wrong file fails before any upload."""
    hp, n_blocks = read_hparams(f)
    expected = expected_tensors(hp, n_blocks, f)
    _check_biases(f, hp)
    run_hp, ride, apart = place_shared(f, hp)

    def layer(T, b):
        i = int(b.split(".")[1])
        opt = T.get
        L = LayerRefs(T[b + "attn_norm.weight"], T[b + "attn_q.weight"], T[b + "attn_k.weight"],
                      T[b + "attn_v.weight"], T[b + "attn_output.weight"], opt(b + "attn_q_norm.weight"),
                      opt(b + "attn_k_norm.weight"), T[b + "post_attention_norm.weight"], None, None,
                      bq=opt(b + "attn_q.bias"), bk=opt(b + "attn_k.bias"), bv=opt(b + "attn_v.bias"))
        return ffn_refs(L, T, b, i < hp.n_dense_lead, ride, apart, merge)

    refs = open_layers(f, run_hp, expected, layer, merge)
    return refs
