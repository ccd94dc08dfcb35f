"""`moeforge bench MODEL.gguf`: whole-model speed in llama-bench's table, and `--sweep` in
sweep-bench's (ik_llama.cpp), so the numbers sit next to llama.cpp's on the same file.

pp N: N prompt tokens into an empty context (ubatches of --ubatch: by default as large as
the GPU's free memory allows, up to 4096, shown as n_ubatch where not 512), logits of the last
token only; tg N: N tokens decoded one at a time from an empty context. With -d D (as
llama-bench's --n-depth), the context first holds D tokens (processed untimed, once per
test) and each run starts after them: "pp512 @ d4096". Each test runs
twice to warm up (the first compiles and sizes buffers, the second captures the CUDA
graphs), then --repetitions times; t/s is the mean ± standard deviation over
repetitions, as llama-bench prints it. The token ids are random (no sampling), as there.
"""
from __future__ import annotations

import json
import sys
import time

import numpy as np

FTYPES = {0: "all F32", 1: "F16", 2: "Q4_0", 7: "Q8_0", 10: "Q2_K - Medium", 11: "Q3_K - Small",
          12: "Q3_K - Medium", 13: "Q3_K - Large", 14: "Q4_K - Small", 15: "Q4_K - Medium",
          16: "Q5_K - Small", 17: "Q5_K - Medium", 18: "Q6_K", 30: "IQ4_XS - 4.25 bpw", 32: "BF16",
          38: "MXFP4 MoE"}
SIZE_LABELS = {("qwen3moe", 48): "30B.A3B", ("qwen3moe", 94): "235B.A22B", ("gpt-oss", 24): "20B",
               ("gpt-oss", 36): "120B", ("glm4moe", 46): "106B.A12B", ("glm4moe", 92): "355B.A32B",
               ("deepseek2", 27): "16B", ("llama", 32): "8x7B", ("llama", 56): "8x22B"}


def expert_loads(model, tokens) -> list[np.ndarray]:
    """The routing a prompt pass of these tokens runs: per routed layer, the (token, slot)
    entries each expert takes (scripts/routing_stats.py prints them). The pass runs eagerly
    (no graphs), so each layer's ids are copied as they are made."""
    b, seen = model.backend, []
    route = b.route_tokens

    def recording(*args, **kwargs):
        ids, wts = route(*args, **kwargs)
        seen.append(ids[:, :model.hp.n_expert_used].copy())    # the buffer is the next layer's too
        return ids, wts
    b.route_tokens = recording
    graphs = getattr(b, "use_graphs", None)
    if graphs is not None:
        b.use_graphs = False
    try:
        model.eval(tokens, want_logits=False)
    finally:
        del b.route_tokens
        if graphs is not None:
            b.use_graphs = graphs
    host = [ids.get() if hasattr(ids, "get") else np.asarray(ids) for ids in seen]
    return [np.bincount(ids.ravel(), minlength=model.hp.n_expert) for ids in host]


def model_label(m) -> str:
    """llama.cpp's description: architecture, size class, file type."""
    size = SIZE_LABELS.get((m.arch, m.hp.n_layer), "?B")
    ft = m.file.get("general.file_type")
    return f"{m.arch} {size} {FTYPES.get(ft, '?') if ft is not None else '?'}"


def _timed(model, fn) -> float:
    model.backend.synchronize()
    t0 = time.perf_counter()
    fn()
    model.backend.synchronize()
    return time.perf_counter() - t0


def run_pp(model, n: int, rng, depth: int = 0) -> float:
    """n prompt tokens into an empty context, or after the depth tokens already in the cache."""
    toks = rng.integers(0, model.hp.n_vocab, size=n)
    if depth:
        model.n_past = depth
    else:
        model.reset(n)
    return _timed(model, lambda: model.eval(toks, want_logits=False))


def run_tg(model, n: int, rng, start: int = 0) -> float:
    toks = rng.integers(0, model.hp.n_vocab, size=n)
    model.n_past = start

    def go():
        for t in toks:
            model.eval([int(t)], want_logits=False)
    return _timed(model, go)


