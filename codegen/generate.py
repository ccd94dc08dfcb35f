"""`moeforge generate`: render and compile every instance for every architecture, in
parallel, with a progress bar and a closing table."""
from __future__ import annotations

import os
import sys
import time
from collections import defaultdict
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

from .compile import ARCHS, CompileError, compile_spec, default_build_dir
from .enumerate import all_specs
from .quant import QuantType


def _one(job):
    spec, arch, build_dir = job
    t = time.perf_counter()
    try:
        ck = compile_spec(spec, arch, build_dir)
        return spec, arch, ck.cached, ck.info, None, time.perf_counter() - t
    except CompileError as e:
        return spec, arch, False, {}, str(e), time.perf_counter() - t


def generate(types: list[QuantType], archs=ARCHS, build_dir: Path | None = None,
             jobs: int | None = None, progress: bool = True, out=sys.stdout,
             subset: dict | None = None, families: tuple[str, ...] | None = None) -> dict:
    """subset {arch: specs}: build only those for that architecture (the tests' plan for
    architectures that compile another's code path); the others get every instance.
    families: only the instances of those kernel families (mmq, mmvq, mmf, model, util)."""
    from tqdm import tqdm
    build_dir = Path(build_dir) if build_dir else default_build_dir()
    specs = [s for s in all_specs(types) if families is None or s.family in families]
    subset = subset or {}
    work = [(s, a, build_dir) for a in archs for s in subset.get(a, specs) if s.supports(a)]
    jobs = jobs or os.cpu_count() or 1
    t0 = time.perf_counter()
    results = []
    bar = tqdm(total=len(work), desc="compiling", unit="kernel", disable=not progress, file=sys.stderr)
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        for fut in as_completed([pool.submit(_one, w) for w in work]):
            results.append(fut.result())
            bar.update(1)
    bar.close()
    summary = _summarize(results, time.perf_counter() - t0)
    _print_table(summary, build_dir, out)
    return summary


def _summarize(results, seconds: float) -> dict:
    rows: dict = defaultdict(lambda: {"instances": 0, "cached": 0, "failed": 0, "max_registers": 0,
                                      "with_spills": 0, "seconds": 0.0})
    failures = []
    for spec, arch, cached, info, err, dt in results:
        r = rows[(arch, spec.family, getattr(spec, "qtype", "-"))]
        r["instances"] += 1
        r["cached"] += cached
        r["seconds"] += dt
        if err:
            r["failed"] += 1
            failures.append((spec.name, arch, err))
            continue
        for k in info.values():
            r["max_registers"] = max(r["max_registers"], k["registers"])
        r["with_spills"] += any(k["spill_stores"] or k["spill_loads"] for k in info.values())
    return {"rows": dict(rows), "failures": failures, "seconds": seconds,
            "total": len(results), "cached": sum(r[2] for r in results)}


def _print_table(summary: dict, build_dir: Path, out) -> None:
    hdr = f"{'arch':<6} {'family':<6} {'type':<5} {'instances':>9} {'cached':>6} {'failed':>6} {'max regs':>8} {'spilling':>8}"
    print(hdr, file=out)
    print("-" * len(hdr), file=out)
    for (arch, fam, qt), r in sorted(summary["rows"].items()):
        print(f"{arch:<6} {fam:<6} {qt:<5} {r['instances']:>9} {r['cached']:>6} {r['failed']:>6} "
              f"{r['max_registers']:>8} {r['with_spills']:>8}", file=out)
    print(f"{summary['total']} instances ({summary['cached']} from cache) in {summary['seconds']:.1f} s "
          f"-> {build_dir}", file=out)
    for name, arch, err in summary["failures"][:5]:
        print(f"FAILED {name} {arch}: {err.splitlines()[0]}", file=out)
