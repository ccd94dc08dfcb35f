"""llama with experts (Mixtral's family) as GGUF stores it: hyperparameters from the
`llama.*` metadata, the tensors of its layers, and the weights as the graph uses them.

What sets it apart from qwen3moe, in llama.cpp's graph for it: no q/k norms, RoPE on
adjacent pairs of each head (ggml's NORM mode, not NEOX's halves), and
`llama.feed_forward_length` is the experts' width (the files have no expert key). The
routing is qwen3moe's: softmax, top-k, the chosen probabilities renormalised.

How the graph runs it (runtime.graph_glm4moe, whose layers without q/k norms and without
biases are these): the RoPE kernels turn NEOX pairs, so q's and k's rows are permuted per
head as they load, even dimensions first, then odd (rows 2i and 2i+1 of a head become
rows i and i + head_dim/2). NEOX on the permuted rows turns the pairs NORM turns on the
file's, with the same angles; q and k share the permutation, so every attention score
(a dot product over a head) is the file's, and v is untouched. Dense llama files (no
experts), scaled RoPE and per-dimension RoPE factors are refused by name.
"""
from __future__ import annotations

import re

import numpy as np

from . import arch_qwen3moe
from .arch import HParams, LayerRefs, ModelRefs, common_hparams, open_layers, refuse_scaled_rope
from .gguf_file import Expect, GGUFError, GGUFFile, TensorRef

ARCH = "llama"


def read_hparams(f: GGUFFile) -> HParams:
    a = ARCH
    if not f.get(f"{a}.expert_count", 0, kind=int):
        raise GGUFError(f"{f.path}: a dense llama model ({a}.expert_count is missing or 0): moeforge runs "
                        f"mixture-of-experts models; llama files with experts (Mixtral's) run")
    c = common_hparams(f, a)
    head_dim = c["head_dim"]
    rot = f.get(f"{a}.rope.dimension_count", head_dim, kind=int)
    if rot != head_dim:
        raise GGUFError(f"{f.path}: {a}.rope.dimension_count ({rot}) must equal the head size ({head_dim})")
    refuse_scaled_rope(f, a)
    if f.get(f"{a}.attention.scale", 0.0, kind=float) != 0.0:
        raise GGUFError(f"{f.path}: {a}.attention.scale: a softmax scale other than 1/sqrt(head size) is not supported")
    n_ff = f.get(f"{a}.feed_forward_length", required=True, kind=int)
    if n_ff <= 0:
        raise GGUFError(f"{f.path}: {a}.feed_forward_length must be positive, got {n_ff}")
    return HParams(
        **c, n_ff_exp=n_ff,
        rms_eps=f.get(f"{a}.attention.layer_norm_rms_epsilon", required=True, kind=float),
        rope_base=f.get(f"{a}.rope.freq_base", 10000.0, kind=float),
        n_ctx_train=f.get(f"{a}.context_length", 4096, kind=int))


def expected_tensors(hp: HParams, f: GGUFFile) -> dict[str, Expect]:
    """qwen3moe's tensors without its q/k norms."""
    return arch_qwen3moe.expected_tensors(hp, f, qk_norm=False)


def _refuse_known_extras(f: GGUFFile) -> None:
    """Files that a plain 'unexpected tensors' would leave puzzling."""
    if "rope_freqs.weight" in f.tensors:
        raise GGUFError(f"{f.path}: rope_freqs.weight: RoPE with per-dimension factors (Llama 3.1's) is not supported")
    if any(re.fullmatch(r"blk\.\d+\.ffn_(gate|up|down)\.\d+\.weight", n) for n in f.tensors):
        raise GGUFError(f"{f.path}: experts stored one tensor each (blk.N.ffn_gate.E.weight, an old Mixtral "
                        f"conversion): convert the model again with a current llama.cpp (ffn_gate_exps)")
    biased = sorted(n for n in f.tensors if n.endswith(".bias"))
    if biased:
        raise GGUFError(f"{f.path}: {biased[0]}: llama layers with biases are not supported")


def norm_to_neox_rows(t: TensorRef, n_heads: int, head_dim: int) -> TensorRef:
    """q's or k's rows per head in NEOX order: rows 2i and 2i + 1 of each head to i and
    i + head_dim/2 (rows hold whole quant blocks, so any type permutes as bytes)."""
    within = np.concatenate([np.arange(0, head_dim, 2), np.arange(1, head_dim, 2)])
    order = (np.arange(n_heads)[:, None] * head_dim + within).reshape(-1)

    def load(xp=np):
        return t.load(xp).reshape(t.shape[0], -1)[xp.asarray(order)]

    return TensorRef(t.name, t.qtype, t.shape, load)


def open_model(f: GGUFFile, merge: bool = True) -> ModelRefs:
    """Validate everything, read nothing: a wrong file fails before any upload."""
    hp = read_hparams(f)
    _refuse_known_extras(f)

    def layer(T, b):
        return LayerRefs(T[b + "attn_norm.weight"], norm_to_neox_rows(T[b + "attn_q.weight"], hp.n_head, hp.head_dim),
                         norm_to_neox_rows(T[b + "attn_k.weight"], hp.n_head_kv, hp.head_dim),
                         T[b + "attn_v.weight"], T[b + "attn_output.weight"], None, None, T[b + "ffn_norm.weight"],
                         T[b + "ffn_gate_inp.weight"], T[b + "ffn_down_exps.weight"])
    return open_layers(f, hp, expected_tensors(hp, f), layer, merge)
