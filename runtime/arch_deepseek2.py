"""deepseek2 (DeepSeek-V2, V2-Lite, V2.5, Coder-V2; Kimi-K2's layout) as GGUF stores it:
hyperparameters from the `deepseek2.*` metadata, the tensors of its layers, and the weights
as the graph uses them.

Attention is multi-head latent attention (runtime.arch.MLA) in the layout llama.cpp's
converter has written since April 2025 (attn_k_b and attn_v_b, the `_mla` key widths, one kv
head): the graph runs it absorbed, as llama.cpp does, over a cache of one latent key row a
token. Files from before that (one attn_kv_b) are refused with what to do. q comes straight
from the input (attn_q, the Lite models) or through a low-rank q_a and its norm. RoPE turns
adjacent pairs, with YaRN where the file says (its log multiplier stored as 0.1 x
mscale_all_dim, as llama.cpp's converter writes it). The FFN is glm4moe's: dense layers
first, then routing (softmax by default, sigmoid where the file says, a selection bias
where it has one), shared experts riding with the routed ones as as many more experts
and slots (V2-Lite's two: 64 + 2 experts, 6 + 2 slots; runtime.arch.append_shared) where
their types are the routed ones', else one FFN of their total width apart, as llama.cpp
runs them (runtime.arch.ffn_refs).
"""
from __future__ import annotations

import math

from .arch import (MLA, HParams, LayerRefs, MlaRefs, ModelRefs, YaRN, common_hparams, ffn_refs, open_layers,
                   place_shared)
from .gguf_file import Expect, GGUFError, GGUFFile

ARCH = "deepseek2"
F32 = ("f32",)
ROUTER_TYPES = ("f32", "f16")
GATING_FUNCS = {1: "softmax", 2: "sigmoid"}   # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_*


def _yarn(f: GGUFFile, a: str, n_ctx_train: int, head_k: int) -> tuple[YaRN | None, float]:
    """llama.cpp's RoPE scaling for this architecture and the softmax scale it implies: the
    YaRN factor on cos and sin cancelled to 1 (what the model was trained with: its mscale
    over mscale_all_dim), the softmax scaled by (1 + 0.1 mscale_all_dim ln factor)^2 instead."""
    scaling = str(f.get(f"{a}.rope.scaling.type", "none"))
    rope_attn = f.get(f"{a}.rope.scaling.attn_factor", 1.0, kind=float)
    if scaling == "none":
        return None, rope_attn * rope_attn / math.sqrt(head_k)
    if scaling != "yarn":
        raise GGUFError(f"{f.path}: {a}.rope.scaling.type {scaling!r} is not supported for {ARCH} (none, yarn)")
    factor = f.get(f"{a}.rope.scaling.factor", 0.0, kind=float)
    if factor <= 0:
        raise GGUFError(f"{f.path}: {a}.rope.scaling.factor must be positive for YaRN, got {factor}")
    log_mul = f.get(f"{a}.rope.scaling.yarn_log_multiplier", 0.0, kind=float) / 0.1
    ln = math.log(factor)
    # with the multiplier llama.cpp's ratio of mscales is 1 for deepseek2; without it, 1 + 0.1 ln
    ratio = 1.0 if log_mul or factor <= 1 else 1.0 + 0.1 * ln
    attn_factor = ratio / (1.0 + 0.1 * ln) * rope_attn
    yarn = YaRN(freq_scale=1.0 / factor, n_ctx_orig=f.get(f"{a}.rope.scaling.original_context_length", n_ctx_train,
                                                         kind=int), ext_factor=1.0, attn_factor=attn_factor)
    mscale = attn_factor * (1.0 + 0.1 * ln) * (1.0 + 0.1 * log_mul * ln)
    return yarn, mscale * mscale / math.sqrt(head_k)


