"""`moeforge serve` on the numpy backend: the OpenAI-style endpoints, streaming, stop
strings, and requests that are refused with a message naming what is wrong."""
import json
import threading
import urllib.error
import urllib.request

import numpy as np
import pytest

from moeforge.runtime.generation import Generation
from moeforge.serve import make_server

pytest.importorskip("tokenizers")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from moeforge.runtime.model import load_model
    from moeforge.synth import preset, write_qwen3moe
    path = str(tmp_path_factory.mktemp("serve") / "t.gguf")
    write_qwen3moe(path, preset("tiny"), "q8_0", seed=11)
    model = load_model(path, backend="numpy", n_ctx=128)
    srv = make_server(model, port=0, n_ctx=128, name="tiny", quiet=True)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}", model
    srv.shutdown()
    srv.server_close()


def _call(url, path, body=None, raw=None):
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.headers.get("Content-Type"), r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("Content-Type"), e.read().decode()


def _events(text):
    lines = [ln[len("data: "):] for ln in text.split("\n\n") if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(ln) for ln in lines[:-1]]


def test_health_and_models(server):
    url, _ = server
    assert json.loads(_call(url, "/health")[2]) == {"status": "ok"}
    models = json.loads(_call(url, "/v1/models")[2])
    assert models["data"][0]["id"] == "tiny"
    assert _call(url, "/nope")[0] == 404


def test_completion_is_the_models_own_greedy_continuation(server):
    url, model = server
    code, kind, body = _call(url, "/v1/completions", {"prompt": "Once upon", "max_tokens": 6, "temperature": 0})
    assert code == 200 and kind == "application/json"
    out = json.loads(body)
    ids = model.tokenizer.encode("Once upon")
    want = model.generate(ids, 6, stop=model.eos_ids)
    assert out["choices"][0]["text"] == model.tokenizer.decode(want)
    assert out["usage"] == {"prompt_tokens": len(ids), "completion_tokens": len(want), "total_tokens": len(ids) + len(want)}
    assert out["choices"][0]["finish_reason"] == ("length" if len(want) == 6 else "stop")
    # token ids as the prompt, and a seed that repeats a sampled run
    a = json.loads(_call(url, "/v1/completions", {"prompt": ids, "max_tokens": 5, "seed": 4})[2])
    b = json.loads(_call(url, "/v1/completions", {"prompt": ids, "max_tokens": 5, "seed": 4})[2])
    assert a["choices"][0]["text"] == b["choices"][0]["text"]


def test_streamed_completion_is_the_same_text(server):
    url, _ = server
    body = {"prompt": "The", "max_tokens": 8, "temperature": 0}
    whole = json.loads(_call(url, "/v1/completions", body)[2])["choices"][0]
    code, kind, text = _call(url, "/v1/completions", {**body, "stream": True})
    assert code == 200 and kind == "text/event-stream"
    events = _events(text)
    assert "".join(e["choices"][0]["text"] for e in events) == whole["text"]
    assert events[-1]["choices"][0]["finish_reason"] == whole["finish_reason"]


def test_chat_completion_and_its_stream(server):
    url, model = server
    msgs = [{"role": "user", "content": "hi there"}]
    out = json.loads(_call(url, "/v1/chat/completions", {"messages": msgs, "max_tokens": 5, "temperature": 0})[2])
    assert out["object"] == "chat.completion"
    assert out["choices"][0]["message"] == {"role": "assistant", "content": model.chat(msgs, 5)}
    events = _events(_call(url, "/v1/chat/completions", {"messages": msgs, "max_tokens": 5, "temperature": 0,
                                                          "stream": True})[2])
    assert events[0]["object"] == "chat.completion.chunk" and events[0]["choices"][0]["delta"] == {"role": "assistant"}
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events[1:]) == model.chat(msgs, 5)


