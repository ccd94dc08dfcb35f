"""`moeforge serve`: one model behind the OpenAI-style HTTP endpoints that llama.cpp's and
vLLM's servers offer (/v1/completions, /v1/chat/completions, /v1/models, /health), with
server-sent events for `"stream": true`. Requests run one at a time, on the thread that
serves (the one that loaded the model: CUDA work stays on the thread whose context holds
it); one model, one KV cache; the standard library's HTTP server, no other dependency."""
from __future__ import annotations

import json
import time
import uuid
from http.server import BaseHTTPRequestHandler, HTTPServer

from .logprobs import MAX_TOP, chat_logprobs, completion_logprobs, sequence_logprobs
from .runtime.generation import Generation
from .runtime.tool_calls import ReplyParts, whole

# request fields and their types; top_k, min_p and repeat_penalty are llama.cpp's extensions
FIELDS = {"max_tokens": int, "temperature": (int, float), "top_p": (int, float), "top_k": int,
          "min_p": (int, float), "repeat_penalty": (int, float), "seed": int, "stream": bool,
          "frequency_penalty": (int, float), "presence_penalty": (int, float), "echo": bool,
          "top_logprobs": int,
          "stop": (str, list), "prompt": (str, list), "messages": list, "model": str, "n": int,
          "tools": list, "tool_choice": (str, dict), "parallel_tool_calls": bool,
          "max_completion_tokens": int, "stream_options": dict, "logit_bias": dict}
DEFAULT_MAX_TOKENS = 256


class RequestError(ValueError):
    pass


def parse_request(body: bytes, chat: bool) -> dict:
    """The request as checked values; every problem is a RequestError naming the field."""
    try:
        req = json.loads(body or b"{}")
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RequestError(f"the body is not JSON: {e}") from None
    if not isinstance(req, dict):
        raise RequestError("the body must be a JSON object")
    for key, types in FIELDS.items():
        v = req.get(key)
        if v is not None and (not isinstance(v, types) or isinstance(v, bool) and types is not bool):
            raise RequestError(f"'{key}' has the wrong type ({type(v).__name__})")
    need = "messages" if chat else "prompt"
    if req.get(need) is None:
        raise RequestError(f"'{need}' is required")
    if req.get("n", 1) != 1:
        raise RequestError("'n' must be 1 (one completion a request)")
    # OpenAI's newer name for max_tokens (its SDKs send it for chat)
    newer = req.get("max_completion_tokens")
    if newer is not None and req.get("max_tokens") is not None and newer != req["max_tokens"]:
        raise RequestError("'max_tokens' and 'max_completion_tokens' differ: give one")
    if newer is not None:
        req = {**req, "max_tokens": newer}
    if req.get("max_tokens", DEFAULT_MAX_TOKENS) < 0:
        raise RequestError("'max_tokens' must be >= 0")
    opts = req.get("stream_options")
    if opts is not None and (not req.get("stream") or set(opts) - {"include_usage"}
                             or not isinstance(opts.get("include_usage", False), bool)):
        raise RequestError("'stream_options' is {'include_usage': true|false}, with 'stream': true")
    stop = req.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not all(isinstance(s, str) and s for s in stop):
        raise RequestError("'stop' must be a string or a list of non-empty strings")
    prompt = req.get("prompt")
    if isinstance(prompt, list) and not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        raise RequestError("'prompt' must be a string or a list of token ids")
    # logprobs: a count of alternatives for completions, a switch (with top_logprobs) for chat
    lp = req.get("logprobs")
    top = req.get("top_logprobs", 0) if chat else lp
    if chat and lp is not None and not isinstance(lp, bool):
        raise RequestError("'logprobs' must be true or false (the count is 'top_logprobs')")
    if not chat and lp is not None and (isinstance(lp, bool) or not isinstance(lp, int)):
        raise RequestError("'logprobs' must be an integer: how many alternatives each token lists")
    if top is not None and not 0 <= top <= MAX_TOP:
        raise RequestError(f"'{'top_logprobs' if chat else 'logprobs'}' must be in [0, {MAX_TOP}]")
    if req.get("stream") and (lp or req.get("echo")):
        raise RequestError("'logprobs' and 'echo' are not streamed: ask without 'stream'")
    return {**req, "stop": stop, "tools": _tools_of(req, chat)}


