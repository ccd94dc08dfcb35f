"""A llama-bench test (tg128 by default) of a model with a runtime.dispatch constant as it
is and as given, alternating in one process, the graphs captured again at each switch: the
A/B that decides a rule.

    python3 scripts/dispatch_ab.py MODEL.gguf FUSED_KSPLIT_MIN_UNITS=1073741824 [--rounds 2]
    python3 scripts/dispatch_ab.py MODEL.gguf MMF_MIN_DENSE_TOKENS=512 --test pp128,pp256
"""
import argparse
import ast

from moeforge.bench_model import bench
from moeforge.runtime import dispatch
from moeforge.runtime.model import load_model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("setting", help="NAME=VALUE, a constant of moeforge.runtime.dispatch")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--test", default="tg128", help="llama-bench tests, e.g. pp256,tg128")
    ap.add_argument("--no-profile", action="store_true", help="the rules alone: no profile entry is used")
    a = ap.parse_args()
    tests = [(t[:2], int(t[2:])) for t in a.test.split(",")]
    if any(kind not in ("pp", "tg") for kind, _ in tests):
        raise SystemExit(f"--test {a.test}: ppN or tgN, comma separated")
    name, value = a.setting.split("=", 1)
    if not hasattr(dispatch, name):
        raise SystemExit(f"moeforge.runtime.dispatch has no {name}")
    variants = {"as is": getattr(dispatch, name), a.setting: ast.literal_eval(value)}
    m = load_model(a.model, n_ctx=max(600, *(n + 64 for _, n in tests)))
    if a.no_profile:
        from moeforge.runtime import profiles_hook
        profiles_hook.install(None)
    for _ in range(a.rounds):
        for label, v in variants.items():
            setattr(dispatch, name, v)
            m.backend.generation += 1          # the graphs are captured again
            for row, (kind, n) in zip(bench(m, tests, a.reps), tests):
                print(f"{label:>40}: {kind}{n} {row['t_s_mean']:.2f} ± {row['t_s_std']:.2f}", flush=True)


if __name__ == "__main__":
    main()
