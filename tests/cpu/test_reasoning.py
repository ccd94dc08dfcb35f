"""A chat reply's reasoning apart from its answer (runtime.reasoning): both formats, whole
and streamed in random pieces, and through `moeforge serve` and `moeforge run --chat`."""
import json
import threading

import numpy as np
import pytest
from conftest import fed_in_pieces

from moeforge.runtime.reasoning import ReasoningSplit, format_of
from moeforge.runtime.tool_calls import whole


def split(fmt, text, tail=""):
    """(reasoning, content) of a whole reply, as the server reads one without tools."""
    return whole(fmt, None, text, tail)[:2]

HARMONY = ("<|channel|>analysis<|message|>Weigh it: 2 + 2 is 4, not <|e 5.<|end|>"
           "<|start|>assistant<|channel|>final<|message|>It is 4.")
THINK = "<think>\nWeigh it: 2 + 2 is 4, not </thin 5.\n\n</think>\n\nIt is 4."
CASES = [
    ("harmony", HARMONY, "", ("Weigh it: 2 + 2 is 4, not <|e 5.", "It is 4.")),
    ("think", THINK, "", ("Weigh it: 2 + 2 is 4, not </thin 5.", "It is 4.")),
    ("think", "No reasoning at all.", "", ("", "No reasoning at all.")),
    # a template that opens <think> in the prompt: the reply starts inside it
    ("think", "Still weighing.</think>\n\nDone.", "<|im_start|>assistant\n<think>\n", ("Still weighing.", "Done.")),
    # a closed empty block in the prompt (enable_thinking=False) leaves the reply all answer
    ("think", "Done.", "<think>\n\n</think>\n\n", ("", "Done.")),
    # tool calls go to commentary: answer, not reasoning
    ("harmony", "<|channel|>commentary to=functions.f <|constrain|>json<|message|>{\"a\": 1}", "", ("", "{\"a\": 1}")),
    # a reply with no harmony header is taken as it is
    ("harmony", "plain words", "", ("", "plain words")),
]


@pytest.mark.parametrize("fmt,text,tail,want", CASES)
def test_split_whole_and_streamed(fmt, text, tail, want, rng):
    assert split(fmt, text, tail) == want
    for _ in range(50):     # any cut into pieces gives the same two texts
        parts = fed_in_pieces(ReasoningSplit(fmt, tail), text, rng)
        assert all(p for _, p in parts)
        got = tuple("".join(p for kind, p in parts if kind == k) for k in ("reasoning", "content"))
        assert got == want


def test_nothing_is_handed_out_that_a_marker_could_still_claim():
    s = ReasoningSplit("think")
    assert s.add("<thi") == []
    assert s.add("nk>abc</th") == [("reasoning", "abc")]
    assert s.add("ink>\n\nx") == [("content", "x")]
    h = ReasoningSplit("harmony")
    assert h.add("<|channel|>final") == []                # a header is never text
    assert h.add("<|message|>ok <|") == [("content", "ok ")]
    assert h.add("end|>") == []


def test_format_of_a_vocabulary():
    assert format_of(["a", "<|channel|>", "<|message|>", "<|end|>", "<think>"]) == "harmony"
    assert format_of(["a", "<think>", "</think>"]) == "think"
    assert format_of(["a", "<think>"]) is None
    with pytest.raises(ValueError, match="reasoning format"):
        ReasoningSplit("xml")


@pytest.mark.parametrize("fmt,text", [("think", THINK), ("harmony", HARMONY)])
def test_server_gives_reasoning_content_apart(scripted, fmt, text):
    from test_serve import _call, _events

    from moeforge.serve import make_server
    scripted.script = scripted.tokenizer.encode(text, add_bos=False)
    want_thought, want_answer = split(fmt, text)
    for reasoning in ("auto", "none"):
        srv = make_server(scripted, port=0, n_ctx=256, quiet=True, reasoning=reasoning)
        if reasoning == "auto":
            srv.reasoning = fmt              # as a file with those tokens would have it
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        url = f"http://127.0.0.1:{srv.server_address[1]}"
        try:
            body = {"messages": [{"role": "user", "content": "2 + 2?"}], "max_tokens": 200}
            msg = json.loads(_call(url, "/v1/chat/completions", body)[2])["choices"][0]["message"]
            events = _events(_call(url, "/v1/chat/completions", {**body, "stream": True})[2])
        finally:
            srv.shutdown()
            srv.server_close()
        streamed = {k: "".join(e["choices"][0]["delta"].get(k, "") for e in events)
                    for k in ("content", "reasoning_content")}
        if reasoning == "none":
            assert msg == {"role": "assistant", "content": text} and streamed["content"] == text
            assert streamed["reasoning_content"] == ""
        else:
            assert msg == {"role": "assistant", "content": want_answer, "reasoning_content": want_thought}
            assert streamed == {"content": want_answer, "reasoning_content": want_thought}


def test_run_chat_prints_reasoning_to_stderr_and_keeps_the_answer(scripted, monkeypatch, capsys):
    from moeforge import cli_run
    from moeforge.cli import main
    scripted.script = scripted.tokenizer.encode(THINK, add_bos=False)
    monkeypatch.setattr(cli_run, "_load", lambda args: scripted)
    monkeypatch.setattr(type(scripted), "reasoning_format", property(lambda self: "think"))
    seen = []
    real = type(scripted).chat_prompt
    monkeypatch.setattr(type(scripted), "chat_prompt",
                        lambda self, messages, **kw: seen.append([dict(m) for m in messages]) or real(self, messages, **kw))
    monkeypatch.setattr("sys.stdin", __import__("io").StringIO("again\n"))
    assert main(["run", "x.gguf", "--backend", "numpy", "-i", "-p", "2 + 2?"]) == 0
    out, err = capsys.readouterr()
    assert out.count("It is 4.") == 2 and "Weigh it" not in out
    assert "Weigh it: 2 + 2 is 4, not </thin 5." in err
    # the second turn's conversation holds the first answer alone
    assert seen[1][1] == {"role": "assistant", "content": "It is 4."}
    assert np.all([m["role"] in ("user", "assistant") for m in seen[1]])
