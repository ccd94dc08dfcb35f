#!/usr/bin/env python3
"""Regenerate the llama.cpp parity fixtures (tests/fixtures/parity/).

Writes tiny qwen3moe, gpt-oss, glm4moe, deepseek2 and llama (Mixtral) GGUF files with moeforge's synth writer (seeded float weights,
quantized by gguf's reference quantizer, q4_K and q6_K by moeforge's own: bit-identical on
every run; the K-quant files are a wider model, rows of whole super-blocks), evaluates them with
llama.cpp on the CPU through llama-cpp-python (F32 KV cache, flash attention off, one
ubatch, logits for every position), and keeps only the logits, the token ids and a hash
of the weights; the tests rewrite the GGUF files from manifest.json.

llama-cpp-python is not a dependency of moeforge; install it to run this script:
    CMAKE_ARGS="-DGGML_NATIVE=OFF" pip install llama-cpp-python
(GGML_NATIVE=OFF keeps llama.cpp off AMX, whose Q4_0/Q8_0 repacking crashes on some CPUs.)
The gpt-oss group needs a llama.cpp that knows the architecture (llama-cpp-python 0.3.16 or
later), the glm4moe groups one that knows GLM-4.5 (0.3.36 made them); `--group oss` remakes
only those fixtures.

The token sequence is chosen, token by token, so that on every fixture the top-1 token
leads the runner-up by MIN_MARGIN at every position and every routing decision has a gap
of ROUTER_GAP between the k-th and (k+1)-th router logits. Without that, a runtime that
differs from llama.cpp only by rounding (q8_1 activations on the GPU, q8_0 on llama.cpp's
CPU) flips a few near-tied expert choices, and a flipped expert moves the logits far more
than rounding: the fixture would test luck, not parity.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "..", "tests", "fixtures", "parity")

SPEC = dict(n_vocab=384, n_embd=128, n_layer=3, n_head=4, n_head_kv=2, head_dim=32, n_ff_exp=64,
            n_expert=8, n_expert_used=3, n_ctx=256, rope_base=10000.0, rms_eps=1e-6, n_ff=192)
SEED = 20240917
N_TOKENS = 80
MIN_MARGIN = 0.05      # logits (their spread is ~1; rounding noise vs llama.cpp ~0.01)
# K-quant files: llama.cpp's activations in q8_K (one scale a 256 values) move logits by up
# to ~0.1 against the numpy backend, so their tokens keep a wider lead
MIN_MARGIN_K = 0.1
ROUTER_GAP = 0.10      # router logits (spread ~2)
FIXTURES = {
    "f32": dict(qtype="f32"),
    "f16": dict(qtype="f16"),
    "q8_0": dict(qtype="q8_0"),
    "q4_0": dict(qtype="q4_0"),
    # the output head tied to a quantized embedding (no output.weight), q8_0 embedding
    "q4_0-tied": dict(qtype="q4_0", embd_type="q8_0", tied_output=True),
}
# K-quants need rows of whole 256-weight super-blocks: a wider model, its own tokens
SPEC_K = dict(SPEC, n_embd=256, head_dim=64, n_ff_exp=256, n_ff=768)
FIXTURES_K = {"q4_K": dict(qtype="q4_K")}
# llama.cpp's Q4_K_M mix: q6_K head, attn_v and ffn_down in the last of the three layers
# (moeforge converts q6_K to q8_0 as it loads; llama.cpp runs q6_K itself)
FIXTURES_KM = {"q4_K_M": dict(qtype="q4_K_M")}
# gpt-oss (llama.cpp's LLM_ARCH_OPENAI_MOE; synth draws every bias and the sinks): three
# layers, so that both kinds exist (0 and 2 see a sliding window, 1 every key); a window of
# 12 and YaRN (factor 8) from an original context of 64, both short of the N_TOKENS, whose
# ramp mixes pairs 1-3 of 16 at gpt-oss's base; mxfp4_moe: llama.cpp's MXFP4_MOE (mxfp4
# experts, q8_0 elsewhere), the form gpt-oss is released in
SPEC_OSS = dict(n_vocab=384, n_embd=128, n_layer=3, n_head=4, n_head_kv=2, head_dim=32, n_ff_exp=64,
                n_expert=8, n_expert_used=3, n_ctx=256, rope_base=150000.0, rms_eps=1e-5, arch="gpt-oss",
                n_swa=12, yarn_factor=8.0, yarn_orig_ctx=64)
FIXTURES_OSS = {"gpt-oss-f32": dict(qtype="f32"), "gpt-oss-q8_0": dict(qtype="q8_0"),
                "gpt-oss-mxfp4_moe": dict(qtype="mxfp4_moe")}
# glm4moe (GLM-4.5-Air's graph): biased q, k, v, RoPE on 16 of 32 dimensions, a dense first
# layer, sigmoid routing with a selection bias, renormalised weights scaled by 2.5, a shared
# expert, and a prediction block after the trunk that llama.cpp loads and neither runs;
# glm_qk: GLM-4.5's q/k norms on top (after the biases, before the RoPE)
SPEC_GLM = dict(n_vocab=384, n_embd=128, n_layer=3, n_head=6, n_head_kv=2, head_dim=32, n_ff_exp=64,
                n_expert=8, n_expert_used=3, n_ctx=256, rope_base=10000.0, rms_eps=1e-5, n_ff=192, arch="glm4moe",
                n_rot=16, qk_norm=False, n_expert_shared=1, n_dense_lead=1, n_nextn=1, routed_scale=2.5)
FIXTURES_GLM = {"glm-f32": dict(qtype="f32"), "glm-q8_0": dict(qtype="q8_0"), "glm-q4_0": dict(qtype="q4_0")}
SPEC_GLM_QK = dict(SPEC_GLM, qk_norm=True)
FIXTURES_GLM_QK = {"glm-qk-f32": dict(qtype="f32"), "glm-qk-q8_0": dict(qtype="q8_0")}
# deepseek2 (DeepSeek-V2-Lite's graph): latent attention absorbed (a latent of 64 and a
# shared RoPE key of 16 a token; 4 heads of 32 + 16 query values, 32 value ones), RoPE on
# adjacent pairs with YaRN (factor 4 from 64 positions, mscale_all_dim 0.707: the softmax
# scale grows with it), a dense first layer, softmax routing without renormalising, two
# shared experts as one FFN beside the routed ones; ds_qlora: q through a low rank of 96
SPEC_DS = dict(n_vocab=384, n_embd=128, n_layer=3, n_head=4, n_head_kv=1, head_dim=48, n_ff_exp=64,
               n_expert=8, n_expert_used=3, n_ctx=256, rope_base=10000.0, rms_eps=1e-6, n_ff=192,
               arch="deepseek2", n_rot=16, n_expert_shared=2, n_dense_lead=1, routed_scale=1.0,
               yarn_factor=4.0, yarn_orig_ctx=64, kv_lora_rank=64, v_head_dim=32, yarn_log_mul=0.707)
# its quantized files differ from llama.cpp's by up to ~0.1 in a logit (five products a
# layer's attention, each on q8_0 activations there): tokens keep a wider lead
MIN_MARGIN_DS = 0.25
FIXTURES_DS = {"ds-f32": dict(qtype="f32"), "ds-q8_0": dict(qtype="q8_0"), "ds-q4_0": dict(qtype="q4_0")}
SPEC_DS_QLORA = dict(SPEC_DS, q_lora_rank=96)
FIXTURES_DS_QLORA = {"ds-qlora-f32": dict(qtype="f32")}
# llama with experts (Mixtral's graph): no q/k norms, RoPE on adjacent pairs (the loader
# permutes q's and k's rows so that the NEOX kernels turn them), softmax top-k renormalised
SPEC_MIX = dict(SPEC, rms_eps=1e-5, arch="llama", qk_norm=False, n_ff=0)
FIXTURES_MIX = {"mix-f32": dict(qtype="f32"), "mix-q8_0": dict(qtype="q8_0"), "mix-q4_0": dict(qtype="q4_0")}
GROUPS = {"base": (SPEC, FIXTURES, MIN_MARGIN), "mixtral": (SPEC_MIX, FIXTURES_MIX, MIN_MARGIN_K), "k": (SPEC_K, FIXTURES_K, MIN_MARGIN_K),
          "k_m": (SPEC_K, FIXTURES_KM, MIN_MARGIN_K), "oss": (SPEC_OSS, FIXTURES_OSS, MIN_MARGIN),
          "glm": (SPEC_GLM, FIXTURES_GLM, MIN_MARGIN_K), "glm_qk": (SPEC_GLM_QK, FIXTURES_GLM_QK, MIN_MARGIN_K),
          "ds": (SPEC_DS, FIXTURES_DS, MIN_MARGIN_DS), "ds_qlora": (SPEC_DS_QLORA, FIXTURES_DS_QLORA, MIN_MARGIN_K)}


def weights_sha256(path: str) -> str:
    from gguf import GGUFReader
    h = hashlib.sha256()
    for t in GGUFReader(path).tensors:
        h.update(t.name.encode())
        h.update(np.ascontiguousarray(t.data).view(np.uint8).tobytes())
    return h.hexdigest()


def write_fixture_model(path: str, entry: dict) -> None:
    from moeforge.synth import SynthSpec, write_qwen3moe
    spec = SynthSpec(**entry["spec"])
    write_qwen3moe(path, spec, source="float", seed=entry["seed"], name="moeforge parity fixture", **entry["args"])


def llama_logits(path: str, tokens) -> np.ndarray:
    import llama_cpp
    n = len(tokens)
    llm = llama_cpp.Llama(path, n_ctx=max(n, 64), n_batch=n, n_ubatch=n, n_threads=os.cpu_count(),
                          logits_all=True, flash_attn=False, type_k=0, type_v=0, verbose=False)
    llm.eval([int(t) for t in tokens])
    out = np.array(llm.scores[:n], dtype=np.float32)
    llm.close()
    return out


def kl_per_token(ref: np.ndarray, got: np.ndarray) -> np.ndarray:
    def logp(z):
        z = z.astype(np.float64)
        z = z - z.max(axis=-1, keepdims=True)
        return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))
    lp, lq = logp(ref), logp(got)
    return (np.exp(lp) * (lp - lq)).sum(axis=-1)


def margins(logits: np.ndarray) -> np.ndarray:
    top2 = np.sort(logits, axis=-1)[:, -2:]
    return top2[:, 1] - top2[:, 0]


def choose_tokens(paths: dict, rng: np.random.Generator, tries: int, n_vocab: int,
                  min_margin: float = MIN_MARGIN) -> np.ndarray:
    """Greedy, one position at a time (the margins at position i depend only on tokens
    up to i), judged by the numpy backend emulating moeforge's kernels."""
    from moeforge.runtime.model import load_model
    models = [load_model(p, backend="numpy", numerics="kernel") for p in paths.values()]
    gaps = []
    for m in models:
        route = m.backend.route

        def recording(logits, gating, sel_bias=None, route=route):
            # the gap between the k-th and (k+1)-th choice keys (softmax: the logits; sigmoid:
            # probability plus selection bias, whose gaps are at most a quarter of the logits')
            z = logits.astype(np.float64)
            scale = 1.0
            if gating.func == "sigmoid":
                z = 1.0 / (1.0 + np.exp(-z)) + (0.0 if sel_bias is None else np.asarray(sel_bias, np.float64))
                scale = 4.0
            srt = -np.sort(-z, axis=-1)
            k = gating.top_k
            gaps.append(float((srt[:, k - 1] - srt[:, k]).min()) * scale)
            return route(logits, gating, sel_bias)
        m.backend.route = recording
        m.reset(N_TOKENS)
    tokens = []
    for i in range(N_TOKENS):
        for attempt in range(tries):
            cand = int(rng.integers(0, n_vocab - 3))
            gaps.clear()
            ok, done = True, []
            for m in models:
                last = m.eval([cand])[-1]
                done.append(m)
                if margins(last[None])[0] < min_margin or min(gaps) < ROUTER_GAP:
                    ok = False
                    break
            if ok:
                tokens.append(cand)
                break
            for m in done:
                m.n_past -= 1     # drop the candidate: its cache row is overwritten next
        else:
            raise RuntimeError(f"no token for position {i} met the margins in {tries} tries")
    return np.asarray(tokens, dtype=np.int32)


