"""Log-probabilities of a token sequence under the model, for the server's `logprobs` and
`echo` (what lm-evaluation-harness's local-completions model asks a server for, to score
a continuation): one pass over the whole sequence in a fresh context, each position's
log-softmax of the raw logits (temperature 1, before any sampling filter)."""
from __future__ import annotations

import numpy as np

MAX_TOP = 20


def sequence_logprobs(model, ids: list[int], start: int, top: int) -> list[tuple[int, float | None, list]]:
    """(token, its log-probability, the top alternatives [(token, logprob)]) for ids[start:];
    the first token of a sequence has none (nothing before it is scored)."""
    if not 0 <= top <= MAX_TOP:
        raise ValueError(f"top logprobs must be in [0, {MAX_TOP}], got {top}")
    out = []
    if start >= len(ids):
        return out
    logits = model.logits(ids[:-1]) if len(ids) > 1 else np.zeros((0, model.hp.n_vocab), np.float32)
    for i in range(start, len(ids)):
        if i == 0:
            out.append((ids[0], None, []))
            continue
        z = logits[i - 1].astype(np.float64)
        lse = z.max() + np.log(np.exp(z - z.max()).sum())
        alts = []
        if top:
            best = np.argpartition(-z, top - 1)[:top]
            best = best[np.argsort(-z[best], kind="stable")]
            alts = [(int(t), float(z[t] - lse)) for t in best]
        out.append((ids[i], float(z[ids[i]] - lse), alts))
    return out


def token_text(tokenizer, t: int) -> str:
    """A token as the API names it: its text, or OpenAI's "bytes:\\xNN..." where it is a
    piece of a character (so that two such pieces never share a name)."""
    raw = tokenizer.token_bytes(t)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def completion_logprobs(tokenizer, scored, text_offset0: int = 0) -> dict:
    """The legacy completions form: tokens, token_logprobs, top_logprobs, text_offset."""
    tokens, offsets, at = [], [], text_offset0
    for t, _, _ in scored:
        s = token_text(tokenizer, t)
        tokens.append(s)
        offsets.append(at)
        at += len(tokenizer.piece(t))
    return {"tokens": tokens, "token_logprobs": [lp for _, lp, _ in scored],
            "top_logprobs": [({token_text(tokenizer, a): v for a, v in alts} if lp is not None else None)
                             for _, lp, alts in scored],
            "text_offset": offsets}


def chat_logprobs(tokenizer, scored) -> dict:
    """The chat completions form: content, one entry a generated token."""
    def entry(t, lp):
        return {"token": token_text(tokenizer, t), "logprob": lp, "bytes": list(tokenizer.token_bytes(t))}
    return {"content": [{**entry(t, lp), "top_logprobs": [entry(a, v) for a, v in alts]} for t, lp, alts in scored]}
