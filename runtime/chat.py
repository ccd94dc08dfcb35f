"""Chat prompts from the model file's own template (`tokenizer.chat_template`), rendered
the way Hugging Face's tokenizers render them, so that a GGUF converted from a chat model
is prompted as it was trained: Jinja2 in an immutable sandbox (a template is data from a
file, never trusted code), trim_blocks and lstrip_blocks, `raise_exception` and a `tojson`
that keeps non-ASCII text."""
from __future__ import annotations

import json
from datetime import datetime

ROLES = ("system", "user", "assistant", "tool")


class ChatTemplateError(ValueError):
    pass


def check_messages(messages) -> list[dict]:
    """The messages as the templates take them, every problem a ValueError naming the
    message. OpenAI's forms: content a string or a list of text parts (joined); an
    assistant message may carry `tool_calls` and no content; a tool message answers one
    (`tool_call_id`). A call's arguments reach the template as a mapping where they are a
    JSON object (what Hugging Face's templates expect; clients send a JSON string)."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ValueError(f"messages[{i}] must be a dict with a string 'role' and a string 'content', got {m!r}")
        if m["role"] not in ROLES:
            raise ValueError(f"messages[{i}]['role'] is {m['role']!r}; expected one of {ROLES}")
        m = dict(m)
        calls = m.get("tool_calls")
        if calls is not None:
            if m["role"] != "assistant":
                raise ValueError(f"messages[{i}]: only an assistant message carries 'tool_calls'")
            if not isinstance(calls, list):
                _bad(i, "'tool_calls' must be a list")
            m["tool_calls"] = [_check_call(i, j, c) for j, c in enumerate(calls)]
        content = m.get("content")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise ValueError(f"messages[{i}]['content']: only text parts ({{'type': 'text', 'text': ...}}) "
                                 f"are taken")
            m["content"] = "".join(p["text"] for p in content)
        elif content is None and calls:
            m["content"] = ""
        elif not isinstance(content, str):
            raise ValueError(f"messages[{i}] must be a dict with a string 'role' and a string 'content', got {m!r}")
        # a reply's reasoning handed back (the server's reasoning_content): Qwen's templates read
        # it under that name, gpt-oss's as `thinking` (its tool-call turns keep it)
        if isinstance(m.get("reasoning_content"), str) and "thinking" not in m:
            m["thinking"] = m["reasoning_content"]
        out.append(m)
    return out


def _bad(i: int, what: str):
    raise ValueError(f"messages[{i}]: {what}")


def _check_call(i: int, j: int, call) -> dict:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        _bad(i, f"tool_calls[{j}] must be {{'type': 'function', 'function': {{'name': ..., 'arguments': ...}}}}")
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            parsed = json.loads(args) if args.strip() else {}
        except ValueError:
            parsed = None
        args = parsed if isinstance(parsed, dict) else args
    elif not isinstance(args, dict):
        _bad(i, f"tool_calls[{j}]['function']['arguments'] must be a JSON string or an object")
    return {**call, "type": call.get("type", "function"), "function": {**fn, "arguments": args}}


def _environment():
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise ChatTemplateError(f"the chat template refused the messages: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda v, indent=None, **_: json.dumps(v, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def render(template: str, messages, *, add_generation_prompt: bool = True, bos_token: str = "",
           eos_token: str = "", **variables) -> str:
    """The prompt text of `messages` under `template`; `variables` reach the template as
    they are (Qwen3's `enable_thinking`, say)."""
    messages = check_messages(messages)
    if variables.get("tools") and "tools" not in template:
        raise ChatTemplateError("the chat template does not take 'tools' (it never names them)")
    try:
        return _environment().from_string(template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, bos_token=bos_token,
            eos_token=eos_token, **variables)
    except ChatTemplateError:
        raise
    except Exception as e:   # syntax, undefined names, the sandbox's refusals, type errors
        raise ChatTemplateError(f"the chat template failed: {type(e).__name__}: {e}") from None
