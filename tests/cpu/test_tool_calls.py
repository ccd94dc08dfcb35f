"""Tool calls (runtime.tool_calls, runtime.chat, moeforge serve): hermes blocks and harmony
messages to functions read whole and streamed in any cut, a block that is no call kept as
text, the messages of a tool conversation as templates take them, and the server's
`tool_calls` (whole and streamed) and the requests it refuses."""
import json
import threading

import pytest
from conftest import fed_in_pieces

from moeforge.runtime.chat import ChatTemplateError, check_messages, render
from moeforge.runtime.tool_calls import ReplyParts, format_of, whole

HERMES = ('<think>\nWhich city?\n</think>\n\nLet me look.\n<tool_call>\n{"name": "weather", "arguments": '
          '{"city": "Zürich", "days": 2}}\n</tool_call>\n<tool_call>\n{"name": "time", "arguments": {}}\n</tool_call>')
GLM = ('<think>Which city?</think>Let me look.\n<tool_call>weather\n<arg_key>city</arg_key>\n<arg_value>Zürich'
       '</arg_value>\n<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n<arg_key>units</arg_key>\n<arg_value>["C"]'
       '</arg_value>\n<arg_key>note</arg_key>\n<arg_value>not {json</arg_value>\n</tool_call><tool_call>time</tool_call>')
GLM_SHORT = '<think>Hm.</think>Ok.<tool_call>w\n<arg_key>c</arg_key><arg_value>Zug</arg_value></tool_call><tool_call>t</tool_call>'
HARMONY = ('<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary '
           'to=functions.weather <|constrain|>json<|message|>{"city": "Zürich"}<|call|>')
CASES = [
    ("think", "hermes", HERMES, "",
     ("Which city?", "Let me look.\n\n", [("weather", '{"city": "Zürich", "days": 2}'), ("time", "{}")])),
    ("harmony", "harmony", HARMONY, "", ("Need the weather.", "", [("weather", '{"city": "Zürich"}')])),
    # the recipient in the role part of the header, the reply cut at <|call|> (an end of generation)
    ("harmony", "harmony", '<|channel|>analysis<|message|>ok<|end|><|start|>assistant to=functions.f.g'
     '<|channel|>commentary json<|message|> {"a": [1, 2]} ', "", ("ok", "", [("f.g", '{"a": [1, 2]}')])),
    # a commentary message to no one is content (a preamble), as is a final answer
    ("harmony", "harmony", "<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant<|channel|>"
     "final<|message|>Sunny.", "", ("", "Checking.Sunny.", [])),
    # not JSON, or no name: the block stays text; a block the reply ends inside is a call if it parses
    (None, "hermes", '<tool_call>{"name": oops}</tool_call> and <tool_call>{"arguments": {}}</tool_call>', "",
     ("", '<tool_call>{"name": oops}</tool_call> and <tool_call>{"arguments": {}}</tool_call>', [])),
    (None, "hermes", 'x <tool_call>{"name": "f", "arguments": "{\\"q\\": 1}"}', "", ("", "x ", [("f", '{"q": 1}')])),
    (None, "hermes", "no calls, <tool_ but a near miss", "", ("", "no calls, <tool_ but a near miss", [])),
    # no tool format: the text as it is
    ("think", None, HERMES, "", ("Which city?", HERMES[HERMES.index("Let"):], [])),
    # GLM: a name, then key/value pairs; JSON values as such, the others as strings
    ("think", "glm", GLM, "", ("Which city?", "Let me look.\n", [
        ("weather", '{"city": "Zürich", "days": 2, "units": ["C"], "note": "not {json"}'), ("time", "{}")])),
    # not a call: a name with a space, text between the pairs; a block the reply ends inside parses
    (None, "glm", "<tool_call>two words</tool_call><tool_call>f<arg_key>a</arg_key>x<arg_value>1</arg_value>"
     "</tool_call>", "", ("", "<tool_call>two words</tool_call><tool_call>f<arg_key>a</arg_key>x<arg_value>1"
                         "</arg_value></tool_call>", [])),
    (None, "glm", "ok <tool_call>f\n<arg_key>q</arg_key>\n<arg_value>true</arg_value>", "",
     ("", "ok ", [("f", '{"q": true}')])),
]


