"""The `moeforge` command."""
from __future__ import annotations

import argparse
import sys


def _cmd_generate(args) -> int:
    from .codegen.compile import ARCHS
    from .codegen.generate import generate
    from .codegen.quant import parse_types
    archs = tuple(a.strip() for a in args.arch.split(",")) if args.arch else ARCHS
    for a in archs:
        if a not in ARCHS:
            print(f"moeforge generate: unknown architecture {a!r}; choose from {', '.join(ARCHS)}", file=sys.stderr)
            return 2
    families = None
    if args.families:
        from .codegen.enumerate import FAMILIES
        families = tuple(f.strip() for f in args.families.split(","))
        for f in families:
            if f not in FAMILIES:
                print(f"moeforge generate: unknown kernel family {f!r}; choose from {', '.join(FAMILIES)}",
                      file=sys.stderr)
                return 2
    summary = generate(parse_types(args.types), archs, args.out, jobs=args.jobs, progress=not args.quiet,
                       families=families)
    return 1 if summary["failures"] else 0


def _cmd_bench(args) -> int:
    from .bench import main as bench_main
    return bench_main(args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moeforge", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="render and compile every kernel instance (no GPU needed)")
    g.add_argument("--types", default="all", help="quant types, comma separated (default: all)")
    g.add_argument("--arch", default=None, help="architectures, e.g. sm_90 (default: sm_80,sm_86,sm_89,sm_90)")
    g.add_argument("--families", default=None,
                   help="kernel families, comma separated: mmq (int8 tiles), mmvq (mat-vecs), mmf (f16 "
                        "tiles), model, util (default: all)")
    g.add_argument("--out", default=None, help="build directory (default: build/ of the checkout)")
    g.add_argument("--jobs", type=int, default=None, help="parallel compiler processes (default: CPU count)")
    g.add_argument("--quiet", action="store_true", help="no progress bar")
    g.set_defaults(func=_cmd_generate)

    b = sub.add_parser("bench", help="time MUL_MAT_ID on the anchor shapes (needs a GPU)")
    b.add_argument("--types", default="q4_0,q8_0")
    b.add_argument("--shape", action="append", default=None,
                   help="qwen3-30b-a3b, deepseek-v2-lite, gpt-oss-20b or E,top_k,m,k (repeatable; "
                        "default: the anchor shapes)")
    b.add_argument("--n", default=None, help="token counts, comma separated")
    b.add_argument("--paths", default="default",
                   help="'default', 'all', 'sweep' (many specs, best shown), or a list of mmvq,mmq_id,per_expert,mmf_id")
    b.add_argument("--ops", default="mul_mat_id,gate_up", help="mul_mat_id and/or gate_up (the fused decode call)")
    b.add_argument("--reps", type=int, default=50)
    b.add_argument("--json", default=None, help="write the numbers to this file")
    b.set_defaults(func=_cmd_bench)

    from . import cli_model, cli_profile, cli_tune
    cli_tune.add_commands(sub)
    cli_profile.add_commands(sub)
    cli_model.add_commands(sub)
    return p


def main(argv=None) -> int:
    from .cli_model import route_bench
    argv = route_bench(sys.argv[1:] if argv is None else list(argv))
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:  # bad input: one clear line, no traceback
        print(f"moeforge {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
