"""`moeforge bench`: MUL_MAT_ID on the anchor shapes, in test-backend-ops' columns
(us/run, TFLOPS) plus the physical floor and llama.cpp's figure on an H100.

Two timings per row: `hot` repeats one call on the same weights and inputs, as llama.cpp's
harness does (at small n what it reads stays in L2); `cold` rotates through enough weight
copies and input sets that every call reads from HBM, as a model does. Nothing runs on
zeros.
"""
from __future__ import annotations

import json
import math
import sys
from importlib import resources

import numpy as np
import yaml

ANCHOR_SHAPES = ((128, 8, 768, 2048), (32, 4, 1792, 2048))
ANCHOR_N = {(128, 8, 768, 2048): (1, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096),
            (32, 4, 1792, 2048): (1, 4, 16, 128, 1024)}
INT8_TOPS = {"9.0": 1000.0}   # dense int8 through mma.sync (the anchor file's figure for H100)
# A cold timing replays a CUDA graph of COLD_CALLS calls over COLD_SETS input sets (and the
# weight copies). With few calls a graph, the graph's own launch is a visible share of each
# small call (H100, Qwen3 q4_0 fused n=1: 7.24 us a call in graphs of 4 calls, 6.82 in graphs
# of 32, colder at that); with few input sets, the experts a small batch touches repeat
# often enough to stay partly in L2.
COLD_CALLS = 32
COLD_SETS = 16


def anchors() -> dict:
    return yaml.safe_load(resources.files("moeforge").joinpath("anchors.yaml").read_text())


def anchor_us(qtype: str, shape, n: int) -> float | None:
    table = anchors()["mul_mat_id"].get(",".join(map(str, shape)), {}).get(qtype, {})
    return table.get(n)


def floor_us(qtype: str, shape, ids: np.ndarray, bw_gbs: float, cc: str) -> float:
    from .codegen.quant import quant_type
    E, top_k, m, k = shape
    n = ids.shape[0]
    touched = len(np.unique(ids))
    nbytes = touched * m * quant_type(qtype).row_bytes(k) + n * k * 4 + n * top_k * m * 4
    t_mem = nbytes / (bw_gbs * 1e9) * 1e6
    tops = INT8_TOPS.get(cc)
    t_ops = 2.0 * m * k * n * top_k / (tops * 1e12) * 1e6 if tops else 0.0
    return max(t_mem, t_ops)