# each of deepseek-llm's splits at work: newlines alone, cased letters after a space
# (Latin, Greek, Cyrillic, fullwidth), punctuation runs (ASCII, fullwidth, curly quotes, the
# ideographic full stop), trailing spaces, CJK and Hangul runs, long digit runs
DEEPSEEK_TEXTS = ["Hello world's 1234567 CAPS\n\n  x", "αβγ Привет ＡＢＣ！！ “quoted”。", "中文字符 한국어 text 99",
                  "  a\tb\r\nc   ", "x=(y+1)*2; // done...  ", "ǅemal ʕayn µm 3.14159"]
GLM4_TEXTS = ["Hello world's 12345 CAPS\n\n  x", "yueifa yudrcu lyt wdgeo", "Ünïcødé ✓ 中文 🙂 123456 don'T",
              "  a\tb\r\nc   ", "yu yuk yueip yueiph ie"]


# a SentencePiece vocabulary (the mix-* fixtures', as Mixtral's): spaces, runs of them, tabs
# and newlines, characters only byte pieces spell, U+2581 itself, and random strings of them
SPM_TEXTS = ["Hello world", " leading space", "two  spaces\tand\nlines\n\n", "中文 and é ü 🙂", "\u2581raw\u2581",
             "the rest of it is here", "", "x"]


