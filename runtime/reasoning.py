"""A chat reply's reasoning kept apart from its answer, as the text streams in.

Two formats, told apart by the model's vocabulary (`format_of`):
  "think"    <think> ... </think>, then the answer (Qwen3, DeepSeek-R1). A template that
             opens <think> in the prompt itself has the reply start inside it: the prompt's
             last tokens say so.
  "harmony"  gpt-oss: messages "<|channel|>NAME<|message|>TEXT<|end|>", each after the
             next "<|start|>assistant"; the analysis channel is reasoning, the others (final;
             commentary, where tool calls go) are the answer.
llama.cpp's server (--reasoning-format) and vLLM's reasoning parsers hand the two out apart,
as `reasoning_content` and `content`; `moeforge serve` does the same and `moeforge run`
prints the reasoning to stderr. Markers are held back while the text could still be the
start of one, as stop strings are (runtime.generation).
"""
from __future__ import annotations

FORMATS = ("think", "harmony")
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
H_MESSAGE = "<|message|>"
H_ENDS = ("<|end|>", "<|return|>", "<|call|>", "<|start|>")
H_HEADER_MAX = 256      # a header longer than this is no header: the text is the answer


def format_of(vocab) -> str | None:
    """The reasoning format of a vocabulary (token strings), None where it has neither."""
    tokens = set(vocab)
    if {"<|channel|>", H_MESSAGE, "<|end|>"} <= tokens:
        return "harmony"
    if {THINK_OPEN, THINK_CLOSE} <= tokens:
        return "think"
    return None


def held_back(text: str, markers) -> int:
    """How many characters at the end of text could begin one of the markers."""
    for k in range(min(len(text), max(len(m) for m in markers) - 1), 0, -1):
        if any(m.startswith(text[-k:]) for m in markers):
            return k
    return 0


class ReasoningSplit:
    """add(text) / flush() -> [(kind, piece)], kind "reasoning" or "content", in order."""

    def __init__(self, fmt: str, prompt_tail: str = "", calls: bool = False):
        """calls (harmony): a message to a recipient ("to=functions.NAME" in its header) is a
        tool call, emitted whole at its end as ("call", (NAME, body)) (runtime.tool_calls)."""
        if fmt not in FORMATS:
            raise ValueError(f"reasoning format must be one of {FORMATS}, got {fmt!r}")
        self.fmt, self.buf, self.out, self.calls, self.recipient = fmt, "", [], calls, None
        if fmt == "think":
            opened = prompt_tail.rfind(THINK_OPEN) > prompt_tail.rfind(THINK_CLOSE)
            self.state = "open" if opened else "start"
        else:
            self.state, self.kind = "header", "content"

    def add(self, text: str) -> list[tuple[str, str]]:
        self.buf += text
        (self._think if self.fmt == "think" else self._harmony)(final=False)
        return self._take()

    def flush(self) -> list[tuple[str, str]]:
        (self._think if self.fmt == "think" else self._harmony)(final=True)
        return self._take()

    def _emit(self, kind: str, piece: str) -> None:
        if piece:
            self.out.append((kind, piece))

    def _take(self) -> list[tuple[str, str]]:
        out, self.out = self.out, []
        return out

    def _think(self, final: bool) -> None:
        while True:
            if self.state == "start":
                lead = self.buf.lstrip()
                if lead.startswith(THINK_OPEN):
                    self.buf, self.state = lead[len(THINK_OPEN):], "open"
                elif not final and THINK_OPEN.startswith(lead):
                    return                                   # could still be "<think>"
                else:
                    self.state = "content"
            elif self.state in ("open", "after"):   # blank lines around the reasoning are neither
                self.buf = self.buf.lstrip()
                if not self.buf:
                    return
                self.state = "reasoning" if self.state == "open" else "content"
            elif self.state == "reasoning":
                i = self.buf.find(THINK_CLOSE)
                if i < 0:
                    # held: what could begin the marker, and trailing blanks (they may end the reasoning)
                    sure = self.buf if final else self.buf[:len(self.buf) - held_back(self.buf, (THINK_CLOSE,))].rstrip()
                    self._emit("reasoning", sure)
                    self.buf = self.buf[len(sure):]
                    return
                self._emit("reasoning", self.buf[:i].rstrip())
                self.buf, self.state = self.buf[i + len(THINK_CLOSE):], "after"
            else:
                self._emit("content", self.buf)
                self.buf = ""
                return

    def _harmony(self, final: bool) -> None:
        while True:
            if self.state == "header":
                i = self.buf.find(H_MESSAGE)
                if i >= 0:
                    header = self.buf[:i]
                    name = header.split("<|channel|>")[-1].split()
                    self.kind = "reasoning" if name and name[0] == "analysis" else "content"
                    self.recipient = _recipient(header) if self.calls else None
                    self.buf, self.state = self.buf[i + len(H_MESSAGE):], "body"
                elif len(self.buf) > H_HEADER_MAX or (final and "<|channel|>" not in self.buf):
                    self.kind, self.state = "content", "body"   # not harmony after all: the text as it is
                else:
                    if final:
                        self.buf = ""                            # a header with no message
                    return
            else:
                ends = [j for j in (self.buf.find(m) for m in H_ENDS) if j >= 0]
                if self.recipient is not None and (ends or final):   # a call: its body whole
                    j = min(ends) if ends else len(self.buf)
                    self._emit("call", (self.recipient, self.buf[:j].strip()))
                    self.buf, self.state, self.recipient = self.buf[j:], "body", None
                    self.kind = "content"
                    if not ends:
                        return
                    continue
                if self.recipient is not None:
                    return
                if not ends:
                    keep = 0 if final else held_back(self.buf, H_ENDS)
                    self._emit(self.kind, self.buf[:len(self.buf) - keep])
                    self.buf = self.buf[len(self.buf) - keep:]
                    return
                j = min(ends)
                self._emit(self.kind, self.buf[:j])
                rest = self.buf[j:]
                marker = next(m for m in H_ENDS if rest.startswith(m))
                # the next message's header begins after "<|start|>" (its role is part of it)
                self.buf, self.state = rest[len(marker):], "header"


def _recipient(header: str) -> str | None:
    """The function a harmony header addresses ("to=functions.NAME", before or after the
    channel), None where it names none."""
    at = header.find("to=")
    if at < 0:
        return None
    name = header[at + 3:].split("<|")[0].split()
    if not name:
        return None
    return name[0].removeprefix("functions.")

