"""CLI commands of the tuner: `tune` and `generate-and-tune` (`profile ...` is cli_profile).

Exit codes: 0 done, 1 something failed (compile failures, an invalid profile), 2 a usage
error or no CUDA device where one is needed.
"""
from __future__ import annotations

import argparse
import sys
import time

GENERATE_AND_TUNE_BUDGET_S = 600.0
# Kept back from the budget for loading the studies, writing the profile and the table.
RESERVE_S = 15.0
DEFAULT_TRIALS = 30


def _err(msg: str) -> None:
    print(msg, file=sys.stderr)


def _no_gpu(cmd: str) -> int:
    _err(f"moeforge {cmd}: no CUDA device found; tuning measures kernels on a GPU and cannot run here "
         f"(`moeforge generate` compiles without one)")
    return 2


def _standin_fingerprint() -> dict:
    from . import __version__
    from .codegen.render import templates_hash
    return {"gpu": "moeforge stand-in objective (no GPU)", "cc": "0.0", "sm_count": 1, "memory_gib": 0.0,
            "driver": "none", "cuda_runtime": "none", "nvrtc": "none", "moeforge": __version__,
            "templates": templates_hash()}


def _keys(args, ops=("mul_mat_id",)) -> list:
    """TuneKeys from --model/--shape/--types/--n; ValueError with a user message."""
    from .codegen.quant import parse_types
    from .tuning.shapes import DEFAULT_SET, NAMED, model_products, parse_shape
    from .tuning.space import ANCHOR_N, BUCKETS, TuneKey
    types = None
    products = None                      # (shape, type) pairs of a model's expert products
    if getattr(args, "model", None) and "mul_mat_id" not in ops:
        shapes = []                      # dense products: their shapes come from the model below
    elif getattr(args, "model", None):
        from .codegen.quant import QUANT_TYPES
        found = model_products(args.model)
        asked = {q.name for q in parse_types(args.types)} if args.types else set(QUANT_TYPES)
        products = [(s, q) for s, q in found if q in asked]
        if not products:
            model_types = sorted({q for _, q in found})
            raise ValueError(f"{args.model}: its expert tensors are {', '.join(model_types) or 'absent'}; "
                             f"moeforge tunes {', '.join(sorted(asked))} here")
        shapes = []
    elif getattr(args, "shape", None):
        shapes = [parse_shape(s) for s in args.shape]
    else:
        shapes = [NAMED[s] for s in DEFAULT_SET]
    if args.types:
        types = [q.name for q in parse_types(args.types)]
    types = types or ["q4_0", "q8_0"]
    ns = ANCHOR_N
    if getattr(args, "n", None):
        try:
            ns = tuple(int(v) for v in args.n.split(",") if v.strip())
        except ValueError:
            raise ValueError(f"--n {args.n!r}: expected comma-separated integers") from None
        bad = [n for n in ns if n not in BUCKETS]
        if bad or not ns:
            raise ValueError(f"--n: token buckets are powers of two from 1 to {BUCKETS[-1]}; got {bad or 'none'}")
    keys = []
    for op in ops:
        if op == "mul_mat" and getattr(args, "model", None):
            # the model's own dense products, each in the type it is stored in
            from .tuning.shapes import model_dense_shapes
            dense = [(m, k, q) for m, k, q in model_dense_shapes(args.model)
                     if not args.types or q in types]
            if not dense:
                raise ValueError(f"{args.model}: no dense quantized product of the tuned types "
                                 f"({', '.join(types)}) in its first layer or output head")
            keys += [TuneKey(op, q, (1, 1, m, k), n) for m, k, q in dense for n in ns]
            continue
        if products is not None:
            keys += [TuneKey(op, q, s, n) for s, q in products for n in ns]
            continue
        for q in types:
            for s in shapes:
                shape = s if op == "mul_mat_id" else (1, 1, s[2], s[3])
                keys += [TuneKey(op, q, shape, n) for n in ns]
    return sorted(set(keys))


def _default_name(key) -> str:
    from .tuning.space import default_choice
    return default_choice(key).spec.name