def _tools_of(req: dict, chat: bool) -> list | None:
    """The request's tools where the model may call them (None: no tools, or tool_choice
    "none"). "required" and a named function would need decoding constrained to a call,
    which moeforge does not do: refused, not ignored."""
    tools, choice = req.get("tools"), req.get("tool_choice")
    if tools is None:
        if choice is not None:
            raise RequestError("'tool_choice' is only allowed when 'tools' are given")
        return None
    if not chat:
        raise RequestError("'tools' are for /v1/chat/completions")
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) and t.get("type", "function") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise RequestError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., "
                               f"'parameters': {{...}}}}}}")
        if not isinstance(fn.get("parameters", {}), dict):
            raise RequestError(f"tools[{i}]['function']['parameters'] must be a JSON schema object")
    if choice not in (None, "auto", "none"):
        raise RequestError(f"'tool_choice' {choice!r} would need decoding constrained to a call, which moeforge "
                           f"does not do: use 'auto' (the default) or 'none'")
    return tools if tools and choice != "none" else None


def _logit_bias(req: dict, n_vocab: int) -> tuple:
    """OpenAI's logit_bias, {"token id": bias in [-100, 100]}, as (id, bias) pairs."""
    out = []
    for k, v in (req.get("logit_bias") or {}).items():
        t = int(k) if isinstance(k, str) and k.isdigit() else -1
        if not 0 <= t < n_vocab:
            raise RequestError(f"'logit_bias' key {k!r} is not a token id of this model (0 .. {n_vocab - 1})")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not -100 <= v <= 100:
            raise RequestError(f"'logit_bias' of token {k}: {v!r} is not a number in [-100, 100]")
        out.append((t, float(v)))
    return tuple(out)


def sampling_of(req: dict, n_vocab: int):
    from .runtime.sampling import Sampling
    # llama.cpp's server defaults where the request says nothing
    s = Sampling(logit_bias=_logit_bias(req, n_vocab), temperature=float(req.get("temperature", 0.8)),
                 top_k=req.get("top_k", 40),
                 top_p=float(req.get("top_p", 0.95)), min_p=float(req.get("min_p", 0.05)),
                 repeat_penalty=float(req.get("repeat_penalty", 1.0)), seed=req.get("seed"),
                 frequency_penalty=float(req.get("frequency_penalty", 0.0)),
                 presence_penalty=float(req.get("presence_penalty", 0.0)))
    try:
        return s.check()
    except ValueError as e:
        raise RequestError(str(e)) from None


REASONING = ("auto", "none")


class Server(HTTPServer):
    def __init__(self, address, model, name: str, n_ctx: int, quiet: bool = False, reasoning: str = "auto"):
        super().__init__(address, Handler)
        self.model, self.model_name, self.n_ctx, self.quiet = model, name, n_ctx, quiet
        # chat replies: the reasoning as `reasoning_content`, apart from `content` (as llama.cpp's
        # --reasoning-format and vLLM's reasoning parsers give it); "none": the text as it is
        self.reasoning = model.reasoning_format if reasoning == "auto" else None
        # where a request gives tools, the calls the reply writes as `tool_calls`
        self.tool_calls = model.tool_call_format


