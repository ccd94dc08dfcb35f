"""The model commands on a machine without a GPU."""
import json
import sys

import numpy as np
import pytest

from moeforge.cli import main
from moeforge.runtime.device import has_gpu


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("cli") / "tiny.gguf")
    assert main(["synth", "--preset", "tiny", "--type", "q4_0", path, "--quiet"]) == 0
    return path


def test_import_is_lazy_and_exports_load_model():
    import subprocess
    code = ("import sys, moeforge; assert 'moeforge.runtime.model' not in sys.modules; "
            "assert callable(moeforge.load_model); assert 'moeforge.runtime.model' in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_synth_cli(tiny, capsys):
    from moeforge.runtime.model import load_model
    assert load_model(tiny, backend="numpy").hp.n_layer == 2
    assert main(["synth", "--preset", "nope", "x.gguf"]) == 2
    assert "unknown preset" in capsys.readouterr().err


def test_synth_cli_writes_k_quants(tmp_path, capsys):
    """q4_K needs rows of whole super-blocks: the tiny-k preset has them, tiny does not."""
    from moeforge.runtime.gguf_file import GGUFFile
    from moeforge.synth import TYPES
    from moeforge.cli_model import SYNTH_TYPES
    assert set(SYNTH_TYPES) == set(TYPES)
    path = str(tmp_path / "k.gguf")
    assert main(["synth", "--preset", "tiny-k", "--type", "q4_K", path, "--quiet"]) == 0
    assert {t.qtype for t in GGUFFile(path).tensors.values()} == {"q4_K", "f32"}
    from moeforge.bench_model import model_label
    from moeforge.runtime.model import load_model
    assert model_label(load_model(path, backend="numpy")).endswith("Q4_K - Small")   # llama-bench's name
    capsys.readouterr()
    assert main(["synth", "--preset", "tiny", "--type", "q4_K", str(tmp_path / "bad.gguf"), "--quiet"]) == 2
    assert "not whole q4_K blocks of 256" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["k.gguf"]      # nothing half-written


def test_synth_cli_writes_gpt_oss(tmp_path, capsys):
    from moeforge.runtime.gguf_file import GGUFFile
    from moeforge.runtime.model import load_model
    path = str(tmp_path / "oss.gguf")
    assert main(["synth", "--arch", "gpt-oss", "--preset", "tiny-oss", "--type", "mxfp4_moe", path, "--quiet"]) == 0
    f = GGUFFile(path)
    assert f.architecture == "gpt-oss"
    types = {name: t.qtype for name, t in f.tensors.items()}
    assert {types[f"blk.0.ffn_{p}_exps.weight"] for p in ("gate", "up", "down")} == {"mxfp4"}
    assert types["blk.0.attn_q.weight"] == types["output.weight"] == "q8_0"
    assert types["blk.0.attn_sinks.weight"] == types["blk.0.ffn_down_exps.bias"] == "f32"
    m = load_model(path, backend="numpy")
    assert m.hp.n_swa == 8 and m.hp.yarn is not None
    assert np.isfinite(m.logits([1, 2, 3])).all()
    capsys.readouterr()


def test_synth_cli_arch_and_preset(tmp_path, capsys, monkeypatch):
    """The architecture is the preset's; --arch alone picks its real model (and, as --type
    does not say, the type that model ships in); a preset of another architecture is refused."""
    import moeforge.synth
    calls = []

    def fake_write(path, spec, qtype, **kw):
        calls.append((spec.arch, spec.n_embd, qtype, kw["name"]))
        return dict(path=path, bytes=0, seconds=1.0, gb_per_s=0.0, tensors=0)
    monkeypatch.setattr(moeforge.synth, "write_model", fake_write)
    out = str(tmp_path / "x.gguf")
    assert main(["synth", "--arch", "gpt-oss", "--preset", "gpt-oss-20b", "--type", "mxfp4_moe", out, "--quiet"]) == 0
    assert main(["synth", "--arch", "gpt-oss", out, "--quiet"]) == 0
    assert main(["synth", "--preset", "tiny-oss", out, "--quiet"]) == 0
    assert main(["synth", "--preset", "tiny-oss", "--type", "q8_0", out, "--quiet"]) == 0
    assert main(["synth", out, "--quiet"]) == 0
    assert main(["synth", "--arch", "qwen3moe", out, "--quiet"]) == 0
    assert calls == [("gpt-oss", 2880, "mxfp4_moe", "moeforge-synth gpt-oss-20b mxfp4_moe"),
                     ("gpt-oss", 2880, "mxfp4_moe", "moeforge-synth gpt-oss-20b mxfp4_moe"),
                     ("gpt-oss", 128, "mxfp4_moe", "moeforge-synth tiny-oss mxfp4_moe"),
                     ("gpt-oss", 128, "q8_0", "moeforge-synth tiny-oss q8_0"),
                     ("qwen3moe", 2048, "q4_0", "moeforge-synth qwen3-30b-a3b q4_0"),
                     ("qwen3moe", 2048, "q4_0", "moeforge-synth qwen3-30b-a3b q4_0")]
    capsys.readouterr()
    assert main(["synth", "--arch", "gpt-oss", "--preset", "tiny", out]) == 2
    assert "preset 'tiny' is a qwen3moe model, not --arch gpt-oss (gpt-oss's presets: gpt-oss-20b, gpt-oss-120b, tiny-oss)" \
        in capsys.readouterr().err
    assert main(["synth", "--arch", "qwen3moe", "--preset", "tiny-oss", out]) == 2
    assert "is a gpt-oss model, not --arch qwen3moe" in capsys.readouterr().err
    assert main(["synth", "--preset", "tiny-oss", "--merged-gate-up", out]) == 2
    assert "--merged-gate-up is for qwen3moe" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["synth", "--arch", "mamba", out])
    assert "invalid choice: 'mamba'" in capsys.readouterr().err
    assert main(["synth", "--arch", "llama", out, "--quiet"]) == 0
    assert calls[-1] == ("llama", 4096, "q4_0", "moeforge-synth mixtral-8x7b q4_0")
    from moeforge.cli_model import SYNTH_ARCHS, SYNTH_DEFAULTS
    from moeforge.synth import ARCHS, PRESETS
    assert set(SYNTH_ARCHS) == set(ARCHS) == set(SYNTH_DEFAULTS)
    assert all(PRESETS[p].arch == a and t in moeforge.synth.TYPES for a, (p, t) in SYNTH_DEFAULTS.items())
    assert len(calls) == 7