@pytest.mark.parametrize("reasoning,calls,text,tail,want", CASES)
def test_calls_whole_and_streamed(reasoning, calls, text, tail, want, rng):
    assert whole(reasoning, calls, text, tail) == want
    for _ in range(40):     # any cut into pieces gives the same parts
        parts = fed_in_pieces(ReplyParts(reasoning, calls, tail), text, rng, most=6)
        assert all(v for _, v in parts)
        got = ("".join(v for k, v in parts if k == "reasoning"), "".join(v for k, v in parts if k == "content"),
               [v for k, v in parts if k == "call"])
        assert got == want


def test_formats_from_the_vocabulary_and_bad_combinations():
    assert format_of(["<|channel|>", "<|message|>", "<|call|>", "<|end|>"]) == "harmony"
    assert format_of(["<tool_call>", "</tool_call>", "<think>"]) == "hermes"
    assert format_of(["<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"]) == "glm"
    assert format_of(["<tool_call>", "a"]) is None
    with pytest.raises(ValueError, match="tool-call format"):
        ReplyParts("think", "json")
    with pytest.raises(ValueError, match="harmony reasoning split"):
        ReplyParts(None, "harmony")


def test_tool_conversation_messages_as_templates_take_them():
    msgs = check_messages([
        {"role": "user", "content": [{"type": "text", "text": "Weather in "}, {"type": "text", "text": "Zürich?"}]},
        {"role": "assistant", "content": None, "reasoning_content": "Look it up.", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Zürich"}'}},
            {"id": "call_2", "type": "function", "function": {"name": "raw", "arguments": "not json"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}])
    assert msgs[0]["content"] == "Weather in Zürich?" and msgs[1]["content"] == ""
    assert msgs[1]["thinking"] == msgs[1]["reasoning_content"] == "Look it up."   # gpt-oss's name, Qwen's
    assert msgs[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Zürich"}     # a mapping for the template
    assert msgs[1]["tool_calls"][1]["function"]["arguments"] == "not json"             # kept as it came
    assert msgs[2]["tool_call_id"] == "call_1"
    template = ("{% for t in tools %}[tool {{ t.function.name }}]{% endfor %}{% for m in messages %}"
                "<{{ m.role }}>{{ m.content }}{% for c in m.tool_calls or [] %}"
                "{{ c.function.name }}({{ c.function.arguments | tojson }}){% endfor %}{% endfor %}")
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]
    text = render(template, msgs, tools=tools)
    assert text.startswith("[tool weather]<user>Weather in Zürich?") and 'weather({"city": "Zürich"})' in text
    with pytest.raises(ChatTemplateError, match="does not take 'tools'"):
        render("{% for m in messages %}{{ m.content }}{% endfor %}", msgs, tools=tools)


@pytest.mark.parametrize("bad,msg", [
    ({"role": "user", "content": "x", "tool_calls": []}, "only an assistant message"),
    ({"role": "assistant", "content": None, "tool_calls": [{"function": {}}]}, r"tool_calls\[0\] must be"),
    ({"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": 3}}]},
     "arguments'] must be"),
    ({"role": "assistant", "content": None, "tool_calls": "f()"}, "must be a list"),
    ({"role": "assistant", "content": None}, "string 'content'"),
    ({"role": "user", "content": [{"type": "image_url", "image_url": {}}]}, "only text parts"),
])
def test_bad_tool_messages_name_what_is_wrong(bad, msg):
    with pytest.raises(ValueError, match=msg):
        check_messages([{"role": "system", "content": "s"}, bad])


