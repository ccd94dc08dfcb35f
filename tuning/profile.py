"""Per-GPU profiles: the tuned choice per (op, quant type, shape class, token bucket).

A profile is untrusted input (it may come from `profile import`, another machine, a
half-written file): it is read with yaml.safe_load and every field is checked — schema
version, types, parameter ranges, and each spec rebuilt through KernelSpec.from_dict and
its own check() — before any of it can reach a kernel launch. Writes are atomic, so a
killed tuner never leaves half a profile behind.
"""
from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from ..codegen.spec import KernelSpec
from ..fsutil import atomic_write
from ..runtime.dispatch import Choice
from . import fingerprint as fpmod
from .space import OPS, PATHS, TuneKey, path_allows

SCHEMA_VERSION = 1
TOP_KEYS = {"schema_version", "fingerprint", "created", "entries"}
ENTRY_REQUIRED = {"op": str, "qtype": str, "shape": list, "n": int, "path": str, "spec": dict,
                  "us": float, "default_us": float}
ENTRY_OPTIONAL = {"default_spec": str, "us_random": float, "us_skewed": float, "trials": int,
                  "kernel": str, "paths": list,   # paths: those the study measured
                  "wgmma": bool}                  # wgmma tiles among them (dispatch._measured_f16)
HEX = set("0123456789abcdef")


class ProfileError(ValueError):
    def __init__(self, source: str, problems: list[str]):
        self.source, self.problems = source, problems
        shown = "; ".join(problems[:5]) + (f"; ... {len(problems) - 5} more" if len(problems) > 5 else "")
        super().__init__(f"{source}: {shown}")


@dataclass(frozen=True)
class Entry:
    key: TuneKey
    path: str
    spec: KernelSpec
    us: float
    default_us: float
    extra: dict = field(default_factory=dict, compare=False)   # the optional fields

    @property
    def speedup(self) -> float:
        return self.default_us / self.us if self.us > 0 else float("nan")

    def choice(self) -> Choice:
        """What dispatch runs for this entry, with what its study knew (dispatch.outdated)."""
        return Choice(self.path, self.spec, "profile", tuple(self.extra.get("paths", ())),
                      kept_default=self.extra.get("default_spec") == self.spec.name,
                      trials=self.extra.get("trials"), wgmma_timed=bool(self.extra.get("wgmma", False)))

    def runs(self) -> Choice:
        """What dispatch runs for this entry's bucket with the entry in the profile, as the
        current card answers (dispatch.on_card for the profile's): the entry's own choice,
        or what takes its place (an outdated kept default, the f16 rule's tile where the
        study did not time it)."""
        from ..runtime import dispatch
        return dispatch.resolve(self.key.op, self.key.qtype, self.key.shape, self.key.n, self.choice())

    def to_dict(self) -> dict:
        k = self.key
        return {"op": k.op, "qtype": k.qtype, "shape": list(k.shape), "n": k.n, "path": self.path,
                "spec": self.spec.to_dict(), "us": round(float(self.us), 3),
                "default_us": round(float(self.default_us), 3), **self.extra}


@dataclass
class Profile:
    fingerprint: dict
    entries: dict[TuneKey, Entry] = field(default_factory=dict)
    created: str = ""
    source: str = "<memory>"

    def __post_init__(self):
        self._index: dict | None = None

    def put(self, entry: Entry) -> None:
        self.entries[entry.key] = entry
        self._index = None

    def to_dict(self) -> dict:
        fp = {k: self.fingerprint[k] for k in fpmod.FIELDS}
        return {"schema_version": SCHEMA_VERSION, "fingerprint": fp,
                "created": self.created or time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "entries": [self.entries[k].to_dict() for k in sorted(self.entries)]}

    def with_current_kernels(self, templates: str) -> tuple["Profile", int]:
        """This profile as usable under template set `templates`: every entry when it was
        tuned under that set; otherwise only the entries whose recorded kernel source hash
        is the hash of the source their spec renders to now (an entry without one cannot be
        checked and is left out). Returns (profile, number of entries left out)."""
        if self.fingerprint.get("templates") == templates:
            return self, 0
        from ..codegen.render import source_hash
        kept = Profile(dict(self.fingerprint), created=self.created, source=self.source)
        for e in self.entries.values():
            if e.extra.get("kernel") == source_hash(e.spec):
                kept.put(e)
        return kept, len(self.entries) - len(kept.entries)

    # -- run-time lookup -------------------------------------------------------------------
    def choose(self, op: str, qtype: str, shape, n: int) -> Choice | None:
        """The entry of the nearest token bucket (distance in log2(n): buckets are powers of
        two, so a bucket is at most a factor sqrt(2) from the n it serves when every bucket
        was tuned). Entries whose path cannot run n tokens (mat-vec past its limits) are
        skipped, never handed to dispatch."""
        if self._index is None:
            idx: dict = {}
            for key, e in self.entries.items():
                idx.setdefault((key.op, key.qtype, key.shape), []).append(e)
            self._index = {k: sorted(v, key=lambda e: e.key.n) for k, v in idx.items()}
        cands = self._index.get((op, qtype, tuple(shape)))
        if not cands or n <= 0:
            return None
        best, best_d = None, math.inf
        ln = math.log2(n)
        for e in cands:   # ascending n: on a tie the smaller bucket wins
            d = abs(math.log2(e.key.n) - ln)
            if d < best_d and path_allows(op, e.path, e.spec, shape, n) is None:
                best, best_d = e, d
        return best.choice() if best is not None else None