def test_openai_sdk_fields_max_completion_tokens_and_streamed_usage(server):
    """OpenAI's newer max_completion_tokens is max_tokens; stream_options.include_usage adds
    a last chunk with the usage and no choices (every other chunk's usage null)."""
    url, model = server
    msgs = [{"role": "user", "content": "hi there"}]
    body = {"messages": msgs, "max_completion_tokens": 4, "temperature": 0}
    out = json.loads(_call(url, "/v1/chat/completions", body)[2])
    assert out["choices"][0]["message"]["content"] == model.chat(msgs, 4)
    events = _events(_call(url, "/v1/chat/completions",
                           {**body, "stream": True, "stream_options": {"include_usage": True}})[2])
    assert events[-1]["choices"] == [] and events[-1]["usage"] == out["usage"]
    assert all(e["usage"] is None for e in events[:-1]) and events[-2]["choices"][0]["finish_reason"]
    plain = _events(_call(url, "/v1/chat/completions", {**body, "stream": True})[2])
    assert all("usage" not in e for e in plain) and plain[-1]["choices"][0]["finish_reason"]
    for bad, msg in (({**body, "max_tokens": 5}, "differ"), ({**body, "stream_options": {"include_usage": True}},
                     "with 'stream': true"), ({**body, "stream": True, "stream_options": {"x": 1}}, "stream_options")):
        code, _, text = _call(url, "/v1/chat/completions", bad)
        assert code == 400 and msg in json.loads(text)["error"]["message"], text


def test_logit_bias_bans_and_forces_tokens(server):
    """OpenAI's logit_bias: -100 all but bans the greedy choice, +100 forces a token; keys
    that are not this model's token ids and biases out of [-100, 100] are 400s."""
    url, model = server
    ids = model.tokenizer.encode("Once upon")
    first = model.generate(ids, 1)[0]

    def text(bias):
        body = {"prompt": ids, "max_tokens": 3, "temperature": 0, "logit_bias": bias}
        return json.loads(_call(url, "/v1/completions", body)[2])["choices"][0]["text"]
    dec = model.tokenizer.decode
    assert text({}).startswith(dec([first]))
    assert not text({str(first): -100}).startswith(dec([first]))
    forced = (first + 7) % model.hp.n_vocab
    assert text({str(forced): 100}) == dec([forced] * 3)
    for bias, msg in (({"abc": 1}, "not a token id"), ({str(model.hp.n_vocab): 1}, "not a token id"),
                      ({"3": 101}, "in [-100, 100]"), ({"3": True}, "in [-100, 100]")):
        code, _, text = _call(url, "/v1/completions", {"prompt": ids, "logit_bias": bias})
        assert code == 400 and msg in json.loads(text)["error"]["message"], text


def test_stop_strings_cut_the_text_and_are_held_back_while_streaming(server):
    url, model = server
    ids = model.tokenizer.encode("A story:")
    full = model.tokenizer.decode(model.generate(ids, 12))
    cut = next((i for i in range(2, len(full) - 2) if full[i:i + 2].strip() and full.find(full[i:i + 2]) == i), None)
    assert cut is not None, f"no usable stop string in the seeded tiny model's greedy text {full!r}"
    stop = full[cut:cut + 2]
    body = {"prompt": ids, "max_tokens": 12, "temperature": 0, "stop": [stop, "\u2603never"]}
    out = json.loads(_call(url, "/v1/completions", body)[2])["choices"][0]
    assert out["text"] == full[:cut] and out["finish_reason"] == "stop"
    events = _events(_call(url, "/v1/completions", {**body, "stream": True})[2])
    assert "".join(e["choices"][0]["text"] for e in events) == full[:cut]


def test_stream_pieces_never_show_a_stop_strings_start(server):
    """Generation._final_length holds back text that may begin a stop string; the decoder
    holds back a character's first bytes until its last arrives."""
    _, model = server
    g = Generation(model, [1], 4, None, ["END"])
    g.text = "abc EN"
    assert g._final_length() == len("abc ")
    stream = model.tokenizer.stream()
    ids = model.tokenizer.encode("a🙂")
    pieces = [stream.add(t) for t in ids]
    assert len(ids) > 2 and pieces[0] == "a" and all(p == "" for p in pieces[1:-1]) and pieces[-1] == "🙂"


def _log_softmax(z):
    z = z.astype(np.float64)
    return z - (z.max(-1, keepdims=True) + np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1, keepdims=True)))


