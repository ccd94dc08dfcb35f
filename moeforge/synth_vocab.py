"""A synthetic GPT-2-style byte-level BPE vocabulary, so that synthetic GGUF files carry a
tokenizer llama.cpp (and moeforge) can load: the 256 byte tokens in GPT-2's printable
byte alphabet, then merges of existing tokens, then Qwen's special tokens.

The merges are drawn to look like text (letters after letters, a space-marked word start
first), not learned: tokenization is valid, not efficient.
"""
from __future__ import annotations

import numpy as np

from .runtime.tokenizer import byte_alphabet

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
TOKEN_NORMAL, TOKEN_CONTROL = 1, 3
# ChatML, the turn format of Qwen's models (their files carry a longer template of it)
CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def build_vocab(n_vocab: int, seed: int = 0) -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges "a b") with exactly n_vocab tokens."""
    alpha = byte_alphabet()
    n_merges = n_vocab - 256 - len(SPECIALS)
    if n_merges < 0:
        raise ValueError(f"n_vocab={n_vocab} is too small for a byte-level vocabulary (>= {256 + len(SPECIALS)})")
    rng = np.random.default_rng(seed)
    space = alpha[ord(" ")]
    letters = [alpha[c] for c in b"etaoinshrdlcumwfgypbvkjxqz"]
    weights = np.linspace(2.0, 0.2, len(letters))
    weights /= weights.sum()
    tokens = list(alpha)
    known = set(tokens)
    merges: list[str] = []
    grown: list[str] = []   # tokens that further merges extend
    # Draw in batches: one call to the generator per batch keeps this fast for 150k merges.
    while len(merges) < n_merges:
        left_pick = rng.random(4096)
        let_pick = rng.choice(len(letters), size=4096, p=weights)
        grow_pick = rng.random(4096)
        for i in range(4096):
            if len(merges) >= n_merges:
                break
            b = letters[let_pick[i]]
            if not grown or left_pick[i] < 0.15:
                a = space if left_pick[i] < 0.08 else letters[int(left_pick[i] * 1000) % len(letters)]
            else:
                a = grown[int(grow_pick[i] * len(grown))]
            new = a + b
            if new in known or len(new) > 16:
                continue
            known.add(new)
            tokens.append(new)
            merges.append(f"{a} {b}")
            grown.append(new)
    types = [TOKEN_NORMAL] * len(tokens) + [TOKEN_CONTROL] * len(SPECIALS)
    return tokens + list(SPECIALS), types, merges


def add_tokenizer(writer, n_vocab: int, seed: int = 0) -> None:
    """The tokenizer.ggml.* keys a Qwen3 GGUF carries (gpt2 model, qwen2 pre-tokenizer)."""
    tokens, types, merges = build_vocab(n_vocab, seed)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    eot = n_vocab - len(SPECIALS)
    writer.add_eos_token_id(eot + 2)          # <|im_end|>
    writer.add_pad_token_id(eot)
    writer.add_bos_token_id(eot)              # <|endoftext|>, as Qwen3's files say
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHATML)
