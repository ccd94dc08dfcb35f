"""`moeforge run`: a completion of a prompt, or a chat in the file's own template (one turn
with --chat, a conversation read from stdin with -i), streamed as it is generated."""
from __future__ import annotations

import sys
import time

from .cli_model import _model_options, _load


def add_run_command(sub) -> None:
    r = sub.add_parser("run", help="complete a prompt or chat (greedy, or sampled as llama.cpp samples)")
    r.add_argument("model", metavar="MODEL.gguf")
    r.add_argument("-p", "--prompt", default=None, help="the text to complete (with --chat: the user's message)")
    r.add_argument("-n", type=int, default=None,
                   help="tokens to generate at most (default 32; in a chat 512 a reply)")
    r.add_argument("--chat", action="store_true", help="the prompt is a user message in the file's chat template")
    r.add_argument("-i", "--interactive", action="store_true",
                   help="a conversation: each line of stdin is a user message (after -p, if given)")
    r.add_argument("--system", default=None, help="a system message for the chat")
    r.add_argument("--no-think", action="store_true",
                   help="pass enable_thinking=false to the chat template (Qwen3's switch)")
    r.add_argument("--reasoning-format", default="auto", choices=("auto", "none"),
                   help="auto (default): in a chat, the reply's reasoning (<think>, gpt-oss's analysis channel) "
                        "goes to stderr and only the answer to stdout (and into the conversation); none: the "
                        "reply's text as it is")
    r.add_argument("--temp", type=float, default=0.0,
                   help="temperature; 0 (the default) is greedy; llama.cpp's default is 0.8")
    r.add_argument("--top-k", type=int, default=40, help="keep the k most probable tokens (0: off; default 40)")
    r.add_argument("--top-p", type=float, default=0.95, help="keep the most probable tokens up to this mass "
                   "(1: off; default 0.95)")
    r.add_argument("--min-p", type=float, default=0.05, help="drop tokens less probable than this fraction of the "
                   "most probable (0: off; default 0.05)")
    r.add_argument("--repeat-penalty", type=float, default=1.0, help="llama.cpp's repetition penalty (1: off)")
    r.add_argument("--repeat-last-n", type=int, default=64, help="tokens the penalties look back at (default 64)")
    r.add_argument("--frequency-penalty", type=float, default=0.0, help="less this per occurrence (0: off)")
    r.add_argument("--presence-penalty", type=float, default=0.0, help="less this once a token occurred (0: off)")
    r.add_argument("--seed", type=int, default=None, help="seed of the draws (default: a fresh one every run)")
    r.add_argument("--ignore-eos", action="store_true", help="generate n tokens even past end of generation")
    r.add_argument("--backend", default="cuda", choices=("cuda", "numpy"))
    _model_options(r)
    r.set_defaults(func=_cmd_run)


def _sampling(args):
    from .runtime.sampling import Sampling
    try:   # bad settings are named before the model loads
        return Sampling(temperature=args.temp, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                        repeat_penalty=args.repeat_penalty, repeat_last_n=args.repeat_last_n,
                        seed=args.seed, frequency_penalty=args.frequency_penalty,
                        presence_penalty=args.presence_penalty).check()
    except ValueError as e:
        raise SystemExit(f"moeforge run: {e}") from None


def _stream(model, ids: list[int], n: int, sampling, ignore_eos: bool, reasoning: str | None = None) -> str:
    """Generate, printing the text as it comes, then the prompt's and the tokens' speed; the
    reply's text. reasoning (a runtime.reasoning format): its reasoning goes to stderr, the
    answer (returned) to stdout."""
    from .runtime.generation import Generation
    from .runtime.tool_calls import ReplyParts
    gen = Generation(model, ids, n, sampling, eos=not ignore_eos)
    parts = ReplyParts(reasoning, None, model.tokenizer.decode(ids[-8:]))
    answer = []
    t0 = time.perf_counter()

    def put(kind: str, piece: str) -> None:
        out = sys.stderr if kind == "reasoning" else sys.stdout
        if kind == "content":
            answer.append(piece)
        out.write(piece)
        out.flush()

    def show(piece: str) -> None:
        for kind, p in parts.add(piece):
            put(kind, p)

    gen.run(on_text=show)
    for kind, p in parts.flush():
        put(kind, p)
    t1 = time.perf_counter()
    sys.stdout.write("\n")
    sys.stdout.flush()
    # as llama.cpp reports: the prompt pass (to the first token), then the tokens after it
    tp = (gen.first_token_at or t1) - t0
    k = len(gen.tokens)
    rate = lambda c, s: f"{c / s:.1f} t/s" if s > 0 and c else "-"  # noqa: E731
    print(f"moeforge run: prompt {len(ids)} tokens in {tp:.3f} s ({rate(len(ids), tp)}), "
          f"generated {k} tokens ({rate(k - 1, t1 - t0 - tp)} after the first)", file=sys.stderr)
    return "".join(answer)


def _cmd_run(args) -> int:
    sampling = _sampling(args)
    chat = args.chat or args.interactive or args.system is not None
    if args.prompt is None and not args.interactive:
        raise SystemExit("moeforge run: give a prompt (-p), or -i for a conversation")
    model = _load(args)
    tok = model.tokenizer
    if not chat:
        ids = tok.encode(args.prompt)
        if not ids:
            raise SystemExit("moeforge run: the prompt encodes to no tokens")
        sys.stdout.write(args.prompt)
        _stream(model, ids, 32 if args.n is None else args.n, sampling, args.ignore_eos)
        return 0
    variables = {"enable_thinking": False} if args.no_think else {}
    reasoning = model.reasoning_format if args.reasoning_format == "auto" else None
    messages = [{"role": "system", "content": args.system}] if args.system else []
    turns = [args.prompt] if args.prompt is not None else []

    def lines():
        yield from turns
        if args.interactive:
            while True:
                print("> ", end="", file=sys.stderr, flush=True)
                line = sys.stdin.readline()
                if not line:
                    return
                if line.strip():
                    yield line.rstrip("\n")

    for user in lines():
        messages.append({"role": "user", "content": user})
        try:
            ids = model.chat_prompt(messages, **variables)
        except ValueError as e:
            raise SystemExit(f"moeforge run: {e}") from None
        # the answer alone goes into the conversation (templates drop the reasoning of earlier
        # turns, and gpt-oss's refuses channel markers in a message's content)
        reply = _stream(model, ids, 512 if args.n is None else args.n, sampling, args.ignore_eos, reasoning)
        messages.append({"role": "assistant", "content": reply})
    return 0
