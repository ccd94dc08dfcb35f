"""SentencePiece vocabularies (llama.cpp's "llama" tokenizer model, Mixtral's): llama.cpp's
ids on the mix-* fixtures' vocabulary (tests/fixtures/parity/spm-tokens.json, from
llama-cpp-python 0.3.36: spaces and their runs, byte pieces for what no piece covers,
U+2581 in the text, random strings), decoding back, and what the builder refuses."""
import json
import os

import pytest

from moeforge.runtime.gguf_file import GGUFError, GGUFFile

pytest.importorskip("tokenizers")


@pytest.fixture(scope="module")
def spm(parity_models):
    from conftest import PARITY_DIR
    from moeforge.runtime.tokenizer import Tokenizer
    with open(os.path.join(PARITY_DIR, "spm-tokens.json")) as fh:
        want = json.load(fh)
    return want, Tokenizer.from_gguf(GGUFFile(parity_models["mix-f32"]["path"])), parity_models["mix-f32"]["path"]


def test_ids_are_llama_cpps(spm):
    want, tok, _ = spm
    assert tok.spm_space is True and tok.add_bos and tok.bos_id == 1
    got = [tok.encode(t) for t in want["texts"]]
    assert got == want["ids"]
    assert any(i in range(3, 259) for ids in got for i in ids), "no byte piece among them"
    assert any(len(tok.piece(i)) > 2 for ids in got for i in ids), "no merged piece among them"


def test_decode_undoes_encode_and_pieces_keep_the_space(spm):
    """decode drops the space the encoder put before the text (llama.cpp's detokenizer);
    the pieces one at a time, as a stream prints them, keep it. A U+2581 in the text comes
    back a space (it is the vocabulary's space), as from llama.cpp."""
    want, tok, _ = spm
    for text in want["texts"]:
        ids = tok.encode(text, add_bos=False)
        back = text.replace("\u2581", " ")
        assert tok.decode(ids) == back
        assert tok.decode([tok.bos_id] + ids, skip_special=True) == back
        if text:
            s = tok.stream()
            assert "".join(s.add(i) for i in ids) + s.flush() == " " + back
            assert b"".join(tok.token_bytes(i) for i in ids) == (" " + back).encode()


def test_merges_rank_by_the_score_of_the_piece_they_make():
    from moeforge.runtime.tokenizer_spm import spm_merges
    pieces = ["a", "b", "c", "ab", "bc", "abc"]
    scores = [0.0, 0.0, 0.0, -2.0, -1.0, -3.0]
    assert spm_merges(pieces, scores, [1] * 6) == [("b", "c"), ("a", "b"), ("a", "bc"), ("ab", "c")]
    assert spm_merges(pieces, scores, [1, 1, 1, 1, 3, 1]) == [("a", "b"), ("a", "bc"), ("ab", "c")]


def test_a_broken_vocabulary_is_refused(spm):
    from moeforge.runtime.tokenizer import Tokenizer
    _, _, path = spm
    f = GGUFFile(path)
    f.metadata["tokenizer.ggml.scores"] = f.metadata["tokenizer.ggml.scores"][:-1]
    with pytest.raises(GGUFError, match="scores has"):
        Tokenizer.from_gguf(f)
    f = GGUFFile(path)
    f.metadata["tokenizer.ggml.tokens"] = [("<0x4X>" if t == "<0x41>" else t) for t in f.metadata["tokenizer.ggml.tokens"]]
    with pytest.raises(GGUFError, match="byte pieces"):
        Tokenizer.from_gguf(f)


def test_mixtral_chat_prompt(spm):
    """The synthetic Mixtral's template (Mistral's [INST] turns) through the SentencePiece
    encoder: one BOS, from the template, and the turn's text tokenized after it."""
    from moeforge.runtime.model import load_model
    _, tok, path = spm
    m = load_model(path, backend="numpy")
    ids = m.chat_prompt([{"role": "user", "content": "hi there"}])
    assert ids[0] == tok.bos_id and ids.count(tok.bos_id) == 1
    assert tok.decode(ids[1:]) == "[INST] hi there [/INST]"
