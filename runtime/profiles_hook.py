"""Where dispatch asks the active per-GPU profile for a choice. The tuner's profile
module installs the real lookup; until then every product runs on the defaults."""
from __future__ import annotations

_lookup = None


def install(fn) -> None:
    global _lookup
    _lookup = fn


def lookup(op: str, qtype: str, shape: tuple[int, int, int, int], n: int):
    return _lookup(op, qtype, shape, n) if _lookup else None
