#!/usr/bin/env python3
"""Run one MUL_MAT_ID case a few times, for a profiler (ncu) to look at.
   profile_case.py QTYPE N PATH SPEC_FIELDS   e.g. q4_0 16 mmq_id x=8,y=128,warps=4,stages=2,stream_k=0"""
import sys

import numpy as np


def main():
    import cupy as cp
    from moeforge import reference as ref
    from moeforge.codegen.spec import MmqSpec, MmvqSpec
    from moeforge.runtime.dispatch import Choice
    from moeforge.runtime.ops import run_mul_mat_id
    from moeforge.runtime.tensor import QuantTensor
    qtype, n, path = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    fields = dict(kv.split("=") for kv in sys.argv[4].split(",")) if len(sys.argv) > 4 else {}
    fields = {k: (int(v) if v.lstrip("-").isdigit() else v) for k, v in fields.items()}
    for b in ("stream_k", "ids"):
        if b in fields:
            fields[b] = bool(fields[b])
    E, top_k, m, k = 128, 8, 768, 2048
    spec = (MmvqSpec if path in ("mmvq", "fused") else MmqSpec)(qtype, **fields)
    rng = np.random.default_rng(0)
    rows = 2 * m if path == "fused" else m
    w = QuantTensor.from_blocks(ref.random_blocks(qtype, E * rows, k, rng), qtype, (E, rows, k))
    x = cp.asarray(rng.standard_normal((n, k)).astype(np.float32))
    ids = cp.asarray(np.argsort(rng.random((n, E)), axis=1)[:, :top_k].astype(np.int32))
    out = cp.empty((n, top_k, m), dtype=cp.float32)
    if path == "fused":
        from moeforge.runtime.fused import Operands, run_moe_gate_up
        ops = Operands(x, w, None, None, None, None, experts=True)
        for _ in range(6):
            run_moe_gate_up(ops, ids, out, spec.act, spec)
    else:
        for _ in range(6):
            run_mul_mat_id(w, x, ids, out, Choice(path, spec))
    cp.cuda.Device().synchronize()


if __name__ == "__main__":
    main()
