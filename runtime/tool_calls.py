"""Tool calls in a chat reply, handed out as OpenAI's API does (`tool_calls`, each a function
name and its arguments as a JSON string), for the formats model files write:
  "hermes"   <tool_call>{"name": ..., "arguments": {...}}</tool_call> blocks in the answer
             (Qwen3, Qwen2.5, Hermes; the vocabulary holds both markers).
  "glm"      <tool_call>NAME then <arg_key>K</arg_key><arg_value>V</arg_value> pairs and
             </tool_call> (GLM-4.5, GLM-4.6: the vocabulary also holds the arg markers); a
             value that is JSON (a number, a list, ...) is taken as such, else as a string.
  "harmony"  gpt-oss: a message whose header names a recipient ("to=functions.NAME"), its
             body the arguments, ended by <|call|> (runtime.reasoning reads the headers).
`ReplyParts` runs a reply through the reasoning split and then through the call blocks, as
the text streams in: pieces of reasoning and of content as they come, each call whole once
its block ends. A block that does not parse (not JSON, no name) stays content, as vLLM's
parsers leave it: nothing the model wrote is lost.
"""
from __future__ import annotations

import json
import re

from .reasoning import ReasoningSplit, held_back

FORMATS = ("hermes", "harmony", "glm")
OPEN, CLOSE = "<tool_call>", "</tool_call>"
GLM_ARG = re.compile(r"\s*<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)


def format_of(vocab) -> str | None:
    """The tool-call format of a vocabulary (token strings), None where it has none."""
    tokens = set(vocab)
    if {"<|channel|>", "<|message|>", "<|call|>"} <= tokens:
        return "harmony"
    if {OPEN, CLOSE, "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"} <= tokens:
        return "glm"
    if {OPEN, CLOSE} <= tokens:
        return "hermes"
    return None


def hermes_call(block: str) -> tuple[str, str] | None:
    """(name, arguments JSON) of a <tool_call> block's inside, None where it is no call."""
    try:
        obj = json.loads(block)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)


def glm_call(block: str) -> tuple[str, str] | None:
    """(name, arguments JSON) of a GLM <tool_call> block's inside, None where it is no call:
    a name, then only argument pairs."""
    i = block.find("<arg_key>")
    name, rest = (block, "") if i < 0 else (block[:i], block[i:])
    name = name.strip()
    if not name or any(c.isspace() for c in name):
        return None
    args, at = {}, 0
    for m in GLM_ARG.finditer(rest):
        if m.start() != at:
            return None
        args[m.group(1).strip()], at = _glm_value(m.group(2)), m.end()
    if rest[at:].strip():
        return None
    return name, json.dumps(args, ensure_ascii=False)


def _glm_value(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text


class HermesCalls:
    """add(text) / flush() -> [(kind, value)]: ("content", text) around the blocks, ("call",
    (name, arguments)) for each block once it closes. parse: a block's inside -> the call
    or None (hermes_call; glm_call for GLM's blocks)."""

    def __init__(self, parse=hermes_call):
        self.buf, self.inside, self.parse = "", False, parse

    def add(self, text: str) -> list:
        self.buf += text
        return self._run(final=False)

    def flush(self) -> list:
        return self._run(final=True)

    def _run(self, final: bool) -> list:
        out = []
        while self.buf:
            if not self.inside:
                i = self.buf.find(OPEN)
                if i < 0:
                    keep = 0 if final else held_back(self.buf, (OPEN,))
                    out.append(("content", self.buf[:len(self.buf) - keep]))
                    self.buf = self.buf[len(self.buf) - keep:]
                    break
                out.append(("content", self.buf[:i]))
                self.buf, self.inside = self.buf[i + len(OPEN):], True
            else:
                j = self.buf.find(CLOSE)
                if j < 0:
                    if final:     # the reply ended inside a block: a call if it parses
                        call = self.parse(self.buf.strip())
                        out.append(("call", call) if call else ("content", OPEN + self.buf))
                        self.buf = ""
                    break
                call = self.parse(self.buf[:j].strip())
                out.append(("call", call) if call else ("content", OPEN + self.buf[:j + len(CLOSE)]))
                self.buf, self.inside = self.buf[j + len(CLOSE):], False
        return [(k, v) for k, v in out if v]


class ReplyParts:
    """A chat reply as [(kind, value)]: "reasoning" and "content" text pieces, and "call"
    (name, arguments) where `calls` names a format (None: tool calls stay text)."""

    def __init__(self, reasoning: str | None, calls: str | None = None, prompt_tail: str = ""):
        if calls not in (None, *FORMATS):
            raise ValueError(f"tool-call format must be one of {FORMATS}, got {calls!r}")
        if calls == "harmony" and reasoning != "harmony":
            raise ValueError("harmony tool calls are read with the harmony reasoning split")
        self.split = ReasoningSplit(reasoning, prompt_tail, calls=calls == "harmony") if reasoning else None
        self.hermes = {"hermes": HermesCalls, "glm": lambda: HermesCalls(glm_call)}.get(calls, lambda: None)()

    def add(self, text: str) -> list:
        return self._calls(self.split.add(text) if self.split else [("content", text)], final=False)

    def flush(self) -> list:
        return self._calls(self.split.flush() if self.split else [], final=True)

    def _calls(self, parts, final: bool) -> list:
        if self.hermes is None:
            return parts
        out = []
        for kind, value in parts:
            out += self.hermes.add(value) if kind == "content" else [(kind, value)]
        return out + (self.hermes.flush() if final else [])


def whole(reasoning: str | None, calls: str | None, text: str, prompt_tail: str = "") -> tuple[str, str, list]:
    """(reasoning, content, [(name, arguments)]) of a whole reply."""
    p = ReplyParts(reasoning, calls, prompt_tail)
    parts = p.add(text) + p.flush()
    return ("".join(v for k, v in parts if k == "reasoning"), "".join(v for k, v in parts if k == "content"),
            [v for k, v in parts if k == "call"])