@pytest.mark.skipif(has_gpu(), reason="checks the message given without a GPU")
def test_bench_without_gpu_is_a_clear_error(tiny, capsys):
    assert main(["bench", tiny]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        main(["perplexity", tiny, "-f", tiny])
    from moeforge.runtime.device import NoGPUError
    from moeforge.runtime.model import load_model
    with pytest.raises(NoGPUError, match="cuda backend needs a CUDA device"):
        load_model(tiny, backend="cuda")


def test_bench_routes_gguf_to_the_model_bench(tiny, capsys, tmp_path):
    out = tmp_path / "b.json"
    assert main(["bench", tiny, "--backend", "numpy", "-p", "32", "-n", "4", "-r", "2", "--json", str(out)]) == 0
    captured = capsys.readouterr()
    table = captured.out.splitlines()
    assert "loaded in" in captured.err and tiny in captured.err
    assert table[0].split("|")[1:-1] == [c.ljust(len(c)) for c in table[0].split("|")[1:-1]]
    assert [c.strip() for c in table[0].split("|")[1:-1]] == ["model", "size", "params", "backend", "ngl",
                                                               "test", "t/s"]
    assert "qwen3moe ?B Q4_0" in table[2] and "pp32" in table[2] and "tg4" in table[3]
    data = json.loads(out.read_text())
    assert [r["test"] for r in data["tests"]] == ["pp32", "tg4"] and data["tests"][0]["t_s_mean"] > 0
    assert data["load_s"] > 0


def test_bench_table_names_a_ubatch_other_than_llama_benchs(tiny, capsys, tmp_path):
    """n_ubatch as llama-bench shows it: a column where it is not 512, before type_kv."""
    out = tmp_path / "u.json"
    assert main(["bench", tiny, "--backend", "numpy", "-p", "8", "-n", "0", "-r", "1", "-ub", "4",
                 "--cache-type", "f16", "--json", str(out)]) == 0
    table = capsys.readouterr().out.splitlines()
    assert [c.strip() for c in table[0].split("|")[1:-1]][4:8] == ["ngl", "n_ubatch", "type_kv", "test"]
    assert [c.strip() for c in table[2].split("|")[1:-1]][5:7] == ["4", "f16"]
    assert table[1].split("|")[6].strip().endswith(":")   # right-aligned, as a number
    assert [r["n_ubatch"] for r in json.loads(out.read_text())["tests"]] == [4]
    assert main(["bench", tiny, "--backend", "numpy", "-p", "8", "-n", "0", "-r", "1"]) == 0
    assert "n_ubatch" not in capsys.readouterr().out       # numpy's own ubatch is 512


def test_bench_takes_a_list_of_ubatches(tiny, capsys, tmp_path, monkeypatch):
    """-ub 4,512 as llama-bench's: the tests once for each, one load, each row labelled, each
    prompt really passed in ubatches of its size."""
    from moeforge.runtime import model as model_mod
    passes, real = [], model_mod.Model._step
    monkeypatch.setattr(model_mod.Model, "_step", lambda self, ids, last_only: passes.append(len(ids))
                        or real(self, ids, last_only))
    out = tmp_path / "l.json"
    assert main(["bench", tiny, "--backend", "numpy", "-p", "10", "-n", "0", "-r", "1", "-ub", "4,512",
                 "--json", str(out)]) == 0
    table = capsys.readouterr().out.splitlines()
    assert [[c.strip() for c in ln.split("|")[1:-1]][5:7] for ln in table[2:]] == [["4", "pp10"], ["512", "pp10"]]
    assert [r["n_ubatch"] for r in json.loads(out.read_text())["tests"]] == [4, 512]
    assert passes == [4, 4, 2] * 3 + [10] * 3           # two warm-ups and one repetition each
    assert main(["bench", tiny, "--backend", "numpy", "--profile", "-ub", "4,8"]) == 2
    assert "takes one ubatch" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", tiny, "--backend", "numpy", "-ub", "4,0"])


def test_bench_at_depth(tiny, capsys, tmp_path):
    """-d as llama-bench's: each test after that many tokens in the context, labelled so."""
    out = tmp_path / "d.json"
    assert main(["bench", tiny, "--backend", "numpy", "-p", "16", "-n", "3", "-d", "0,24", "-r", "2",
                 "--json", str(out)]) == 0
    table = capsys.readouterr().out.splitlines()
    assert [ln.split("|")[6].strip() for ln in table[2:]] == ["pp16", "tg3", "pp16 @ d24", "tg3 @ d24"]
    data = json.loads(out.read_text())
    assert [r["depth"] for r in data["tests"]] == [0, 0, 24, 24]
    assert all(r["t_s_mean"] > 0 for r in data["tests"])


def test_bench_at_depth_attends_to_the_depth(tiny):
    """The timed run really starts after the depth: the model's position afterwards."""
    import numpy as np

    from moeforge.bench_model import bench
    from moeforge.runtime.model import load_model
    m = load_model(tiny, backend="numpy", n_ctx=64)
    bench(m, [("tg", 3)], reps=1, depths=(20,))
    assert m.n_past == 23
    bench(m, [("pp", 8)], reps=1, depths=(20,))
    assert m.n_past == 28
    assert np.isfinite(m.eval([1])).all()


def test_profile_at_depth(tiny, capsys):
    """--profile with -d: the decode step and the prompt ubatch after the largest depth."""
    assert main(["bench", tiny, "--backend", "numpy", "--profile", "-ub", "8", "-d", "0,24"]) == 0
    titles = [ln for ln in capsys.readouterr().out.splitlines() if "qwen3moe" in ln]
    assert "decode step: 1 token after 24 cached" in titles[0]
    assert "prompt: one ubatch of 8 tokens after 24 cached" in titles[1]


def test_sweep_table(tiny, capsys):
    assert main(["bench", tiny, "--backend", "numpy", "--sweep", "--ctx", "96", "--sweep-pp", "32",
                 "--sweep-tg", "8"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split("|")[1:-1] == ["    PP ", "     TG ", "   N_KV ", "   T_PP s ", " S_PP t/s ",
                                         "   T_TG s ", " S_TG t/s "]
    assert [int(ln.split("|")[3]) for ln in lines[2:]] == [0, 32]


def test_perplexity_and_run_on_numpy(tiny, tmp_path, capsys):
    pytest.importorskip("tokenizers")
    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    assert main(["perplexity", tiny, "-f", str(text), "--backend", "numpy", "--ctx", "64", "--chunks", "2"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("[1]") and "Final estimate: PPL = " in out
    ppl = float(out.rsplit("=", 1)[1])
    assert 1 < ppl < 1e6 and np.isfinite(ppl)
    assert main(["run", tiny, "-p", "Hello", "-n", "3", "--backend", "numpy"]) == 0
    assert capsys.readouterr().out.startswith("Hello")
    assert main(["run", tiny, "-p", "Hello", "-n", "3", "--backend", "numpy", "--attn-precision", "tf32"]) == 0
    assert main(["run", tiny, "-p", "Hello", "-n", "3", "--backend", "numpy", "--cache-type", "f16"]) == 0
    assert capsys.readouterr().out.startswith("Hello")
    with pytest.raises(SystemExit):
        main(["run", tiny, "-p", "Hello", "--backend", "numpy", "--cache-type", "q8_0"])
    with pytest.raises(SystemExit):
        main(["run", tiny, "-p", "Hello", "--backend", "numpy", "--attn-precision", "bf16"])
    with pytest.raises(SystemExit):
        main(["run", tiny, "-p", "Hello", "--backend", "numpy", "-ub", "0"])


def test_the_ubatch_reaches_the_model(tiny, tmp_path, capsys, monkeypatch):
    """-ub of run, serve and perplexity: the model's prompt passes of that many tokens; the
    same greedy tokens as one pass."""
    pytest.importorskip("tokenizers")
    from moeforge.runtime import model as model_mod
    seen = []
    real = model_mod.Model._step

    def step(self, ids, last_only):
        seen.append(len(ids))
        return real(self, ids, last_only)
    monkeypatch.setattr(model_mod.Model, "_step", step)
    prompt = "the quick brown fox jumps over the lazy dog " * 3
    outs = []
    for ub in ("3", "512"):
        seen.clear()
        assert main(["run", tiny, "-p", prompt, "-n", "4", "--backend", "numpy", "-ub", ub]) == 0
        outs.append(capsys.readouterr().out)
        prompt_passes = [n for n in seen if n > 1]
        assert prompt_passes and max(prompt_passes) <= int(ub)
    assert len(set(outs)) == 1


def test_kernel_bench_is_untouched():
    from moeforge.cli_model import route_bench
    assert route_bench(["bench", "--types", "q4_0"]) == ["bench", "--types", "q4_0"]
    assert route_bench(["bench", "m.gguf", "-p", "512"]) == ["bench-model", "m.gguf", "-p", "512"]


def test_profile_of_one_forward_pass(tiny, capsys, tmp_path):
    """The per-op table on the numpy backend: one row per kind of op, each layer's call
    counted, leaves only (the composed expert_gate_up shows as its product and swiglu)."""
    out = tmp_path / "p.json"
    assert main(["bench", tiny, "--backend", "numpy", "--profile", "-ub", "16", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "decode step: 1 token after 128 cached" in text and "one ubatch of 16 tokens" in text
    data = json.loads(out.read_text())["profile"]
    for prof in data.values():
        rows = prof["ops"]
        assert prof["method"] == "host clock per call"
        assert abs(prof["total_us"] - sum(r["total_us"] for r in rows)) < 1e-3 * prof["total_us"] + 0.1
        by = {r["op"]: r for r in rows}
        assert by["matmul q"]["calls"] == 2 and by["attention attn"]["calls"] == 2
        assert by["matmul logits"]["calls"] == 1 and by["route"]["calls"] == 2
        assert "expert_gate_up act" not in by and by["swiglu_split act"]["calls"] == 2
        assert all(r["total_us"] > 0 for r in rows)


def test_profile_by_removal_says_how_far_its_rows_go():
    from moeforge.runtime.op_profile import OpRow, Profile, format_profile
    rows = [OpRow("matmul qkv", 48, 3000.0), OpRow("embed x", 1, -3.0)]
    removal = format_profile(Profile(rows, 3100.0, "CUDA graph of the pass, each row the time saved"), "t")
    clock = format_profile(Profile(rows, 3100.0, "host clock per call"), "t")
    assert "small rows carry that noise" in removal.splitlines()[-1]
    assert "noise" not in clock and clock.splitlines()[-1].startswith("whole pass")
