"""What `moeforge tune` shows at the end: one row per token bucket (default time, tuned
time, speedup, chosen spec) and, with --plot, tuned vs default (and llama.cpp's anchor
where one exists) against n."""
from __future__ import annotations

import sys
from collections import defaultdict


def _us(v) -> str:
    return f"{v:.2f}" if v else "-"


def table(results, out=None) -> None:
    out = out or sys.stdout
    groups = defaultdict(list)
    for r in results:
        groups[(r.key.op, r.key.qtype, r.key.shape)].append(r)
    for (op, qtype, shape), rows in sorted(groups.items()):
        print(f"\n{op} {qtype} E,top_k,m,k={','.join(map(str, shape))}", file=out)
        hdr = (f"{'n':>5} {'path':<10} {'default us':>10} {'tuned us':>10} {'speedup':>7} {'trials':>6} "
               f"{'failed':>6}  chosen spec")
        print(hdr, file=out)
        print("-" * (len(hdr) + 24), file=out)
        for r in sorted(rows, key=lambda r: r.key.n):
            sp = f"{r.speedup:.2f}x" if r.speedup else "-"
            path = r.choice.path if r.choice else "-"
            spec = r.choice.spec.name if r.choice else ("(no trial finished)" if not r.failed else "(every trial failed)")
            print(f"{r.key.n:>5} {path:<10} {_us(r.default_us):>10} {_us(r.best_us):>10} {sp:>7} {r.trials:>6} "
                  f"{r.failed:>6}  {spec}", file=out)
    fails = [(r.key.label, s, why) for r in results for s, why in r.failures]
    if fails:
        print(f"\n{len(fails)} failed trials (a failed trial is never chosen); the first few:", file=out)
        for label, spec, why in fails[:8]:
            print(f"  {label} {spec}: {why.splitlines()[0] if why else '?'}", file=out)


class PlotUnavailable(RuntimeError):
    pass


def plot(results, path: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PlotUnavailable("--plot needs matplotlib, which is not installed "
                              "(python3 -m pip install matplotlib); the table above has the same numbers") from None
    from ..bench import anchor_us
    groups = defaultdict(list)
    for r in results:
        groups[(r.key.op, r.key.qtype, r.key.shape)].append(r)
    keys = sorted(groups)
    fig, axes = plt.subplots(len(keys), 1, figsize=(8, 3.2 * len(keys)), squeeze=False)
    for ax, gk in zip(axes[:, 0], keys):
        rows = sorted(groups[gk], key=lambda r: r.key.n)
        op, qtype, shape = gk
        ns = [r.key.n for r in rows]
        for label, vals, style in (("default", [r.default_us for r in rows], "o--"),
                                   ("tuned", [r.best_us for r in rows], "o-")):
            pts = [(n, v) for n, v in zip(ns, vals) if v]
            if pts:
                ax.plot(*zip(*pts), style, label=label)
        anchor = [(n, anchor_us(qtype, shape, n)) for n in ns] if op == "mul_mat_id" else []
        anchor = [(n, a) for n, a in anchor if a]
        if anchor:
            ax.plot(*zip(*anchor), "s:", label="llama.cpp (H100 anchor)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tokens n")
        ax.set_ylabel("us per call")
        ax.set_title(f"{op} {qtype} {','.join(map(str, shape))}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
