"""Tokens each expert takes, layer by layer, in one prompt pass of a model: how balanced the
routing is that a benchmark of the model times (a trained router keeps each expert near
the mean; synthetic files before the eleventh session sent every token to the same top_k
experts, DESIGN-NOTES "Synthetic models' routing").

    python3 scripts/routing_stats.py MODEL.gguf [--tokens 512] [--backend numpy|cuda] [--every 6]

The numpy backend holds every layer's experts in float32 (a 2-layer Qwen3-30B-A3B-shaped
file takes ~6 GiB); the cuda backend runs eagerly (no graphs) so each layer's ids are kept.
"""
import argparse

import numpy as np

from moeforge.bench_model import expert_loads
from moeforge.runtime.model import load_model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--backend", default="numpy", choices=("numpy", "cuda"))
    ap.add_argument("--every", type=int, default=1, help="print every N-th layer (and the last)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    m = load_model(a.model, backend=a.backend, n_ctx=a.tokens + 8)
    toks = np.random.default_rng(a.seed).integers(0, m.hp.n_vocab, size=a.tokens)
    loads = expert_loads(m, toks)
    print(f"{a.model}: {a.tokens} random tokens, {m.hp.n_expert} experts, top {m.hp.n_expert_used}")
    print(f"{'layer':>5} {'mean':>6} {'max':>5} {'max/mean':>8} {'idle':>5} {'p10':>5} {'p50':>5} {'p90':>5}")
    for i, c in enumerate(loads):
        if i % a.every and i != len(loads) - 1:
            continue
        p10, p50, p90 = np.percentile(c, [10, 50, 90])
        print(f"{i:>5} {c.mean():>6.1f} {c.max():>5} {c.max() / c.mean():>8.2f} {int((c == 0).sum()):>5} "
              f"{p10:>5.0f} {p50:>5.0f} {p90:>5.0f}")


if __name__ == "__main__":
    main()