class Handler(BaseHTTPRequestHandler):
    server: Server

    def log_message(self, fmt, *args):
        if not self.server.quiet:
            super().log_message(fmt, *args)

    def _json(self, code: int, obj: dict) -> None:
        data = json.dumps(obj, ensure_ascii=False).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, code: int, message: str, kind: str = "invalid_request_error") -> None:
        self._json(code, {"error": {"message": message, "type": kind, "code": code}})

    def do_GET(self):
        if self.path == "/health":
            return self._json(200, {"status": "ok"})
        if self.path == "/v1/models":
            return self._json(200, {"object": "list", "data": [
                {"id": self.server.model_name, "object": "model", "owned_by": "moeforge"}]})
        self._error(404, f"no such endpoint: GET {self.path}")

    def do_POST(self):
        chat = self.path == "/v1/chat/completions"
        if not chat and self.path != "/v1/completions":
            return self._error(404, f"no such endpoint: POST {self.path}")
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        try:
            req = parse_request(body, chat)
            gen = self._generation(req, chat)
        except ValueError as e:      # RequestError, and the model's own checks (token ids, messages)
            return self._error(400, str(e))
        try:
            if req.get("stream"):
                return self._stream(req, gen, chat)
            gen.run()
            choice = self._choice(req, gen, chat)
        except Exception as e:  # noqa: BLE001 - reported to the client, the server stays up
            return self._error(500, f"{type(e).__name__}: {e}", "server_error")
        done = self._head(chat)
        done.update(choices=[choice], usage=_usage(gen))
        self._json(200, done)

    def _choice(self, req: dict, gen: Generation, chat: bool) -> dict:
        """The reply's choice, with the log-probabilities and the echoed prompt asked for."""
        m, choice = self.server.model, {"index": 0, "finish_reason": gen.finish}
        if chat:
            thought, answer, calls = whole(self.server.reasoning, self._calls(req), gen.text, self._prompt_tail(gen))
            choice["message"] = {"role": "assistant", "content": answer}
            if thought:
                choice["message"]["reasoning_content"] = thought
            if calls:
                if req.get("parallel_tool_calls") is False:
                    calls = calls[:1]
                # as OpenAI's: no text but the calls is a null content
                choice["message"].update(content=answer if answer.strip() else None,
                                         tool_calls=[_call_of(c) for c in calls])
                choice["finish_reason"] = "tool_calls"
            if req.get("logprobs"):
                scored = sequence_logprobs(m, gen.ids + gen.tokens, len(gen.ids), req.get("top_logprobs", 0))
                choice["logprobs"] = chat_logprobs(m.tokenizer, scored)
            return choice
        echo = bool(req.get("echo"))
        prompt = req["prompt"] if isinstance(req["prompt"], str) else m.tokenizer.decode(gen.ids)
        choice["text"] = prompt + gen.text if echo else gen.text
        if req.get("logprobs") is not None:
            scored = sequence_logprobs(m, gen.ids + gen.tokens, 0 if echo else len(gen.ids), req["logprobs"])
            choice["logprobs"] = completion_logprobs(m.tokenizer, scored, 0 if echo else len(prompt))
        return choice

    def _calls(self, req: dict) -> str | None:
        """The tool-call format read from this request's reply (None: calls stay text)."""
        fmt = self.server.tool_calls if req.get("tools") else None
        return None if fmt == "harmony" and self.server.reasoning != "harmony" else fmt

    def _generation(self, req: dict, chat: bool) -> Generation:
        m = self.server.model
        sampling = sampling_of(req, m.hp.n_vocab)
        if chat and req.get("tools"):
            if self.server.tool_calls is None:
                raise RequestError("this model writes no tool calls moeforge reads (its vocabulary has neither "
                                   "<tool_call> and </tool_call> nor gpt-oss's harmony tokens)")
            ids = m.chat_prompt(req["messages"], tools=req["tools"])
        elif chat:
            ids = m.chat_prompt(req["messages"])
        elif isinstance(req["prompt"], str):
            ids = m.tokenizer.encode(req["prompt"])
        else:
            ids = [int(t) for t in m._check_tokens(req["prompt"])]
        if not ids:
            raise RequestError("the prompt holds no tokens")
        n = req.get("max_tokens", DEFAULT_MAX_TOKENS)
        if len(ids) + n > self.server.n_ctx:
            raise RequestError(f"the prompt ({len(ids)} tokens) and max_tokens ({n}) exceed the context of "
                               f"{self.server.n_ctx} tokens (moeforge serve --ctx)")
        return Generation(m, ids, n, sampling, req["stop"])

    def _prompt_tail(self, gen: Generation) -> str:
        """The prompt's last tokens as text (a template may open the reasoning there)."""
        return self.server.model.tokenizer.decode(gen.ids[-8:])

    def _head(self, chat: bool, chunk: bool = False) -> dict:
        kind = "chat.completion" if chat else "text_completion"
        return {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}",
                "object": kind + (".chunk" if chunk and chat else ""), "created": int(time.time()),
                "model": self.server.model_name}

    def _stream(self, req: dict, gen: Generation, chat: bool) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.end_headers()
        head = self._head(chat, chunk=True)
        usage = (req.get("stream_options") or {}).get("include_usage", False)
        if usage:      # as OpenAI's: every chunk has usage, null but in the last one, which has no choices
            head["usage"] = None

        def event(choice: dict) -> None:
            self.wfile.write(b"data: " + json.dumps({**head, "choices": [choice]}, ensure_ascii=False).encode()
                             + b"\n\n")
            self.wfile.flush()

        def delta(text: str, finish=None) -> dict:
            body = {"delta": {"content": text}} if chat else {"text": text}
            return {"index": 0, "finish_reason": finish, **body}

        calls = self._calls(req) if chat else None
        parts = ReplyParts(self.server.reasoning, calls, self._prompt_tail(gen)) if chat else None
        n_calls, one_call = 0, req.get("parallel_tool_calls") is False

        def put(pieces) -> None:
            nonlocal n_calls
            for kind, p in pieces:
                if kind == "call" and one_call and n_calls:
                    continue
                if kind == "call":    # whole, as its block ends: name and arguments in one delta
                    d = {"tool_calls": [{"index": n_calls, **_call_of(p)}]}
                    n_calls += 1
                else:
                    d = {"reasoning_content" if kind == "reasoning" else "content": p}
                event({"index": 0, "finish_reason": None, "delta": d})

        def send(piece: str) -> bool:
            try:
                if parts is None:
                    event(delta(piece))
                else:
                    put(parts.add(piece))
                return False
            except OSError:          # the client closed the stream: stop generating for it
                return True

        try:
            if chat:
                event({"index": 0, "finish_reason": None, "delta": {"role": "assistant"}})
            gen.run(on_text=send)
            if parts is not None:
                put(parts.flush())
            event(delta("", "tool_calls" if n_calls else gen.finish))
            if usage:
                self.wfile.write(b"data: " + json.dumps({**head, "choices": [], "usage": _usage(gen)}).encode()
                                 + b"\n\n")
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()
        except OSError:
            pass


