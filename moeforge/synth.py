"""Synthetic qwen3moe, gpt-oss, glm4moe, deepseek2 and llama (Mixtral) GGUF files: real shapes, random
weights, a loadable tokenizer.

Two sources of weights:
  "blocks"  (moeforge synth) valid random GGUF blocks copied from a pool of random blocks
            at random block offsets, so a 17 GB file costs little more than the disk
            write: no float is generated or quantized;
  "float"   (the parity fixtures) seeded float weights, quantized with gguf's reference
            quantizer, so the F32/F16/Q8_0/Q4_0 files are versions of one model.

Metadata keys and tensor names are those of llama.cpp's converters for them.
"""
from __future__ import annotations

import os
import time
import zlib
from dataclasses import asdict, dataclass, replace

import numpy as np

from .codegen.quant import QUANT_TYPES
from .runtime.convert import block_size, row_bytes
from .synth_mla import add_deepseek2_metadata, deepseek2_layers
from .synth_vocab import add_spm_tokenizer, add_tokenizer

ARCHS = ("qwen3moe", "gpt-oss", "glm4moe", "deepseek2", "llama")
# q3_K_M, q4_K_M, q5_K_M: llama.cpp's mixes of those names (q3_K, q4_K or q5_K, with more
# bits in places: see mix_types); q2_K_mix: llama.cpp's Q2_K mix (plain "q2_K" is q2_K for
# every matrix, as the other type names are); q6_K also for every matrix, or as --output-type/--embd-type
# (llama.cpp's Q4_0 files keep a q6_K head); iq4_xs every matrix (llama.cpp's IQ4_XS mix
# gives attn_v q5_K and the head q6_K: --output-type q6_K comes close); mxfp4_moe as
# llama.cpp's MXFP4_MOE (mxfp4 has kernels for the expert products only)
TYPES = ("f32", "f16", "q8_0", "q4_0", "q2_K", "q2_K_mix", "q3_K", "q3_K_M", "q4_K", "q4_K_M", "q5_K",
         "q5_K_M", "q6_K", "iq4_xs", "mxfp4_moe")
TENSOR_TYPES = ("f32", "f16", "q8_0", "q4_0", "q2_K", "q3_K", "q4_K", "q5_K", "q6_K", "iq4_xs", "mxfp4")
# the base type of each mix
MIXES = {"q2_K_mix": "q2_K", "q3_K_M": "q3_K", "q4_K_M": "q4_K", "q5_K_M": "q5_K"}
# llama.cpp's MXFP4_MOE: the expert tensors mxfp4, every other matrix q8_0
EXPERT_MIXES = {"mxfp4_moe": ("mxfp4", "q8_0")}
# llama.cpp's LLAMA_FTYPE_MOSTLY_*; every matrix q4_K (q5_K, iq4_xs) is closest to Q4_K_S
# (Q5_K_S, IQ4_XS)
FILE_TYPE = {"f32": 0, "f16": 1, "q4_0": 2, "q8_0": 7, "q2_K": 10, "q2_K_mix": 10, "q3_K": 11, "q3_K_M": 12,
             "q4_K": 14, "q4_K_M": 15, "q5_K": 16, "q5_K_M": 17, "q6_K": 18, "iq4_xs": 30, "mxfp4_moe": 38}


@dataclass(frozen=True)
class SynthSpec:
    n_vocab: int
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff_exp: int
    n_expert: int
    n_expert_used: int
    n_ctx: int = 4096
    rope_base: float = 1e6
    rms_eps: float = 1e-6
    n_ff: int = 0           # the dense feed_forward_length key (informational for qwen3moe)
    arch: str = "qwen3moe"
    n_swa: int = 0          # gpt-oss: the sliding window, YaRN's factor and original context
    yarn_factor: float = 0.0
    yarn_orig_ctx: int = 0
    # glm4moe: RoPE on the first n_rot dimensions (0: all), q/k norms or not, a shared expert,
    # dense FFNs (n_ff wide) in the first n_dense_lead layers, a multi-token-prediction
    # block after the trunk (n_nextn), routed weights scaled by routed_scale
    n_rot: int = 0
    qk_norm: bool = True
    n_expert_shared: int = 0
    n_dense_lead: int = 0
    n_nextn: int = 0
    routed_scale: float = 0.0
    # deepseek2 (moeforge.synth_mla): head_dim is a query head (nope + n_rot RoPE values), the
    # latent of kv_lora_rank, value heads of v_head_dim, q low-rank where q_lora_rank > 0,
    # YaRN's mscale_all_dim (yarn_log_mul)
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    v_head_dim: int = 0
    yarn_log_mul: float = 0.0


