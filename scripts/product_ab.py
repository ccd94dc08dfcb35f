"""One product, two choices, the tuner's own check and timing (tuning.objective: random and
skewed routing, weights rotated past the L2, CUDA events, median): the A/B that decides a
dispatch rule on the card at hand, with the tile count and waves each side runs.

    python3 scripts/product_ab.py streamk [--types q4_0] [--n 16,32,...]
        the expert products' default int8 tile against the same tile with stream-k
    python3 scripts/product_ab.py dense-f16 [--types q4_0,q8_0] [--n 64,128,256,512]
        the dense products' default int8 tile against the f16 tile the rule takes from 512
    python3 scripts/product_ab.py f16 [--types q6_K] [--n 128,...] [--dense-n 128,...]
        what runs without the f16 tiles (dispatch.MMF_TYPES empty: the int8 tiles) against the f16
        tile the rule takes at that count (wgmma where the card has it), at every count, to
        place a format's threshold
    python3 scripts/product_ab.py wgmma [--types q4_0,q8_0] [--n 256,...] [--dense-n 128,...]
        what runs without the wgmma tiles (MOEFORGE_WGMMA=0: the profile's or the rules'
        choice) against the wgmma tile the rule takes at that count (the expert products
        also below the rule's threshold of tokens an expert, to place it)
"""
import argparse
import dataclasses
import json
import math

import numpy as np

from moeforge.codegen.quant import quant_type
from moeforge.runtime import dispatch
from moeforge.runtime.dispatch import Choice
from moeforge.tuning.objective import Case, Settings, check, measure, preflight
from moeforge.tuning.space import TuneKey

# (model, product): (E, top_k, m, k); gate and up merged, as the runtime runs them
EXPERTS = {
    ("mixtral-8x7b", "gate_up"): (8, 2, 28672, 4096), ("mixtral-8x7b", "down"): (8, 2, 4096, 14336),
    ("gpt-oss-20b", "gate_up"): (32, 4, 5760, 2880), ("gpt-oss-20b", "down"): (32, 4, 2880, 2880),
    ("deepseek-v2-lite", "gate_up"): (64, 6, 2816, 2048), ("deepseek-v2-lite", "down"): (64, 6, 2048, 1408),
    ("qwen3-30b-a3b", "gate_up"): (128, 8, 1536, 2048), ("qwen3-30b-a3b", "down"): (128, 8, 2048, 768),
}
DENSE = {
    ("qwen3-30b-a3b", "qkv"): (5120, 2048), ("qwen3-30b-a3b", "attn_out"): (2048, 4096),
    ("mixtral-8x7b", "qkv"): (6144, 4096), ("mixtral-8x7b", "attn_out"): (4096, 4096),
    ("gpt-oss-20b", "qkv"): (5120, 2880), ("gpt-oss-20b", "attn_out"): (2880, 4096),
    ("deepseek-v2-lite", "attn_out"): (2048, 2048),
}


def waves(choice: Choice, key: TuneKey, sm_count: int, blocks_per_sm: int) -> tuple[int, float]:
    """Tiles of the mean routing (every expert with its mean count of tokens) and the waves
    they take at the instance's blocks an SM."""
    E, top_k, m, _ = key.shape
    s = choice.spec
    if key.op == "mul_mat_id":
        tiles = dispatch.moe_tiles(E, top_k, m, key.n, s.x, s.y)
    else:
        tiles = math.ceil(key.n / s.x) * math.ceil(m / s.y) * getattr(s, "splits", 1)
    return tiles, tiles / (sm_count * blocks_per_sm)


def run(pairs, out_rows, rng) -> None:
    """Times each pair; B/A is of the mean over the routings (the tuner's objective), and
    apart for random (balanced) and skewed routing (a few hot experts) where both ran."""
    sm = dispatch.device_sm_count()
    print(f"{'model':<17} {'product':<8} {'type':<5} {'n':>5}  {'A':<28} {'tiles':>6} {'waves':>6} {'us':>8}  "
          f"{'B':<28} {'tiles':>6} {'waves':>6} {'us':>8}  {'B/A':>5} {'rand':>5} {'skew':>5}", flush=True)
    held = None      # (op, type, shape), weights: consecutive n of one product share them
    for (model, prod, key), a, b in pairs:
        same = held is not None and held[0] == (key.op, key.qtype, key.shape)
        case = Case(key, Settings(), rng, held[1] if same else None)
        held = (key.op, key.qtype, key.shape), (case.raw, case.weights)
        row = dict(model=model, product=prod, qtype=key.qtype, n=key.n, shape=key.shape)
        cells, res = [], {}
        for tag, c in (("a", a), ("b", b)):
            info = preflight(c)
            check(case, c)
            res[tag] = measure(case, c)
            us = res[tag]["value"]
            tiles, w = waves(c, key, sm, info["blocks_per_sm"])
            row.update({f"{tag}_spec": c.spec.name, f"{tag}_us": us, f"{tag}_tiles": tiles, f"{tag}_waves": w},
                       **{f"{tag}_us_{k}": res[tag][f"us_{k}"] for k in case.inputs})
            cells.append(f"{c.spec.name:<28} {tiles:>6} {w:>6.2f} {us:>8.1f}")
        out_rows.append(row)
        kinds = " ".join(f"{res['b'][f'us_{k}'] / res['a'][f'us_{k}']:>5.2f}" if k in case.inputs else f"{'':>5}"
                         for k in ("random", "skewed"))
        print(f"{model:<17} {prod:<8} {key.qtype:<5} {key.n:>5}  {cells[0]}  {cells[1]}  "
              f"{row['b_us'] / row['a_us']:>5.2f} {kinds}", flush=True)


