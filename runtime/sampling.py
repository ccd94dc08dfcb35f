"""Choosing the next token from the logits, as llama.cpp's default sampler chain does:
repetition, frequency and presence penalties, then top-k, top-p and min-p (each on the probabilities of what the step
before kept, at temperature 1), then the temperature, then a draw. Temperature 0 is greedy.

On the host: one row of logits a step. The filters look only at a window below the largest
logit, never sorting a 152k vocabulary whole (_top): well under a millisecond a token.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0    # 0: greedy (the argmax after the penalty); llama.cpp's default is 0.8
    top_k: int = 40             # 0: off
    top_p: float = 0.95         # 1: off
    min_p: float = 0.05         # 0: off; relative to the most probable token
    repeat_penalty: float = 1.0  # 1: off; llama.cpp's: positive logits divided, negative multiplied
    repeat_last_n: int = 64     # how many of the latest tokens the penalty looks at
    seed: int | None = None     # None: a fresh draw every run
    frequency_penalty: float = 0.0  # subtracted once per occurrence in the last repeat_last_n (OpenAI's)
    presence_penalty: float = 0.0   # subtracted once from every token that occurs there
    logit_bias: tuple[tuple[int, float], ...] = ()   # (token id, added to its logit), first in the chain

    def check(self) -> "Sampling":
        def bad(field, want):
            raise ValueError(f"sampling {field}={getattr(self, field)!r}: must be {want}")
        if not (np.isfinite(self.temperature) and self.temperature >= 0):
            bad("temperature", "a finite number >= 0")
        if self.top_k < 0:
            bad("top_k", ">= 0 (0 turns it off)")
        if not 0 < self.top_p <= 1:
            bad("top_p", "in (0, 1]")
        if not 0 <= self.min_p <= 1:
            bad("min_p", "in [0, 1]")
        if not (np.isfinite(self.repeat_penalty) and self.repeat_penalty > 0):
            bad("repeat_penalty", "a finite number > 0")
        if self.repeat_last_n < 0:
            bad("repeat_last_n", ">= 0")
        for field in ("frequency_penalty", "presence_penalty"):
            if not np.isfinite(getattr(self, field)):
                bad(field, "a finite number")
        if not all(isinstance(t, int) and t >= 0 and np.isfinite(b) for t, b in self.logit_bias):
            bad("logit_bias", "(token id >= 0, finite bias) pairs")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def penalize(logits: np.ndarray, recent, penalty: float, frequency: float = 0.0, presence: float = 0.0) -> np.ndarray:
    """llama.cpp's penalties: each distinct recent token's logit divided by the repetition
    penalty where positive, multiplied where not (once, however often it occurred), then
    less frequency * its count + presence. A float32 copy where anything changes; where
    nothing does, the logits as they are (no copy of a 152k row a token)."""
    if not (len(recent) and (penalty != 1.0 or frequency or presence)):
        return np.asarray(logits, dtype=np.float32)
    out = np.array(logits, dtype=np.float32)
    ids, counts = np.unique(np.asarray(recent, dtype=np.int64), return_counts=True)
    v = out[ids]
    v = np.where(v > 0, v / penalty, v * penalty)
    out[ids] = v - (frequency * counts + presence)
    return out


def _top(z: np.ndarray, enough) -> np.ndarray:
    """The largest values' ids, most probable first (ties by id, as a stable sort of all):
    every id within a window below the maximum, the window widened until enough(ids) says
    it holds what the filters need. A vocabulary of 152k is never sorted whole: the window
    of a real model's logits holds tens to thousands."""
    top, width = z.max(), 4.0
    while True:
        ids = np.flatnonzero(z >= top - width)
        if ids.size == z.size or enough(ids):
            return ids[np.argsort(-z[ids], kind="stable")]
        width *= 2


def candidates(logits: np.ndarray, s: Sampling) -> np.ndarray:
    """The token ids top-k, top-p and min-p keep, most probable first (at least one)."""
    z = np.asarray(logits)
    if s.top_k:
        order = _top(z, lambda ids: ids.size >= s.top_k)[:s.top_k]
        p = np.exp(z[order].astype(np.float64) - float(z[order[0]]))
        total = p.sum()
    else:
        # top-p over the whole vocabulary: the window must hold top_p of all the mass; with
        # top-p off, min-p's set (z >= max + ln(min_p)); with both off, everything
        zmax = float(z.max())
        total = np.exp(z.astype(np.float64) - zmax).sum()
        if s.top_p < 1:
            need = s.top_p * total * (1 + 1e-9)     # past the sums' rounding: the run ends inside
            order = _top(z, lambda ids: np.exp(z[ids].astype(np.float64) - zmax).sum() >= need)
        else:
            ids = np.flatnonzero(z >= zmax + np.log(s.min_p)) if s.min_p > 0 else np.arange(z.size)
            order = ids[np.argsort(-z[ids], kind="stable")]
        p = np.exp(z[order].astype(np.float64) - zmax)
    p = p / total
    if s.top_p < 1:
        # the shortest run whose probability reaches top_p
        keep = int(np.searchsorted(np.cumsum(p), s.top_p)) + 1
        order, p = order[:keep], p[:keep] / p[:keep].sum()
    if s.min_p > 0:
        order = order[p >= s.min_p * p[0]]
    return order


class Sampler:
    """One generation's draws: seeded once, so that a seed gives the same tokens every run."""

    def __init__(self, settings: Sampling | None = None):
        self.s = (settings or Sampling()).check()
        self.rng = np.random.default_rng(self.s.seed)

    def __call__(self, logits: np.ndarray, history=()) -> int:
        s = self.s
        if s.logit_bias:      # llama.cpp's chain starts with it; -100 (OpenAI's floor) all but bans a token
            logits = np.array(logits, dtype=np.float32)
            for t, b in s.logit_bias:
                logits[t] += b
        recent = history[-s.repeat_last_n:] if s.repeat_last_n else ()
        z = penalize(logits, recent, s.repeat_penalty, s.frequency_penalty, s.presence_penalty)
        if s.greedy:
            return int(np.argmax(z))
        keep = candidates(z, s)
        t = z[keep].astype(np.float64) / s.temperature
        p = np.exp(t - t.max())
        return int(keep[self.rng.choice(keep.size, p=p / p.sum())])
