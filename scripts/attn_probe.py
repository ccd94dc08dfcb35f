#!/usr/bin/env python3
"""Decode attention alone, on a GPU: us a layer for one token at n cached positions, a CUDA
graph of 8 layers' calls (caches in turn, no PDL), median of 25 replays. Heads: Qwen3-30B-A3B's
(32, 4, 128) and gpt-oss's (64, 8, 64) on the grouped kernel (tensor cores, forced at every
length), qwen3-ph on the per-head kernel; up to 4096 positions the output is also checked
against float64 (NMSE) and the split counters after it (tests/conftest.split_counters_ready).
Run from the repository root (BENCHMARKS.md, "Decode attention's split merge"):
    NKV=512,4096,16384 CACHES=f16,f32 TAG=name python3 scripts/attn_probe.py
SPLITS=N forces the splits; NCU=1 only launches (for ncu -k regex:attn_decode)."""
import dataclasses
import os
import sys

import cupy as cp
import numpy as np

sys.path.insert(0, "tests")
from conftest import attn_hparams, attention64, split_counters_ready
from moeforge.runtime.backend_cuda import CudaBackend

HEADS = {"qwen3": (32, 4, 128), "gptoss": (64, 8, 64), "qwen3-ph": (32, 4, 128)}
N_KV = [int(x) for x in os.environ.get("NKV", "512,4096,16384,32768").split(",")]
CACHES = os.environ.get("CACHES", "f16").split(",")
LAYERS = 8
res = {}
for cache_type in CACHES:
    for name, heads in HEADS.items():
        hp = dataclasses.replace(attn_hparams(*heads), n_layer=LAYERS)
        B = CudaBackend(hp, cache_type=cache_type)
        B.decode_attn_grouped, B.decode_attn_tc = not name.endswith('-ph'), True
        if os.environ.get("SPLITS"):
            B.decode_attn_splits = int(os.environ["SPLITS"])
        cache = B.new_cache(max(N_KV) + 16)
        with B.context():
            for il in range(LAYERS):
                cache.k[il][...] = cp.random.standard_normal(cache.k[il].shape, dtype=cp.float32).astype(cache.k[il].dtype)
                cache.v[il][...] = cp.random.standard_normal(cache.v[il].shape, dtype=cp.float32).astype(cache.v[il].dtype)
            q = cp.random.standard_normal((1, hp.q_dim), dtype=cp.float32)
        for n_kv in (N_KV if not name.endswith('-ph') else [128, 512, 1024]):
            pos = cp.asarray(np.array([n_kv - 1], dtype=np.int32))
            s = B.stream
            with s:
                for il in range(LAYERS):
                    B.attention(cache, il, q, pos, n_kv - 1, 1, "attn")
                s.synchronize()
                if os.environ.get("NCU"):
                    continue
                s.begin_capture()
                for il in range(LAYERS):
                    B.attention(cache, il, q, pos, n_kv - 1, 1, "attn")
                g = s.end_capture()
                for _ in range(3):
                    g.launch(s)
                a, b = cp.cuda.Event(), cp.cuda.Event()
                t = []
                for _ in range(25):
                    a.record(s)
                    g.launch(s)
                    b.record(s)
                    b.synchronize()
                    t.append(cp.cuda.get_elapsed_time(a, b) * 1000.0 / LAYERS)
            err = ""
            if n_kv <= 4096 and not os.environ.get("NCU"):
                with s:
                    B.ws("attn", (1, hp.q_dim)).fill(cp.nan)
                    got = B.attention(cache, 3, q, pos, n_kv - 1, 1, "attn").get().astype(np.float64)
                want = attention64(q.get().astype(np.float64), cache.k[3].get().astype(np.float64),
                                   cache.v[3].get().astype(np.float64), np.array([n_kv - 1]), hp)
                nmse = float(((got - want) ** 2).sum() / (want ** 2).sum())
                err = f"nmse {nmse:.1e} counters {split_counters_ready(B, hp)}"
            res[f"{name} {cache_type} {n_kv}"] = (float(np.median(t)), err)
tag = os.environ.get("TAG", "base")
for k, v in res.items():
    print(f"{tag:10s} {k:26s} {v[0]:8.2f} us  {v[1]}")
