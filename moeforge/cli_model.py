"""CLI commands of the model runtime: synth, perplexity, run, bench-model (also reached as
`moeforge bench MODEL.gguf`)."""
from __future__ import annotations

import argparse
import os
import sys
import time

# synth.TYPES and synth.ARCHS, spelled out so that the CLI starts without numpy and gguf (test_model_cli)
SYNTH_TYPES = ("q4_0", "q8_0", "q2_K", "q2_K_mix", "q3_K", "q3_K_M", "q4_K", "q4_K_M", "q5_K", "q5_K_M", "q6_K", "iq4_xs", "mxfp4_moe", "f16", "f32")
SYNTH_ARCHS = ("qwen3moe", "gpt-oss", "glm4moe", "deepseek2", "llama")
# without --preset: each architecture's real model; without --type: the type it ships in
# (gpt-oss: llama.cpp's MXFP4_MOE, mxfp4 experts as OpenAI released them, q8_0 elsewhere)
SYNTH_DEFAULTS = {"qwen3moe": ("qwen3-30b-a3b", "q4_0"), "gpt-oss": ("gpt-oss-20b", "mxfp4_moe"),
                  "glm4moe": ("glm-4.5-air", "q4_0"), "deepseek2": ("deepseek-v2-lite", "q4_0"),
                  "llama": ("mixtral-8x7b", "q4_0")}


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def _cmd_synth(args) -> int:
    from .synth import PRESETS, describe, preset, write_model
    if args.preset is not None and args.preset not in PRESETS:
        print(f"moeforge synth: unknown preset {args.preset!r}; choose from {', '.join(PRESETS)}", file=sys.stderr)
        return 2
    # the architecture is the preset's; --arch alone picks its real model's preset
    if args.preset is None:
        args.preset = SYNTH_DEFAULTS[args.arch or "qwen3moe"][0]
    arch = PRESETS[args.preset].arch
    if args.arch is not None and args.arch != arch:
        same = [n for n, p in PRESETS.items() if p.arch == args.arch]
        print(f"moeforge synth: preset {args.preset!r} is a {arch} model, not --arch {args.arch} "
              f"({args.arch}'s presets: {', '.join(same)})", file=sys.stderr)
        return 2
    if args.type is None:
        args.type = SYNTH_DEFAULTS[arch][1]
    if arch == "gpt-oss" and args.merged_gate_up:
        print("moeforge synth: --merged-gate-up is for qwen3moe (gpt-oss files keep gate and up apart)",
              file=sys.stderr)
        return 2
    spec = preset(args.preset, n_layer=args.layers)
    if not args.quiet:
        print(f"synth {args.preset} ({describe(spec)}), {args.type} -> {args.out}", file=sys.stderr)

    def progress(i, n, name):
        if not args.quiet and (i == n or i % 25 == 0):
            print(f"  {i}/{n} tensors", file=sys.stderr)
    r = write_model(args.out, spec, args.type, seed=args.seed, skewed_router=args.skewed_router,
                    embd_type=args.embd_type, output_type=args.output_type, merged_gate_up=args.merged_gate_up,
                    tied_output=args.tied_output, name=f"moeforge-synth {args.preset} {args.type}",
                    progress=progress)
    print(f"wrote {r['path']}: {r['bytes'] / 2**30:.2f} GiB, {r['tensors']} tensors in {r['seconds']:.1f} s "
          f"({r['gb_per_s']:.2f} GB/s)")
    return 0


def _load(args):
    from .runtime.device import has_gpu
    from .runtime.gguf_file import check_header
    from .runtime.model import load_model
    check_header(args.model)     # a wrong path is named before a missing GPU
    if args.backend == "cuda" and not has_gpu():
        raise SystemExit("moeforge: the cuda backend needs a CUDA GPU, and none was found "
                         "(--backend numpy runs small models on the CPU)")
    t0 = time.perf_counter()

    def progress(i, n):   # a 17 GB model takes 10-20 s to load: say where it is
        if i == n or i % 8 == 0:
            print(f"\rmoeforge: loading {os.path.basename(args.model)}, layer {i}/{n}", end="",
                  file=sys.stderr, flush=True)
    model = load_model(args.model, backend=args.backend, n_ctx=getattr(args, "ctx", None), n_ubatch=args.ubatch,
                       attn_precision=args.attn_precision, cache_type=args.cache_type, swa_full=args.swa_full,
                       progress=progress)
    print(f" ({time.perf_counter() - t0:.1f} s)", file=sys.stderr, flush=True)
    return model