PRESETS = {
    "qwen3-30b-a3b": SynthSpec(n_vocab=151936, n_embd=2048, n_layer=48, n_head=32, n_head_kv=4, head_dim=128,
                               n_ff_exp=768, n_expert=128, n_expert_used=8, n_ctx=40960, n_ff=6144),
    "qwen3-235b-a22b": SynthSpec(n_vocab=151936, n_embd=4096, n_layer=94, n_head=64, n_head_kv=4, head_dim=128,
                                 n_ff_exp=1536, n_expert=128, n_expert_used=8, n_ctx=40960, n_ff=12288),
    "tiny": SynthSpec(n_vocab=512, n_embd=128, n_layer=2, n_head=4, n_head_kv=2, head_dim=32,
                      n_ff_exp=64, n_expert=8, n_expert_used=2, n_ctx=512, rope_base=1e4, n_ff=256),
    # the smallest whose every matrix row holds whole K-quant super-blocks (256 weights)
    "tiny-k": SynthSpec(n_vocab=512, n_embd=256, n_layer=2, n_head=4, n_head_kv=2, head_dim=64,
                        n_ff_exp=256, n_expert=8, n_expert_used=2, n_ctx=512, rope_base=1e4, n_ff=512),
    # gpt-oss-20b's shapes (its GGUF from llama.cpp's converter: MXFP4 experts, the rest Q8_0
    # or F16/F32): synth --type mxfp4_moe
    "gpt-oss-20b": SynthSpec(n_vocab=201088, n_embd=2880, n_layer=24, n_head=64, n_head_kv=8, head_dim=64,
                             n_ff_exp=2880, n_expert=32, n_expert_used=4, n_ctx=131072, rope_base=150000.0,
                             rms_eps=1e-5, arch="gpt-oss", n_swa=128, yarn_factor=32.0, yarn_orig_ctx=4096),
    # gpt-oss-120b: gpt-oss-20b's layer with 128 experts, 36 of them
    "gpt-oss-120b": SynthSpec(n_vocab=201088, n_embd=2880, n_layer=36, n_head=64, n_head_kv=8, head_dim=64,
                              n_ff_exp=2880, n_expert=128, n_expert_used=4, n_ctx=131072, rope_base=150000.0,
                              rms_eps=1e-5, arch="gpt-oss", n_swa=128, yarn_factor=32.0, yarn_orig_ctx=4096),
    # GLM-4.5-Air (106B-A12B): 46 layers and a prediction block, the first layer dense
    "glm-4.5-air": SynthSpec(n_vocab=151552, n_embd=4096, n_layer=46, n_head=96, n_head_kv=8, head_dim=128,
                             n_ff_exp=1408, n_expert=128, n_expert_used=8, n_ctx=131072, rope_base=1e6,
                             rms_eps=1e-5, n_ff=10944, arch="glm4moe", n_rot=64, qk_norm=False, n_expert_shared=1,
                             n_dense_lead=1, n_nextn=1, routed_scale=1.0),
    # GLM-4.5 (355B-A32B): q/k norms, 160 experts, three dense layers
    "glm-4.5": SynthSpec(n_vocab=151552, n_embd=5120, n_layer=92, n_head=96, n_head_kv=8, head_dim=128,
                         n_ff_exp=1536, n_expert=160, n_expert_used=8, n_ctx=131072, rope_base=1e6, rms_eps=1e-5,
                         n_ff=12288, arch="glm4moe", n_rot=64, qk_norm=True, n_expert_shared=1, n_dense_lead=3,
                         n_nextn=1, routed_scale=2.5),
    "tiny-glm": SynthSpec(n_vocab=512, n_embd=128, n_layer=3, n_head=6, n_head_kv=2, head_dim=32,
                          n_ff_exp=64, n_expert=8, n_expert_used=3, n_ctx=512, rope_base=1e4, rms_eps=1e-5,
                          n_ff=192, arch="glm4moe", n_rot=16, qk_norm=False, n_expert_shared=1, n_dense_lead=1,
                          n_nextn=1, routed_scale=2.5),
    # DeepSeek-V2-Lite (16B-A2.4B): latent attention, 64 experts and 2 shared, layer 0 dense
    "deepseek-v2-lite": SynthSpec(n_vocab=102400, n_embd=2048, n_layer=27, n_head=16, n_head_kv=1, head_dim=192,
                                  n_ff_exp=1408, n_expert=64, n_expert_used=6, n_ctx=163840, rope_base=10000.0,
                                  rms_eps=1e-6, n_ff=10944, arch="deepseek2", n_rot=64, n_expert_shared=2,
                                  n_dense_lead=1, routed_scale=1.0, yarn_factor=40.0, yarn_orig_ctx=4096,
                                  kv_lora_rank=512, v_head_dim=128, yarn_log_mul=0.707),
    "tiny-deepseek": SynthSpec(n_vocab=512, n_embd=128, n_layer=3, n_head=4, n_head_kv=1, head_dim=48,
                               n_ff_exp=64, n_expert=8, n_expert_used=3, n_ctx=512, rope_base=1e4, rms_eps=1e-6,
                               n_ff=192, arch="deepseek2", n_rot=16, n_expert_shared=2, n_dense_lead=1,
                               routed_scale=1.0, yarn_factor=4.0, yarn_orig_ctx=64, kv_lora_rank=64,
                               v_head_dim=32, yarn_log_mul=0.707),
    # Mixtral-8x7B (llama with experts): no q/k norms, RoPE on adjacent pairs, the experts'
    # width as llama.feed_forward_length
    "mixtral-8x7b": SynthSpec(n_vocab=32000, n_embd=4096, n_layer=32, n_head=32, n_head_kv=8, head_dim=128,
                              n_ff_exp=14336, n_expert=8, n_expert_used=2, n_ctx=32768, rope_base=1e6,
                              rms_eps=1e-5, arch="llama", qk_norm=False),
    "mixtral-8x22b": SynthSpec(n_vocab=32768, n_embd=6144, n_layer=56, n_head=48, n_head_kv=8, head_dim=128,
                               n_ff_exp=16384, n_expert=8, n_expert_used=2, n_ctx=65536, rope_base=1e6,
                               rms_eps=1e-5, arch="llama", qk_norm=False),
    "tiny-mixtral": SynthSpec(n_vocab=512, n_embd=128, n_layer=2, n_head=4, n_head_kv=2, head_dim=32,
                              n_ff_exp=64, n_expert=8, n_expert_used=2, n_ctx=512, rope_base=1e4, rms_eps=1e-5,
                              arch="llama", qk_norm=False),
    "tiny-oss": SynthSpec(n_vocab=512, n_embd=128, n_layer=4, n_head=4, n_head_kv=2, head_dim=32,
                          n_ff_exp=64, n_expert=8, n_expert_used=2, n_ctx=512, rope_base=1e4, rms_eps=1e-5,
                          arch="gpt-oss", n_swa=8, yarn_factor=4.0, yarn_orig_ctx=64),
}