def bench(model, tests, reps: int, seed: int = 0, depths=(0,)) -> list[dict]:
    rng = np.random.default_rng(seed)
    rows = []
    for depth in depths:
        for kind, n in tests:
            need = depth + n + 1
            if model.cache.n_ctx < need:
                model.reset(need)
            if depth:
                # the runs write only positions from depth on: the first depth stay valid
                model.reset()
                model.eval(rng.integers(0, model.hp.n_vocab, size=depth), want_logits=False)

            def once():
                if kind == "pp":
                    return run_pp(model, n, rng, depth)
                return run_tg(model, n, rng, start=depth)
            for _ in range(2):                       # warm-up: compiles and sizes buffers, then captures
                once()
            ts = np.array([n / once() for _ in range(reps)])
            rows.append({"test": f"{kind}{n}" + (f" @ d{depth}" if depth else ""), "n": n, "depth": depth,
                         "n_ubatch": model.n_ubatch,
                         "t_s_mean": float(ts.mean()), "t_s_std": float(ts.std(ddof=1)) if reps > 1 else 0.0,
                         "samples": ts.tolist()})
    return rows


def format_llama_bench(model, rows, backend_label: str) -> str:
    head = ["model", "size", "params", "backend", "ngl", "test", "t/s"]
    size = f"{model.n_bytes / 2**30:.2f} GiB" if model.n_bytes >= 2**30 else f"{model.n_bytes / 2**20:.2f} MiB"
    params = f"{model.n_params / 1e9:.2f} B" if model.n_params >= 1e9 else f"{model.n_params / 1e6:.2f} M"
    body = [[model_label(model), size, params,
             backend_label, "99", r["test"], f"{r['t_s_mean']:.2f} ± {r['t_s_std']:.2f}"] for r in rows]
    # as llama-bench shows n_ubatch, type_k and type_v where they are not its defaults
    # (moeforge's ubatch is larger by default: runtime.backend.AUTO_UBATCHES)
    ubatches = [str(r["n_ubatch"]) for r in rows]
    extra = [(name, values) for name, values, default in (("n_ubatch", ubatches, "512"),
                                                          ("type_kv", [model.backend.cache_type] * len(rows), "f32"))
             if any(v != default for v in values)]
    for i, (name, values) in enumerate(extra):
        head.insert(5 + i, name)
        for b, v in zip(body, values):
            b.insert(5 + i, v)
    right = {i for i, h in enumerate(head) if h in ("size", "params", "ngl", "n_ubatch", "test", "t/s")}
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(head)]
    widths[0], widths[-1] = max(widths[0], 30), max(widths[-1], 20)

    def line(cells):
        return "| " + " | ".join(c.rjust(w) if i in right else c.ljust(w)
                                 for i, (c, w) in enumerate(zip(cells, widths))) + " |"
    sep = "| " + " | ".join(("-" * (w - 1) + ":") if i in right else "-" * w for i, w in enumerate(widths)) + " |"
    return "\n".join([line(head), sep] + [line(b) for b in body])


