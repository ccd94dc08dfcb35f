"""Model: a GGUF model loaded on a backend, with a KV cache.

`logits` evaluates a sequence in a fresh context; `eval` appends to the current one
(what generation and the benchmarks use); `perplexity` follows llama.cpp's recipe.
"""
from __future__ import annotations

import math
import os
import warnings

import numpy as np

from . import (arch_deepseek2, arch_glm4moe, arch_gptoss, arch_llama, arch_qwen3moe, graph_deepseek2, graph_glm4moe,
               graph_gptoss, graph_qwen3moe)
from .convert import note
from .gguf_file import GGUFError, GGUFFile
from .sampling import Sampler, Sampling

ARCHS = {arch_qwen3moe.ARCH: (arch_qwen3moe, graph_qwen3moe), arch_gptoss.ARCH: (arch_gptoss, graph_gptoss),
         arch_glm4moe.ARCH: (arch_glm4moe, graph_glm4moe), arch_deepseek2.ARCH: (arch_deepseek2, graph_deepseek2),
         arch_llama.ARCH: (arch_llama, graph_glm4moe)}     # llama's layers: glm4moe's without norms or biases
BACKENDS = ("cuda", "numpy")
# With n_ubatch=None, a pass that returns every row's logits (logits(), perplexity) takes at
# most this many tokens: its logits alone are n x n_vocab floats (Qwen3's 151936: 2.5 GB at
# 4096), and such passes are short anyway (perplexity's chunks are 512).
ALL_LOGITS_UBATCH = 512


