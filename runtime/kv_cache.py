"""The KV cache: each layer's keys and values by position, float32 or f16.

A layer with a sliding window (gpt-oss: every other one sees 128 positions) keeps only a
ring of positions, as llama.cpp's SWA cache does: position p lives in row p mod R. Every
kernel addresses the cache by position, so the backend decides how a ring looks to them:
numpy holds R rows and its ops take positions mod R; the GPU maps R rows' memory again
and again over a range of n_ctx rows (runtime.ring_memory), so that its kernels need no
change at all.
"""
from __future__ import annotations

import math

import numpy as np

from ..codegen.spec import ModelSpec
from .arch import HParams

# the element of each KV cache type the model kernels are built for (codegen.spec.ModelSpec.cache)
CACHE_TYPES = {"f32": np.float32, "f16": np.float16}
assert tuple(CACHE_TYPES) == ModelSpec.CACHE_TYPES


def check_cache_type(cache_type: str) -> str:
    if cache_type not in CACHE_TYPES:
        raise ValueError(f"cache_type must be one of {tuple(CACHE_TYPES)}, got {cache_type!r}")
    return cache_type


def ring_rows(window: int, max_pass: int, row_bytes: int, unit_bytes: int = 1) -> int:
    """Rows of a sliding layer's ring. A forward pass stores its max_pass keys before its
    first query reads the window - 1 keys before it, so window - 1 + max_pass positions
    must be held at once; rounded up to whole units (the device's mapping granularity:
    then every row of every unit is whole)."""
    unit = math.lcm(row_bytes, unit_bytes)
    need = (window - 1 + max_pass) * row_bytes
    return -(-need // unit) * unit // row_bytes


class KVCache:
    """Keys and values, a (rows, kv_dim) array a layer (k[il], v[il]), float32 or f16
    (cache_type), like llama.cpp's cache of that type: f16 halves the memory and what
    attention reads, each value rounded to nearest even once, when it is stored.

    max_pass: the most tokens a forward pass stores; with it, a sliding layer keeps a ring
    (ring_rows) where that is shorter than n_ctx. None keeps every position of every layer
    (llama.cpp's --swa-full). ring_unit: the ring's size granularity in bytes; ring_layer
    (rows, n_ctx, kv_dim, dtype) -> array: the backend's form of a ring layer."""

    def __init__(self, xp, hp: HParams, n_ctx: int, cache_type: str = "f32", max_pass: int | None = None,
                 ring_unit: int = 1, ring_layer=None):
        self.n_ctx, self.type, self.max_pass = n_ctx, check_cache_type(cache_type), max_pass
        dtype = np.dtype(CACHE_TYPES[cache_type])
        row_bytes = hp.kv_dim * dtype.itemsize
        rows = [n_ctx] * hp.n_layer
        if max_pass is not None and ring_layer is not None:
            for il in range(hp.n_layer):
                if hp.window(il):
                    rows[il] = min(n_ctx, ring_rows(hp.window(il), max_pass, row_bytes, ring_unit))
        self.rows = tuple(rows)                 # positions each layer holds
        self.windows = tuple(hp.window(il) if rows[il] < n_ctx else 0 for il in range(hp.n_layer))
        full = [il for il in range(hp.n_layer) if rows[il] == n_ctx]
        # the layers that hold every position share one allocation
        kf = xp.zeros((len(full), n_ctx, hp.kv_dim), dtype=dtype)
        # latent attention (runtime.arch.MLA): the value row is the key row's first values
        vf = kf[..., :hp.v_dim] if hp.mla else xp.zeros((len(full), n_ctx, hp.kv_dim), dtype=dtype)
        k, v = [None] * hp.n_layer, [None] * hp.n_layer
        for j, il in enumerate(full):
            k[il], v[il] = kf[j], vf[j]
        for il in range(hp.n_layer):
            if k[il] is None:
                k[il] = ring_layer(rows[il], n_ctx, hp.kv_dim, dtype)
                v[il] = ring_layer(rows[il], n_ctx, hp.kv_dim, dtype)
        self.k, self.v = tuple(k), tuple(v)
        self.dtype = dtype
        self.nbytes = (1 if hp.mla else 2) * row_bytes * sum(rows)

    @property
    def rings(self) -> int:
        """How many layers keep a ring."""
        return sum(1 for w in self.windows if w)

    def holds(self, keep: int, n_past: int) -> bool:
        """Whether, with positions up to n_past stored, a pass may continue at position keep
        (keep <= n_past): every ring still holds the window before keep."""
        return all(not w or max(0, keep - w + 1) >= n_past - r for w, r in zip(self.windows, self.rows))


def rows_of(layer, start: int, stop: int):
    """Where positions start .. stop-1 lie in a layer as the numpy backend holds it: a
    slice, or rows mod its length where it is a ring that wraps there."""
    if stop <= layer.shape[0]:
        return slice(start, stop)
    return np.arange(start, stop) % layer.shape[0]