# -- validation ----------------------------------------------------------------------------
def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _check_entry(i: int, d) -> tuple[Entry | None, list[str]]:
    at = f"entries[{i}]"
    if not isinstance(d, dict):
        return None, [f"{at} must be a mapping"]
    errs = []
    for k, t in {**ENTRY_REQUIRED, **ENTRY_OPTIONAL}.items():
        if k not in d:
            if k in ENTRY_REQUIRED:
                errs.append(f"{at}.{k} is missing")
            continue
        v = d[k]
        ok = _is_num(v) if t is float else (type(v) is t)
        if not ok:
            errs.append(f"{at}.{k} must be {t.__name__}, got {v!r}")
        elif t is float and v <= 0:
            errs.append(f"{at}.{k} must be positive, got {v!r}")
        elif t is int and v < 0:
            errs.append(f"{at}.{k} must not be negative, got {v!r}")
    errs += [f"{at}.{k} is not a known field" for k in d if k not in ENTRY_REQUIRED and k not in ENTRY_OPTIONAL]
    if errs:
        return None, errs
    if d["op"] not in OPS:
        return None, [f"{at}.op must be one of {OPS}, got {d['op']!r}"]
    if not all(type(v) is int for v in d["shape"]):
        return None, [f"{at}.shape must hold integers, got {d['shape']!r}"]
    try:
        key = TuneKey(d["op"], d["qtype"], tuple(d["shape"]), d["n"])
    except ValueError as e:
        return None, [f"{at}: {e}"]
    try:
        spec = KernelSpec.from_dict(d["spec"])
    except (TypeError, ValueError) as e:
        return None, [f"{at}.spec: {e}"]
    if getattr(spec, "qtype", None) != key.qtype:
        return None, [f"{at}.spec is for {getattr(spec, 'qtype', None)!r}, the entry for {key.qtype!r}"]
    if d["path"] not in PATHS[key.op]:
        return None, [f"{at}.path must be one of {PATHS[key.op]} for {key.op}, got {d['path']!r}"]
    why = path_allows(key.op, d["path"], spec, key.shape, key.n)
    if why:
        return None, [f"{at}: {why}"]
    if "kernel" in d and not (len(d["kernel"]) == 16 and set(d["kernel"]) <= HEX):
        return None, [f"{at}.kernel must be 16 lowercase hex digits, got {d['kernel']!r}"]
    if "paths" in d and not (d["paths"] and all(p in PATHS[key.op] for p in d["paths"])):
        return None, [f"{at}.paths must list paths of {PATHS[key.op]}, got {d['paths']!r}"]
    extra = {k: d[k] for k in ENTRY_OPTIONAL if k in d}
    return Entry(key, d["path"], spec, float(d["us"]), float(d["default_us"]), extra), []


def from_dict(data, source: str = "<memory>") -> Profile:
    """A validated Profile, or ProfileError listing every problem found."""
    if not isinstance(data, dict):
        raise ProfileError(source, [f"a profile is a mapping, got {type(data).__name__}"])
    errs = []
    v = data.get("schema_version")
    if type(v) is not int:
        raise ProfileError(source, [f"schema_version must be an integer, got {v!r}"])
    if v != SCHEMA_VERSION:
        raise ProfileError(source, [f"schema_version {v} is not supported (this moeforge reads {SCHEMA_VERSION})"])
    errs += [f"{k} is not a known top-level field" for k in data if k not in TOP_KEYS]
    errs += fpmod.validate(data.get("fingerprint"))
    created = data.get("created", "")
    if not isinstance(created, str):
        errs.append("created must be a string")
    raw_entries = data.get("entries")
    if not isinstance(raw_entries, list):
        errs.append("entries must be a list")
        raw_entries = []
    prof = Profile(dict(data.get("fingerprint") or {}), created=created if isinstance(created, str) else "",
                   source=source)
    for i, d in enumerate(raw_entries):
        entry, e = _check_entry(i, d)
        errs += e
        if entry is not None:
            if entry.key in prof.entries:
                errs.append(f"entries[{i}] repeats {entry.key.label}")
            prof.put(entry)
    if errs:
        raise ProfileError(source, errs)
    if isinstance(prof.fingerprint.get("memory_gib"), int):
        prof.fingerprint["memory_gib"] = float(prof.fingerprint["memory_gib"])
    return prof


def load(path: str | os.PathLike) -> Profile:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise ProfileError(str(path), [f"cannot read: {e.strerror or e}"]) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ProfileError(str(path), [f"not valid YAML: {str(e).splitlines()[0]}"]) from None
    return from_dict(data, str(path))


def dump(profile: Profile) -> str:
    return yaml.safe_dump(profile.to_dict(), sort_keys=False, default_flow_style=None, width=120)


def save(profile: Profile, path: str | os.PathLike) -> Path:
    """Atomic: a temporary file in the same directory, then os.replace, so a reader sees
    the old profile or the new one, never half of one. Validated before it is written."""
    path = Path(path)
    text = dump(profile)
    from_dict(yaml.safe_load(text), str(path))   # never write what we would refuse to read
    path.parent.mkdir(parents=True, exist_ok=True)
    return atomic_write(path, text)


def file_name(fp: dict) -> str:
    return f"{fpmod.slug(fp)}.yaml"