class Model:
    def __init__(self, f: GGUFFile, backend: str = "cuda", *, n_ctx: int | None = None, n_ubatch: int | None = None,
                 numerics: str = "float", merge_gate_up: bool = True, attn_precision: str | None = None,
                 cache_type: str = "f32", swa_full: bool = False, progress=None):
        if n_ubatch is not None and (isinstance(n_ubatch, bool) or not isinstance(n_ubatch, (int, np.integer))
                                     or n_ubatch < 1):
            raise ValueError(f"n_ubatch (prompt tokens per forward pass) must be a positive integer, got {n_ubatch!r}")
        arch_name = f.architecture
        if arch_name not in ARCHS:
            raise GGUFError(f"{f.path}: architecture {arch_name!r} is not supported (moeforge runs "
                            f"{', '.join(ARCHS)})")
        arch, graph = ARCHS[arch_name]
        self._forward = graph.forward
        refs = arch.open_model(f, merge=merge_gate_up)   # validates everything before any upload
        converting = note(f)
        if converting:
            warnings.warn(f"moeforge: {converting}", stacklevel=2)
        self.file, self.path, self.arch, self.hp = f, f.path, arch_name, refs.hp
        if backend == "numpy":
            from .backend_numpy import NumpyBackend
            self.backend = NumpyBackend(self.hp, numerics, attn_precision, cache_type)
        elif backend == "cuda":
            from .backend_cuda import CudaBackend
            self.backend = CudaBackend(self.hp, attn_precision, cache_type)
        else:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        self.weights = self.backend.upload(refs, progress)
        self.n_params = sum(int(np.prod(t.shape)) for t in f.tensors.values())
        self.n_bytes = sum(t.nbytes for t in f.tensors.values())
        self.n_ctx = n_ctx or min(self.hp.n_ctx_train, 4096)
        # sliding-window layers keep a ring of positions (runtime.kv_cache) that holds a pass
        # of up to n_ubatch tokens, or of as many as the backend's choice may take
        self.swa_full, self.ubatch_auto = bool(swa_full), n_ubatch is None
        self.n_ubatch = None if n_ubatch is None else int(n_ubatch)
        self.cache = self.backend.new_cache(self.n_ctx, self._max_pass())
        # None: the backend's choice (runtime.backend.AUTO_UBATCHES), after the weights and
        # the cache took their memory; ALL_LOGITS_UBATCH where every row's logits come back
        if self.ubatch_auto:
            self.n_ubatch = self.backend.auto_ubatch(self.n_ctx)
        self.reset()
        self._tokenizer = None

    # -- contexts -----------------------------------------------------------------------------
    def _max_pass(self) -> int | None:
        if self.swa_full:
            return None
        return self.backend.auto_ubatch_limit() if self.ubatch_auto else self.n_ubatch

    def _ring_too_short(self) -> bool:
        return self.cache.max_pass is not None and self.n_ubatch > self.cache.max_pass

    def reset(self, n_ctx: int | None = None) -> None:
        """Empty the context; a larger n_ctx, or an n_ubatch larger than the sliding
        layers' rings hold a pass of, reallocates the cache."""
        if (n_ctx is not None and n_ctx > self.cache.n_ctx) or self._ring_too_short():
            n_ctx = max(n_ctx or 0, self.cache.n_ctx)
            self.cache = None
            self.cache = self.backend.new_cache(n_ctx, self._max_pass())
            self.n_ctx = n_ctx
        self.n_past = 0
        self._held: list[int] = []     # the tokens whose keys and values the cache holds, in order

    def _prefill(self, ids: np.ndarray, extra: int) -> np.ndarray:
        """Make ids the context, room for `extra` tokens after them, and return the last
        one's logits. The longest prefix the cache already holds is kept (a conversation's
        next turn repeats the turns before it), as llama.cpp's server keeps a prompt's cache;
        at least the last token is evaluated again, for its logits."""
        keep = 0
        if ids.size + extra <= self.cache.n_ctx:
            lim = min(len(self._held), self.n_past, ids.size - 1)
            differ = np.nonzero(np.asarray(self._held[:lim], dtype=np.int64) != ids[:lim])[0]
            keep = int(differ[0]) if differ.size else lim
        if keep and not self.cache.holds(keep, self.n_past):
            keep = 0                  # a ring has dropped part of the window before keep
        if keep:
            self.n_past = keep
            del self._held[keep:]
        else:
            self.reset(ids.size + extra)
        return self.eval(ids[keep:], last_only=True, reuse=True)[-1]

    def _check_tokens(self, ids) -> np.ndarray:
        ids = np.asarray(ids)
        if ids.ndim != 1 or (ids.size and not np.issubdtype(ids.dtype, np.integer)):
            raise ValueError(f"token ids must be a 1-D sequence of integers, got shape {ids.shape} {ids.dtype}")
        if ids.size and (ids.min() < 0 or ids.max() >= self.hp.n_vocab):
            raise ValueError(f"token ids must be in [0, {self.hp.n_vocab}), got [{ids.min()}, {ids.max()}]")
        return ids.astype(np.int32)

    def eval(self, token_ids, *, want_logits: bool = True, last_only: bool = False, reuse: bool = False):
        """Append tokens to the context (in ubatches); float32 logits (n, n_vocab) on the
        host, those of the last token only (1, n_vocab), or None where want_logits is False
        (the benchmarks: then only the last token's logits are computed, as llama.cpp does).
        reuse (with last_only): the row may sit in a buffer the next call overwrites
        (generation reads it once; it saves a fresh host array a token)."""
        ids = self._check_tokens(token_ids)
        if self.n_past + ids.size > self.cache.n_ctx:
            raise ValueError(f"context full: {self.n_past} + {ids.size} tokens > n_ctx {self.cache.n_ctx}")
        if self._ring_too_short():
            raise ValueError(f"n_ubatch {self.n_ubatch} is more than the sliding-window layers' KV rings hold a "
                             f"pass of ({self.cache.max_pass}): reset() the context first")
        outs = []
        ub = self.n_ubatch
        if self.ubatch_auto and want_logits and not last_only:
            ub = min(ub, ALL_LOGITS_UBATCH)
        with self.backend.context():
            for lo in range(0, ids.size, ub):
                final = lo + ub >= ids.size
                out = self._step(ids[lo:lo + ub], last_only=last_only or not want_logits)
                if want_logits and final and last_only and reuse:
                    return self.backend.to_host_reused(out)[-1:]
                if want_logits and (final or not last_only):
                    outs.append(self.backend.to_host(out))
        if not want_logits:
            return None
        if not outs:
            return np.zeros((0, self.hp.n_vocab), dtype=np.float32)
        return np.concatenate(outs).astype(np.float32, copy=False)

    def _step(self, ids: np.ndarray, last_only: bool = False):
        n, pos0 = ids.size, self.n_past
        B = self.backend
        decode, prompt = getattr(B, "decode_step", None), getattr(B, "prompt_step", None)
        if n == 1 and decode is not None:
            out = decode(self, int(ids[0]), pos0)
        elif prompt is not None:
            out = prompt(self, ids, pos0, last_only)
        else:
            tokens = B.to_device(ids, "tokens")
            pos = B.to_device(np.arange(pos0, pos0 + n, dtype=np.int32), "pos")
            out = self._forward(self, tokens, pos, pos0, n, last_only)
        self.n_past += n
        # position by position (the benchmarks move n_past themselves; -1 for positions never
        # evaluated, which no prompt matches)
        del self._held[pos0:]
        self._held.extend([-1] * (pos0 - len(self._held)) + ids.tolist())
        return out

    # -- the public API ---------------------------------------------------------------------
    def logits(self, token_ids) -> np.ndarray:
        """float32 (n_tokens, n_vocab): the logits after every position, in a fresh context."""
        ids = self._check_tokens(token_ids)
        self.reset(max(ids.size, 1))
        return self.eval(ids)

    def generate(self, prompt_ids, n: int, sampling: Sampling | None = None, *, stop=(),
                 on_token=None) -> list[int]:
        """Up to n tokens that follow the prompt: greedy, or drawn as `sampling` says
        (runtime.sampling: llama.cpp's chain; a seed repeats a run). A token in `stop` (the
        model's end-of-generation ids: `eos_ids`) ends it and is not returned. on_token(id)
        is called as each token is chosen (streaming); a true return ends the generation
        there (a stop string the caller watches for). The part of the prompt the context
        already holds is not evaluated again (_prefill)."""
        ids = self._check_tokens(prompt_ids)
        if ids.size == 0:
            raise ValueError("the prompt must hold at least one token")
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        choose = Sampler(sampling)
        stop = {int(t) for t in stop}
        last = self._prefill(ids, n) if n else None
        history, out = [int(t) for t in ids], []
        for _ in range(n):
            tok = choose(last, history)
            if tok in stop:
                break
            out.append(tok)
            history.append(tok)
            if on_token is not None and on_token(tok):
                break
            if len(out) == n:
                break
            last = self.eval([tok], last_only=True, reuse=True)[-1]
        return out

    @property
    def eos_ids(self) -> tuple[int, ...]:
        """The tokens that end a generation, from the GGUF metadata (end of sequence, end of
        turn, end of message: GLM's <|observation|>, where a tool's answer would follow), as
        llama.cpp stops on them. gpt-oss's harmony vocabulary (it has <|return|> and
        <|call|>): a reply ends with one of those two, and <|end|>, which only closes a
        message (the reasoning before the final answer), is not one (llama.cpp's rule)."""
        keys = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
        found = [int(v) for v in (self.file.get(k, kind=int) for k in keys) if v is not None]
        tokens = self._token_strings()
        if tokens and "<|return|>" in tokens and "<|call|>" in tokens:
            end = tokens.index("<|end|>") if "<|end|>" in tokens else None
            found = [t for t in found if t != end] + [tokens.index("<|return|>"), tokens.index("<|call|>")]
        return tuple(dict.fromkeys(t for t in found if t < self.hp.n_vocab))

    @property
    def reasoning_format(self) -> str | None:
        """How a chat reply marks its reasoning, from the vocabulary: "think" (<think>..</think>),
        "harmony" (gpt-oss's channels) or None (runtime.reasoning)."""
        from .reasoning import format_of
        return format_of(self._token_strings() or ())

    @property
    def tool_call_format(self) -> str | None:
        """How a chat reply writes tool calls, from the vocabulary: "hermes" (<tool_call>
        blocks of JSON), "glm" (<tool_call> blocks of a name and <arg_key>/<arg_value> pairs),
        "harmony" (gpt-oss's messages to functions.NAME) or None (runtime.tool_calls)."""
        from .tool_calls import format_of
        return format_of(self._token_strings() or ())

    def _token_strings(self) -> list[str] | None:
        tokens = self.file.get("tokenizer.ggml.tokens")
        return tokens if isinstance(tokens, list) else None

    def chat_prompt(self, messages, add_generation_prompt: bool = True, **variables) -> list[int]:
        """The token ids of `messages` in the file's chat template (runtime.chat), ending in
        the assistant's turn; `variables` reach the template (Qwen3: enable_thinking=False)."""
        from .chat import render
        template = self.file.get("tokenizer.chat_template")
        if not isinstance(template, str) or not template.strip():
            raise ValueError(f"{self.path}: the file has no chat template (tokenizer.chat_template); "
                             f"give the prompt text itself")
        tok = self.tokenizer
        name = lambda i: "" if i is None else tok.token_bytes(i).decode("utf-8", "replace")  # noqa: E731
        text = render(template, messages, add_generation_prompt=add_generation_prompt,
                      bos_token=name(tok.bos_id), eos_token=name(tok.eos_id), **variables)
        # the template writes the special tokens it wants: no BOS added (as Hugging Face's)
        return tok.encode(text, add_bos=False)

    def chat(self, messages, n: int = 512, sampling: Sampling | None = None, *, on_token=None,
             **variables) -> str:
        """The assistant's reply to `messages` (a list of {'role', 'content'}), at most n
        tokens, ended by the file's end-of-turn token."""
        out = self.generate(self.chat_prompt(messages, **variables), n, sampling, stop=self.eos_ids,
                            on_token=on_token)
        return self.tokenizer.decode(out)

    def perplexity(self, token_ids, ctx: int = 512) -> dict:
        """llama.cpp's recipe: chunks of ctx tokens, each in a fresh context, scoring only
        the second half of each chunk (the first half gives the context)."""
        ids = self._check_tokens(token_ids)
        n_chunks = ids.size // ctx
        if ctx < 4 or n_chunks == 0:
            raise ValueError(f"need at least one chunk of ctx={ctx} tokens (ctx >= 4), got {ids.size} tokens")
        nll, count, per_chunk = 0.0, 0, []
        first = ctx // 2
        for c in range(n_chunks):
            chunk = ids[c * ctx:(c + 1) * ctx]
            logits = self.logits(chunk).astype(np.float64)
            z = logits[first:-1]
            lse = np.log(np.exp(z - z.max(axis=-1, keepdims=True)).sum(axis=-1)) + z.max(axis=-1)
            nlls = lse - z[np.arange(z.shape[0]), chunk[first + 1:]]
            nll += float(nlls.sum())
            count += nlls.size
            per_chunk.append(math.exp(nll / count))
        return {"ppl": math.exp(nll / count), "n_chunks": n_chunks, "n_tokens": count, "running": per_chunk}

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from .tokenizer import Tokenizer
            self._tokenizer = Tokenizer.from_gguf(self.file)
        return self._tokenizer

    def describe(self) -> str:
        return (f"{self.arch} {os.path.basename(self.path)}: {self.hp.n_layer} layers, d={self.hp.n_embd}, "
                f"{self.hp.n_expert} experts (top {self.hp.n_expert_used}"
                + (f", {self.hp.shared_slots} shared" if self.hp.shared_slots else "")
                + (f"; the first {self.hp.n_dense_lead} dense" if self.hp.n_dense_lead else "")
                + f"), vocab {self.hp.n_vocab}, "
                f"{self.n_params / 1e9:.2f} B params, {self.n_bytes / 2**30:.2f} GiB, backend {self.backend.name}, "
                f"{self.backend.cache_type} KV cache of {self.cache.n_ctx} positions, "
                f"{self.cache.nbytes / 2**20:.1f} MiB" + (f" ({self.cache.rings} sliding layers in rings of "
                f"{min(self.cache.rows)})" if self.cache.rings else ""))


def load_model(path, backend: str = "cuda", **kwargs) -> Model:
    """Load a GGUF model. backend: "cuda" (moeforge's kernels) or "numpy" (CPU reference;
    numerics="float" or "kernel"). attn_precision: the prompt attention's, "f16", "tf32" or
    "f32" (default: f16 where the attention weights are quantized or the cache is f16, else
    f32; runtime.prompt_attention). cache_type: the KV cache's, "f32" (the default: exact)
    or "f16" (half the memory and of what attention reads; llama.cpp's default, with its
    range: values past 65504 become inf). n_ubatch: prompt tokens a forward pass (default:
    the largest of 4096/2048/1024/512 the free memory allows on a GPU, 512 where every row's
    logits come back and on numpy; 512 is llama.cpp's default). swa_full: sliding-window
    layers keep every position too (default: a ring of the window and a pass, once that is
    less than n_ctx; llama.cpp's --swa-full). Validation errors are GGUFError (a ValueError)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "cuda":
        from .device import require_gpu
        require_gpu("the cuda backend")
    return Model(GGUFFile(path), backend, **kwargs)