def _cmd_perplexity(args) -> int:
    if not os.path.isfile(args.file):
        print(f"moeforge perplexity: no such file {args.file!r}", file=sys.stderr)
        return 2
    text = open(args.file, encoding="utf-8", errors="replace").read()
    model = _load(args)
    ids = model.tokenizer.encode(text)
    usable = len(ids) // args.ctx
    if args.chunks:
        usable = min(usable, args.chunks)
    if usable == 0:
        print(f"moeforge perplexity: the text has {len(ids)} tokens, fewer than one chunk of {args.ctx}",
              file=sys.stderr)
        return 2
    print(f"{model.describe()}\nperplexity: {len(ids)} tokens, {usable} chunks of {args.ctx}", file=sys.stderr)
    res = model.perplexity(ids[:usable * args.ctx], ctx=args.ctx)
    print("".join(f"[{i + 1}]{p:.4f}," for i, p in enumerate(res["running"])))
    print(f"Final estimate: PPL = {res['ppl']:.4f}")
    return 0


def _cmd_bench_model(args) -> int:
    from .bench_model import main
    return main(args)


def _positive(text: str) -> int:
    v = int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {v}")
    return v


def _positives(text: str) -> list[int]:
    vs = [_positive(v) for v in text.split(",") if v.strip()]
    if not vs:
        raise argparse.ArgumentTypeError(f"expected one or more comma-separated counts, got {text!r}")
    return vs


def _model_options(parser, bench: bool = False) -> None:
    """What every command that loads a model takes: the prompt's ubatch, attention, cache
    (bench: a list of ubatches, each a set of rows, as llama-bench's)."""
    parser.add_argument("-ub", "--ubatch", type=_positives if bench else _positive, default=None,
                        help=("a comma-separated list gives each its rows, as llama-bench's; " if bench else "") +
                             "prompt tokens per forward pass (default: the largest of 4096, 2048, 1024 and 512 "
                             "the GPU's free memory allows, 512 where every position's logits are kept, as in "
                             "perplexity; llama.cpp's default is 512). Larger ubatches give a MoE model's experts "
                             "more tokens each: 4096 ran a 4096-token prompt of Qwen3-30B-A3B 30%% faster than "
                             "512 on an H200, of gpt-oss-20b 65%% faster")
    parser.add_argument("--attn-precision", default=None, choices=("f16", "tf32", "f32"),
                        help="prompt attention (default: f16 where the attention weights are quantized or the "
                             "cache is f16, else f32)")
    from .codegen.spec import ModelSpec
    parser.add_argument("--cache-type", default="f32", choices=ModelSpec.CACHE_TYPES,
                        help="the KV cache's type (default f32; f16 halves its memory and what attention reads, "
                             "as llama.cpp's default cache)")
    parser.add_argument("--swa-full", action="store_true",
                        help="sliding-window layers (gpt-oss) keep every position in the KV cache too (default: a "
                             "ring of the window and one ubatch, as llama.cpp's; a ring cannot return to a "
                             "position more than an ubatch back, so a conversation whose turns rewrite older "
                             "text is evaluated again from its start)")


