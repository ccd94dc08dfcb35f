"""The tokenizer built from a GGUF vocabulary."""
import builtins

import numpy as np
import pytest

from moeforge.runtime.gguf_file import GGUFError, GGUFFile
from moeforge.synth import preset, write_qwen3moe

pytest.importorskip("tokenizers")


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tok") / "t.gguf")
    write_qwen3moe(path, preset("tiny"), "q8_0", seed=0)
    return path


@pytest.mark.parametrize("text", ["Hello world, the quick brown fox!", "  leading spaces\n\nand lines\t tabs",
                                  "Ünïcødé ✓ 中文 🙂 123456", "<|im_start|>user\nhi<|im_end|>", ""])
def test_round_trip(gguf_path, text):
    from moeforge.runtime.tokenizer import Tokenizer
    tok = Tokenizer.from_gguf(GGUFFile(gguf_path))
    ids = tok.encode(text)
    assert all(0 <= i < 512 for i in ids)
    assert tok.decode(ids) == text


def test_merges_apply_and_specials_are_single_tokens(gguf_path):
    from moeforge.runtime.tokenizer import Tokenizer
    f = GGUFFile(gguf_path)
    tok = Tokenizer.from_gguf(f)
    tokens = f.metadata["tokenizer.ggml.tokens"]
    merged = next(t for t in tokens[256:] if t.startswith("\u0120") and len(t) >= 3)
    word = " " + merged[1:]
    assert tok.encode("x" + word)[1:] == [tokens.index(merged)]
    assert tok.encode("<|im_end|>") == [tokens.index("<|im_end|>")]
    assert tok.eos_id == tokens.index("<|im_end|>") and tok.add_bos is False


def test_model_tokenizer_and_ids(gguf_path):
    from moeforge.runtime.model import load_model
    m = load_model(gguf_path, backend="numpy")
    ids = m.tokenizer.encode("some text to score")
    assert m.logits(ids).shape == (len(ids), 512)
    assert isinstance(m.generate(np.asarray(ids), 2)[0], int)


def test_missing_tokenizers_package_is_a_clear_error(gguf_path, monkeypatch):
    from moeforge.runtime.tokenizer import Tokenizer
    real = builtins.__import__

    def fake(name, *a, **k):
        if name.startswith("tokenizers"):
            raise ImportError(name)
        return real(name, *a, **k)
    monkeypatch.setattr(builtins, "__import__", fake)
    with pytest.raises(ImportError, match="pip install tokenizers"):
        Tokenizer.from_gguf(GGUFFile(gguf_path))


def test_unsupported_vocabulary(gguf_path, tmp_path):
    from moeforge.runtime.tokenizer import Tokenizer
    f = GGUFFile(gguf_path)
    f.metadata["tokenizer.ggml.model"] = "bert"
    with pytest.raises(GGUFError, match="gpt2-style"):
        Tokenizer.from_gguf(f)


def test_token_bytes_join_to_the_texts_bytes(gguf_path):
    """Each token's bytes (pieces of a character for some) join to the text's UTF-8: what
    the server's logprobs name a token by."""
    from moeforge.runtime.tokenizer import Tokenizer
    tok = Tokenizer.from_gguf(GGUFFile(gguf_path))
    for text in ("Ünïcødé ✓ 中文 🙂", "plain words", "<|im_start|>user\nhi<|im_end|>"):
        ids = tok.encode(text)
        assert b"".join(tok.token_bytes(i) for i in ids) == text.encode("utf-8")


def test_text_stream_is_decode_piece_by_piece(gguf_path, rng):
    """Tokenizer.stream: the pieces of random token runs (broken characters among them) join
    to decode() of all of them."""
    from moeforge.runtime.tokenizer import Tokenizer
    tok = Tokenizer.from_gguf(GGUFFile(gguf_path))
    for _ in range(200):
        ids = rng.integers(0, tok.n_vocab, size=int(rng.integers(1, 30))).tolist()
        s = tok.stream()
        assert "".join(s.add(t) for t in ids) + s.flush() == tok.decode(ids)


def _pieces(pattern: str, text: str) -> list[str]:
    from tokenizers import Regex, pre_tokenizers
    split = pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False)
    return [p for p, _ in split.pre_tokenize_str(text)]


def test_gpt4o_split():
    """gpt-oss's o200k pre-tokenizer ("gpt-4o" in llama.cpp): capitals start a word, a
    contraction stays on its word whatever its case, digits go in threes, punctuation keeps
    its newlines and slashes."""
    from moeforge.runtime.tokenizer import PRE_PATTERNS
    pat = PRE_PATTERNS["gpt-4o"]
    assert _pieces(pat, "Hello world's 12345 CAPS\n\n  x") == [
        "Hello", " world's", " ", "123", "45", " CAPS", "\n\n", " ", " x"]
    assert _pieces(pat, "CamelCase HELLO'S don'T a/b/\n\nc\r\n") == [
        "Camel", "Case", " HELLO'S", " don'T", " a", "/b", "/\n\n", "c", "\r\n"]
    assert _pieces(pat, " ünïcødé ÉCOLE Straße 中文 🙂1234567 ...\tend") == [
        " ünïcødé", " ÉCOLE", " Straße", " 中文", " 🙂", "123", "456", "7", " ...", "\tend"]
    # Qwen2's split differs on exactly these: one digit at a time, CamelCase whole
    assert _pieces(PRE_PATTERNS["qwen2"], "CamelCase 12345") == ["CamelCase", " ", "1", "2", "3", "4", "5"]