def _usage(gen: Generation) -> dict:
    return {"prompt_tokens": len(gen.ids), "completion_tokens": len(gen.tokens),
            "total_tokens": len(gen.ids) + len(gen.tokens)}


def _call_of(call: tuple[str, str]) -> dict:
    """A tool call as OpenAI's API gives it: an id, the function's name, its arguments as a
    JSON string."""
    name, args = call
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": name, "arguments": args}}


def add_serve_command(sub) -> None:
    from .cli_model import _model_options
    s = sub.add_parser("serve", help="serve a model over OpenAI-style HTTP endpoints (as llama-server)")
    s.add_argument("model", metavar="MODEL.gguf")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8080)
    s.add_argument("--ctx", "-c", type=int, default=4096, help="tokens of context a request may use (default 4096)")
    s.add_argument("--alias", default=None, help="the model's name in the API (default: the file's name)")
    s.add_argument("--backend", default="cuda", choices=("cuda", "numpy"))
    s.add_argument("--quiet", action="store_true", help="no request log")
    s.add_argument("--reasoning-format", default="auto", choices=REASONING,
                   help="auto (default): a chat reply's reasoning (<think>, gpt-oss's analysis channel) as "
                        "reasoning_content, apart from content; none: the reply's text as it is")
    _model_options(s)
    s.set_defaults(func=_cmd_serve)


def make_server(model, host: str = "127.0.0.1", port: int = 8080, n_ctx: int = 4096, name: str = "model",
                quiet: bool = False, reasoning: str = "auto") -> Server:
    if n_ctx < 2:
        raise ValueError(f"the context must hold at least 2 tokens, got {n_ctx}")
    if reasoning not in REASONING:
        raise ValueError(f"reasoning must be one of {REASONING}, got {reasoning!r}")
    return Server((host, port), model, name, n_ctx, quiet, reasoning)


def _cmd_serve(args) -> int:
    import os
    import sys

    from .cli_model import _load
    model = _load(args)
    name = args.alias or os.path.basename(args.model)
    srv = make_server(model, args.host, args.port, args.ctx, name, args.quiet, args.reasoning_format)
    print(f"moeforge serve: {name} on http://{srv.server_address[0]}:{srv.server_address[1]} "
          f"(/v1/completions, /v1/chat/completions, /v1/models, /health)", file=sys.stderr, flush=True)
    try:
        srv.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        srv.server_close()
    return 0