def more_bits(i: int, n: int) -> bool:
    """The layers llama.cpp's K-quant mixes give more bits (llama-quant.cpp's use_more_bits:
    the first and last eighth, and every third between), in its integer arithmetic."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def mix_types(mix: str, base: str, i: int, n: int, n_gqa: int = 1) -> tuple[str, str, str]:
    """(attn_v, attn_output, ffn_down) of layer i of n in llama.cpp's mix (llama-quant.cpp's
    rules for an MoE without 8 experts): Q4_K_M and Q5_K_M give attn_v and ffn_down q6_K in
    the more_bits layers; Q3_K_M gives attn_v q5_K in the first two layers and q4_K after,
    attn_output q4_K, ffn_down q5_K in the first sixteenth and q4_K after; Q2_K gives
    attn_output and ffn_down q3_K and attn_v q4_K where 4 or more query heads share a key
    head (q3_K otherwise)."""
    if mix == "q3_K_M":
        return "q5_K" if i < 2 else "q4_K", "q4_K", "q5_K" if i < n // 16 else "q4_K"
    if mix == "q2_K_mix":
        return ("q4_K" if n_gqa >= 4 else "q3_K"), "q3_K", "q3_K"
    more = "q6_K" if more_bits(i, n) else base
    return more, base, more


def tensor_plan(s: SynthSpec, qtype: str, *, embd_type=None, output_type=None, merged_gate_up=False,
                tied_output=False):
    """[(name, numpy-order shape, type)] in the order llama.cpp's converter writes them."""
    d, E, ff = s.n_embd, s.n_expert, s.n_ff_exp
    mix = qtype in MIXES
    if mix:   # a q6_K head, more bits in some layers' attn_v, attn_output, ffn_down (mix_types)
        mix, qtype, output_type = qtype, MIXES[qtype], output_type or "q6_K"
    experts = None
    if qtype in EXPERT_MIXES:
        experts, qtype = EXPERT_MIXES[qtype]
    plan = [("token_embd.weight", (s.n_vocab, d), embd_type or qtype)]
    if s.arch in ("gpt-oss", "glm4moe", "deepseek2"):
        if s.arch == "deepseek2":
            layers = deepseek2_layers(s, qtype, experts)
        else:
            layers = _gptoss_layers(s, qtype, experts) if s.arch == "gpt-oss" else _glm_layers(s, qtype, experts, mix)
        return plan + layers + [("output_norm.weight", (d,), "f32")] + (
            [] if tied_output else [("output.weight", (s.n_vocab, d), output_type or qtype)])
    for i in range(s.n_layer):
        b = f"blk.{i}."
        wv, wo, down = mix_types(mix, qtype, i, s.n_layer, s.n_head // s.n_head_kv) if mix else (qtype, qtype, qtype)
        plan += [
            (b + "attn_norm.weight", (d,), "f32"),
            (b + "attn_q.weight", (s.n_head * s.head_dim, d), qtype),
            (b + "attn_k.weight", (s.n_head_kv * s.head_dim, d), qtype),
            (b + "attn_v.weight", (s.n_head_kv * s.head_dim, d), wv),
            (b + "attn_output.weight", (d, s.n_head * s.head_dim), wo),
        ]
        if s.arch == "qwen3moe":   # llama's layers (Mixtral's) are the same without them
            plan += [(b + "attn_q_norm.weight", (s.head_dim,), "f32"), (b + "attn_k_norm.weight", (s.head_dim,), "f32")]
        plan += [
            (b + "ffn_norm.weight", (d,), "f32"),
            (b + "ffn_gate_inp.weight", (E, d), "f32"),   # llama-quantize keeps the router in F32
        ]
        gu = experts or qtype
        if merged_gate_up:
            plan.append((b + "ffn_gate_up_exps.weight", (E, 2 * ff, d), gu))
        else:
            plan += [(b + "ffn_gate_exps.weight", (E, ff, d), gu), (b + "ffn_up_exps.weight", (E, ff, d), gu)]
        plan.append((b + "ffn_down_exps.weight", (E, d, ff), experts or down))
    plan.append(("output_norm.weight", (d,), "f32"))
    if not tied_output:
        plan.append(("output.weight", (s.n_vocab, d), output_type or qtype))
    return plan


def _gptoss_layers(s: SynthSpec, qtype: str, experts: str | None):
    d, E, ff, q, kv = s.n_embd, s.n_expert, s.n_ff_exp, s.n_head * s.head_dim, s.n_head_kv * s.head_dim
    plan = []
    for i in range(s.n_layer):
        b = f"blk.{i}."
        plan += [
            (b + "attn_norm.weight", (d,), "f32"),
            (b + "attn_q.weight", (q, d), qtype), (b + "attn_q.bias", (q,), "f32"),
            (b + "attn_k.weight", (kv, d), qtype), (b + "attn_k.bias", (kv,), "f32"),
            (b + "attn_v.weight", (kv, d), qtype), (b + "attn_v.bias", (kv,), "f32"),
            (b + "attn_output.weight", (d, q), qtype), (b + "attn_output.bias", (d,), "f32"),
            (b + "attn_sinks.weight", (s.n_head,), "f32"),
            (b + "post_attention_norm.weight", (d,), "f32"),
            (b + "ffn_gate_inp.weight", (E, d), "f32"), (b + "ffn_gate_inp.bias", (E,), "f32"),
            (b + "ffn_gate_exps.weight", (E, ff, d), experts or qtype), (b + "ffn_gate_exps.bias", (E, ff), "f32"),
            (b + "ffn_up_exps.weight", (E, ff, d), experts or qtype), (b + "ffn_up_exps.bias", (E, ff), "f32"),
            (b + "ffn_down_exps.weight", (E, d, ff), experts or qtype), (b + "ffn_down_exps.bias", (E, d), "f32"),
        ]
    return plan


def _glm_layers(s: SynthSpec, qtype: str, experts: str | None, mix: str | bool):
    d, E, ff, q, kv = s.n_embd, s.n_expert, s.n_ff_exp, s.n_head * s.head_dim, s.n_head_kv * s.head_dim
    sh = s.n_expert_shared * ff
    plan = []
    for i in range(s.n_layer + s.n_nextn):
        b = f"blk.{i}."
        wv, wo, down = mix_types(mix, qtype, i, s.n_layer, s.n_head // s.n_head_kv) if mix else (qtype, qtype, qtype)
        plan += [
            (b + "attn_norm.weight", (d,), "f32"),
            (b + "attn_q.weight", (q, d), qtype), (b + "attn_q.bias", (q,), "f32"),
            (b + "attn_k.weight", (kv, d), qtype), (b + "attn_k.bias", (kv,), "f32"),
            (b + "attn_v.weight", (kv, d), wv), (b + "attn_v.bias", (kv,), "f32"),
            (b + "attn_output.weight", (d, q), wo),
        ]
        if s.qk_norm:
            plan += [(b + "attn_q_norm.weight", (s.head_dim,), "f32"), (b + "attn_k_norm.weight", (s.head_dim,), "f32")]
        plan.append((b + "post_attention_norm.weight", (d,), "f32"))
        if i < s.n_dense_lead:
            plan += [(b + "ffn_gate.weight", (s.n_ff, d), qtype), (b + "ffn_up.weight", (s.n_ff, d), qtype),
                     (b + "ffn_down.weight", (d, s.n_ff), down)]
            continue
        plan += [
            (b + "ffn_gate_inp.weight", (E, d), "f32"), (b + "exp_probs_b.bias", (E,), "f32"),
            (b + "ffn_gate_exps.weight", (E, ff, d), experts or qtype),
            (b + "ffn_up_exps.weight", (E, ff, d), experts or qtype),
            (b + "ffn_down_exps.weight", (E, d, ff), experts or down),
        ]
        if sh:
            plan += [(b + "ffn_gate_shexp.weight", (sh, d), qtype), (b + "ffn_up_shexp.weight", (sh, d), qtype),
                     (b + "ffn_down_shexp.weight", (d, sh), down)]
        if i >= s.n_layer:   # the prediction block's own tensors (llama.cpp's MTP), never run
            plan += [(b + "nextn.eh_proj.weight", (d, 2 * d), qtype), (b + "nextn.enorm.weight", (d,), "f32"),
                     (b + "nextn.hnorm.weight", (d,), "f32"), (b + "nextn.shared_head_norm.weight", (d,), "f32")]
    return plan


def nbytes_of(shape, t: str) -> int:
    if t in ("f32", "f16"):
        return int(np.prod(shape)) * (4 if t == "f32" else 2)
    return int(np.prod(shape[:-1])) * row_bytes(t, shape[-1])


def _byte_shape(shape, t: str):
    return shape if t in ("f32", "f16") else (*shape[:-1], row_bytes(t, shape[-1]))


def _np_dtype(t: str):
    return {"f32": np.float32, "f16": np.float16}.get(t, np.uint8)


class _Weights:
    """Scales that keep activations O(1) through the graph, and a router that may be skewed."""

    def __init__(self, spec: SynthSpec, seed: int, skewed_router: bool):
        self.spec, self.seed, self.skewed = spec, seed, skewed_router

    def rng(self, name: str) -> np.random.Generator:
        return np.random.default_rng([self.seed, zlib.crc32(name.encode())])

    # Block-source files: what a layer writes into the residual stream (attention's output
    # projection, the FFN's down products) is weights of WRITE_GAIN / sqrt(k), the other
    # matrices' 1 / sqrt(k), against a token embedding of unit scale. Random layers write a
    # component every token shares (causal attention averages the prefix; an expert adds the
    # same vector's worth to every token it takes); summed over the layers, wherever it
    # outweighs the token's own embedding every router sends every token to the same
    # experts, and the prompt's expert products become a few dense ones, which no trained
    # model gives. At 0.1 a 512-token prompt's expert loads stay within ~2x of the mean
    # through all 48 layers of Qwen3-30B-A3B's shape (0.25: 3.9x by layer 47; before the
    # eleventh session, with positive scales and no gain, every token took the same 8
    # experts from layer 0: DESIGN-NOTES "Synthetic models' routing").
    WRITE_GAIN = 0.1
    WRITES = ("attn_output.weight", "ffn_down.weight", "ffn_down_exps.weight", "ffn_down_shexp.weight")

    def std(self, name: str, shape) -> float:
        if name == "token_embd.weight":
            return 1.0
        if name == "output.weight":
            return 1.0 / np.sqrt(shape[-1])   # logits spread ~1: softer, like a trained model's
        if name.endswith("ffn_gate_inp.weight"):
            return 2.0 / np.sqrt(shape[-1])
        return 1.0 / np.sqrt(shape[-1])

    def pool_rms(self, name: str, shape) -> float:
        """The root mean square a block-source tensor's values are scaled to (_BlockPool):
        std()'s, the layers' writes WRITE_GAIN times that. (random_blocks' own scales give
        q8_0 weights of ~0.4, q4_0's ~0.03, whatever k; the float source, whose files the
        parity fixtures are, keeps std() alone.)"""
        rms = self.std(name, shape)
        return rms * self.WRITE_GAIN if name.endswith(self.WRITES) else rms

    def small(self, name: str, shape) -> np.ndarray:
        """Norm weights, biases, sinks and the router: always float32, always drawn."""
        rng = self.rng(name)
        if name.endswith(".bias"):
            return (0.1 * rng.standard_normal(shape)).astype(np.float32)
        if name.endswith("attn_sinks.weight"):     # logits comparable with the attention scores'
            return rng.standard_normal(shape).astype(np.float32)
        if len(shape) == 1:
            return (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        w = rng.standard_normal(shape) * self.std(name, shape)
        if self.skewed:
            # Every token embedding shares a positive component on every 32nd coordinate
            # (see skew_embedding); router rows that point along it win top-k for most
            # tokens: expert 0 most, the next ones less (shift ~8 / (1 + e)^0.7 logits).
            n_shared = shape[1] // 32
            shift = 8.0 / (1.0 + np.arange(shape[0])) ** 0.7
            w[:, ::32] += (shift / (1.5 * n_shared))[:, None]
        return w.astype(np.float32)

    @staticmethod
    def skew_embedding(blocks: np.ndarray, t: str) -> np.ndarray:
        """Raise value 0 of every block to the format's largest positive quant, its f16
        scales made positive: the shared component the skewed router keys on."""
        b = blocks.reshape(-1, QUANT_TYPES[t].block_bytes).copy() if t in QUANT_TYPES else blocks
        for at, _ in QUANT_TYPES[t].f16_scales if t in QUANT_TYPES else ():
            b[:, at + 1] &= 0x7F
        if t == "q4_0":
            b[:, 2] = (b[:, 2] & 0xF0) | 0x0F
        elif t == "q8_0":
            b[:, 2] = 127
        elif t == "q4_K":   # value 0 of sub-blocks 2i and 2i+1: the two nibbles of byte 32i
            b[:, 16::32] = 0xFF
        elif t == "q5_K":   # the same nibbles, and byte 0 of the fifth bits (value 0 of each sub-block)
            b[:, 48::32] = 0xFF
            b[:, 16] = 0xFF
        elif t == "iq4_xs":   # value 0 of each sub-block: the low nibble of its first byte, the
            b[:, 8::16] |= 0x0F   # level 113; its scale ls - 32 made positive (ls's top bit and a
            b[:, 2:4] |= 0xAA     # low nibble of at least 1)
            b[:, 4:8] |= 0x11
        elif t == "q2_K":   # value 0 of block 4n+j: bits 2j of qs[32n] (q = 3); its scale
            b[:, 16:80:32] = 0xFF   # sc[8n + 2j] 15 and its min 0
            b[:, 0:16:2] = 0x0F
        elif t == "q3_K":   # value 0 of block 4n+j: bits 2j of qs[32n] and bit 4n+j of hmask[0]
            b[:, 0] = 0xFF      # (q - 4 = 3); every scale s - 32 made positive (top bits 2, a
            b[:, 32:96:32] = 0xFF   # low nibble of at least 1)
            b[:, 96:104] |= 0x11
            b[:, 104:108] = 0xAA
        elif t == "q6_K":   # value 0 of block 4n+p: both nibbles of ql[64n + 32(p & 1)], qh[32n]
            b[:, 0:128:32] = 0xFF
            b[:, 128:192:32] = 0xFF
            sc = b[:, 192:208].view(np.int8)          # its scale, sc[8n + 2p], made positive
            sc[:, ::2] = np.clip(np.abs(sc[:, ::2].astype(np.int16)), 1, 127)
        return b.reshape(-1)

    def float_tensor(self, name: str, shape, t: str) -> np.ndarray:
        w = (self.rng(name).standard_normal(shape, dtype=np.float32) * np.float32(self.std(name, shape)))
        if self.skewed and name == "token_embd.weight":
            w[:, ::32] = np.abs(w[:, ::32]) + 1.5
        if t == "q6_K":
            from .runtime.quantize import quantize_q6_k
            return quantize_q6_k(w.reshape(-1, shape[-1]))
        if t in QUANT_TYPES:
            from .runtime.quantize import quantize
            return quantize(w, QUANT_TYPES[t])
        return w.astype(_np_dtype(t))


class _BlockPool:
    """Random valid blocks of one type (or unit normals of a float type); tensors are
    copied out of it from random block offsets, wrapping around. The blocks' f16 scales
    have random signs (random_blocks), so the weights are zero-mean: positive scales alone
    give q4_0 weights a mean of -d/2 (q4_K's, q5_K's, q2_K's a positive one), which summed
    over k outweighs everything else a product computes and sends every token to the same
    experts. rms: the pool's values scaled to this root mean square (_Weights.pool_rms)."""

    POOL_BYTES = 48 << 20

    def __init__(self, t: str, rng: np.random.Generator, rms: float | None = None):
        self.t = t
        self._fill(t, rng)
        if rms is not None:
            self._scale(rms / self._rms())

    def _rms(self) -> float:
        if self.t not in QUANT_TYPES:
            return float(np.sqrt(np.mean(self.pool.view(_np_dtype(self.t)).astype(np.float64) ** 2)))
        from .reference import dequantize
        q = QUANT_TYPES[self.t]
        n = min(len(self.pool) // q.block_bytes, 4096)
        w = dequantize(self.pool[:n * q.block_bytes].reshape(1, -1), self.t, (1, n * q.block_values))
        return float(np.sqrt(np.mean(np.asarray(w, dtype=np.float64) ** 2)))

    def _scale(self, gain: float) -> None:
        if self.t not in QUANT_TYPES:
            v = self.pool.view(_np_dtype(self.t))
            v[:] = (v.astype(np.float32) * np.float32(gain)).astype(v.dtype)
            return
        q = QUANT_TYPES[self.t]
        b = self.pool.reshape(-1, self.unit)
        if q.f16_scale_bytes is not None:    # mxfp4's e8m0 byte: the nearest power of two, kept
            # within the f16 tiles' range (gpt-oss-20b's down: 0.73x the RMS asked, half the
            # blocks at the lowest byte)
            lo, hi = q.f16_scale_bytes
            b[:, 0] = np.clip(b[:, 0].astype(np.int32) + int(round(np.log2(gain))), lo, hi).astype(np.uint8)
            return
        for at, _ in q.f16_scales:
            d = b[:, at:at + 2].copy().view(np.float16)
            b[:, at:at + 2] = (d.astype(np.float32) * np.float32(gain)).astype(np.float16).view(np.uint8)

    def _fill(self, t: str, rng: np.random.Generator) -> None:
        from .reference import random_blocks
        if t == "q6_K":   # no random_blocks for it: quantized normals of the pool's float scale
            from .runtime.quantize import quantize_q6_k
            self.unit = 210
            n = self.POOL_BYTES // 4 // self.unit   # quantizing is the cost: a quarter of the pool
            self.pool = quantize_q6_k(rng.standard_normal((n, 256), dtype=np.float32) * np.float32(0.02)).reshape(-1)
        elif t in QUANT_TYPES:
            q = QUANT_TYPES[t]
            nb = self.POOL_BYTES // q.block_bytes
            self.unit = q.block_bytes
            self.pool = random_blocks(t, 1, nb * q.block_values, rng).reshape(-1)
        else:
            dt = _np_dtype(t)
            self.unit = np.dtype(dt).itemsize
            n = self.POOL_BYTES // self.unit
            self.pool = (rng.standard_normal(n, dtype=np.float32) * np.float32(0.02)).astype(dt).view(np.uint8)

    def chunks(self, nbytes: int, rng: np.random.Generator, chunk=64 << 20):
        units = len(self.pool) // self.unit
        at = int(rng.integers(0, units)) * self.unit
        left = nbytes
        while left:
            n = min(left, chunk, len(self.pool) - at)
            yield self.pool[at:at + n]
            left -= n
            at = (at + n) % len(self.pool)


def write_model(path, spec: SynthSpec, qtype: str = "q4_0", *, source: str = "blocks", seed: int = 0,
                   skewed_router: bool = False, embd_type=None, output_type=None, merged_gate_up: bool = False,
                   tied_output: bool = False, name: str | None = None, progress=None) -> dict:
    """Write the file, streaming tensor by tensor; returns sizes and the time taken."""
    import gguf
    if qtype not in TYPES:
        raise ValueError(f"type {qtype!r}: synth writes {', '.join(TYPES)}")
    for t in (embd_type, output_type):
        if t is not None and t not in TENSOR_TYPES:
            raise ValueError(f"tensor type {t!r}: synth writes {', '.join(TENSOR_TYPES)}")
    if source not in ("blocks", "float"):
        raise ValueError(f"source must be 'blocks' or 'float', got {source!r}")
    plan = tensor_plan(spec, qtype, embd_type=embd_type, output_type=output_type,
                       merged_gate_up=merged_gate_up, tied_output=tied_output)
    for tname, shape, t in plan:
        if t not in ("f32", "f16") and shape[-1] % block_size(t)[0]:
            raise ValueError(f"{tname}: rows of {shape[-1]} weights are not whole {t} blocks of "
                             f"{block_size(t)[0]} (the tiny-k preset's rows are)")
    t0 = time.perf_counter()
    tmp = f"{path}.tmp{os.getpid()}"
    if spec.arch not in ARCHS:
        raise ValueError(f"architecture {spec.arch!r}: synth writes {', '.join(ARCHS)}")
    if merged_gate_up and spec.arch not in ("qwen3moe", "llama"):
        raise ValueError(f"merged_gate_up: {spec.arch} files hold gate and up separately")
    w = gguf.GGUFWriter(tmp, spec.arch)
    _add_metadata(w, spec, qtype, name or f"moeforge-synth {qtype}")
    (add_spm_tokenizer if spec.arch == "llama" else add_tokenizer)(w, spec.n_vocab, seed)
    total = 0
    for tname, shape, t in plan:
        nb = nbytes_of(shape, t)
        total += nb
        raw_dtype = None if t in ("f32", "f16") else gguf.GGMLQuantizationType[t.upper()]
        w.add_tensor_info(tname, _byte_shape(shape, t), _np_dtype(t), nb, raw_dtype=raw_dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    fout = w.fout[0]
    weights = _Weights(spec, seed, skewed_router)
    pools: dict[tuple, _BlockPool] = {}
    rng = np.random.default_rng(seed)
    for i, (tname, shape, t) in enumerate(plan):
        w.write_padding(fout, fout.tell())
        nb = nbytes_of(shape, t)
        if t == "f32" and (len(shape) == 1 or tname.endswith((".bias", "ffn_gate_inp.weight"))):
            fout.write(weights.small(tname, shape).tobytes())
        elif source == "float":
            fout.write(np.ascontiguousarray(weights.float_tensor(tname, shape, t)).tobytes())
        else:
            rms = weights.pool_rms(tname, shape)
            pool = pools.get((t, rms)) or pools.setdefault((t, rms), _BlockPool(t, rng, rms))
            skew = skewed_router and tname == "token_embd.weight" and t in QUANT_TYPES
            for c in pool.chunks(nb, rng):
                fout.write(memoryview(_Weights.skew_embedding(c, t) if skew else c))
        w.write_padding(fout, nb)
        if progress:
            progress(i + 1, len(plan), tname)
    w.close()
    os.replace(tmp, path)
    dt = time.perf_counter() - t0
    size = os.path.getsize(path)
    return {"path": str(path), "bytes": size, "tensor_bytes": total, "seconds": dt,
            "gb_per_s": size / dt / 1e9, "tensors": len(plan)}


def _add_metadata(w, s: SynthSpec, qtype: str, name: str) -> None:
    w.add_name(name)
    w.add_file_type(FILE_TYPE[qtype])
    w.add_quantization_version(2)
    w.add_context_length(s.n_ctx)
    w.add_embedding_length(s.n_embd)
    llama = s.arch == "llama"    # its feed_forward_length is the experts' width, and the only key for it
    w.add_feed_forward_length(s.n_ff_exp if llama else s.n_ff or s.n_ff_exp * s.n_expert_used)
    w.add_block_count(s.n_layer + s.n_nextn)
    w.add_head_count(s.n_head)
    w.add_head_count_kv(s.n_head_kv)
    mla = s.arch == "deepseek2"     # the cache's rows: the latent and the RoPE key, the latent
    w.add_key_length(s.kv_lora_rank + s.n_rot if mla else s.head_dim)
    w.add_value_length(s.kv_lora_rank if mla else s.head_dim)
    w.add_rope_freq_base(s.rope_base)
    w.add_layer_norm_rms_eps(s.rms_eps)
    w.add_expert_count(s.n_expert)
    w.add_expert_used_count(s.n_expert_used)
    if not llama:
        w.add_expert_feed_forward_length(s.n_ff_exp)
    else:
        w.add_rope_dimension_count(s.head_dim)
    if s.n_swa:
        w.add_sliding_window(s.n_swa)
    if s.arch == "glm4moe":
        import gguf
        w.add_rope_dimension_count(s.n_rot or s.head_dim)
        w.add_expert_shared_count(s.n_expert_shared)
        w.add_leading_dense_block_count(s.n_dense_lead)
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        w.add_expert_weights_scale(s.routed_scale)
        w.add_expert_weights_norm(True)
        if s.n_nextn:
            w.add_nextn_predict_layers(s.n_nextn)
    if mla:
        add_deepseek2_metadata(w, s)
    if s.yarn_factor:
        import gguf
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(s.yarn_factor)
        w.add_rope_scaling_orig_ctx_len(s.yarn_orig_ctx)


write_qwen3moe = write_model     # the name the parity script and older callers use


def preset(name: str, **overrides) -> SynthSpec:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose from {', '.join(PRESETS)}")
    base = PRESETS[name]
    return replace(base, **{k: v for k, v in overrides.items() if v is not None})


def describe(spec: SynthSpec) -> str:
    return ", ".join(f"{k}={v}" for k, v in asdict(spec).items())