def read_hparams(f: GGUFFile) -> HParams:
    a = ARCH
    c = common_hparams(f, a, equal_kv=False)
    key_mla = f.get(f"{a}.attention.key_length_mla", 0, kind=int)
    val_mla = f.get(f"{a}.attention.value_length_mla", 0, kind=int)
    if not (key_mla and val_mla) or "blk.0.attn_kv_b.weight" in f.tensors:
        raise GGUFError(f"{f.path}: a {ARCH} file without the latent attention's split tensors (attn_k_b, attn_v_b) "
                        f"and {a}.attention.key_length_mla / value_length_mla: convert the model again with "
                        f"llama.cpp's convert_hf_to_gguf.py from April 2025 or later")
    r = f.get(f"{a}.attention.kv_lora_rank", required=True, kind=int)
    q_lora = f.get(f"{a}.attention.q_lora_rank", 0, kind=int)
    dr = f.get(f"{a}.rope.dimension_count", required=True, kind=int)
    dn = key_mla - dr
    if c["n_head_kv"] != 1 or c["head_dim"] != r + dr or c.pop("v_dim") != r:
        raise GGUFError(f"{f.path}: {a}: latent attention wants head_count_kv 1, key_length kv_lora_rank + "
                        f"rope.dimension_count ({r + dr}) and value_length kv_lora_rank ({r}); the file has "
                        f"{c['n_head_kv']}, {c['head_dim']}")
    if dr % 2 or dn <= 0 or r <= 0 or val_mla <= 0 or q_lora < 0:
        raise GGUFError(f"{f.path}: {a}: rope.dimension_count ({dr}) must be even and below key_length_mla "
                        f"({key_mla}); kv_lora_rank ({r}) and value_length_mla ({val_mla}) positive")
    n_layer, n_vocab = c["n_layer"], c["n_vocab"]
    if f.get(f"{a}.nextn_predict_layers", 0, kind=int):
        raise GGUFError(f"{f.path}: {a}.nextn_predict_layers: multi-token-prediction blocks are not supported for {ARCH}")
    if f.get(f"{a}.expert_group_count", 1, kind=int) > 1:
        raise GGUFError(f"{f.path}: {a}.expert_group_count: group-limited routing is not supported")
    func = f.get(f"{a}.expert_gating_func", 0, kind=int)
    if func == 0:   # llama.cpp's default for files without the key (GLM-4.7-Lite's shape: sigmoid)
        func = 2 if n_layer in (47, 48) and n_vocab == 154880 else 1
    if func not in GATING_FUNCS:
        raise GGUFError(f"{f.path}: {a}.expert_gating_func {func}: supported are "
                        + ", ".join(f"{k} ({v})" for k, v in GATING_FUNCS.items()))
    dense = f.get(f"{a}.leading_dense_block_count", 0, kind=int)
    if dense > n_layer:
        raise GGUFError(f"{f.path}: {a}.leading_dense_block_count ({dense}) exceeds the {n_layer} layers")
    n_ff = f.get(f"{a}.feed_forward_length", 0, kind=int)
    if dense and n_ff <= 0:
        raise GGUFError(f"{f.path}: {a}.feed_forward_length must be positive where layers are dense")
    n_ff_exp = f.get(f"{a}.expert_feed_forward_length", required=True, kind=int)
    shared = f.get(f"{a}.expert_shared_count", required=True, kind=int)
    if n_ff_exp <= 0 or shared < 0:
        raise GGUFError(f"{f.path}: {a}.expert_feed_forward_length must be positive and expert_shared_count "
                        f"not negative")
    norm = f.get(f"{a}.expert_weights_norm", False)
    if not isinstance(norm, bool):
        raise GGUFError(f"{f.path}: {a}.expert_weights_norm must be a boolean, got {norm!r}")
    n_ctx_train = f.get(f"{a}.context_length", 4096, kind=int)
    yarn, kq_scale = _yarn(f, a, n_ctx_train, key_mla)
    return HParams(
        **c, n_ff_exp=n_ff_exp,
        rms_eps=f.get(f"{a}.attention.layer_norm_rms_epsilon", required=True, kind=float),
        rope_base=f.get(f"{a}.rope.freq_base", 10000.0, kind=float), n_ctx_train=n_ctx_train,
        expert_weights_scale=f.get(f"{a}.expert_weights_scale", 0.0, kind=float), yarn=yarn,
        expert_gating=GATING_FUNCS[func], expert_weights_norm=norm, shared_slots=shared, n_dense_lead=dense,
        n_ff=n_ff, mla=MLA(r, dn, dr, val_mla, kq_scale, q_lora))


