"""`moeforge profile list | show | path | export | import`: the per-GPU profiles on disk.

Exit codes: 0 done, 1 an invalid profile or a refused import, 2 a usage error (or no CUDA
device where the command needs one to know which profile is meant).
"""
from __future__ import annotations

import sys
from pathlib import Path


def _err(msg: str) -> None:
    print(msg, file=sys.stderr)


def _current_fp():
    from .runtime.device import has_gpu
    from .tuning import fingerprint as fpmod
    return fpmod.current() if has_gpu() else None


def _find(name: str | None, profile_dir) -> Path | None:
    """A profile named on the command line (a path, a file in the profile directory or a
    shipped one), or this GPU's when none is named; None without a GPU to ask."""
    from .tuning import paths
    from .tuning.profile import file_name
    if name is None:
        fp = _current_fp()
        if fp is None:
            return None
        from .tuning.activate import candidate_files, resolve
        prof = resolve(fp, candidate_files(paths.profile_dir(profile_dir)), warn=_err)
        return Path(prof.source) if prof else paths.profile_dir(profile_dir) / file_name(fp)
    p = Path(name)
    if p.exists():
        return p
    for cand in [paths.profile_dir(profile_dir) / name, paths.profile_dir(profile_dir) / f"{name}.yaml",
                 *[s for s in paths.shipped_profiles() if s.name in (name, f"{name}.yaml")]]:
        if cand.exists():
            return cand
    return p


def _open(name: str | None, args, action: str, hint: str):
    """(path, profile) of the profile `name` (default: this GPU's), or the exit code after
    saying why there is none: 2 without a GPU to name it, 1 when it is invalid."""
    from .tuning.profile import ProfileError, load
    target = _find(name, args.profile_dir)
    if target is None:
        _err(f"moeforge profile {action}: no CUDA device found; {hint}")
        return 2
    try:
        return target, load(target)
    except ProfileError as e:
        _err(f"moeforge profile {action}: {e}")
        return 1


def _path(args, pdir: Path) -> int:
    from .tuning.profile import file_name
    fp = _current_fp()
    if fp is None:
        print(pdir)
        _err("moeforge profile path: no CUDA device found; printed the profile directory")
        return 0
    print(pdir / file_name(fp))
    return 0


def _list(args, pdir: Path) -> int:
    from .codegen.render import templates_hash
    from .runtime import dispatch
    from .tuning.activate import assess, candidate_files
    from .tuning.fingerprint import card
    from .tuning.profile import ProfileError, load
    here = _current_fp()
    files = candidate_files(pdir)
    if not files:
        print(f"no profiles in {pdir} and none shipped")
        return 0
    for f in files:
        try:
            p = load(f)
        except ProfileError as e:
            print(f"{f}\n    CORRUPT: {'; '.join(e.problems[:3])}")
            continue
        fp = p.fingerprint
        usable, stale = p.with_current_kernels(here["templates"] if here else templates_hash())
        status = ""
        if here is not None:
            status = {"match": "  [this GPU]", "soft": "  [this GPU, other software: used with a warning]",
                      "refuse": ""}[assess(p, here)[0]]
        notes = [f"{stale} timed on kernels that have changed since: not used"] if stale else []
        with dispatch.on_card(*card(fp)):
            replaced = sum(e.runs().spec != e.spec for e in usable.entries.values())
        if replaced:
            notes.append(f"{replaced} where another tile runs in its place: `moeforge profile show`")
        note = f" ({'; '.join(notes)})" if notes else ""
        print(f"{f}{status}\n    {fp['gpu']} (cc {fp['cc']}, {fp['sm_count']} SMs, {fp['memory_gib']} GiB), "
              f"driver {fp['driver']}, CUDA {fp['cuda_runtime']}, NVRTC {fp['nvrtc']}, moeforge {fp['moeforge']}, "
              f"templates {fp['templates']}: {len(p.entries)} entries{note}")
    return 0


