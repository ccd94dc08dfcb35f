"""deepseek2's part of the synthetic writer (moeforge.synth): the tensors of a layer with
latent attention and glm4moe's FFN, and the metadata keys llama.cpp's converter writes for
it (one kv head, key and value rows of the latent, the `_mla` widths, YaRN's log multiplier
as 0.1 x mscale_all_dim)."""
from __future__ import annotations


def mla_type(qtype: str) -> str:
    """k_b's rows are nope_dim wide (128): whole blocks of 32, not K-quant super-blocks."""
    return qtype if qtype in ("f32", "f16", "q4_0", "q8_0") else "q8_0"


def deepseek2_layers(s, qtype: str, experts: str | None) -> list:
    d, E, ff, H = s.n_embd, s.n_expert, s.n_ff_exp, s.n_head
    r, dr, dv, dk = s.kv_lora_rank, s.n_rot, s.v_head_dim, s.head_dim
    sh, mt = s.n_expert_shared * ff, mla_type(qtype)
    plan = []
    for i in range(s.n_layer):
        b = f"blk.{i}."
        plan.append((b + "attn_norm.weight", (d,), "f32"))
        if s.q_lora_rank:
            plan += [(b + "attn_q_a.weight", (s.q_lora_rank, d), qtype),
                     (b + "attn_q_a_norm.weight", (s.q_lora_rank,), "f32"),
                     (b + "attn_q_b.weight", (H * dk, s.q_lora_rank), qtype)]
        else:
            plan.append((b + "attn_q.weight", (H * dk, d), qtype))
        plan += [
            (b + "attn_kv_a_mqa.weight", (r + dr, d), qtype), (b + "attn_kv_a_norm.weight", (r,), "f32"),
            (b + "attn_k_b.weight", (H, r, dk - dr), mt), (b + "attn_v_b.weight", (H, dv, r), mt),
            (b + "attn_output.weight", (d, H * dv), qtype), (b + "ffn_norm.weight", (d,), "f32"),
        ]
        if i < s.n_dense_lead:
            plan += [(b + "ffn_gate.weight", (s.n_ff, d), qtype), (b + "ffn_up.weight", (s.n_ff, d), qtype),
                     (b + "ffn_down.weight", (d, s.n_ff), qtype)]
            continue
        plan += [
            (b + "ffn_gate_inp.weight", (E, d), "f32"),
            (b + "ffn_gate_exps.weight", (E, ff, d), experts or qtype),
            (b + "ffn_up_exps.weight", (E, ff, d), experts or qtype),
            (b + "ffn_down_exps.weight", (E, d, ff), experts or qtype),
        ]
        if sh:
            plan += [(b + "ffn_gate_shexp.weight", (sh, d), qtype), (b + "ffn_up_shexp.weight", (sh, d), qtype),
                     (b + "ffn_down_shexp.weight", (d, sh), qtype)]
    return plan


def add_deepseek2_metadata(w, s) -> None:
    """The keys beyond the common ones (moeforge.synth._add_metadata writes those, with key
    and value lengths of the latent row)."""
    import gguf
    w.add_rope_dimension_count(s.n_rot)
    w.add_kv_lora_rank(s.kv_lora_rank)
    w.add_q_lora_rank(s.q_lora_rank)
    w.add_key_length_mla(s.head_dim)
    w.add_value_length_mla(s.v_head_dim)
    w.add_expert_shared_count(s.n_expert_shared)
    w.add_leading_dense_block_count(s.n_dense_lead)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SOFTMAX)
    w.add_expert_weights_scale(s.routed_scale)
    w.add_expert_weights_norm(False)
    if s.yarn_factor and s.yarn_log_mul:
        w.add_rope_scaling_yarn_log_mul(0.1 * s.yarn_log_mul)