def run_tuning(args, keys, deadline: float | None, trials: int | None, cmd: str) -> int:
    from .tuning import merge, paths, report, study
    from .tuning.space import DEFAULT_SMEM_LIMIT
    from .tuning.storage import make_storage
    standin = getattr(args, "objective", "gpu") == "standin"
    gpus = [g.strip() for g in args.gpus.split(",") if g.strip()] if getattr(args, "gpus", None) else None
    if standin:
        if not args.profile_dir:
            _err(f"moeforge {cmd}: the stand-in objective needs --profile-dir (its profile is not for a real GPU)")
            return 2
        fp, smem = _standin_fingerprint(), DEFAULT_SMEM_LIMIT
    else:
        from .runtime.device import device_info, has_gpu
        from .tuning import fingerprint as fpmod
        if not has_gpu():
            return _no_gpu(cmd)
        fp = fpmod.current()
        if gpus:
            for g in gpus:
                try:
                    other = fpmod.current(int(g))
                except Exception as e:
                    _err(f"moeforge {cmd}: --gpus {g}: {e}")
                    return 2
                if fpmod.ident(other) != fpmod.ident(fp):
                    _err(f"moeforge {cmd}: --gpus mixes GPUs ({fpmod.describe(fpmod.differences(fp, other))}); "
                         f"a study and a profile belong to one kind of GPU")
                    return 2
        smem = device_info()["smem_per_block_optin"]
    if keys is None:   # --stale: the buckets of this GPU's profile the runtime does not take as they are
        said = []
        src, keys = merge.stale_keys(fp, paths.profile_dir(args.profile_dir), warn=said.append)
        if said:
            _err(f"moeforge {cmd}: {said[0]}; nothing to refresh (`moeforge generate-and-tune` makes a new one)")
            return 1
        if src is None:
            print(f"moeforge {cmd}: no profile of this GPU in {paths.profile_dir(args.profile_dir)} and none "
                  f"shipped: nothing is stale (`moeforge generate-and-tune` makes one)")
            return 0
        if not keys:
            print(f"moeforge {cmd}: every entry of {src} was timed on the kernels of this moeforge and runs as "
                  f"it is: nothing to re-tune")
            return 0
        print(f"moeforge {cmd}: {len(keys)} entries of {src} do not run as they are (timed on kernels that have "
              f"changed since, or another tile runs in their place: `moeforge profile show`)", file=sys.stderr)
    url = args.storage or paths.default_storage_url()
    task = study.Task(keys=keys, storage_url=url, fingerprint=fp, smem_limit=smem, trials=trials,
                      deadline=deadline, objective="standin" if standin else "gpu",
                      trial_timeout=args.trial_timeout, progress=not args.quiet,
                      heartbeat=getattr(args, "heartbeat", None) or study.HEARTBEAT_S,
                      grace=getattr(args, "grace", None) or study.GRACE_S)
    print(f"moeforge {cmd}: {len(keys)} studies ({_budget_text(trials, deadline)}) in {_safe_url(url)}",
          file=sys.stderr)
    study.run_workers(task, gpus)
    storage = make_storage(url, task.heartbeat, task.grace)
    results = [r for r in (study.result(storage, fp, k, smem) for k in keys) if r is not None]
    report.table(results)
    path = merge.save_results(fp, results, paths.profile_dir(args.profile_dir), _default_name,
                              warn=lambda msg: _err(f"moeforge {cmd}: {msg}"))
    print(f"\nprofile: {path}" if path else "\nno profile written: no study measured its default yet")
    if getattr(args, "plot", None):
        try:
            report.plot(results, args.plot)
            print(f"plot: {args.plot}")
        except report.PlotUnavailable as e:
            _err(f"moeforge {cmd}: {e}")
    return 0


def _budget_text(trials, deadline) -> str:
    parts = []
    if trials:
        parts.append(f"{trials} trials each")
    if deadline:
        parts.append(f"{deadline - time.time():.0f} s in all")
    return ", ".join(parts) or "no budget"


def _safe_url(url: str) -> str:
    """Never print a database password."""
    if "@" in url and "://" in url:
        scheme, rest = url.split("://", 1)
        return f"{scheme}://***@{rest.rsplit('@', 1)[1]}"
    return url


def _usable(budget: float) -> float:
    """The part of a time budget that trials may use (the rest writes the results)."""
    return max(budget - RESERVE_S, 0.9 * budget)


def cmd_tune(args) -> int:
    if args.stale:
        given = [f"--{o}" for o in ("model", "shape", "types", "n") if getattr(args, o)]
        if given or args.op != "mul_mat_id":
            _err(f"moeforge tune: --stale takes its buckets from the profile; it does not combine with "
                 f"{', '.join(given) or '--op'}")
            return 2
        keys = None
    else:
        try:
            keys = _keys(args, ops=(args.op,))
        except ValueError as e:
            _err(f"moeforge tune: {e}")
            return 2
    trials = args.trials
    if trials is None and args.time_budget is None:
        trials = DEFAULT_TRIALS
    deadline = time.time() + _usable(args.time_budget) if args.time_budget else None
    return run_tuning(args, keys, deadline, trials, "tune")