def add_commands(sub) -> None:
    s = sub.add_parser("synth", help="write a synthetic GGUF model with real shapes and random weights")
    s.add_argument("out", metavar="OUT.gguf")
    s.add_argument("--arch", default=None, choices=SYNTH_ARCHS,
                   help="the model's architecture (default: the preset's; with no --preset, qwen3moe); a "
                        "preset of another architecture is refused")
    s.add_argument("--preset", default=None,
                   help="qwen3moe: qwen3-30b-a3b (the default), qwen3-235b-a22b, tiny or tiny-k (tiny with rows of "
                        "whole K-quant super-blocks); gpt-oss: gpt-oss-20b (the default with --arch gpt-oss) "
                        "or tiny-oss; glm4moe: glm-4.5-air, glm-4.5 or tiny-glm; deepseek2: deepseek-v2-lite "
                        "or tiny-deepseek; llama: mixtral-8x7b, mixtral-8x22b or tiny-mixtral")
    s.add_argument("--type", default=None, choices=SYNTH_TYPES,
                   help="type of every matrix, or q3_K_M / q4_K_M / q5_K_M / q2_K_mix: llama.cpp's mixes "
                        "Q3_K_M, Q4_K_M, Q5_K_M and Q2_K (q6_K for the head; more bits for attn_v, "
                        "attn_output and ffn_down in some layers: synth.mix_types), or mxfp4_moe: llama.cpp's "
                        "MXFP4_MOE (mxfp4 experts, q8_0 elsewhere). Default: q4_0 for qwen3moe, mxfp4_moe for "
                        "gpt-oss (the format it is released in)")
    s.add_argument("--embd-type", default=None, help="type of token_embd (default: --type)")
    s.add_argument("--output-type", default=None, help="type of the output head (default: --type)")
    s.add_argument("--layers", type=int, default=None, help="override the preset's layer count")
    s.add_argument("--skewed-router", action="store_true", help="a few hot experts take most tokens")
    s.add_argument("--merged-gate-up", action="store_true",
                   help="write ffn_gate_up_exps instead of gate and up (moeforge loads it; llama.cpp may not)")
    s.add_argument("--tied-output", action="store_true", help="no output.weight: the head is the embedding")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--quiet", action="store_true")
    s.set_defaults(func=_cmd_synth)

    p = sub.add_parser("perplexity", help="perplexity of a GGUF model on a text file (llama.cpp's recipe)")
    p.add_argument("model", metavar="MODEL.gguf")
    p.add_argument("-f", "--file", required=True, help="text file")
    p.add_argument("--ctx", "-c", type=int, default=512, help="tokens per chunk (default 512)")
    p.add_argument("--chunks", type=int, default=None, help="at most this many chunks")
    p.add_argument("--backend", default="cuda", choices=("cuda", "numpy"))
    _model_options(p)
    p.set_defaults(func=_cmd_perplexity)

    from .cli_run import add_run_command
    from .serve import add_serve_command
    add_run_command(sub)
    add_serve_command(sub)

    b = sub.add_parser("bench-model", help="model speed in llama-bench's table (also: moeforge bench MODEL.gguf)")
    b.add_argument("model", metavar="MODEL.gguf")
    b.add_argument("-p", type=_ints, default=[512, 2048], help="prompt sizes (default 512,2048)")
    b.add_argument("-n", type=_ints, default=[128], help="generation lengths (default 128)")
    b.add_argument("-d", "--n-depth", dest="d", type=_ints, default=[0],
                   help="tokens already in the context when each test starts (default 0), as llama-bench's")
    b.add_argument("-r", "--repetitions", type=int, default=5)
    b.add_argument("--sweep", action="store_true", help="sweep-bench's table: PP and TG as the KV cache fills")
    b.add_argument("--ctx", "-c", type=int, default=4096, help="context of the sweep (default 4096)")
    b.add_argument("--sweep-pp", type=int, default=512)
    b.add_argument("--sweep-tg", type=int, default=128)
    b.add_argument("--profile", action="store_true",
                   help="time every op of one decode step and one prompt ubatch (where the time goes), "
                        "after the largest -d tokens when given")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--backend", default="cuda", choices=("cuda", "numpy"))
    _model_options(b, bench=True)
    b.add_argument("--json", default=None, help="write the numbers to this file")
    b.set_defaults(func=_cmd_bench_model)


def route_bench(argv: list[str]) -> list[str]:
    """`moeforge bench MODEL.gguf ...` is the model benchmark; `moeforge bench` with no
    GGUF file stays the kernel benchmark."""
    if argv and argv[0] == "bench" and any(a.endswith(".gguf") and not a.startswith("-") for a in argv[1:]):
        return ["bench-model", *argv[1:]]
    return argv
