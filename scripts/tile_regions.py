#!/usr/bin/env python3
"""Where a tile kernel's warps wait: ncu's per-instruction stall samples of one launch,
split into the prologue, the main loop and the epilogue.

  ncu --kernel-name regex:^mmf_id --launch-skip 1 --launch-count 1 --section WarpStateStats \\
      --section SourceCounters --import-source no -o /tmp/t \\
      python3 scripts/tile_regions.py run mxfp4 32 4 2880 2880 2048 down
  ncu -i /tmp/t.ncu-rep --page source --csv --print-source sass > /tmp/t.csv
  python3 scripts/tile_regions.py table /tmp/t.csv

`run QTYPE E TOP_K M K N [gate_up|down]` launches one expert product on the tile the rules
choose for it (random routing; x a row a token, or a row an entry for a down product),
twice: the first compiles and warms, the second is the one to profile.
`table` reads the SASS export: the main loop runs from the target of the first backward
branch after the last MMA instruction (HGMMA, HMMA) to that branch; what comes before is the
prologue, what comes after the epilogue. Each region: its instructions, its share of the
stall samples and its top stall reasons. An epilogue that runs once a tile yet holds a
large share is what the glu tiles' unrolled epilogue was (DESIGN-NOTES "Glu tiles").
"""
from __future__ import annotations

import csv
import re
import sys


def run(qtype: str, E: int, top_k: int, m: int, k: int, n: int, product: str = "gate_up") -> None:
    import cupy as cp
    import numpy as np

    from moeforge import reference as ref
    from moeforge.runtime import dispatch
    from moeforge.runtime.mmf import run_mmf
    from moeforge.runtime.tensor import QuantTensor
    rng = np.random.default_rng()
    choice = dispatch.choose_mul_mat_id(qtype, E, top_k, m, k, n)
    if choice.path != "mmf_id":
        raise SystemExit(f"the rules take {choice.path} for this product, not an f16 tile")
    print(choice.spec.name, file=sys.stderr)
    w = QuantTensor.from_blocks(ref.random_blocks(qtype, E * m, k, rng), qtype, (E, m, k))
    x_div = 1 if product == "down" else top_k
    x = cp.asarray(rng.standard_normal((n * top_k // x_div, k)).astype(np.float32))
    ids = cp.asarray(np.stack([rng.choice(E, top_k, replace=False) for _ in range(n)]).astype(np.int32))
    out = cp.empty((n, top_k, m), dtype=cp.float32)
    for _ in range(2):
        run_mmf(choice.spec, w, x, ids, x_div, out)
    cp.cuda.Device().synchronize()


def _num(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


HOT = 6     # instructions listed a region


def regions(lines) -> list[dict]:
    """The SASS export's rows as prologue, main loop and epilogue: instructions, share of
    the stall samples, executions, the top stall reasons (shares of the region's) and the
    HOT instructions with the most samples (address, SASS, share of all samples, their top
    reason)."""
    rows = [r for r in csv.reader(lines) if r]
    head = next((i for i, r in enumerate(rows) if "Address" in r and "Source" in r), None)
    if head is None:
        raise ValueError("no SASS rows: export with --page source --csv --print-source sass")
    cols = {h: i for i, h in enumerate(rows[head])}
    data = [r for r in rows[head + 1:] if len(r) == len(cols)]
    addr = [int(r[cols["Address"]], 16) for r in data]
    src = [r[cols["Source"]] for r in data]
    mma = [i for i, s in enumerate(src) if re.search(r"\bH(G)?MMA\b", s)]
    if not mma:
        raise ValueError("no MMA instruction: not a tile kernel")
    back = next(((i, int(m.group(1), 16)) for i in range(mma[-1], len(src))
                 if (m := re.search(r"\bBRA\s+(0x[0-9a-f]+)", src[i])) and int(m.group(1), 16) < addr[i]), None)
    if back is None or back[1] not in addr:
        raise ValueError("no backward branch after the last MMA: no main loop found")
    start, end = addr.index(back[1]), back[0] + 1
    samples = [_num(r[cols["Warp Stall Sampling (All Samples)"]]) for r in data]
    total = sum(samples) or 1.0
    stalls = [h for h in cols if h.startswith("stall_") and "Not Issued" not in h]
    out = []
    for name, a, b in (("prologue", 0, start), ("main loop", start, end), ("epilogue", end, len(data))):
        got = sum(samples[a:b])
        why = {s[6:]: sum(_num(r[cols[s]]) for r in data[a:b]) for s in stalls}
        top = sorted(why.items(), key=lambda kv: -kv[1])[:4]
        # the instructions that hold most of the region's samples: which wait it is (the
        # MMAs', a barrier's, a copy's, a shared-memory load's) and why
        hot = []
        for i in sorted(range(a, b), key=lambda i: -samples[i])[:HOT]:
            if samples[i] <= 0:
                break
            reason = max(stalls, key=lambda s: _num(data[i][cols[s]]), default=None)
            hot.append((f"{addr[i]:#x}", src[i], samples[i] / total, reason[6:] if reason else ""))
        out.append(dict(region=name, instructions=b - a, share=got / total,
                        executed=sum(_num(r[cols["Instructions Executed"]]) for r in data[a:b]),
                        stalls=[(s, v / got if got else 0.0) for s, v in top], hot=hot))
    return out


def format_table(rows: list[dict]) -> str:
    lines = [f"{'region':<10} {'SASS':>6} {'samples':>8} {'executed':>10}  top stalls"]
    for r in rows:
        why = ", ".join(f"{s} {100 * v:.0f}%" for s, v in r["stalls"] if v > 0)
        lines.append(f"{r['region']:<10} {r['instructions']:>6} {100 * r['share']:>7.1f}% "
                     f"{r['executed']:>10.3g}  {why}")
        for address, sass, share, reason in r.get("hot", []):
            lines.append(f"  {address:>8} {100 * share:>5.1f}% {reason:<14} {sass[:72]}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if len(argv) in (7, 8) and argv[0] == "run" and argv[7:] in ([], ["gate_up"], ["down"]):
        run(argv[1], *map(int, argv[2:7]), *argv[7:])
        return 0
    if len(argv) >= 2 and argv[0] == "table":
        for path in argv[1:]:
            with open(path, newline="") as f:
                print(f"{path}\n{format_table(regions(f))}")
        return 0
    print(__doc__.strip(), file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