TOOLS = [{"type": "function", "function": {"name": "weather", "description": "today's weather",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


def _serve(model, reasoning, calls):
    from moeforge.serve import make_server
    srv = make_server(model, port=0, n_ctx=256, quiet=True)
    srv.reasoning, srv.tool_calls = reasoning, calls       # as a file with those tokens would have it
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, f"http://127.0.0.1:{srv.server_address[1]}"


@pytest.mark.parametrize("reasoning,calls,text", [("think", "hermes", HERMES), ("harmony", "harmony", HARMONY),
                                                  ("think", "glm", GLM_SHORT)])
def test_server_returns_tool_calls_whole_and_streamed(scripted, monkeypatch, reasoning, calls, text):
    from test_serve import _call, _events
    seen = []
    monkeypatch.setattr(type(scripted), "chat_prompt",
                        lambda self, messages, **kw: seen.append(kw) or self.tokenizer.encode("hi", add_bos=False))
    scripted.script = scripted.tokenizer.encode(text, add_bos=False)
    want_thought, want_content, want_calls = whole(reasoning, calls, text)
    srv, url = _serve(scripted, reasoning, calls)
    try:
        body = {"messages": [{"role": "user", "content": "Weather in Zürich?"}], "tools": TOOLS, "max_tokens": 200}
        out = json.loads(_call(url, "/v1/chat/completions", body)[2])["choices"][0]
        events = _events(_call(url, "/v1/chat/completions", {**body, "stream": True})[2])
        plain = json.loads(_call(url, "/v1/chat/completions", {**body, "tool_choice": "none"})[2])["choices"][0]
        one = json.loads(_call(url, "/v1/chat/completions", {**body, "parallel_tool_calls": False})[2])["choices"][0]
        one_events = _events(_call(url, "/v1/chat/completions",
                                   {**body, "parallel_tool_calls": False, "stream": True})[2])
    finally:
        srv.shutdown()
        srv.server_close()
    assert seen[0] == {"tools": TOOLS} and seen[1] == {"tools": TOOLS} and seen[2] == {} and seen[3] == {"tools": TOOLS}
    msg = out["message"]
    assert out["finish_reason"] == "tool_calls" and msg["reasoning_content"] == want_thought
    assert msg["content"] == (want_content if want_content.strip() else None)
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in msg["tool_calls"]] == want_calls
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in msg["tool_calls"])
    assert len({c["id"] for c in msg["tool_calls"]}) == len(want_calls)
    deltas = [e["choices"][0]["delta"] for e in events]
    streamed = [c for d in deltas for c in d.get("tool_calls", [])]
    assert [(c["index"], c["function"]["name"], c["function"]["arguments"]) for c in streamed] == \
        [(i, n, a) for i, (n, a) in enumerate(want_calls)]
    assert "".join(d.get("content", "") for d in deltas) == want_content
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"
    # parallel_tool_calls false: the first call only
    assert [c["function"]["name"] for c in one["message"]["tool_calls"]] == [want_calls[0][0]]
    assert [c["function"]["name"] for e in one_events for c in e["choices"][0]["delta"].get("tool_calls", [])] == \
        [want_calls[0][0]]
    # tool_choice "none": no tools in the prompt, the calls' text stays text
    assert plain["finish_reason"] != "tool_calls" and "tool_calls" not in plain["message"]


@pytest.mark.parametrize("extra,msg", [
    ({"tools": TOOLS, "tool_choice": "required"}, "constrained to a call"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "weather"}}}, "constrained to a call"),
    ({"tool_choice": "auto"}, "only allowed when 'tools'"),
    ({"tools": [{"type": "function", "function": {"description": "x"}}]}, "tools[0] must be"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}, "JSON schema object"),
    ({"tools": "weather"}, "'tools' has the wrong type"),
])
def test_bad_tool_requests_are_400(scripted, extra, msg):
    from test_serve import _call
    srv, url = _serve(scripted, None, "hermes")
    try:
        code, _, body = _call(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], **extra})
    finally:
        srv.shutdown()
        srv.server_close()
    assert code == 400 and msg in json.loads(body)["error"]["message"], body


def test_tools_for_a_model_without_a_call_format_or_template_are_400(scripted):
    from test_serve import _call
    body = {"messages": [{"role": "user", "content": "x"}], "tools": TOOLS}
    for calls, msg in ((None, "writes no tool calls"), ("hermes", "does not take 'tools'")):
        srv, url = _serve(scripted, None, calls)      # the synthetic file's ChatML template names no tools
        try:
            code, _, out = _call(url, "/v1/chat/completions", body)
        finally:
            srv.shutdown()
            srv.server_close()
        assert code == 400 and msg in json.loads(out)["error"]["message"], out