def spm_ids(out: str, spec: dict, fixture: dict, file: str, n_random: int = 40) -> None:
    """llama.cpp's token ids (BOS added, specials not parsed) for SPM_TEXTS and seeded random
    strings, on a fixture's SentencePiece vocabulary."""
    import llama_cpp
    rng = np.random.default_rng(SEED)
    alpha = list("etaoinshrdlu  ETAOIN.,!?'\n\t0123") + ["  ", "中", "é", "🙂", "\u2581", "ü"]
    texts = SPM_TEXTS + ["".join(rng.choice(alpha, size=int(rng.integers(1, 40)))) for _ in range(n_random)]
    with tempfile.TemporaryDirectory() as tmp:
        p = os.path.join(tmp, "spm.gguf")
        write_fixture_model(p, {"spec": spec, "seed": SEED, "args": fixture})
        llm = llama_cpp.Llama(p, vocab_only=True, verbose=False)
        ids = [llm.tokenize(t.encode(), add_bos=True, special=False) for t in texts]
    with open(os.path.join(out, file), "w") as fh:
        json.dump({"texts": texts, "ids": ids}, fh, indent=1)
        fh.write("\n")


def pre_tokenizer_ids(out: str, pre: str, texts: list[str], spec: dict, fixture: dict, file: str) -> None:
    """llama.cpp's token ids for texts under the pre-tokenizer `pre` (with a BOS where the
    vocabulary adds one), on a fixture's vocabulary: glm4's split (whole pieces before
    merges, no BOS) on glm-f32's, deepseek-llm's six splits on ds-f32's."""
    import llama_cpp
    sys.path.insert(0, os.path.join(HERE, "..", "tests"))
    from conftest import rewrite
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "src.gguf")
        write_fixture_model(src, {"spec": spec, "seed": SEED, "args": fixture})
        p = rewrite(src, os.path.join(tmp, "pre.gguf"), kv=lambda k, v, t: pre if k == "tokenizer.ggml.pre" else v)
        llm = llama_cpp.Llama(p, vocab_only=True, verbose=False)
        ids = [llm.tokenize(t.encode(), add_bos=True, special=False) for t in texts]
    with open(os.path.join(out, file), "w") as fh:
        json.dump({"texts": texts, "ids": ids}, fh, indent=1)
        fh.write("\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=OUT)
    ap.add_argument("--tries", type=int, default=500, help="candidate tokens per position")
    ap.add_argument("--group", choices=sorted(GROUPS), action="append",
                    help="regenerate only this group of fixtures (repeatable; the others stay as they are)")
    args = ap.parse_args(argv)
    import llama_cpp
    os.makedirs(args.out, exist_ok=True)
    mpath = os.path.join(args.out, "manifest.json")
    if args.group and os.path.exists(mpath):
        with open(mpath) as fh:
            manifest = json.load(fh)
    else:
        manifest = {"llama_cpp_python": llama_cpp.__version__, "n_tokens": N_TOKENS, "min_margin": MIN_MARGIN,
                    "router_gap": ROUTER_GAP, "fixtures": {}}
    for group in args.group or sorted(GROUPS):
        spec, fixtures, min_margin = GROUPS[group]
        if make_group(args, manifest, spec, fixtures, min_margin, llama_cpp.__version__):
            return 1
        if group == "glm":
            pre_tokenizer_ids(args.out, "glm4", GLM4_TEXTS, SPEC_GLM, FIXTURES_GLM["glm-f32"], "glm4-tokens.json")
        if group == "mixtral":
            spm_ids(args.out, SPEC_MIX, FIXTURES_MIX["mix-f32"], "spm-tokens.json")
        if group == "ds":
            pre_tokenizer_ids(args.out, "deepseek-llm", DEEPSEEK_TEXTS, SPEC_DS, FIXTURES_DS["ds-f32"],
                              "deepseek-llm-tokens.json")
    with open(mpath, "w") as fh:
        json.dump(manifest, fh, indent=1, sort_keys=True)
        fh.write("\n")
    return 0


def make_group(args, manifest, spec, fixtures, min_margin, llama_version) -> int:
    """One group's fixtures (one model spec, its own token sequence) into manifest."""
    from moeforge.runtime.model import load_model
    with tempfile.TemporaryDirectory() as tmp:
        paths = {}
        for name, a in fixtures.items():
            entry = {"spec": spec, "seed": SEED, "args": a, "llama_cpp_python": llama_version}
            paths[name] = os.path.join(tmp, f"{name}.gguf")
            write_fixture_model(paths[name], entry)
            manifest["fixtures"][name] = dict(entry, file=f"{name}.npz", weights_sha256=weights_sha256(paths[name]),
                                              min_margin=min_margin)
        tokens = choose_tokens(paths, np.random.default_rng(SEED), args.tries, spec["n_vocab"], min_margin)
        logits = {name: llama_logits(p, tokens) for name, p in paths.items()}
        worst = min(float(margins(v).min()) for v in logits.values())
        print(f"smallest top-1 margin in llama.cpp's logits: {worst:.4f}", file=sys.stderr)
        if worst < min_margin / 2:
            print("llama.cpp disagrees with the numpy backend on the margins; not writing fixtures",
                  file=sys.stderr)
            return 1
        for name, p in paths.items():
            ref = logits[name]
            np.savez_compressed(os.path.join(args.out, f"{name}.npz"), tokens=tokens, logits=ref)
            report = {}
            for numerics in ("float", "kernel"):
                got = load_model(p, backend="numpy", numerics=numerics).logits(tokens)
                report[numerics] = {
                    "max_abs": float(np.abs(got - ref).max()),
                    "top1_agree": float((got.argmax(-1) == ref.argmax(-1)).mean()),
                    "mean_kl": float(kl_per_token(ref, got).mean()),
                }
            manifest["fixtures"][name]["numpy_vs_llama_cpp"] = report
            manifest["fixtures"][name]["smallest_margin"] = float(margins(ref).min())
            print(name, json.dumps(report), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