def test_gpt4o_vocabulary_loads(gguf_path):
    from moeforge.runtime.tokenizer import Tokenizer
    f = GGUFFile(gguf_path)
    f.metadata["tokenizer.ggml.pre"] = "gpt-4o"
    tok = Tokenizer.from_gguf(f)
    pieces = [p for p, _ in tok._tok.pre_tokenizer.pre_tokenize_str("Hello world's 12345")]
    assert pieces == ["Hello", "\u0120world's", "\u0120", "123", "45"]     # byte-level: space is \u0120
    for text in ("Hello world's 12345 CAPS\n\n  x", "Ünïcødé ✓ 中文 🙂 123456"):
        assert tok.decode(tok.encode(text)) == text
    f.metadata["tokenizer.ggml.pre"] = "o200k-nope"
    with pytest.raises(GGUFError, match="gpt-4o"):
        Tokenizer.from_gguf(f)


def test_glm4_split_and_whole_pieces(gguf_path):
    """GLM-4's vocabulary (llama.cpp's "glm4"): Llama 3's split (digits in threes,
    contractions in any case) and, as llama.cpp's ignore_merges, a piece the vocabulary
    holds is one token whatever the merges say (here with none at all); no BOS."""
    from moeforge.runtime.tokenizer import PRE_PATTERNS, Tokenizer
    assert _pieces(PRE_PATTERNS["glm4"], "Hello WORLD'S 12345\n\n  x") == [
        "Hello", " WORLD", "'S", " ", "123", "45", "\n\n", " ", " x"]
    f = GGUFFile(gguf_path)
    f.metadata["tokenizer.ggml.merges"] = []
    f.metadata["tokenizer.ggml.bos_token_id"] = 1
    f.metadata["tokenizer.ggml.add_bos_token"] = True
    tokens = f.metadata["tokenizer.ggml.tokens"]
    word = next(t for t in tokens if len(t) > 3 and t.isalpha() and t.isascii())
    f.metadata["tokenizer.ggml.pre"] = "qwen2"
    assert len(Tokenizer.from_gguf(f).encode(word, add_bos=False)) == len(word)    # bytes: no merges
    f.metadata["tokenizer.ggml.pre"] = "glm4"
    tok = Tokenizer.from_gguf(f)
    assert tok.encode(word) == [tokens.index(word)] and tok.bos_id is None
    for text in ("Hello world's 12345 CAPS\n\n  x", "Ünïcødé ✓ 中文 🙂 123456"):
        assert tok.decode(tok.encode(text)) == text


def _llama_cpp_ids(parity_models, pre, fixture, file):
    """llama.cpp's ids for texts (tests/fixtures/parity/FILE, from llama-cpp-python 0.3.36)
    and our tokenizer for pre on that fixture's vocabulary."""
    import json
    import os
    from conftest import PARITY_DIR
    from moeforge.runtime.tokenizer import Tokenizer
    with open(os.path.join(PARITY_DIR, file)) as fh:
        want = json.load(fh)
    f = GGUFFile(parity_models[fixture]["path"])
    f.metadata["tokenizer.ggml.pre"] = pre
    return want, Tokenizer.from_gguf(f)


@pytest.mark.parametrize("pre,fixture,file", [("glm4", "glm-f32", "glm4-tokens.json"),
                                              ("deepseek-llm", "ds-f32", "deepseek-llm-tokens.json")])
def test_pre_tokenizer_matches_llama_cpp(parity_models, pre, fixture, file):
    """llama.cpp's ids for texts on a fixture's vocabulary: glm4's split (whole pieces
    before merges, no BOS), deepseek-llm's six splits in turn (newlines, cased letters,
    punctuation runs, trailing spaces, CJK and Hangul, digit runs of any length)."""
    want, tok = _llama_cpp_ids(parity_models, pre, fixture, file)
    assert [tok.encode(t) for t in want["texts"]] == want["ids"]


def test_deepseek_llm_pieces(parity_models):
    """The ds fixture's few merges rarely cross a split, so the pieces themselves, as the six
    rules in turn cut them (a space stays off a digit run, punctuation runs keep one leading
    space, trailing spaces end as one piece, CJK and Hangul runs stand alone)."""
    _, tok = _llama_cpp_ids(parity_models, "deepseek-llm", "ds-f32", "deepseek-llm-tokens.json")
    pieces = {"Hello world's 1234567 CAPS\n\n  x": ["Hello", " world", "'", "s", " ", "1234567", " CAPS", "\n", "\n",
                                                 " ", " x"],
              "中文字符 한국어 text 99": ["中文字符", " ", "한국어", " text", " ", "99"],
              "x=(y+1)*2; // done...  ": ["x", "=(", "y", "+", "1", ")*", "2", ";", " //", " done", "...", "  "]}
    for text, want_pieces in pieces.items():
        assert [text[a:b] for _, (a, b) in tok._tok.pre_tokenizer.pre_tokenize_str(text)] == want_pieces
