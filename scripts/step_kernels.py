#!/usr/bin/env python3
"""The kernels of one decode step, as Nsight Compute times them one at a time.

  ncu --profile-from-start off --clock-control none --csv --page raw --print-units base \\
      --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum \\
      python3 scripts/step_kernels.py run MODEL.gguf [DEPTH] > step.csv
  python3 scripts/step_kernels.py table step.csv

`run` fills the cache with DEPTH tokens (128 by default), decodes a few steps (the step is
then a captured graph) and decodes one more between cudaProfilerStart and Stop. `table`
sums the export by kernel: calls, time, DRAM bytes and their rate. ncu replays each
kernel alone with cold caches, so its times are each kernel's own, not the step's (a
kernel that does nothing reads ~3 us there; in the PDL chain it costs next to nothing).
What the table is for: the kernels that move many bytes slowly, and any kernel that is not
moeforge's (CuPy's elementwise kernels and fills launch without PDL: each ends the decode
step's chain, and the kernel after it cannot launch until it is done; they are flagged).
"""
from __future__ import annotations

import csv
import re
import sys
from collections import defaultdict

OUTSIDE_THE_CHAIN = re.compile(r"^cupy_|^cub::|^thrust::")


def run(path: str, depth: int = 128) -> None:
    import cupy as cp
    import numpy as np
    from moeforge.runtime.model import load_model
    m = load_model(path, n_ctx=depth + 64, cache_type="f16")
    rng = np.random.default_rng(0)
    m.reset()
    m.eval(rng.integers(0, m.hp.n_vocab, size=depth), want_logits=False)
    for _ in range(4):
        m.eval([int(rng.integers(0, m.hp.n_vocab))], want_logits=False)
    m.backend.synchronize()
    cp.cuda.profiler.start()
    m.eval([int(rng.integers(0, m.hp.n_vocab))], want_logits=False)
    m.backend.synchronize()
    cp.cuda.profiler.stop()


def _num(s: str) -> float:
    s = s.replace(",", "")
    return float(s) if s not in ("", "n/a") else 0.0


def table(lines) -> list[dict]:
    """Rows of an ncu `--csv --page raw --print-units base` export (other lines, such as
    ncu's own and the program's output, are skipped), summed by kernel name, slowest first."""
    rows = list(csv.reader(lines))
    head = next((i for i, r in enumerate(rows) if "Kernel Name" in r), None)
    if head is None:
        raise ValueError("no ncu CSV header (a 'Kernel Name' column) in the input")
    cols = rows[head]
    name_i, time_i = cols.index("Kernel Name"), cols.index("gpu__time_duration.sum")
    byte_i = [cols.index(c) for c in ("dram__bytes_read.sum", "dram__bytes_write.sum") if c in cols]
    acc = defaultdict(lambda: [0, 0.0, 0.0])
    for r in rows[head + 1:]:
        if len(r) != len(cols) or not r[0].isdigit():    # the units row, stray lines
            continue
        a = acc[re.sub(r"\(.*", "", r[name_i])]
        a[0] += 1
        a[1] += _num(r[time_i]) / 1e3
        a[2] += sum(_num(r[i]) for i in byte_i)
    out = [{"kernel": k, "calls": c, "us": us, "mb": b / 1e6, "gb_s": b / (us * 1e3) if us else 0.0,
            "outside_chain": bool(OUTSIDE_THE_CHAIN.match(k))} for k, (c, us, b) in acc.items()]
    return sorted(out, key=lambda d: -d["us"])


def format_table(rows: list[dict]) -> str:
    lines = [f"{'kernel':58s} {'calls':>5s} {'us':>9s} {'us/call':>8s} {'MB':>8s} {'GB/s':>6s}"]
    for d in rows:
        flag = "  <- outside the PDL chain" if d["outside_chain"] else ""
        lines.append(f"{d['kernel'][:58]:58s} {d['calls']:5d} {d['us']:9.1f} {d['us'] / d['calls']:8.2f} "
                     f"{d['mb']:8.1f} {d['gb_s']:6.0f}{flag}")
    lines.append(f"{'total':58s} {sum(d['calls'] for d in rows):5d} {sum(d['us'] for d in rows):9.1f}")
    return "\n".join(lines)


def main(argv) -> int:
    if len(argv) >= 2 and argv[0] == "run":
        run(argv[1], int(argv[2]) if len(argv) > 2 else 128)
        return 0
    if len(argv) == 2 and argv[0] == "table":
        with open(argv[1], newline="") as fh:
            print(format_table(table(fh)))
        return 0
    print(__doc__.strip(), file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
