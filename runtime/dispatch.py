"""Which kernel runs a product: the per-GPU profile's choice when one exists for the
shape and token count, else the defaults below (chosen from measurements on an H100).

A choice is a path and a spec:
  mmvq        mat-vec, every expert's weights read once for all its tokens (n <= 8)
  mmq_id      one int8 tensor-core launch for all experts, tiles from the routing kernel
  per_expert  gather each expert's tokens, one dense launch per expert, scatter back
"""
from __future__ import annotations

from dataclasses import dataclass

from ..codegen.spec import KernelSpec, MmqSpec, MmvqSpec

PATHS = ("mmvq", "mmq_id", "per_expert")
MMVQ_MAX_TOKENS = 8     # past this the int8 tensor-core tiles win


@dataclass(frozen=True)
class Choice:
    path: str
    spec: KernelSpec
    source: str = "default"   # "default" or "profile"


def _pow2_at_least(v: float, lo: int, hi: int) -> int:
    p = lo
    while p < v and p < hi:
        p *= 2
    return p


def default_mmvq(qtype: str, n: int, ids: bool) -> MmvqSpec:
    """One token: one launch that quantizes x in each block (per pair). More tokens: the
    routing tiles, so an expert several tokens chose is read once."""
    if n == 1:
        return MmvqSpec(qtype, tokens=1, warps=4, rows=2, ids=ids, per_pair=True)
    return MmvqSpec(qtype, tokens=_pow2_at_least(n, 1, 8), warps=4, rows=2, ids=ids)


def default_fused(qtype: str, n: int, act: str, bias: bool, ids: bool) -> MmvqSpec:
    return MmvqSpec(qtype, tokens=_pow2_at_least(n, 1, 8), warps=4, rows=1, ids=ids, act=act, bias=bias,
                    per_pair=n == 1)


def default_mmq(qtype: str, tokens_per_tile: float, ids: bool, stream_k: bool = True) -> MmqSpec:
    """Tile width from the tokens each expert receives, not from the batch: with 128
    experts and 128 tokens x top-8, each expert sees ~8 tokens and a 64-wide tile would
    be mostly empty (where llama.cpp loses most of its time)."""
    x = _pow2_at_least(tokens_per_tile, 8, 64)
    if x <= 16:
        return MmqSpec(qtype, x=x, y=128, warps=8, kblocks=8, stages=3, ids=ids, stream_k=stream_k)
    return MmqSpec(qtype, x=x, y=64, warps=4, kblocks=8, stages=3, ids=ids, stream_k=stream_k)


def choose_mul_mat_id(qtype: str, E: int, top_k: int, m: int, k: int, n: int) -> Choice:
    from .profiles_hook import lookup
    found = lookup("mul_mat_id", qtype, (E, top_k, m, k), n)
    return found if found is not None else default_mul_mat_id(qtype, E, top_k, m, k, n)


def default_mul_mat_id(qtype: str, E: int, top_k: int, m: int, k: int, n: int) -> Choice:
    """The choice without any profile: the tuner's baseline, enqueued first."""
    if n <= MMVQ_MAX_TOKENS:
        return Choice("mmvq", default_mmvq(qtype, n, ids=True))
    return Choice("mmq_id", default_mmq(qtype, n * top_k / E, ids=True))


def choose_mul_mat(qtype: str, m: int, k: int, n: int) -> Choice:
    from .profiles_hook import lookup
    found = lookup("mul_mat", qtype, (1, 1, m, k), n)
    return found if found is not None else default_mul_mat(qtype, m, k, n)


def default_mul_mat(qtype: str, m: int, k: int, n: int) -> Choice:
    if n <= MMVQ_MAX_TOKENS:
        return Choice("mmvq", default_mmvq(qtype, n, ids=False))
    return Choice("mmq", default_mmq(qtype, n, ids=False))
