"""Which products to tune: named MoE expert shapes, E,top_k,m,k literals, or the shapes a
GGUF model's metadata describes."""
from __future__ import annotations

from pathlib import Path

from ..codegen.quant import type_name

# (E, top_k, m, k) of the gate/up expert product: m = expert feed-forward length,
# k = embedding length.
NAMED = {
    "qwen3-30b-a3b": (128, 8, 768, 2048),
    "deepseek-v2-lite": (64, 6, 1408, 2048),
    "gpt-oss-20b": (32, 4, 2880, 2880),
}
DEFAULT_SET = tuple(NAMED)


def parse_shape(text: str) -> tuple[int, int, int, int]:
    t = text.strip().lower()
    if t in NAMED:
        return NAMED[t]
    parts = t.split(",")
    try:
        vals = tuple(int(p) for p in parts)
    except ValueError:
        vals = ()
    if len(vals) != 4 or min(vals) <= 0:
        raise ValueError(f"--shape {text!r}: expected one of {', '.join(NAMED)} or E,top_k,m,k "
                         f"(four positive integers)")
    if vals[1] > vals[0]:
        raise ValueError(f"--shape {text!r}: top_k={vals[1]} exceeds E={vals[0]}")
    return vals


def model_products(path: str | Path) -> list[tuple[tuple[int, int, int, int], str]]:
    """The expert products a GGUF MoE model runs, as (E, top_k, m, k) and quant type: gate
    and up as one product of 2 x the expert FFN length (the runtime merges them as it loads,
    and ffn_gate_up_exps is that already), and down (m = embedding, k = expert FFN length),
    each in every type its tensors come in (a K_M mix keeps some down tensors in q6_K)."""
    import gguf
    reader = gguf.GGUFReader(str(path))

    def field(name: str):
        f = reader.fields.get(name)
        if f is None:
            return None
        return f.contents() if hasattr(f, "contents") else f.parts[f.data[0]].tolist()[0]

    arch = field("general.architecture")
    if not isinstance(arch, str):
        raise ValueError(f"{path}: no general.architecture in the GGUF metadata")
    vals = {}
    for k in ("expert_count", "expert_used_count"):
        v = field(f"{arch}.{k}")
        if v is None:
            raise ValueError(f"{path}: {arch}.{k} is missing; is this a Mixture-of-Experts model?")
        vals[k] = int(v)
    E, top_k = vals["expert_count"], vals["expert_used_count"]
    from ..runtime.arch import shared_rides
    tensors = {t.name: t for t in reader.tensors}
    types = {name: type_name(t.tensor_type) for name, t in tensors.items()}
    # glm4moe: the blocks of the prediction head are never run; a shared expert whose types
    # are the routed ones' rides with them as one more expert and slot (the loaders' rule)
    trunk = int(field(f"{arch}.block_count") or 0) - int(field(f"{arch}.nextn_predict_layers") or 0)
    shared = int(field(f"{arch}.expert_shared_count") or 0)
    ride = shared_rides(types, range(int(field(f"{arch}.leading_dense_block_count") or 0), trunk), shared)

    def run(name: str) -> bool:
        block = name.split(".")[1] if name.startswith("blk.") else ""
        return not (trunk > 0 and block.isdigit() and int(block) >= trunk)
    found = []
    for name, t in types.items():
        if not run(name):
            continue
        if "_exps" in name:
            # the widths from the tensors themselves (GGUF order (k, m, experts)), not from
            # metadata whose keys differ by architecture (Mixtral's llama files have no
            # expert width key); separate gate and up run as one product of both
            e, k = (E + shared, top_k + shared) if ride else (E, top_k)
            k_, m_ = (int(v) for v in tensors[name].shape[:2])
            gate_or_up = name.split(".")[-2] in ("ffn_gate_exps", "ffn_up_exps")
            found.append(((e, k, 2 * m_ if gate_or_up else m_, k_), t))
        elif name.endswith(("attn_k_b.weight", "attn_v_b.weight")) and len(tensors[name].shape) == 3:
            # deepseek2's latent attention: a matrix a head, run as an expert product with
            # every head a slot of every token (runtime.backend.Backend.mla_absorb, mla_expand)
            k_, m_, h = (int(v) for v in tensors[name].shape[:3])   # GGUF order (k, m, heads)
            found.append(((h, h, m_, k_), t))
        elif ("_shexp." in name and not ride) or name.split(".")[-2] in ("ffn_gate", "ffn_up", "ffn_down"):
            # a dense FFN (a first dense layer, a shared expert of its own types): one expert every token takes
            k_, m_ = (int(v) for v in tensors[name].shape[:2])   # GGUF order (k, m)
            found.append(((1, 1, m_, k_) if "ffn_down" in name else (1, 1, 2 * m_, k_), t))
    return sorted(dict.fromkeys(found))


def model_dense_shapes(path: str | Path) -> list[tuple[int, int, str]]:
    """(m, k, quant type) of the dense quantized products a model's forward pass runs on
    the GPU, read from its first layer's tensors: q, k and v stacked into one product where
    they share a quantized type (as the CUDA backend runs them), deepseek2's latent
    projections (q or its low-rank pair, the kv latent's), the attention output, and the
    output head (the token embedding where the file ties them)."""
    import gguf

    from ..codegen.quant import QUANT_TYPES
    reader = gguf.GGUFReader(str(path))
    T = {t.name: t for t in reader.tensors}

    def mk(name: str):
        t = T.get(name)
        if t is None or len(t.shape) != 2:
            return None
        return int(t.shape[1]), int(t.shape[0]), type_name(t.tensor_type)   # GGUF order: (k, m)
    q, k, v = (mk(f"blk.0.attn_{x}.weight") for x in ("q", "k", "v"))
    out = []
    if q and k and v and q[2] == k[2] == v[2] and q[2] in QUANT_TYPES and q[1] == k[1] == v[1]:
        out.append((q[0] + k[0] + v[0], q[1], q[2]))
    else:
        out += [w for w in (q, k, v) if w]
    out += [w for w in (mk(f"blk.0.attn_{x}.weight") for x in ("q_a", "q_b", "kv_a_mqa")) if w]
    out += [w for w in (mk("blk.0.attn_output.weight"), mk("output.weight") or mk("token_embd.weight")) if w]
    return [w for w in dict.fromkeys(out) if w[2] in QUANT_TYPES]