def cmd_generate_and_tune(args) -> int:
    from .codegen.compile import ARCHS
    from .codegen.generate import generate
    from .codegen.quant import parse_types
    from .runtime.device import device_info, has_gpu
    t0 = time.time()
    gpu = has_gpu()
    archs = (device_info()["arch"],) if gpu else ARCHS
    if gpu and archs[0] not in ARCHS:
        _err(f"moeforge generate-and-tune: this GPU is {archs[0]}; moeforge builds for {', '.join(ARCHS)}")
        return 2
    summary = generate(parse_types("q4_0,q8_0"), archs, progress=not args.quiet, out=sys.stdout)
    if summary["failures"]:
        _err(f"moeforge generate-and-tune: {len(summary['failures'])} instances failed to compile; "
             f"their trials will fail and never be chosen")
    if not gpu and args.objective != "standin":
        return _no_gpu("generate-and-tune")
    args.model, args.shape, args.types, args.n = None, None, "q4_0,q8_0", None
    keys = _keys(args)
    # The whole command has args.time_budget seconds: what generate used is gone, and the
    # rest is split evenly over the studies, each passing on what it leaves unused.
    deadline = t0 + _usable(args.time_budget)
    return run_tuning(args, keys, deadline, None, "generate-and-tune")


# -- parser -------------------------------------------------------------------------------
def _common(p, budget_default=None) -> None:
    p.add_argument("--storage", default=None,
                   help="Optuna storage URL (default: SQLite in the user cache); postgresql://... to share "
                        "studies between workers on many hosts (pip install 'moeforge[postgres]')")
    p.add_argument("--gpus", default=None, help="one worker process per GPU, e.g. 0,1 (default: this process, GPU 0)")
    p.add_argument("--profile-dir", default=None,
                   help="where profiles live (default: $MOEFORGE_PROFILE_DIR, else the user cache)")
    p.add_argument("--plot", default=None, metavar="FILE.png", help="draw tuned vs default against n (needs matplotlib)")
    p.add_argument("--trial-timeout", type=float, default=120.0, help="seconds before a candidate is killed")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    # For tests and CI on machines without a GPU: the same driver with a CPU objective.
    p.add_argument("--objective", choices=("gpu", "standin"), default="gpu", help=argparse.SUPPRESS)
    p.add_argument("--heartbeat", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--grace", type=int, default=None, help=argparse.SUPPRESS)


def add_commands(sub) -> None:
    t = sub.add_parser("tune", help="tune kernels for this GPU and write its profile (needs a GPU)")
    src = t.add_mutually_exclusive_group()
    src.add_argument("--model", default=None, help="a GGUF MoE model: the expert products it runs (gate/up merged, down), "
                     "each in its tensors' types")
    src.add_argument("--shape", action="append", default=None,
                     help="qwen3-30b-a3b, deepseek-v2-lite, gpt-oss-20b or E,top_k,m,k (repeatable; "
                          "default: those three)")
    src.add_argument("--stale", action="store_true",
                     help="re-tune the buckets of this GPU's profile whose kernels have changed since they "
                          "were timed (after a template edit), or where something else runs in the entry's "
                          "place (a short study's default that has changed since, f16 tiles its study did not "
                          "time), and merge them in")
    t.add_argument("--types", default=None, help="quant types, comma separated (default: q4_0,q8_0)")
    t.add_argument("--op", choices=("mul_mat_id", "mul_mat"), default="mul_mat_id",
                   help="mul_mat_id: expert products; mul_mat: dense (with --model, its own projections)")
    t.add_argument("--n", default=None, help="token buckets, powers of two (default: 1,4,8,...,4096)")
    t.add_argument("--trials", type=int, default=None,
                   help=f"measured trials per bucket (default {DEFAULT_TRIALS} unless --time-budget is given)")
    t.add_argument("--time-budget", type=float, default=None, help="seconds for the whole command")
    _common(t)
    t.set_defaults(func=cmd_tune)

    g = sub.add_parser("generate-and-tune",
                       help="compile for this GPU, tune the default shapes for q4_0 and q8_0, write the profile")
    g.add_argument("--time-budget", type=float, default=GENERATE_AND_TUNE_BUDGET_S,
                   help=f"seconds for everything, compilation included (default {GENERATE_AND_TUNE_BUDGET_S:.0f})")
    _common(g)
    g.set_defaults(func=cmd_generate_and_tune)
