"""tg128 of a model with a runtime.dispatch constant as it is and as given, alternating in
one process, the decode graph captured again at each switch: the A/B that decides a rule.

    python3 scripts/dispatch_ab.py MODEL.gguf FUSED_KSPLIT_MIN_UNITS=1073741824 [--rounds 2]
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
    a = ap.parse_args()
    name, value = a.setting.split("=", 1)
    if not hasattr(dispatch, name):
        raise SystemExit(f"moeforge.runtime.dispatch has no {name}")
    variants = {"as is": getattr(dispatch, name), a.setting: ast.literal_eval(value)}
    m = load_model(a.model, n_ctx=600)
    for _ in range(a.rounds):
        for label, v in variants.items():
            setattr(dispatch, name, v)
            m.backend.generation += 1          # the decode graph is captured again
            row = bench(m, [("tg", 128)], a.reps)[0]
            print(f"{label:>40}: tg128 {row['t_s_mean']:.2f} ± {row['t_s_std']:.2f}", flush=True)


if __name__ == "__main__":
    main()
