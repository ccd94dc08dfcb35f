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
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError(f"messages[{i}] must be a dict with a string 'role' and a string 'content', got {m!r}")
        if m["role"] not in ROLES:
            raise ValueError(f"messages[{i}]['role'] is {m['role']!r}; expected one of {ROLES}")
        out.append(dict(m))
    return out


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
    try:
        return _environment().from_string(template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, bos_token=bos_token,
            eos_token=eos_token, **variables)
    except ChatTemplateError:
        raise
    except Exception as e:   # syntax, undefined names, the sandbox's refusals, type errors
        raise ChatTemplateError(f"the chat template failed: {type(e).__name__}: {e}") from None
