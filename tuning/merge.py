"""Tuning results into the profile file of a fingerprint, and which buckets of it are stale.

A profile file is per fingerprint without the template hash (fingerprint.ident), so results
of a re-tune after a template edit merge into the file they refresh. What they merge into:
the file already in the profile directory, else the profile shipped for this fingerprint
(tuning a few buckets keeps the rest of the shipped tuning), else nothing. Entries timed on
kernels whose source has changed since are dropped on the way: the file's fingerprint
becomes this run's, and it must not vouch for them.
"""
from __future__ import annotations

import time
from pathlib import Path

from ..codegen.render import source_hash
from . import activate, paths
from .profile import Entry, Profile, ProfileError, file_name, load, save


def _source(path: Path, warn, set_aside: bool = True) -> Profile | None:
    """The profile new entries merge into; a corrupt one is reported, and set aside when
    a new one is about to be written in its place."""
    if path.exists():
        try:
            return load(path)
        except ProfileError as e:
            if not set_aside:
                warn(f"the profile {path} is corrupt ({'; '.join(e.problems[:3])})")
                return None
            keep = path.with_name(path.name + f".corrupt-{int(time.time())}")
            path.replace(keep)
            warn(f"the existing profile was corrupt ({'; '.join(e.problems[:3])}); moved it to {keep} "
                 f"and wrote a new one")
            return None
    shipped = [p for p in paths.shipped_profiles() if p.name == path.name]
    if shipped:
        try:
            return load(shipped[0])
        except ProfileError as e:
            warn(f"the shipped profile {shipped[0]} is corrupt and is not merged: {e}")
    return None


def base_profile(fp: dict, path: Path, warn) -> Profile:
    """What new entries for fingerprint `fp` merge into (see the module docstring)."""
    src = _source(path, warn)
    out = Profile(dict(fp), source=str(path))
    if src is None:
        return out
    kept, dropped = src.with_current_kernels(fp["templates"])
    if dropped:
        warn(f"{dropped} entries of {src.source} were timed on kernels that have changed since; they are "
             f"dropped (`moeforge tune --stale` re-tunes their buckets)")
    out.created = kept.created
    for e in kept.entries.values():
        # entries of this template set that predate the per-entry hash get theirs now
        out.put(e if "kernel" in e.extra else
                Entry(e.key, e.path, e.spec, e.us, e.default_us, {**e.extra, "kernel": source_hash(e.spec)}))
    return out


def stale_keys(fp: dict, profile_dir, warn) -> tuple[Path | None, list]:
    """The buckets of this fingerprint's profile that the runtime does not take as they are
    (what `moeforge tune --stale` re-tunes): those whose kernels have changed since they were
    timed, and those where something else runs in the entry's place on the fingerprint's
    card (Entry.runs): a short study's kept default that is no longer today's
    (dispatch.outdated), a study that did not time the f16 tiles the rules take there.
    Returns them and the profile they come from."""
    from ..runtime import dispatch
    from .fingerprint import card
    path = Path(profile_dir) / file_name(fp)
    src = _source(path, warn, set_aside=False)
    if src is None:
        return None, []
    kept, _ = src.with_current_kernels(fp["templates"])
    with dispatch.on_card(*card(fp)):
        replaced = {k for k, e in kept.entries.items() if e.runs().spec != e.spec}
    return Path(src.source), sorted(set(src.entries) - set(kept.entries) | replaced)


def save_results(fp: dict, results, profile_dir, default_name, warn) -> Path | None:
    """Merge tuning results (study.Result) into the profile; None when nothing was measured."""
    path = Path(profile_dir) / file_name(fp)
    prof = base_profile(fp, path, warn)
    n = 0
    for r in results:
        if r.choice is None or not r.default_us:
            continue   # nothing measured, or the default was not: no entry is better than a guess
        extra = {"default_spec": default_name(r.key), "trials": r.trials}
        extra.update({k: round(float(v), 3) for k, v in r.attrs.items()})
        extra["kernel"] = source_hash(r.choice.spec)
        if r.paths:
            extra["paths"] = list(r.paths)
        if r.wgmma:
            extra["wgmma"] = True
        prof.put(Entry(r.key, r.choice.path, r.choice.spec, r.best_us, r.default_us, extra))
        n += 1
    if not n:
        return None
    prof.created = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    save(prof, path)
    activate.reset()
    return path
