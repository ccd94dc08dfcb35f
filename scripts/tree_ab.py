#!/usr/bin/env python3
"""Two source trees, one list of products: the f16 tile the rules take for each (wgmma where
the card has it), timed by the tuner's own check and timing (tuning.objective: random and
skewed routing, weights rotated past the L2, CUDA graphs, events, median), with a hash of its
output on seeded inputs: an edit that must not change a bit is shown not to, and its speed
compared on one card in one call.

    python3 scripts/tree_ab.py prepare OLD_REV /tmp/old    # prints the PYTHONPATH of its package
    (cd /tmp && PYTHONPATH=/tmp/old/pkg python3 $TREE/scripts/tree_ab.py run old) >> ab.jsonl
    python3 scripts/tree_ab.py run new >> ab.jsonl    # alternate old and new, twice or more
    python3 scripts/tree_ab.py table ab.jsonl

`prepare REV DIR`: the tree at REV (git archive) in DIR/tree and its package importable from
DIR/pkg, laid out by the tree's own pyproject package-dir (links, no install: the GPU
machine has no index, and its pip cannot build a wheel there). REV may be a folder holding
a tree already (the device's copy of the checkout has no git history: archive the old
revision here into a carried folder, then prepare from that folder there).

`run TAG [--models ...] [--types ...] [--n ...] [--dense] [--set NAME=VALUE]` uses
whichever moeforge is imported (this script from the new tree drives the old package too: it calls only
dispatch.mmf_rule_spec and tuning.objective). Products: scripts/product_ab.py's EXPERTS
(and DENSE with --dense). `table` compares the fastest run of each tag, the first tag seen
being the baseline; `same` says whether every run's output hash agreed. `--set` changes a
constant of runtime.dispatch for the run: a rule's A/B inside one tree (two tags, one with
the setting).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from collections import defaultdict
from pathlib import Path


def prepare(rev: str, where: str, repo: str = ".") -> Path:
    import io
    import subprocess
    import tarfile
    import tomllib
    root = Path(where)
    tree, pkg = root / "tree", root / "pkg"
    if (Path(rev) / "pyproject.toml").is_file():
        tree = Path(rev)
    else:
        tree.mkdir(parents=True, exist_ok=True)
        data = subprocess.run(["git", "-C", repo, "archive", rev], check=True, capture_output=True).stdout
        with tarfile.open(fileobj=io.BytesIO(data)) as tar:
            tar.extractall(tree, filter="data")
    dirs = tomllib.loads((tree / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    # the top package first, then its subpackages inside it (that is, inside the tree's top
    # package folder), each a relative link to its folder: carried elsewhere, they still hold
    for name, src in sorted(dirs.items(), key=lambda kv: kv[0].count(".")):
        dest = pkg.joinpath(*name.split("."))
        dest.parent.mkdir(parents=True, exist_ok=True)
        target = os.path.relpath((tree / src).resolve(), dest.parent.resolve())
        if dest.is_symlink() and os.readlink(dest) != target:
            dest.unlink()               # a link to another tree (DIR reused), or to where this one was
        if dest.exists():
            continue
        dest.symlink_to(target, target_is_directory=True)
    return pkg


def products(models, types, dense):
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from product_ab import DENSE, EXPERTS

    from moeforge.codegen.quant import quant_type
    out = [(f"{mo} {p}", (E, top_k, m, k)) for (mo, p), (E, top_k, m, k) in EXPERTS.items()]
    if dense:
        out += [(f"{mo} {p}", (1, 1, m, k)) for (mo, p), (m, k) in DENSE.items()]
    return [(name, q, shape) for name, shape in out for q in types
            if (not models or name.split()[0] in models) and shape[3] % quant_type(q).block_values == 0]


def apply_settings(settings) -> dict:
    """NAME=VALUE settings of runtime.dispatch constants (a rule's A/B inside one tree, as
    scripts/dispatch_ab.py does for a model): set, and returned as they were before."""
    import ast

    from moeforge.runtime import dispatch
    before = {}
    for setting in settings:
        name, sep, value = setting.partition("=")
        if not sep or not hasattr(dispatch, name) or not name.isupper():
            raise SystemExit(f"--set {setting}: NAME=VALUE, NAME a constant of moeforge.runtime.dispatch")
        before[name] = getattr(dispatch, name)
        setattr(dispatch, name, ast.literal_eval(value))
    return before


def run(tag: str, models, types, ns, dense, settings=()) -> None:
    import numpy as np

    from moeforge.runtime import dispatch
    from moeforge.runtime.dispatch import Choice
    from moeforge.tuning.objective import Case, Settings, check, measure, preflight
    from moeforge.tuning.space import TuneKey
    apply_settings(settings)
    sm = dispatch.device_sm_count()
    wgmma = dispatch.wgmma_available()
    for name, q, (E, top_k, m, k) in products(models, types, dense):
        ids = E > 1
        for n in ns:
            key = TuneKey("mul_mat_id" if ids else "mul_mat", q, (E, top_k, m, k), n)
            case = Case(key, Settings(), np.random.default_rng(1000 + n))   # the same inputs in both trees
            spec = dispatch.mmf_rule_spec(q, n, ids, m, sm, n * top_k / E if ids else None, wgmma,
                                          (E, top_k) if ids else None)
            choice = Choice("mmf_id" if ids else "mmf", spec)
            preflight(choice)
            err = check(case, choice)
            case.out.fill(float("nan"))
            case.launch(choice, "random", 0)
            digest = hashlib.sha256(case.out.get().tobytes()).hexdigest()[:16]
            r = measure(case, choice)
            print(json.dumps(dict(tag=tag, product=name, qtype=q, n=n, spec=spec.name, us=round(r["value"], 2),
                                  hash=digest, nmse=err["nmse_emulated"])), flush=True)


def table(rows: list[dict]) -> str:
    tags = list(dict.fromkeys(r["tag"] for r in rows))
    if len(tags) != 2:
        raise ValueError(f"a table compares two tags, the runs hold {len(tags)}: {', '.join(tags)}")
    runs = defaultdict(list)
    for r in rows:
        runs[(r["product"], r["qtype"], r["n"])].append(r)
    a, b = tags
    lines = [f"{'product':<28} {'type':<6} {'n':>5} {'tile':<34} {a + ' us':>16} {b + ' us':>16} "
             f"{b + '/' + a:>9}  same"]
    for (prod, q, n), rs in runs.items():
        side = {t: [r for r in rs if r["tag"] == t] for t in tags}
        if not side[a] or not side[b]:
            lines.append(f"{prod:<28} {q:<6} {n:>5} (only {', '.join(t for t in tags if side[t])} ran)")
            continue
        best = {t: min(r["us"] for r in side[t]) for t in tags}
        same = len({r["hash"] for r in rs}) == 1
        # a tree whose rule picks another tile: both, the baseline's first
        tile = " -> ".join(dict.fromkeys(side[t][-1]["spec"] for t in tags))
        lines.append(f"{prod:<28} {q:<6} {n:>5} {tile:<34} "
                     f"{'/'.join(str(r['us']) for r in side[a]):>16} {'/'.join(str(r['us']) for r in side[b]):>16} "
                     f"{best[b] / best[a]:>9.3f}  {'yes' if same else 'NO'}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="mode", required=True)
    r = sub.add_parser("run")
    r.add_argument("tag")
    r.add_argument("--models", default="qwen3-30b-a3b,gpt-oss-20b,deepseek-v2-lite")
    r.add_argument("--types", default="q4_0")
    r.add_argument("--n", default="1024,2048,4096")
    r.add_argument("--dense", action="store_true")
    r.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                   help="a runtime.dispatch constant for this run (repeatable): one tree, two settings")
    t = sub.add_parser("table")
    t.add_argument("jsonl")
    p = sub.add_parser("prepare")
    p.add_argument("rev")
    p.add_argument("dir")
    a = ap.parse_args()
    if a.mode == "prepare":
        print(prepare(a.rev, a.dir))
    elif a.mode == "run":
        run(a.tag, a.models.split(","), a.types.split(","), [int(v) for v in a.n.split(",")], a.dense, a.set)
    else:
        print(table([json.loads(line) for line in open(a.jsonl) if line.strip()]))


if __name__ == "__main__":
    main()
