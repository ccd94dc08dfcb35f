"""Which products to tune: named MoE expert shapes, E,top_k,m,k literals, or the shapes a
GGUF model's metadata describes."""
from __future__ import annotations

from pathlib import Path

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


def model_shapes(path: str | Path) -> tuple[list[tuple[int, int, int, int]], list[str]]:
    """The expert products of a GGUF model: gate/up (m = expert FFN length, k = embedding)
    and down (the transpose), and the quant types of its expert tensors."""
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
    for k in ("expert_count", "expert_used_count", "expert_feed_forward_length", "embedding_length"):
        v = field(f"{arch}.{k}")
        if v is None:
            raise ValueError(f"{path}: {arch}.{k} is missing; is this a Mixture-of-Experts model?")
        vals[k] = int(v)
    E, top_k = vals["expert_count"], vals["expert_used_count"]
    ff, embd = vals["expert_feed_forward_length"], vals["embedding_length"]
    shapes = [(E, top_k, ff, embd)]
    if (E, top_k, embd, ff) not in shapes:
        shapes.append((E, top_k, embd, ff))
    types = sorted({t.tensor_type.name.lower() for t in reader.tensors if "_exps" in t.name})
    return shapes, types
