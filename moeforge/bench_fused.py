"""Benchmark rows for decoding (issue: fused gate/up): the fused act(gate) * up call against
two separate expert mat-vec calls, n = 1, 2, 4, 8, with achieved GB/s next to the card's
measured copy bandwidth. `hot`: the same call every time (llama.cpp's harness; its
weights stay in L2); `cold`: weights and inputs rotated through more memory than L2
holds (what a model sees)."""
from __future__ import annotations

import math
import sys

import numpy as np

from .bench import COLD_CALLS, COLD_SETS
from .codegen.quant import quant_type

# (name, E, top_k, n_ff, k, act, bias)
FUSED_SHAPES = (("qwen3-30b-a3b", 128, 8, 768, 2048, "silu", False),
                ("gpt-oss-20b", 32, 4, 2880, 2880, "swiglu_oai", True))
FUSED_N = (1, 2, 4, 8)


def _weights(qtype, E, n_ff, k, rng, copies):
    from . import reference as ref
    from .runtime.tensor import QuantTensor
    raw = ref.random_blocks(qtype, E * 2 * n_ff, k, rng)
    gu = QuantTensor.from_blocks(raw, qtype, (E, 2 * n_ff, k))
    half = raw.reshape(E, 2 * n_ff, -1)
    gate = QuantTensor.from_blocks(np.ascontiguousarray(half[:, :n_ff]), qtype, (E, n_ff, k))
    up = QuantTensor.from_blocks(np.ascontiguousarray(half[:, n_ff:]), qtype, (E, n_ff, k))
    sets = [(gu, gate, up)]
    for _ in range(copies - 1):
        sets.append(tuple(t.copy() for t in (gu, gate, up)))
    return sets


def _fused_specs(qtype, n, act, bias, sweep: bool, k: int):
    from .codegen.spec import MmvqSpec
    from .runtime import dispatch
    default = dispatch.default_fused(qtype, n, act, bias, ids=True, k=k)
    if not sweep:
        return [default]
    t = min(8, 1 << (n - 1).bit_length())
    out = [default] + [MmvqSpec(qtype, tokens=t, warps=4, rows=r, act=act, bias=bias) for r in (1, 2, 4)]
    # a block per (token, slot) pair: with 128 experts a few tokens rarely share one
    out += [MmvqSpec(qtype, tokens=1, warps=4, rows=r, act=act, bias=bias, per_pair=True) for r in (1, 2, 4)]
    out += [MmvqSpec.decode(qtype, rows=r, act=act, bias=bias) for r in (1, 2, 4)]
    if n == 1:   # the guessing form, both unit counts (dispatch.default_fused picks one)
        out += [MmvqSpec.decode(qtype, rows=2, act=act, bias=bias, guess=True, units=u) for u in (1, 2)]
    seen, uniq = set(), []
    for s in out:
        if s not in seen:
            seen.add(s)
            uniq.append(s)
    return uniq