def expected_tensors(hp: HParams, f: GGUFFile) -> dict[str, Expect]:
    d, E, ff, H, m = hp.n_embd, hp.n_expert, hp.n_ff_exp, hp.n_head, hp.mla
    sh = hp.shared_slots * ff
    ex = {"token_embd.weight": Expect((hp.n_vocab, d)), "output_norm.weight": Expect((d,), F32),
          "output.weight": Expect((hp.n_vocab, d), required=False)}
    for i in range(hp.n_layer):
        b = f"blk.{i}."
        ex.update({
            b + "attn_norm.weight": Expect((d,), F32),
            b + "attn_kv_a_mqa.weight": Expect((m.kv_lora_rank + m.rope_dim, d)),
            b + "attn_kv_a_norm.weight": Expect((m.kv_lora_rank,), F32),
            b + "attn_k_b.weight": Expect((H, m.kv_lora_rank, m.nope_dim)),
            b + "attn_v_b.weight": Expect((H, m.v_dim, m.kv_lora_rank)),
            b + "attn_output.weight": Expect((d, H * m.v_dim)),
            b + "ffn_norm.weight": Expect((d,), F32),
        })
        if m.q_lora_rank:
            ex.update({b + "attn_q_a.weight": Expect((m.q_lora_rank, d)),
                       b + "attn_q_a_norm.weight": Expect((m.q_lora_rank,), F32),
                       b + "attn_q_b.weight": Expect((H * m.q_head, m.q_lora_rank))})
        else:
            ex[b + "attn_q.weight"] = Expect((H * m.q_head, d))
        if i < hp.n_dense_lead:
            ex.update({b + "ffn_gate.weight": Expect((hp.n_ff, d)), b + "ffn_up.weight": Expect((hp.n_ff, d)),
                       b + "ffn_down.weight": Expect((d, hp.n_ff))})
            continue
        ex.update({b + "ffn_gate_inp.weight": Expect((E, d), ROUTER_TYPES),
                   b + "exp_probs_b.bias": Expect((E,), F32, required=False),
                   b + "ffn_down_exps.weight": Expect((E, d, ff))})
        if b + "ffn_gate_up_exps.weight" in f.tensors:
            ex[b + "ffn_gate_up_exps.weight"] = Expect((E, 2 * ff, d))
        else:
            ex.update({b + "ffn_gate_exps.weight": Expect((E, ff, d)), b + "ffn_up_exps.weight": Expect((E, ff, d))})
        if sh:
            ex.update({b + "ffn_gate_shexp.weight": Expect((sh, d)), b + "ffn_up_shexp.weight": Expect((sh, d)),
                       b + "ffn_down_shexp.weight": Expect((d, sh))})
    return ex


def open_model(f: GGUFFile, merge: bool = True) -> ModelRefs:
    """Validate everything, read nothing: a wrong file fails before any upload. The shared
    experts ride with the routed ones where their types allow (runtime.arch.shared_rides)."""
    hp = read_hparams(f)
    expected = expected_tensors(hp, f)
    run_hp, ride, apart = place_shared(f, hp)

    def layer(T, b):
        i = int(b.split(".")[1])
        low_rank = hp.mla.q_lora_rank > 0
        A = MlaRefs(T[b + "attn_kv_a_mqa.weight"], T[b + "attn_kv_a_norm.weight"], T[b + "attn_k_b.weight"],
                    T[b + "attn_v_b.weight"], q_a=T[b + "attn_q_a.weight"] if low_rank else None,
                    q_a_norm=T[b + "attn_q_a_norm.weight"] if low_rank else None)
        L = LayerRefs(T[b + "attn_norm.weight"], T[b + ("attn_q_b.weight" if low_rank else "attn_q.weight")], None,
                      None, T[b + "attn_output.weight"], None, None, T[b + "ffn_norm.weight"], None, None, mla=A)
        return ffn_refs(L, T, b, i < hp.n_dense_lead, ride, apart, merge)

    return open_layers(f, run_hp, expected, layer, merge)