def test_echo_and_logprobs_score_a_prompt_as_lm_eval_asks(server):
    """max_tokens 0, echo, logprobs: the prompt's own tokens scored (the first has none),
    each with its top alternatives; what lm-evaluation-harness needs for loglikelihood."""
    url, model = server
    ids = model.tokenizer.encode("the quick brown fox")
    out = json.loads(_call(url, "/v1/completions", {"prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 3})[2])
    choice = out["choices"][0]
    lp = choice["logprobs"]
    assert choice["text"] == model.tokenizer.decode(ids) and len(lp["tokens"]) == len(ids)
    want = _log_softmax(model.logits(ids))
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    np.testing.assert_allclose(lp["token_logprobs"][1:], [want[i - 1, ids[i]] for i in range(1, len(ids))], atol=1e-5)
    for i in range(1, len(ids)):
        top = lp["top_logprobs"][i]
        assert len(top) <= 3 and max(top.values()) == pytest.approx(want[i - 1].max(), abs=1e-5)
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])


def test_logprobs_of_generated_tokens_completion_and_chat(server):
    url, model = server
    out = json.loads(_call(url, "/v1/completions", {"prompt": "Hello", "max_tokens": 4, "temperature": 0,
                                                     "logprobs": 2})[2])
    lp = out["choices"][0]["logprobs"]
    assert len(lp["token_logprobs"]) == out["usage"]["completion_tokens"]
    for got, top in zip(lp["token_logprobs"], lp["top_logprobs"]):     # greedy: each is its row's best
        assert len(top) == 2 and got == pytest.approx(max(top.values()), abs=1e-4) and got <= 0
    msgs = [{"role": "user", "content": "hey"}]
    out = json.loads(_call(url, "/v1/chat/completions", {"messages": msgs, "max_tokens": 3, "temperature": 0,
                                                          "logprobs": True, "top_logprobs": 4})[2])
    content = out["choices"][0]["logprobs"]["content"]
    assert len(content) == out["usage"]["completion_tokens"]
    assert all(len(c["top_logprobs"]) == 4 and c["logprob"] <= 0 for c in content)


@pytest.mark.parametrize("body,msg", [
    (json.dumps({"prompt": "x", "max_tokens": 1, "logprobs": 21}).encode(), "'logprobs' must be in [0, 20]"),
    (json.dumps({"prompt": "x", "max_tokens": 1, "logprobs": True}).encode(), "must be an integer"),
    (json.dumps({"prompt": "x", "max_tokens": 1, "echo": True, "stream": True}).encode(), "not streamed"),
    (b"{not json", "not JSON"),
    (json.dumps({"max_tokens": 3}).encode(), "'prompt' is required"),
    (json.dumps({"prompt": "x", "max_tokens": -1}).encode(), "max_tokens"),
    (json.dumps({"prompt": "x", "temperature": -1}).encode(), "temperature"),
    (json.dumps({"prompt": "x", "top_p": "high"}).encode(), "'top_p' has the wrong type"),
    (json.dumps({"prompt": [1, 99999]}).encode(), "token ids must be in"),
    (json.dumps({"prompt": "x", "max_tokens": 500}).encode(), "exceed the context"),
    (json.dumps({"prompt": "x", "stop": [""]}).encode(), "'stop'"),
    (json.dumps({"prompt": "x", "n": 2}).encode(), "'n' must be 1"),
])
def test_bad_requests_are_400_with_the_reason(server, body, msg):
    url, _ = server
    code, _, text = _call(url, "/v1/completions", raw=body)
    assert code == 400 and msg in json.loads(text)["error"]["message"]


def test_bad_chat_messages_are_400(server):
    url, _ = server
    code, _, text = _call(url, "/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]})
    assert code == 400 and "'robot'" in json.loads(text)["error"]["message"]
    code, _, text = _call(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": 3})
    assert code == 400 and "top_logprobs" in json.loads(text)["error"]["message"]


def test_serve_command_loads_and_serves(server, monkeypatch, capsys):
    from moeforge import serve
    from moeforge.cli import main
    path = server[1].path
    served = []
    monkeypatch.setattr(serve.Server, "serve_forever", lambda self: served.append(self.model_name))
    assert main(["serve", path, "--backend", "numpy", "--port", "0", "--alias", "mine", "--quiet"]) == 0
    assert served == ["mine"] and "on http://127.0.0.1:" in capsys.readouterr().err
    with pytest.raises(ValueError, match="at least 2 tokens"):
        make_server(server[1], port=0, n_ctx=1)