def rule_pairs(types, models, ns, dense_ns, off, counted, wgmma, keep):
    """Each product and count: A what dispatch chooses with the constant `off` (NAME, VALUE)
    set, B the f16 tile mmf_rule_spec takes (with the tokens an expert where `counted`, else
    any count; the wgmma tiles where `wgmma`), where keep(B)."""
    sm = dispatch.device_sm_count()

    def without(choose):
        name, value = off
        held = getattr(dispatch, name)
        setattr(dispatch, name, value)
        try:
            return choose()
        finally:
            setattr(dispatch, name, held)
    pairs = []
    for (model, prod), (E, top_k, m, k) in EXPERTS.items():
        for q in (q for q in types if k % quant_type(q).block_values == 0):    # q4_K: not gpt-oss's 2880
            for n in ns if not models or model in models else ():
                b = dispatch.mmf_rule_spec(q, n, True, m, sm, n * top_k / E if counted else None, wgmma, (E, top_k))
                if keep(b):
                    a = without(lambda: dispatch.choose_mul_mat_id(q, E, top_k, m, k, n))
                    pairs.append(((model, prod, TuneKey("mul_mat_id", q, (E, top_k, m, k), n)), a, Choice("mmf_id", b)))
    for (model, prod), (m, k) in DENSE.items():
        for q in (q for q in types if k % quant_type(q).block_values == 0):
            for n in dense_ns if not models or model in models else ():
                b = dispatch.mmf_rule_spec(q, n, False, m, sm, None, wgmma)
                if keep(b):
                    a = without(lambda: dispatch.choose_mul_mat(q, m, k, n))
                    pairs.append(((model, prod, TuneKey("mul_mat", q, (1, 1, m, k), n)), a, Choice("mmf", b)))
    return pairs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=("streamk", "dense-f16", "wgmma", "f16"))
    ap.add_argument("--dense-n", default="128,256,512,2048")
    ap.add_argument("--types", default="q4_0")
    ap.add_argument("--n", default=None)
    ap.add_argument("--models", default=None, help="comma separated (default: all)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    types = a.types.split(",")
    models = a.models.split(",") if a.models else None
    pairs = []
    if a.mode == "streamk":
        ns = [int(v) for v in (a.n or "16,32,64,128,256,512").split(",")]
        for (model, prod), shape in EXPERTS.items():
            if models and model not in models:
                continue
            for q in types:
                for n in ns:
                    key = TuneKey("mul_mat_id", q, shape, n)
                    base = dispatch.default_mul_mat_id(q, *shape, n)
                    if base.path != "mmq_id":
                        continue
                    sk = dataclasses.replace(base.spec, stream_k=not base.spec.stream_k)
                    pairs.append(((model, prod, key), base, Choice("mmq_id", sk)))
    elif a.mode == "wgmma":
        # the wgmma tile at any count (to place it below the rule's threshold as well)
        pairs = rule_pairs(types, models, [int(v) for v in (a.n or "256,512,1024,2048,4096").split(",")],
                           [int(v) for v in a.dense_n.split(",")], ("WGMMA", False), False, True,
                           lambda s: s.wgmma)
    elif a.mode == "f16":
        pairs = rule_pairs(types, models, [int(v) for v in (a.n or "128,256,512,1024,2048,4096").split(",")],
                           [int(v) for v in a.dense_n.split(",")], ("MMF_TYPES", ()), True,
                           dispatch.wgmma_available(), lambda s: True)
    else:
        ns = [int(v) for v in (a.n or "64,128,256,512").split(",")]
        sm = dispatch.device_sm_count()
        for (model, prod), (m, k) in DENSE.items():
            if models and model not in models:
                continue
            for q in types:
                for n in ns:
                    key = TuneKey("mul_mat", q, (1, 1, m, k), n)
                    base = dispatch.default_mul_mat(q, m, k, n)
                    f16 = Choice("mmf", dispatch.mmf_rule_spec(q, n, False, m, sm))
                    pairs.append(((model, prod, key), base, f16))
    rows = []
    run(pairs, rows, np.random.default_rng())
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