def sweep(model, n_ctx: int, pp: int, tg: int, seed: int = 0) -> list[dict]:
    """sweep-bench: at each KV fill, tg tokens decoded (then dropped from the context),
    then a pp batch processed and kept; the fill grows by pp until the context is full."""
    rng = np.random.default_rng(seed)
    model.reset(n_ctx)
    for _ in range(2):                                # warm-up, as in bench()
        model.reset()
        run_pp(model, min(pp, n_ctx // 2), rng)
    model.reset()
    run_tg(model, min(tg, 4), rng)
    model.reset()
    rows = []
    n_kv = 0
    while n_kv + pp + tg <= n_ctx:
        t_tg = run_tg(model, tg, rng, start=n_kv)
        model.n_past = n_kv
        toks = rng.integers(0, model.hp.n_vocab, size=pp)
        t_pp = _timed(model, lambda: model.eval(toks, want_logits=False))
        rows.append({"pp": pp, "tg": tg, "n_kv": n_kv, "t_pp": t_pp, "s_pp": pp / t_pp,
                     "t_tg": t_tg, "s_tg": tg / t_tg})
        n_kv += pp
    return rows


def format_sweep(rows) -> str:
    out = ["|    PP |     TG |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |",
           "|-------|--------|--------|----------|----------|----------|----------|"]
    for r in rows:
        out.append(f"| {r['pp']:5d} | {r['tg']:6d} | {r['n_kv']:6d} | {r['t_pp']:8.3f} | {r['s_pp']:8.2f} | "
                   f"{r['t_tg']:8.3f} | {r['s_tg']:8.2f} |")
    return "\n".join(out)


PROFILE_PAST = 128     # the decode step is profiled after this many cached positions


def _profile(model, args) -> int:
    """Per-op time of one decode step and one prompt ubatch (runtime.op_profile)."""
    from .runtime.op_profile import format_profile, profile_forward
    rng = np.random.default_rng(args.seed)
    result = {}
    depth = max(args.d)
    step_past = depth or PROFILE_PAST
    for label, n, past in ((f"decode step: 1 token after {step_past} cached", 1, step_past),
                           (f"prompt: one ubatch of {model.n_ubatch} tokens" + (f" after {depth} cached" if depth else ""),
                            model.n_ubatch, depth)):
        prof = profile_forward(model, n, rng, n_past=past)
        print(format_profile(prof, f"{model_label(model)}, {model.backend.cache_type} KV cache, {label}"), end="\n\n")
        result[label] = {"method": prof.method, "total_us": round(prof.total_us, 2),
                         "ops": [{"op": r.label, "calls": r.calls, "total_us": round(r.total_us, 2)}
                                 for r in prof.rows]}
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"model": args.model, "label": model_label(model), "profile": result}, fh, indent=1)
    return 0


def main(args) -> int:
    from .runtime.device import has_gpu
    from .runtime.gguf_file import check_header
    check_header(args.model)     # a wrong path is named before a missing GPU
    if args.backend == "cuda" and not has_gpu():
        print("moeforge bench: timing a model needs a CUDA GPU, and none was found "
              "(--backend numpy runs the same tables on the CPU, for testing only)", file=sys.stderr)
        return 2
    from .runtime.backend import AUTO_UBATCHES
    from .runtime.model import load_model
    ubatches = args.ubatch or [None]          # None: the model's own choice
    if len(ubatches) > 1 and (args.sweep or args.profile):
        print(f"moeforge bench: --{'sweep' if args.sweep else 'profile'} takes one ubatch, got {len(ubatches)}",
              file=sys.stderr)
        return 2
    n_ctx = args.ctx if args.sweep else max(args.d) + max([*args.p, *args.n, 1]) + 1
    if args.profile:
        n_ctx = max(n_ctx, max(args.d) + PROFILE_PAST + (ubatches[0] or AUTO_UBATCHES[0]) + 1)
    t0 = time.perf_counter()
    model = load_model(args.model, backend=args.backend, n_ctx=n_ctx, n_ubatch=ubatches[0],
                       attn_precision=getattr(args, "attn_precision", None),
                       cache_type=getattr(args, "cache_type", "f32"), swa_full=getattr(args, "swa_full", False))
    load_s = time.perf_counter() - t0
    print(f"moeforge bench: {args.model} loaded in {load_s:.1f} s\n{model.describe()}", file=sys.stderr)
    label = "moeforge CUDA" if args.backend == "cuda" else "moeforge numpy"
    if args.profile:
        return _profile(model, args)
    if args.sweep:
        rows = sweep(model, args.ctx, args.sweep_pp, args.sweep_tg, args.seed)
        print(format_sweep(rows))
    else:
        tests = [("pp", p) for p in args.p if p > 0] + [("tg", n) for n in args.n if n > 0]
        rows = []
        for ub in ubatches:
            if ub is not None:
                model.n_ubatch, model.ubatch_auto = ub, False
            rows += bench(model, tests, args.repetitions, args.seed, args.d)
        print(format_llama_bench(model, rows, label))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"model": args.model, "label": model_label(model), "backend": label, "load_s": round(load_s, 2),
                       "cache_type": model.backend.cache_type, "kv_cache_bytes": model.cache.nbytes,
                       "kv_ring_layers": model.cache.rings,
                       "sweep" if args.sweep else "tests": rows}, fh, indent=1)
    return 0