def sweep_choices(qtype: str, shape, n: int):
    """Candidates around the tokens each expert receives (a tuner in miniature): mat-vecs
    up to 32 tokens, int8 tiles around the tokens an expert, and every generated f16 tile."""
    from .codegen.enumerate import (MMF_TILES, MMQ_KBLOCKS, MMQ_STAGES, MMQ_X, MMQ_YW, MMVQ_ROWS, MMVQ_WARPS,
                                    mmf_wgmma_specs)
    from .codegen.quant import quant_type
    from .codegen.spec import MmfSpec, MmqSpec, MmvqSpec
    from .runtime.dispatch import MMVQ_MAX_TOKENS, Choice, wgmma_available
    E, top_k, m, k = shape
    out = []
    if n <= 4 * MMVQ_MAX_TOKENS:  # past the default switch too: where does the mat-vec stop winning?
        t = min(8, 1 << math.ceil(math.log2(n)))
        # past 8 tokens each expert still sees only 1-2 (128 experts): small tiles too
        tiles = {t, max(1, t // 2)} | ({1, 2, 4} if n > MMVQ_MAX_TOKENS else set())
        out += [Choice("mmvq", MmvqSpec(qtype, tokens=tt, warps=w, rows=r))
                for tt in sorted(tiles) for w in MMVQ_WARPS for r in MMVQ_ROWS]
        out += [Choice("mmvq", MmvqSpec(qtype, tokens=1, warps=w, rows=r, per_pair=True))
                for w in MMVQ_WARPS for r in MMVQ_ROWS]
        if n <= MMVQ_MAX_TOKENS:    # the decode form: x quantized once, streaming weights, PDL
            out += [Choice("mmvq", MmvqSpec.decode(qtype, ids=True, rows=r)) for r in MMVQ_ROWS]
    per = n * top_k / E
    xs = [x for x in MMQ_X if per / 4 <= x <= max(8, per * 2)] or [8]
    out += [Choice("mmq_id", MmqSpec(qtype, x=x, y=y, warps=w, kblocks=kb, stages=s, stream_k=sk))
            for x in xs for (y, w) in MMQ_YW for kb in MMQ_KBLOCKS for s in MMQ_STAGES for sk in (True, False)]
    if qtype in MmfSpec.QTYPES and n > MMVQ_MAX_TOKENS:   # the f16 tiles the tuner may choose
        q = quant_type(qtype)
        out += [Choice("mmf_id", MmfSpec(qtype, x, y, w, q.whole_kblocks(kb), st, ids=True))
                for x, y, w, kb, st in MMF_TILES]
        if wgmma_available():
            out += [Choice("mmf_id", s) for s in mmf_wgmma_specs(q) if s.ids]
    return out


def _choices(mode: str, qtype: str, shape, n: int):
    from .codegen.spec import MmfSpec, MmqSpec
    from .runtime import dispatch
    E, top_k, m, k = shape
    default = dispatch.choose_mul_mat_id(qtype, E, top_k, m, k, n)
    if mode == "default":
        return [default]
    if mode == "sweep":
        return [default] + [c for c in sweep_choices(qtype, shape, n) if c.spec != default.spec]
    paths = tuple(p for p in dispatch.PATHS if p != "mmf") if mode == "all" else tuple(mode.split(","))
    out = []
    for p in paths:
        if p == "mmvq" and n > dispatch.MMVQ_MAX_TOKENS or p == "mmf_id" and n <= dispatch.MMVQ_MAX_TOKENS:
            continue
        if p == default.path:
            out.append(default)
        elif p == "mmvq":
            out.append(dispatch.Choice("mmvq", dispatch.default_mmvq(qtype, n, ids=True)))
        elif p == "mmq_id":
            out.append(dispatch.Choice("mmq_id", dispatch.default_mmq(qtype, n * top_k / E, ids=True)))
        elif p == "per_expert":
            out.append(dispatch.Choice("per_expert", MmqSpec(qtype, x=64, y=64, warps=4, stages=3,
                                                             ids=False, stream_k=False)))
        elif p == "mmf_id" and qtype in MmfSpec.QTYPES:
            out.append(dispatch.Choice("mmf_id", dispatch.mmf_rule_spec(qtype, n, True, m, dispatch.device_sm_count(),
                                                                         n * top_k / E, dispatch.wgmma_available(),
                                                                         (E, top_k))))
        elif p not in dispatch.PATHS or p == "mmf":
            raise ValueError(f"unknown expert-product path {p!r}; choose from mmvq, mmq_id, per_expert, mmf_id")
    return out


class Case:
    """Weights (one copy, or enough copies to defeat L2) and rotating inputs for one shape."""

    def __init__(self, qtype: str, shape, rng, l2_bytes: int, cold: bool):
        from . import reference as ref
        from .runtime.tensor import QuantTensor
        E, top_k, m, k = shape
        raw = ref.random_blocks(qtype, E * m, k, rng)
        w0 = QuantTensor.from_blocks(raw, qtype, (E, m, k))
        copies = max(2, math.ceil(4 * l2_bytes / w0.nbytes)) if cold else 1
        self.weights = [w0] + [w0.copy() for _ in range(copies - 1)]
        self.rng, self.shape = rng, shape

    def inputs(self, n: int, sets: int = COLD_SETS):
        import cupy as cp
        E, top_k, m, k = self.shape
        xs, idss = [], []
        for _ in range(sets):
            xs.append(cp.asarray(self.rng.standard_normal((n, k)).astype(np.float32)))
            ids = np.argsort(self.rng.random((n, E)), axis=1)[:, :top_k].astype(np.int32)
            idss.append(cp.asarray(ids))
        return xs, idss


def run_shape(qtype: str, shape, ns, mode: str, reps: int, rng, info, bw_gbs: float, out_rows: list):
    import cupy as cp
    from .runtime.ops import run_mul_mat_id
    from .tuning.timing import time_calls
    E, top_k, m, k = shape
    hot = Case(qtype, shape, rng, info["l2_bytes"], cold=False)
    cold = Case(qtype, shape, rng, info["l2_bytes"], cold=True)
    cold.weights[0] = hot.weights[0]
    for n in ns:
        xs, idss = hot.inputs(n)
        out = cp.empty((n, top_k, m), dtype=cp.float32)
        fl = floor_us(qtype, shape, idss[0].get(), bw_gbs, info["cc"])
        for choice in _choices(mode, qtype, shape, n):
            graph = choice.path != "per_expert"
            nin = len(xs)

            def call(i, ws):
                run_mul_mat_id(ws[i % len(ws)], xs[i % nin], idss[i % nin], out, choice)

            try:
                t_hot = time_calls(lambda i: call(0, hot.weights), 1, reps=reps, use_graph=graph)
                nc = max(nin, len(cold.weights))
                t_cold = time_calls(lambda i: call(i, cold.weights), nc, calls=max(nc, COLD_CALLS), reps=reps,
                                    use_graph=graph)
            except Exception as e:  # a spec that cannot launch here is reported, not fatal
                print(f"  {qtype} n={n} {choice.spec.name}: {type(e).__name__}: {e}", file=sys.stderr)
                continue
            a = anchor_us(qtype, shape, n)
            row = dict(qtype=qtype, shape=list(shape), n=n, path=choice.path, spec=_launched(choice, n, top_k, E, info),
                       source=choice.source, us=round(t_hot.median_us, 2), us_cold=round(t_cold.median_us, 2),
                       spread=round(t_hot.spread, 3), graph=graph,
                       tflops=round(2.0 * m * k * n * top_k / (t_hot.median_us * 1e6), 2),
                       floor_us=round(fl, 2), pct_floor=round(100 * fl / t_cold.median_us, 1),
                       llama_us=a, speedup=round(a / t_hot.median_us, 2) if a else None)
            out_rows.append(row)
            print(f"  {qtype} {','.join(map(str, shape))} n={n:<5} {choice.path:<10} {choice.spec.name:<34} "
                  f"{row['us']:>9.2f} us  cold {row['us_cold']:>9.2f}", file=sys.stderr, flush=True)


def _launched(choice, n: int, top_k: int, E: int, info: dict) -> str:
    """The name of the kernel that ran: a MUL_MAT_ID tile runs in its launch form."""
    if choice.path != "mmq_id":
        return choice.spec.name
    from .runtime.launch_ex import pdl_available
    from .runtime.ops import mmq_launch_form
    return mmq_launch_form(choice.spec, n * top_k, E, pdl_available(info["cc"])).name


def best_rows(rows: list) -> list:
    best: dict = {}
    for r in rows:
        key = (r["qtype"], tuple(r["shape"]), r["n"])
        if key not in best or r["us"] < best[key]["us"]:
            best[key] = r
    return list(best.values())


def print_table(rows: list, info: dict, bw_gbs: float, out=sys.stdout) -> None:
    print(f"\n{info['name']} ({info['sm_count']} SMs, driver {info['driver']}, CUDA {info['cuda_runtime']}), "
          f"copy bandwidth {bw_gbs:.0f} GB/s", file=out)
    hdr = (f"{'type':<5} {'E,top_k,m,k':<16} {'n':>5} {'path':<10} {'spec':<34} {'us/run':>9} {'TFLOPS':>7} "
           f"{'cold us':>9} {'floor':>7} {'%floor':>6} {'llama':>8} {'x llama':>7}")
    print(hdr, file=out)
    print("-" * len(hdr), file=out)
    for r in sorted(rows, key=lambda r: (r["qtype"], r["shape"], r["n"], r["us"])):
        llama = f"{r['llama_us']:.1f}" if r["llama_us"] else "-"
        sp = f"{r['speedup']:.2f}" if r["speedup"] else "-"
        print(f"{r['qtype']:<5} {','.join(map(str, r['shape'])):<16} {r['n']:>5} {r['path']:<10} {r['spec']:<34} "
              f"{r['us']:>9.2f} {r['tflops']:>7.2f} {r['us_cold']:>9.2f} {r['floor_us']:>7.1f} "
              f"{r['pct_floor']:>6.1f} {llama:>8} {sp:>7}", file=out)


def main(args) -> int:
    from .codegen.quant import parse_types
    from .runtime.device import device_info, has_gpu
    from .tuning.shapes import parse_shape
    from .tuning.timing import copy_bandwidth_gbs
    try:  # bad arguments are reported before anything needs a GPU
        shapes = [parse_shape(s) for s in args.shape] if args.shape else ANCHOR_SHAPES
    except ValueError as e:
        print(f"moeforge bench: {e}", file=sys.stderr)
        return 2
    if not has_gpu():
        print("moeforge bench: no CUDA device found; benchmarks need a GPU", file=sys.stderr)
        return 2
    info = device_info()
    bw = copy_bandwidth_gbs()
    rng = np.random.default_rng()
    rows: list = []
    ops = args.ops.split(",")
    types = [q.name for q in parse_types(args.types)]
    if "mul_mat_id" in ops:
        for q in types:
            for shape in shapes:
                ns = [int(v) for v in args.n.split(",")] if args.n else ANCHOR_N.get(shape, (1, 16, 128, 1024))
                run_shape(q, shape, ns, args.paths, args.reps, rng, info, bw, rows)
    if "gate_up" in ops:
        from . import bench_fused
        bench_fused.run(types, args.reps, info, bw, rows, rng, sweep=args.paths == "sweep")
    mm = [r for r in rows if "path" in r]
    if mm:
        print_table(best_rows(mm) if args.paths == "sweep" else mm, info, bw)
    if "gate_up" in ops:
        bench_fused.print_table(rows, bw)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": info, "copy_gbs": bw, "rows": rows}, f, indent=1)
    return 0
