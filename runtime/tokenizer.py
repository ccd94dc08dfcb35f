"""Text <-> token ids from a GGUF file's own vocabulary (gpt2-style byte-level BPE; llama-style
SentencePiece ones in runtime.tokenizer_spm).

Built with the `tokenizers` package (an optional dependency: `pip install tokenizers`,
or moeforge[tokenizer]); the model itself takes and returns ids and never needs it.
The pre-tokenizer patterns are those of the GGUF's `tokenizer.ggml.pre` name.
"""
from __future__ import annotations

from .gguf_file import GGUFError, GGUFFile

# Split patterns by pre-tokenizer name (the regexes the model families publish).
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
          r"\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
# OpenAI's o200k split (gpt-oss's tokenizer.json, llama.cpp's "gpt-4o"): a word is an optional
# non-letter, then either capitals and marks before lower-case ones or capitals alone (so
# "CamelCase" splits at the capital), with an English contraction glued on; digits in runs of
# up to three; punctuation keeps trailing newlines and slashes.
_O200K_LETTERS_UPPER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]"
_O200K_LETTERS_LOWER = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_O200K_CONTRACTION = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
_O200K = "|".join([
    rf"[^\r\n\p{{L}}\p{{N}}]?{_O200K_LETTERS_UPPER}*{_O200K_LETTERS_LOWER}+{_O200K_CONTRACTION}",
    rf"[^\r\n\p{{L}}\p{{N}}]?{_O200K_LETTERS_UPPER}+{_O200K_LETTERS_LOWER}*{_O200K_CONTRACTION}",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n/]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])
# GLM-4's split (llama.cpp's "glm4"): Llama 3's, digits in runs of up to three
_GLM4 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
         r"\s*[\r\n]+|\s+(?!\S)|\s+")
# DeepSeek-LLM's (DeepSeek-V2's; llama.cpp's "deepseek-llm"): not one pattern but six splits
# in turn, each of the pieces the ones before left: newlines alone; a space and a run of
# cased letters (Latin, Greek, Cyrillic, ... and their fullwidth forms: the letters with case,
# not CJK's); a space and a run of ASCII or fullwidth punctuation and symbols, curly quotes
# and the ideographic space and full stops; trailing whitespace; runs of CJK ideographs and
# Hangul (and the scripts from U+0800 to U+4E00); digit runs of any length
_DEEPSEEK_LLM = (r"[\r\n]", r"\s?[\p{Lu}\p{Ll}\p{Lt}]+",
                 "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+", r"\s+$",
                 "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+", r"\p{N}+")
PRE_PATTERNS = {"qwen2": _QWEN2, "default": _GPT2, "gpt-2": _GPT2, "gpt-4o": _O200K, "glm4": _GLM4,
                "deepseek-llm": _DEEPSEEK_LLM}
# vocabularies whose pieces are taken whole where the vocabulary holds them, before any
# merge (llama.cpp's ignore_merges), and that never start with a BOS token
WHOLE_PIECES = ("glm4",)
# llama.cpp's token types (tokenizer.ggml.token_type)
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_BYTE = 1, 2, 3, 4, 6


