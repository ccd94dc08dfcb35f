#!/usr/bin/env python3
"""Prompt attention alone, on a GPU: us for one layer's call (the rows it reads rounded to
f16 and attention itself) over a whole ubatch of n tokens from position 0, for
attn_prefill_fa128 and, on sm_90, attn_prefill_wg128: a CUDA graph of LAYERS layers' calls
(each its own cache rows, 67 MB for 4 layers of 4096 float32 rows: more than L2), timed
with CUDA events, median of REPS replays after a warm-up. Also asserts that the two
kernels give the same bits. Heads: Qwen3-30B-A3B's (32, 4, 128). From the repository root:
    NS=512,2048,4096 CACHE=f32 TAG=name python3 scripts/prefill_attn_probe.py
prints one line per n: us a layer per kernel, and the causal product's TFLOP/s.
NCU=1 launches each kernel's calls once (for ncu -k regex:attn_prefill)."""
import dataclasses
import os
import sys

import cupy as cp
import numpy as np

sys.path.insert(0, "tests")
from conftest import attn_hparams  # noqa: E402
import moeforge  # noqa: E402
from moeforge.runtime.backend_cuda import CudaBackend  # noqa: E402

NS = [int(x) for x in os.environ.get("NS", "512,2048,4096").split(",")]
CACHE = os.environ.get("CACHE", "f32")
REPS = int(os.environ.get("REPS", "30"))
LAYERS = int(os.environ.get("LAYERS", "4"))
TAG = os.environ.get("TAG", "")
hp = dataclasses.replace(attn_hparams(32, 4, 128), n_layer=LAYERS)
cc = cp.cuda.Device().compute_capability
kinds = (False, True) if cc.startswith("9") else (False,)
print(f"# {TAG} ({os.path.dirname(moeforge.__file__)}) cache {CACHE}, heads {hp.n_head}/{hp.n_head_kv}x{hp.head_dim}, "
      f"{LAYERS} layers a graph, {REPS} reps")
print(f"{'n':>6} " + " ".join(f"{'wg128' if k else 'fa128':>10}" for k in kinds) + "  TFLOP/s (last)")
for n in NS:
    times, outs = {}, {}
    rng = np.random.default_rng()
    q_h = rng.standard_normal((n, hp.q_dim), dtype=np.float32)
    kv_h = [rng.standard_normal((n, hp.kv_dim), dtype=np.float32) for _ in range(2 * LAYERS)]  # both kernels'
    for wgmma in kinds:
        B = CudaBackend(hp, cache_type=CACHE, attn_wgmma=wgmma)
        B.attn_precision = "f16"
        cache = B.new_cache(n)
        s = B.stream
        with s:
            q = cp.asarray(q_h)
            pos = cp.arange(n, dtype=cp.int32)
            for il in range(LAYERS):
                cache.k[il][:n] = cp.asarray(kv_h[2 * il]).astype(cache.dtype)
                cache.v[il][:n] = cp.asarray(kv_h[2 * il + 1]).astype(cache.dtype)
            for il in range(LAYERS):
                B.attention(cache, il, q, pos, 0, n, "attn")
            outs[wgmma] = B.attention(cache, 0, q, pos, 0, n, "attn").get()
            if os.environ.get("NCU"):
                continue
            s.begin_capture()
            for il in range(LAYERS):
                B.attention(cache, il, q, pos, 0, n, "attn")
            graph = s.end_capture()
            for _ in range(3):
                graph.launch(s)
            start, stop = cp.cuda.Event(), cp.cuda.Event()
            got = []
            for _ in range(REPS):
                start.record(s)
                graph.launch(s)
                stop.record(s)
                stop.synchronize()
                got.append(cp.cuda.get_elapsed_time(start, stop) * 1e3 / LAYERS)
        times[wgmma] = float(np.median(got))
    if len(outs) == 2:
        assert np.array_equal(outs[True], outs[False]), f"n={n}: wg128 and fa128 differ"
    if os.environ.get("NCU"):
        continue
    flop = 4.0 * hp.n_head * hp.head_dim * n * (n + 1) / 2
    print(f"{n:>6} " + " ".join(f"{times[k]:>10.1f}" for k in kinds) + f"  {flop / times[kinds[-1]] / 1e6:.0f}")
