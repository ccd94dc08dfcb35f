"""Which profile dispatch uses: found lazily, on the first product that runs on a GPU, for
the fingerprint of the current device.

Search order: the user's profile directory (what `moeforge tune` wrote or `profile import`
brought), then the profiles shipped in the package. An exact fingerprint match wins; a
profile of the same chip made under another driver/toolkit is used with one warning; one
made under other kernel templates is used for the entries whose kernel source is unchanged,
with one warning saying how many were left out; any other difference is refused with a
warning naming every differing field; a corrupt file is reported and skipped. Nothing here
may break a product: on any surprise, defaults.
"""
from __future__ import annotations

import warnings
from pathlib import Path

from . import fingerprint as fpmod
from .paths import profile_dir, shipped_profiles
from .profile import Profile, ProfileError, load


class ProfileWarning(UserWarning):
    pass


_active: dict[int, Profile | None] = {}
_said: set[str] = set()


def _warn(msg: str) -> None:
    if msg not in _said:       # one warning per distinct message, however many products run
        _said.add(msg)
        warnings.warn(msg, ProfileWarning, stacklevel=3)


def candidate_files(user_dir: Path | None = None) -> list[Path]:
    d = Path(user_dir) if user_dir else profile_dir()
    mine = sorted(d.glob("*.yaml")) if d.is_dir() else []
    return mine + shipped_profiles()


def assess(prof: Profile, here: dict):
    """How the runtime treats `prof` on fingerprint `here`: (verdict, usable profile, entries
    left out, differing fields). Under other templates the entries are judged one by one:
    none left is a refusal; all kept, with nothing else different, is as good as a match."""
    v, diffs = fpmod.verdict(prof.fingerprint, here)
    if v == "refuse":
        return v, None, 0, diffs
    usable, dropped = prof.with_current_kernels(here.get("templates"))
    if not usable.entries:
        return "refuse", None, dropped, diffs
    if v == "soft" and all(k in fpmod.PER_ENTRY for k, _, _ in diffs) and not dropped:
        v = "match"
    return v, usable, dropped, diffs


def resolve(here: dict, files: list[Path] | None = None, warn=_warn) -> Profile | None:
    """The profile to use for fingerprint `here`, or None for the defaults."""
    files = candidate_files() if files is None else files
    soft, refused = [], []
    for path in files:
        try:
            prof = load(path)
        except ProfileError as e:
            warn(f"moeforge: profile {path} is corrupt and is not used: {'; '.join(e.problems[:5])}")
            continue
        v, usable, dropped, diffs = assess(prof, here)
        if v == "match":
            return usable
        if v == "soft":
            soft.append((prof, usable, dropped, diffs))
        else:
            why = f" (the kernels of all its {dropped} entries have changed since)" if dropped else ""
            refused.append((prof, diffs, why))
    if soft:
        prof, usable, dropped, diffs = soft[0]
        per_entry = [k for k, _, _ in diffs if k in fpmod.PER_ENTRY]
        under = ("other kernel templates" if len(per_entry) == len(diffs) else
                 "other software and kernel templates" if per_entry else "other software")
        if dropped:
            warn(f"moeforge: using {len(usable.entries)} of the {len(prof.entries)} entries of profile "
                 f"{prof.source}, tuned on this GPU under {under} ({fpmod.describe(diffs)}); the {dropped} "
                 f"whose kernels have changed since run the default kernels until `moeforge tune --stale` "
                 f"re-measures them")
        else:
            warn(f"moeforge: using profile {prof.source}, tuned on the same GPU under {under} "
                 f"({fpmod.describe(diffs)}{'; no kernel of its entries has changed' if per_entry else ''}); "
                 f"re-run `moeforge tune` to refresh it")
        return usable
    if refused:
        # Name the nearest refused profile (fewest differing fields): that is the one the
        # user most likely expected to apply.
        prof, diffs, why = min(refused, key=lambda pd: len(pd[1]))
        warn(f"moeforge: no profile matches this GPU ({here.get('gpu')}); profile {prof.source} is not "
             f"used because {fpmod.describe(diffs)}{why}; running the default kernels")
    else:
        warn(f"moeforge: no tuned profile for {here.get('gpu')}; running the default kernels "
             f"(`moeforge tune` makes one)")
    return None


def active(device: int | None = None) -> Profile | None:
    from ..runtime.device import cupy_or_none, has_gpu
    if not has_gpu():
        return None
    dev = cupy_or_none().cuda.Device().id if device is None else device
    if dev not in _active:
        try:
            _active[dev] = resolve(fpmod.current(dev))
        except Exception as e:  # never let a profile problem stop a product
            _warn(f"moeforge: could not load a profile ({type(e).__name__}: {e}); running the default kernels")
            _active[dev] = None
    return _active[dev]


def lookup(op: str, qtype: str, shape, n: int):
    prof = active()
    return prof.choose(op, qtype, shape, n) if prof is not None else None


def reset() -> None:
    """Forget the resolved profiles (after `tune` or `profile import` wrote one)."""
    _active.clear()


def install() -> None:
    from ..runtime import profiles_hook
    profiles_hook.install(lookup)
