"""The glu tiles (MmfSpec.glu) against what they replace, timed apart: the plain wgmma tile
the rules take for a model's merged gate|up product, the conversion of its float32 output
into the down's f16 x after it (mmf_x_to_f16 with SiLU; glu_oai_id_f16 with SwiGLU-OAI and
the experts' biases), and the glu tile doing both. CUDA graphs of `--calls` launches,
events, median of `--reps` (tuning.timing.time_calls); random (balanced) routing.

    python3 scripts/glu_probe.py [--models gpt-oss-20b,qwen3-30b-a3b] [--n 2048,4096]

"glu - plain" is what the glu tile's epilogue costs; "gain" is (plain + conversion) - glu.
Under ncu (`ncu --kernel-name regex:mmf_id --metrics
smsp__average_warp_latency_issue_stalled_barrier,smsp__average_warp_latency_issue_stalled_short_scoreboard,gpu__time_duration.sum
python3 scripts/glu_probe.py --reps 1 --calls 1`) the two tiles' stall reasons compare.
"""
import argparse
import dataclasses
import sys

import numpy as np

from product_ab import EXPERTS    # scripts/ is on the path: the models' expert shapes

# model: its experts' format, their activation, whether they have biases (shapes: EXPERTS)
MODELS = {
    "gpt-oss-20b": ("mxfp4", "swiglu_oai", True),
    "qwen3-30b-a3b": ("q4_0", "silu", False),
    "mixtral-8x7b": ("q4_0", "silu", False),
}


def probe(model: str, n: int, calls: int, reps: int, rng) -> dict:
    import cupy as cp

    from moeforge import reference as ref
    from moeforge.codegen.spec import ModelSpec
    from moeforge.runtime import dispatch
    from moeforge.runtime.kernels import grid_1d, load
    from moeforge.runtime.mmf import run_mmf, run_mmf_glu, x_f16_buffer, x_to_f16
    from moeforge.runtime.tensor import QuantTensor
    from moeforge.tuning.timing import time_calls
    E, top_k, m, k = EXPERTS[(model, "gate_up")]
    qtype, act, biased = MODELS[model]
    ff = m // 2
    base = dispatch.choose_mul_mat_id(qtype, E, top_k, m, k, n).spec
    if not getattr(base, "wgmma", False):
        raise SystemExit(f"{model} n={n}: the rules take {base.name}, not a wgmma tile")
    spec = dataclasses.replace(base, glu=act)
    w = QuantTensor.from_blocks(ref.random_blocks(qtype, E * m, k, rng), qtype, (E, m, k))
    x = cp.asarray(rng.standard_normal((n, k)).astype(np.float32))
    ids = cp.asarray(np.stack([rng.choice(E, top_k, replace=False) for _ in range(n)]).astype(np.int32))
    gb = ub = None
    if biased:
        gb, ub = (cp.asarray(rng.standard_normal((E, ff)).astype(np.float32)) for _ in range(2))
    out = cp.empty((n, top_k, m), dtype=cp.float32)
    rows = n * top_k

    def plain(_):
        run_mmf(base, w, x, ids, top_k, out)

    def convert(_):
        if act == "silu":
            x_to_f16(base, out.reshape(rows, m), glu=True)
            return
        xh, kp = x_f16_buffer(base, rows, ff)
        load(ModelSpec(), "glu_oai_id_f16")(grid_1d(rows * kp // 4), (
            out, gb if gb is not None else np.uint64(0), ub if ub is not None else np.uint64(0), ids, xh,
            np.int64(rows), np.int32(ff), np.int32(kp), np.int32(1)), block=256, smem=0)

    def glu(_):
        run_mmf_glu(spec, w, x, ids, top_k, gb, ub)

    t = {name: time_calls(fn, 1, calls=calls, reps=reps).median_us
         for name, fn in (("plain", plain), ("convert", convert), ("glu", glu))}
    return dict(model=model, n=n, tile=base.name, **t, epilogue=t["glu"] - t["plain"],
                gain=t["plain"] + t["convert"] - t["glu"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="gpt-oss-20b,qwen3-30b-a3b")
    ap.add_argument("--n", default="2048,4096")
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--reps", type=int, default=15)
    a = ap.parse_args(argv)
    models = a.models.split(",")
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        ap.error(f"unknown model {', '.join(unknown)}: one of {', '.join(MODELS)}")
    from moeforge.runtime.device import has_gpu
    if not has_gpu():
        print("glu_probe: no CUDA device found", file=sys.stderr)
        return 2
    rng = np.random.default_rng()
    print(f"{'model':<15} {'n':>5} {'tile':<34} {'plain':>9} {'convert':>9} {'glu':>9} {'glu-plain':>10} {'gain':>9}")
    for model in models:
        for n in (int(v) for v in a.n.split(",")):
            r = probe(model, n, a.calls, a.reps, rng)
            print(f"{r['model']:<15} {r['n']:>5} {r['tile']:<34} {r['plain']:>9.1f} {r['convert']:>9.1f} "
                  f"{r['glu']:>9.1f} {r['epilogue']:>10.1f} {r['gain']:>9.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