def _show(args, pdir: Path) -> int:
    from .codegen.render import templates_hash
    found = _open(args.target, args, "show", "name a profile file (see `moeforge profile list`)")
    if isinstance(found, int):
        return found
    target, p = found
    print(f"{target}\nfingerprint:")
    for k, v in p.fingerprint.items():
        print(f"  {k}: {v}")
    print(f"\n{'op':<10} {'type':<5} {'E,top_k,m,k':<18} {'n':>5} {'path':<10} {'us':>9} {'default':>9} "
          f"{'speedup':>7}  spec")
    from .runtime import dispatch
    from .tuning.fingerprint import card
    from .tuning.space import default_choice
    usable, stale = p.with_current_kernels(templates_hash())
    old = ruled = 0
    # what each entry runs on the card the profile names, not on this machine
    cc, sm_count = card(p.fingerprint)
    with dispatch.on_card(cc, sm_count):
        for key in sorted(p.entries):
            e = p.entries[key]
            mark = "" if key in usable.entries else "  (kernel changed since: not used)"
            runs = e.runs() if not mark else None
            if runs is None or runs.spec == e.spec:
                pass
            elif dispatch.outdated(e.choice(), default_choice(key)):
                t, old = e.extra["trials"], old + 1
                mark = f"  (kept an older default after {t} trial{'s' if t != 1 else ''}: today's default runs)"
            else:
                ruled += 1
                timed = "the wgmma tiles" if cc == 9 and {"mmf", "mmf_id"} & set(e.choice().paths) else "the f16 tiles"
                mark = f"  (its study did not time {timed}: the rule's {runs.spec.name} runs)"
            print(f"{key.op:<10} {key.qtype:<5} {','.join(map(str, key.shape)):<18} {key.n:>5} {e.path:<10} "
                  f"{e.us:>9.2f} {e.default_us:>9.2f} {e.speedup:>6.2f}x  {e.spec.name}{mark}")
    if stale:
        print(f"\n{stale} of {len(p.entries)} entries were timed on kernels whose source has changed; "
              f"this moeforge runs the defaults there until they are tuned again (`moeforge tune --stale`)")
    if old:
        print(f"\n{old} of {len(p.entries)} entries kept a default that has changed since, after a short study; "
              f"today's default runs there until `moeforge tune --stale` re-tunes them")
    if ruled:
        print(f"\n{ruled} of {len(p.entries)} entries were tuned before the f16 tiles their card runs now were "
              f"timed: the rule's tile runs there until `moeforge tune --stale` re-tunes them")
    return 0


def _export(args, pdir: Path) -> int:
    from .tuning.profile import save
    found = _open(args.source, args, "export", "name the profile with --from")
    if isinstance(found, int):
        return found
    src, p = found
    save(p, args.file)
    print(f"exported {src} -> {args.file}")
    return 0


def _import(args, pdir: Path) -> int:
    from .tuning import activate
    from .tuning import fingerprint as fpmod
    from .tuning.profile import ProfileError, file_name, load, save
    try:
        p = load(args.file)   # validated exactly as any profile the runtime reads
    except ProfileError as e:
        _err(f"moeforge profile import: refused: {e}")
        return 1
    dest = pdir / file_name(p.fingerprint)
    if dest.exists() and not args.force:
        _err(f"moeforge profile import: {dest} exists; pass --force to replace it")
        return 1
    save(p, dest)
    activate.reset()
    print(f"imported {args.file} -> {dest} ({len(p.entries)} entries)")
    here = _current_fp()
    if here is not None:
        v, diffs = fpmod.verdict(p.fingerprint, here)
        if v != "match":
            _err(f"note: this profile is for another setup ({fpmod.describe(diffs)}); "
                 f"{'it will be used with a warning' if v == 'soft' else 'it will not be used on this GPU'}")
    return 0


ACTIONS = {"list": (_list, "every profile and whether it fits this GPU"),
           "show": (_show, "the entries of a profile (default: this GPU's)"),
           "path": (_path, "where this GPU's profile is (or would be) written"),
           "export": (_export, "copy a profile (default: this GPU's) to FILE"),
           "import": (_import, "validate FILE and install it as its GPU's profile")}


def cmd_profile(args) -> int:
    from .tuning import paths
    return ACTIONS[args.action][0](args, paths.profile_dir(args.profile_dir))


def add_commands(sub) -> None:
    p = sub.add_parser("profile", help="list, show, locate, export or import per-GPU profiles")
    ps = p.add_subparsers(dest="action", required=True)
    for name, (_, helptext) in ACTIONS.items():
        a = ps.add_parser(name, help=helptext)
        a.add_argument("--profile-dir", default=None)
        if name == "show":
            a.add_argument("target", nargs="?", default=None, help="a profile file or name")
        if name == "export":
            a.add_argument("file")
            a.add_argument("--from", dest="source", default=None, help="a profile file or name")
        if name == "import":
            a.add_argument("file")
            a.add_argument("--force", action="store_true", help="replace an existing profile")
        a.set_defaults(func=cmd_profile)
