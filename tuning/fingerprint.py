"""What a profile (and a study) is valid for, and what to do when it was made elsewhere.

A measured winner depends on the chip (name, compute capability, SM count, memory size),
on the code that was timed (moeforge version, the kernels' source) and, more weakly, on the
software under it (driver, CUDA runtime, NVRTC). The policy: the same chip with other
software still gives good choices, so the profile is used with a warning; a different chip
or another moeforge means the choices may be wrong or slow, so the profile is refused.

The template set is judged per entry, not per profile: each entry records the hash of the
source of the kernel it chose (profile.Entry, "kernel"), and under other templates an entry
is used only where that source is unchanged. A change to one kernel family then costs a
re-tune of the buckets that use it, not of the whole profile; and because `ident` leaves
the templates out, that re-tune merges into the same file.
"""
from __future__ import annotations

import hashlib
import json

# Field -> type, in the order they are written.
FIELDS: dict[str, type] = {
    "gpu": str, "cc": str, "sm_count": int, "memory_gib": float,
    "driver": str, "cuda_runtime": str, "nvrtc": str,
    "moeforge": str, "templates": str,
}
# Differences here: use the profile and warn (the same chip, other software under it).
SOFT = ("driver", "cuda_runtime", "nvrtc")
# Differences here: refuse (another chip, or another moeforge than the one that timed it).
HARD = ("gpu", "cc", "sm_count", "memory_gib", "moeforge")
# Differences here: use the entries whose kernel source is unchanged (see the docstring).
PER_ENTRY = ("templates",)


def card(fp: dict) -> tuple[int | None, int]:
    """What the rules ask of the card a fingerprint names (runtime.dispatch.on_card): its
    compute capability's major and its SM count."""
    try:
        cc = int(str(fp.get("cc", "")).split(".")[0])
    except ValueError:
        cc = None
    return cc, int(fp.get("sm_count") or 1)


def current(device: int | None = None) -> dict:
    """The running device's fingerprint (needs a GPU)."""
    from .. import __version__
    from ..codegen.render import templates_hash
    from ..runtime.device import device_info
    info = device_info(device)
    return {"gpu": info["name"], "cc": info["cc"], "sm_count": info["sm_count"],
            "memory_gib": float(info["memory_gib"]), "driver": info["driver"],
            "cuda_runtime": info["cuda_runtime"], "nvrtc": info["nvrtc"],
            "moeforge": __version__, "templates": templates_hash()}


def validate(fp) -> list[str]:
    """Problems with a fingerprint read from a file (empty when it is well formed)."""
    if not isinstance(fp, dict):
        return [f"fingerprint must be a mapping, got {type(fp).__name__}"]
    errs = []
    for k, t in FIELDS.items():
        if k not in fp:
            errs.append(f"fingerprint.{k} is missing")
        elif t is float and isinstance(fp[k], (int, float)) and not isinstance(fp[k], bool):
            continue
        elif type(fp[k]) is not t:
            errs.append(f"fingerprint.{k} must be {t.__name__}, got {type(fp[k]).__name__} {fp[k]!r}")
        elif t is str and not fp[k].strip():
            errs.append(f"fingerprint.{k} is empty")
    for k in fp:
        if k not in FIELDS:
            errs.append(f"fingerprint.{k} is not a known field")
    if not errs and fp["sm_count"] <= 0:
        errs.append("fingerprint.sm_count must be positive")
    return errs


def ident(fp: dict) -> str:
    """A short stable id over every field but the template set: the profile's file name and
    the study prefix (study names add the template hash themselves)."""
    canon = json.dumps({k: fp[k] for k in FIELDS if k not in PER_ENTRY}, sort_keys=True)
    return hashlib.sha256(canon.encode()).hexdigest()[:12]


def slug(fp: dict) -> str:
    name = "".join(c if c.isalnum() else "-" for c in fp["gpu"].lower()).strip("-")
    while "--" in name:
        name = name.replace("--", "-")
    return f"{name}-sm{fp['cc'].replace('.', '')}-{ident(fp)}"


def differences(made: dict, here: dict) -> list[tuple[str, object, object]]:
    return [(k, made.get(k), here.get(k)) for k in FIELDS if made.get(k) != here.get(k)]


def verdict(made: dict, here: dict) -> tuple[str, list[tuple[str, object, object]]]:
    """'match', 'soft' (use and warn; under other templates only the unchanged kernels'
    entries) or 'refuse', with the differing fields."""
    diffs = differences(made, here)
    if not diffs:
        return "match", diffs
    if all(k in SOFT or k in PER_ENTRY or (k == "memory_gib" and _same_memory(a, b)) for k, a, b in diffs):
        return "soft", diffs
    return "refuse", diffs


def _same_memory(a, b) -> bool:
    """Drivers reserve slightly different amounts of the same card's memory; a different
    card of the same name (80 vs 94 GB) differs by far more than 2 %."""
    try:
        return abs(float(a) - float(b)) <= 0.02 * max(float(a), float(b))
    except (TypeError, ValueError):
        return False


def describe(diffs) -> str:
    return ", ".join(f"{k}: profile {a!r}, this machine {b!r}" for k, a, b in diffs)
