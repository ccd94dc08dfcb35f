"""Text <-> token ids for SentencePiece vocabularies (llama.cpp's "llama" tokenizer model:
Mixtral's, Llama 2's): pieces with scores, U+2581 for a space, <0xXX> pieces for bytes.

llama.cpp's encoder puts a space before the text (and after each special token) where the
file says add_space_prefix, writes spaces as U+2581, then merges, of all adjacent pairs
whose join is a piece, the one of the highest score (the leftmost on a tie), until none is
left, and spells what no piece covers as its UTF-8 bytes. The same as byte-fallback BPE
whose merges are ranked by the score of the piece they make (Hugging Face's conversion of
sentencepiece models), which the `tokenizers` package runs.
"""
from __future__ import annotations

from .gguf_file import GGUFError, GGUFFile
from .tokenizer import TOKEN_CONTROL, TOKEN_NORMAL, TOKEN_USER_DEFINED

SPACE = "\u2581"      # a space, in the pieces


def spm_merges(pieces: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """Every split of a normal piece into two pieces, ranked by the piece's score (highest
    first; then by id, then by split point: a fixed order)."""
    vocab = {p: i for i, p in enumerate(pieces)}
    ranked = []
    for i, (p, s, ty) in enumerate(zip(pieces, scores, types)):
        if ty != TOKEN_NORMAL or len(p) < 2:
            continue
        for cut in range(1, len(p)):
            a, b = p[:cut], p[cut:]
            if a in vocab and b in vocab:
                ranked.append((-s, i, cut, a, b))
    ranked.sort()
    return [(a, b) for *_, a, b in ranked]


def build(cls, f: GGUFFile, tokens: list[str], types: list[int]):
    """cls(...) for the file's SentencePiece vocabulary (tokenizer.Tokenizer.from_gguf)."""
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, normalizers
    scores = f.get("tokenizer.ggml.scores", required=True)
    if len(scores) != len(tokens):
        raise GGUFError(f"{f.path}: tokenizer.ggml.scores has {len(scores)} entries for {len(tokens)} tokens")
    unk = f.get("tokenizer.ggml.unknown_token_id", 0, kind=int)
    missing = [f"<0x{b:02X}>" for b in range(256) if f"<0x{b:02X}>" not in tokens]
    if missing:
        raise GGUFError(f"{f.path}: the SentencePiece vocabulary lacks byte pieces ({missing[0]}, ...)")
    bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=spm_merges(tokens, scores, types),
                     unk_token=tokens[unk], byte_fallback=True, fuse_unk=True)
    tok = HFTokenizer(bpe)
    space_prefix = bool(f.get("tokenizer.ggml.add_space_prefix", True))
    norm = [normalizers.Prepend(SPACE)] if space_prefix else []
    tok.normalizer = normalizers.Sequence([*norm, normalizers.Replace(" ", SPACE)])
    tok.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    special = [AddedToken(t, special=True, normalized=False)
               for t, ty in zip(tokens, types) if ty in (TOKEN_CONTROL, TOKEN_USER_DEFINED)]
    if special:
        tok.add_special_tokens(special)
    return cls(tok, f.get("tokenizer.ggml.bos_token_id", 1, kind=int), f.get("tokenizer.ggml.eos_token_id"),
               bool(f.get("tokenizer.ggml.add_bos_token", True)), spm_space=space_prefix)


def token_bytes(tok, token_id: int) -> bytes:
    """A piece's bytes: <0xXX> its byte, U+2581 a space; a special token's text as it is."""
    s = tok.id_to_token(int(token_id)) or ""
    if len(s) == 6 and s.startswith("<0x") and s.endswith(">"):
        try:
            return bytes([int(s[3:5], 16)])
        except ValueError:
            pass
    return s.replace(SPACE, " ").encode("utf-8")
