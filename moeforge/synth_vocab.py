"""A synthetic GPT-2-style byte-level BPE vocabulary, so that synthetic GGUF files carry a
tokenizer llama.cpp (and moeforge) can load: the 256 byte tokens in GPT-2's printable
byte alphabet, then merges of existing tokens, then Qwen's special tokens.

The merges are drawn to look like text (letters after letters, a space-marked word start
first), not learned: tokenization is valid, not efficient.
"""
from __future__ import annotations

import numpy as np

from .runtime.tokenizer import TOKEN_BYTE, TOKEN_CONTROL, TOKEN_NORMAL, TOKEN_UNKNOWN, byte_alphabet
from .runtime.tokenizer_spm import SPACE as SPM_SPACE

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
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


# SentencePiece vocabularies (llama.cpp's "llama" tokenizer model: Mixtral's, Llama 2's)
SPM_CHARS = SPM_SPACE + "etaoinshrdlcumwfgypbvkjxqzETAOINSHRDLCUMWFGYPBVKJXQZ0123456789.,!?'\"-:;()\n"
# Mistral's instruction format, the turn format of Mixtral's files
MISTRAL_INST = ("{{ bos_token }}{% for m in messages %}{% if m.role == 'user' %}[INST] {{ m.content }} [/INST]"
                "{% else %}{{ m.content }}{{ eos_token }}{% endif %}{% endfor %}")


def build_spm_vocab(n_vocab: int, seed: int = 0) -> tuple[list[str], list[float], list[int]]:
    """(pieces, scores, token types) with exactly n_vocab tokens, laid out as Llama's and
    Mixtral's: <unk>, <s>, </s>, the 256 byte pieces <0xXX>, then pieces by falling score:
    single characters (U+2581 for a space), then pieces grown from them as words are (a
    U+2581 start, letters after it). Drawn, not learned: valid, not efficient."""
    n_grown = n_vocab - 3 - 256 - len(SPM_CHARS)
    if n_grown < 0:
        raise ValueError(f"n_vocab={n_vocab} is too small for a SentencePiece vocabulary "
                         f"(>= {3 + 256 + len(SPM_CHARS)})")
    rng = np.random.default_rng(seed)
    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + list(SPM_CHARS)
    known, grown = set(pieces), []
    letters = list("etaoinshrdlcumwfgypbvkjxqz")
    weights = np.linspace(2.0, 0.2, len(letters))
    weights /= weights.sum()
    while len(grown) < n_grown:
        r, b = rng.random(), letters[rng.choice(len(letters), p=weights)]
        a = SPM_SPACE if not grown or r < 0.2 else grown[int(rng.random() * len(grown))]
        if a + b not in known and len(a + b) <= 12:
            known.add(a + b)
            grown.append(a + b)
    pieces += grown
    types = [TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_CONTROL] + [TOKEN_BYTE] * 256 + [TOKEN_NORMAL] * (n_vocab - 259)
    # the byte and control pieces score 0; the others fall with their rank, so that a piece
    # grown earlier merges first (sentencepiece's BPE scores)
    scores = [0.0] * 259 + [-float(i) for i in range(n_vocab - 259)]
    return pieces, scores, types


def add_spm_tokenizer(writer, n_vocab: int, seed: int = 0) -> None:
    """The tokenizer.ggml.* keys a Mixtral GGUF carries (llama model, a space before the text)."""
    pieces, scores, types = build_spm_vocab(n_vocab, seed)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(pieces)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_add_space_prefix(True)
    writer.add_chat_template(MISTRAL_INST)