def byte_alphabet() -> list[str]:
    """GPT-2's byte -> printable character map of byte-level BPE vocabularies: printable
    Latin-1 bytes stand for themselves, the rest are shifted to code points from 256 up."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


_BYTE_OF = {c: b for b, c in enumerate(byte_alphabet())}


class Tokenizer:
    def __init__(self, tok, bos_id, eos_id, add_bos: bool, spm_space: bool | None = None):
        """spm_space: None for byte-level BPE; for a SentencePiece vocabulary whether its
        encoder puts a space before the text (runtime.tokenizer_spm)."""
        self._tok = tok
        self.bos_id, self.eos_id, self.add_bos = bos_id, eos_id, add_bos
        self.spm_space = spm_space
        self._specials = set(tok.get_added_tokens_decoder())

    @classmethod
    def from_gguf(cls, f: GGUFFile) -> "Tokenizer":
        try:
            from tokenizers import AddedToken, Regex
            from tokenizers import Tokenizer as HFTokenizer
            from tokenizers import decoders, models, pre_tokenizers
        except ImportError:
            raise ImportError("text in and out needs the `tokenizers` package: pip install tokenizers "
                              "(token ids work without it)") from None
        model = f.get("tokenizer.ggml.model")
        if model not in ("gpt2", "llama"):
            raise GGUFError(f"{f.path}: tokenizer.ggml.model is {model!r}; moeforge reads gpt2-style "
                            f"byte-level BPE and llama-style SentencePiece vocabularies")
        tokens = f.get("tokenizer.ggml.tokens", required=True)
        types = f.get("tokenizer.ggml.token_type", [1] * len(tokens))
        if model == "llama":
            from . import tokenizer_spm
            return tokenizer_spm.build(cls, f, tokens, types)
        merges = f.get("tokenizer.ggml.merges", required=True)
        pre = f.get("tokenizer.ggml.pre", "default")
        if pre not in PRE_PATTERNS:
            raise GGUFError(f"{f.path}: pre-tokenizer {pre!r} is not known to moeforge "
                            f"(known: {', '.join(PRE_PATTERNS)})")
        vocab = {t: i for i, t in enumerate(tokens)}
        pairs = [tuple(m.split(" ", 1)) for m in merges]
        bpe = models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, ignore_merges=pre in WHOLE_PIECES)
        tok = HFTokenizer(bpe)
        splits = PRE_PATTERNS[pre] if isinstance(PRE_PATTERNS[pre], tuple) else (PRE_PATTERNS[pre],)
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            *(pre_tokenizers.Split(Regex(p), behavior="isolated", invert=False) for p in splits),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
        tok.decoder = decoders.ByteLevel()
        special = [AddedToken(t, special=True, normalized=False)
                   for t, ty in zip(tokens, types) if ty in (TOKEN_CONTROL, TOKEN_USER_DEFINED)]
        if special:
            tok.add_special_tokens(special)
        bos = None if pre in WHOLE_PIECES else f.get("tokenizer.ggml.bos_token_id")
        return cls(tok, bos, f.get("tokenizer.ggml.eos_token_id"), bool(f.get("tokenizer.ggml.add_bos_token", False)))

    @property
    def n_vocab(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            ids = [self.bos_id] + ids
        return ids

    def decode(self, ids, skip_special: bool = False) -> str:
        """The text of ids. A SentencePiece vocabulary's encoder put a space before the text:
        its first piece's leading space is dropped (after special tokens), as llama.cpp's
        detokenizer drops it; piece() and stream() keep every space."""
        ids = list(map(int, ids))
        if not self.spm_space:
            return self._tok.decode(ids, skip_special_tokens=skip_special)
        first = next((i for i, t in enumerate(ids) if t not in self._specials), None)
        if first is None or not self.token_bytes(ids[first]).startswith(b" "):
            return self._tok.decode(ids, skip_special_tokens=skip_special)
        head = self._tok.decode(ids[:first], skip_special_tokens=skip_special)
        return head + self._tok.decode(ids[first:], skip_special_tokens=skip_special)[1:]

    def piece(self, token_id: int) -> str:
        """One token's text as it continues a text (decode of it alone, but a SentencePiece
        piece keeps its leading space)."""
        if self.spm_space is None:
            return self._tok.decode([int(token_id)])
        return self.token_bytes(token_id).decode("utf-8", "replace")

    def stream(self) -> "TextStream":
        """An incremental decoder: each token's text as it completes, O(1) a token (decode
        of the whole continuation every token is O(n) a token: seconds over long replies)."""
        return TextStream(self)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (a piece of a character, for some): its vocabulary
        string through the byte alphabet; a special token's text as it is."""
        if self.spm_space is not None:
            from .tokenizer_spm import token_bytes
            return token_bytes(self._tok, token_id)
        s = self._tok.id_to_token(int(token_id)) or ""
        if all(c in _BYTE_OF for c in s):
            return bytes(_BYTE_OF[c] for c in s)
        return s.encode("utf-8")


class TextStream:
    """Tokens in, text out, as decode() of all of them would give it: the tokens' bytes
    through an incremental UTF-8 decoder that holds back a character's first bytes until
    its last arrives (invalid bytes become U+FFFD, as decode's do)."""

    def __init__(self, tokenizer: Tokenizer):
        import codecs
        self._tok = tokenizer
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")

    def add(self, token_id: int) -> str:
        return self._utf8.decode(self._tok.token_bytes(token_id))

    def flush(self) -> str:
        """What is held back at the end: U+FFFD for a character cut short."""
        return self._utf8.decode(b"", final=True)
