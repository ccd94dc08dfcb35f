"""Chat prompts from the file's template (runtime.chat) and `moeforge run --chat / -i`."""
import io

import pytest

from moeforge.runtime.chat import ChatTemplateError, render
from moeforge.synth_vocab import CHATML

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Grüße, wie geht's?"}]


def test_chatml_renders_every_turn_and_opens_the_reply():
    want = ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nGrüße, wie geht's?<|im_end|>\n"
            "<|im_start|>assistant\n")
    assert render(CHATML, MESSAGES) == want
    assert render(CHATML, MESSAGES, add_generation_prompt=False) == want[:-len("<|im_start|>assistant\n")]


def test_templates_see_what_hugging_face_gives_them():
    t = ("{{ bos_token }}{% if enable_thinking is defined and not enable_thinking %}NOTHINK {% endif %}"
         "{% for m in messages %}{{ m | tojson }}\n{% endfor %}"
         "{% if messages[0].role != 'system' %}{{ raise_exception('a system message must come first') }}{% endif %}")
    out = render(t, MESSAGES, bos_token="<s>", enable_thinking=False)
    assert out.startswith("<s>NOTHINK {\"role\": \"system\"") and "Grüße" in out      # non-ASCII kept
    with pytest.raises(ChatTemplateError, match="a system message must come first"):
        render(t, MESSAGES[1:])


@pytest.mark.parametrize("template,msg", [
    ("{{ ().__class__.__base__.__subclasses__() }}", "SecurityError"),   # a file's template is not code we run
    ("{% for m in messages %}", "TemplateSyntaxError"),
    ("{{ messages[0].content + 1 }}", "TypeError"),
])
def test_bad_templates_are_reported(template, msg):
    with pytest.raises(ChatTemplateError, match=msg):
        render(template, MESSAGES)


@pytest.mark.parametrize("messages,msg", [
    ([], "non-empty list"), ([{"role": "user"}], "string 'content'"), ([{"role": "bot", "content": "x"}], "'bot'"),
])
def test_bad_messages_are_named(messages, msg):
    with pytest.raises(ValueError, match=msg):
        render(CHATML, messages)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    pytest.importorskip("tokenizers")
    from moeforge.runtime.model import load_model
    from moeforge.synth import preset, write_qwen3moe
    path = str(tmp_path_factory.mktemp("chat") / "t.gguf")
    write_qwen3moe(path, preset("tiny"), "q8_0", seed=5)
    return path, load_model(path, backend="numpy")


def test_model_chat_prompt_is_the_template_tokenized(tiny):
    _, m = tiny
    ids = m.chat_prompt(MESSAGES)
    assert m.tokenizer.decode(ids) == render(CHATML, MESSAGES)
    tokens = m.file.get("tokenizer.ggml.tokens")
    assert ids[0] == tokens.index("<|im_start|>") and ids.count(tokens.index("<|im_end|>")) == 2
    chosen = []
    reply = m.chat(MESSAGES, n=5, on_token=chosen.append)
    # counted as chosen: re-encoding the text is no count (a random model's tokens can split
    # a UTF-8 character, which decodes to U+FFFD and encodes as three bytes)
    assert len(chosen) <= 5 and isinstance(reply, str) and reply == m.tokenizer.decode(chosen)


def test_run_chat_and_a_conversation_from_stdin(tiny, capsys, monkeypatch):
    from moeforge.cli import main
    path, m = tiny
    base = ["run", path, "--backend", "numpy", "-n", "4", "--temp", "0.7", "--seed", "3"]
    assert main(base + ["--chat", "-p", "hello"]) == 0
    one = capsys.readouterr()
    want = m.chat([{"role": "user", "content": "hello"}], 4, __import__("moeforge").Sampling(temperature=0.7, seed=3))
    assert one.out == want + "\n"
    monkeypatch.setattr("sys.stdin", io.StringIO("hello\n\nagain\n"))
    assert main(base + ["-i", "--system", "Be brief."]) == 0
    two = capsys.readouterr()
    assert two.err.count("moeforge run: prompt") == 2 and two.err.count("> ") == 4    # hello, the blank line, again, EOF
    with pytest.raises(SystemExit, match="give a prompt"):
        main(["run", path, "--backend", "numpy", "--chat"])


def test_a_file_without_a_template_is_told_so(tiny, monkeypatch):
    _, m = tiny
    monkeypatch.delitem(m.file.metadata, "tokenizer.chat_template")
    with pytest.raises(ValueError, match="no chat template"):
        m.chat_prompt(MESSAGES)


def test_the_features_real_chat_templates_use_work_in_the_sandbox():
    """namespace(), loop.last, string methods and tests, the way Qwen3's and gpt-oss's
    templates use them (written here, not copied), rendered inside the sandbox."""
    t = ("{%- set ns = namespace(last_user=0) %}"
         "{%- for m in messages %}{% if m.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}"
         "{%- for m in messages %}"
         "{%- if m.content is string and '</think>' in m.content %}"
         "{%- set body = m.content.split('</think>')[-1].lstrip('\\n') %}{% else %}{% set body = m.content %}{% endif %}"
         "[{{ m.role | upper }}{{ '*' if loop.index0 == ns.last_user }}]{{ body.strip() }}"
         "{{ '|' if not loop.last }}{% endfor %}"
         "{%- if add_generation_prompt %}[ASSISTANT]{{ '<think>\\n\\n</think>' if enable_thinking is defined "
         "and enable_thinking is false }}{% endif %}")
    msgs = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "<think>x</think>\n b "},
            {"role": "user", "content": " c"}]
    assert render(t, msgs, enable_thinking=False) == "[USER]a|[ASSISTANT]b|[USER*]c[ASSISTANT]<think>\n\n</think>"
    assert render(t, msgs).endswith("[ASSISTANT]")