def run(qtypes, reps: int, info: dict, bw_gbs: float, rows: list, rng, sweep: bool = False) -> None:
    import cupy as cp
    from .runtime import dispatch
    from .runtime.fused import Operands, run_moe_gate_up
    from .runtime.ops import run_mul_mat_id
    from .tuning.timing import time_calls
    for qtype in qtypes:
        q = quant_type(qtype)
        for name, E, top_k, n_ff, k, act, bias in FUSED_SHAPES:
            if k % q.block_values:
                continue   # gpt-oss's rows of 2880 hold no whole K-quant super-blocks
            row_bytes = q.row_bytes(k)
            one = E * 2 * n_ff * row_bytes
            copies = max(2, math.ceil(4 * info["l2_bytes"] / one))
            wsets = _weights(qtype, E, n_ff, k, rng, copies)
            bg = cp.asarray(rng.standard_normal((E, n_ff)).astype(np.float32)) if bias else None
            bu = cp.asarray(rng.standard_normal((E, n_ff)).astype(np.float32)) if bias else None
            for n in FUSED_N:
                xs = [cp.asarray(rng.standard_normal((n, k)).astype(np.float32)) for _ in range(COLD_SETS)]
                idss = [cp.asarray(np.argsort(rng.random((n, E)), axis=1)[:, :top_k].astype(np.int32))
                        for _ in range(COLD_SETS)]
                touched = len(np.unique(idss[0].get()))
                gbytes = touched * 2 * n_ff * row_bytes
                out = cp.empty((n, top_k, n_ff), dtype=cp.float32)
                out2 = cp.empty((n, top_k, n_ff), dtype=cp.float32)
                opsets = [[Operands(x, gu, None, None, bg, bu, experts=True) for x in xs] for gu, _, _ in wsets]
                sep = dispatch.Choice("mmvq", dispatch.default_mmvq(qtype, n, ids=True))

                def fused(i, ws, spec=None):
                    run_moe_gate_up(opsets[i % ws][i % COLD_SETS], idss[i % COLD_SETS], out, act, spec)

                def separate(i, ws):
                    _, g, u = wsets[i % ws]
                    run_mul_mat_id(g, xs[i % COLD_SETS], idss[i % COLD_SETS], out, sep)
                    run_mul_mat_id(u, xs[i % COLD_SETS], idss[i % COLD_SETS], out2, sep)

                res = {}
                nc = max(COLD_SETS, copies)
                for label, fn in (("separate", separate),):
                    hot = time_calls(lambda i: fn(0, 1), 1, reps=reps)
                    cold = time_calls(lambda i: fn(i, copies), nc, calls=max(nc, COLD_CALLS), reps=reps)
                    res[label] = (hot.median_us, cold.median_us)
                best = None
                for spec in _fused_specs(qtype, n, act, bias, sweep, k):
                    hot = time_calls(lambda i: fused(0, 1, spec), 1, reps=reps)
                    cold = time_calls(lambda i: fused(i, copies, spec), nc, calls=max(nc, COLD_CALLS), reps=reps)
                    print(f"    fused {spec.name}: {hot.median_us:.2f} / {cold.median_us:.2f} us", file=sys.stderr)
                    if best is None or cold.median_us < best[1]:
                        best = (hot.median_us, cold.median_us, spec.name)
                res["fused"] = best[:2]
                fh, fc = res["fused"]
                sh, sc = res["separate"]
                row = dict(op="gate_up", shape=name, qtype=qtype, n=n, act=act, bias=bias, spec=best[2],
                           fused_us=round(fh, 2), fused_cold_us=round(fc, 2),
                           separate_us=round(sh, 2), separate_cold_us=round(sc, 2),
                           gbs_cold=round(gbytes / (fc * 1e-6) / 1e9, 1),
                           pct_copy=round(100 * gbytes / (fc * 1e-6) / 1e9 / bw_gbs, 1),
                           gain_cold=round(sc / fc, 2))
                rows.append(row)
                print(f"  fused {qtype} {name} n={n}: fused {fh:.2f}/{fc:.2f} us, separate {sh:.2f}/{sc:.2f} us",
                      file=sys.stderr, flush=True)


def print_table(rows: list, bw_gbs: float, out=sys.stdout) -> None:
    rows = [r for r in rows if r.get("op") == "gate_up"]
    if not rows:
        return
    print(f"\nfused gate+up vs two separate expert mat-vec calls (copy bandwidth {bw_gbs:.0f} GB/s)", file=out)
    hdr = (f"{'type':<5} {'shape':<14} {'n':>2} {'fused us':>9} {'cold':>8} {'separate':>9} {'cold':>8} "
           f"{'GB/s cold':>9} {'%copy':>6} {'gain':>5}  spec")
    print(hdr, file=out)
    print("-" * len(hdr), file=out)
    for r in rows:
        print(f"{r['qtype']:<5} {r['shape']:<14} {r['n']:>2} {r['fused_us']:>9.2f} {r['fused_cold_us']:>8.2f} "
              f"{r['separate_us']:>9.2f} {r['separate_cold_us']:>8.2f} {r['gbs_cold']:>9.0f} {r['pct_copy']:>6.1f} "
              f"{r['gain_cold']:>5.2f}  {r.get('spec', '')}", file=out)
