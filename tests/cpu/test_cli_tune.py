"""The tuner's commands on a machine without a GPU: clear messages and exit codes, shapes
from GGUF metadata, generate-and-tune's flow, the profile commands."""
import importlib.util

import numpy as np
import pytest
import yaml

from moeforge.cli import main
from moeforge.codegen.compile import ARCHS
from moeforge.runtime import device
from moeforge.tuning import profile as pm
from moeforge.tuning.space import TuneKey

from test_profiles import QWEN, fake_fp, make_profile


@pytest.fixture
def no_gpu(monkeypatch):
    monkeypatch.setattr(device, "has_gpu", lambda: False)


def test_tune_without_gpu_is_a_clear_exit_2(no_gpu, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("MOEFORGE_CACHE_DIR", str(tmp_path))
    assert main(["tune", "--shape", "qwen3-30b-a3b", "--trials", "3"]) == 2
    err = capsys.readouterr().err
    assert "no CUDA device found" in err
    assert not (tmp_path / "tuning.db").exists(), "nothing was started"


def test_generate_and_tune_without_gpu_generates_then_stops(no_gpu, capsys, monkeypatch, tmp_path):
    import moeforge.codegen.generate as gen
    calls = []

    def fake_generate(types, archs, build_dir=None, jobs=None, progress=True, out=None):
        calls.append(([t.name for t in types], tuple(archs)))
        return {"failures": []}
    monkeypatch.setattr(gen, "generate", fake_generate)
    monkeypatch.setenv("MOEFORGE_CACHE_DIR", str(tmp_path))
    assert main(["generate-and-tune"]) == 2
    assert calls == [(["q4_0", "q8_0"], ARCHS)], "without a GPU: every architecture, both types"
    assert "no CUDA device found" in capsys.readouterr().err


def test_generate_and_tune_flow_with_the_standin(no_gpu, capsys, monkeypatch, tmp_path):
    """The whole command on the CPU: generate, then the default shape set for q4_0 and q8_0 at
    every anchor n within the time budget, the table, the profile."""
    import moeforge.codegen.generate as gen
    monkeypatch.setattr(gen, "generate", lambda *a, **k: {"failures": []})
    monkeypatch.setenv("MOEFORGE_CACHE_DIR", str(tmp_path / "cache"))
    import time
    t0 = time.time()
    rc = main(["generate-and-tune", "--objective", "standin", "--profile-dir", str(tmp_path / "prof"),
               "--time-budget", "45", "--quiet"])
    assert rc == 0
    assert time.time() - t0 < 45 + 10
    out = capsys.readouterr().out
    for shape in ("128,8,768,2048", "64,6,1408,2048", "32,4,2880,2880"):
        for q in ("q4_0", "q8_0"):
            assert f"mul_mat_id {q} E,top_k,m,k={shape}" in out
    (pfile,) = (tmp_path / "prof").glob("*.yaml")
    entries = pm.load(pfile).entries
    assert len(entries) == 3 * 2 * 12, "every study measured at least its default"
    assert {k.n for k in entries} == {1, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096}


def test_plot_or_a_clear_message(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("MOEFORGE_CACHE_DIR", str(tmp_path / "cache"))
    png = tmp_path / "tuned.png"
    rc = main(["tune", "--objective", "standin", "--shape", "128,8,768,2048", "--types", "q4_0", "--n", "16,32",
               "--trials", "3", "--profile-dir", str(tmp_path / "prof"), "--plot", str(png), "--quiet"])
    assert rc == 0
    if importlib.util.find_spec("matplotlib"):
        assert png.stat().st_size > 1000
    else:
        assert "--plot needs matplotlib" in capsys.readouterr().err
        assert not png.exists()


def _gguf(path, arch="qwen3moe", E=8, top_k=2, ff=64, embd=256, moe=True):
    import gguf
    from gguf import quants
    w = gguf.GGUFWriter(str(path), arch)
    if moe:
        w.add_expert_count(E)
        w.add_expert_used_count(top_k)
        w.add_expert_feed_forward_length(ff)
    w.add_embedding_length(embd)
    Q8, Q4 = gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_0
    for name in ("gate", "up"):
        raw = quants.quantize(np.ones((E * ff, embd), np.float32), Q8)
        w.add_tensor(f"blk.0.ffn_{name}_exps.weight", raw.reshape(E, ff, -1), raw_dtype=Q8)
    for i, q in enumerate((Q8, Q4)):   # a mix: the down product in two types
        raw = quants.quantize(np.ones((E * embd, ff), np.float32), q)
        w.add_tensor(f"blk.{i}.ffn_down_exps.weight", raw.reshape(E, embd, -1), raw_dtype=q)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_products_from_a_gguf_model(tmp_path):
    """The products the runtime runs: gate and up merged (2 x 96 rows), down in each type
    its tensors come in."""
    from moeforge.tuning.shapes import model_products
    f = tmp_path / "m.gguf"
    _gguf(f, E=16, top_k=4, ff=96, embd=320)
    assert model_products(f) == [((16, 4, 192, 320), "q8_0"), ((16, 4, 320, 96), "q4_0"), ((16, 4, 320, 96), "q8_0")]
    dense = tmp_path / "d.gguf"
    _gguf(dense, arch="llama", moe=False)
    with pytest.raises(ValueError, match="expert_count is missing"):
        model_products(dense)


def test_tune_model_uses_its_shapes_and_types(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("MOEFORGE_CACHE_DIR", str(tmp_path / "cache"))
    f = tmp_path / "m.gguf"
    _gguf(f, E=16, top_k=4, ff=96, embd=320)
    rc = main(["tune", "--objective", "standin", "--model", str(f), "--n", "64", "--trials", "2",
               "--profile-dir", str(tmp_path / "prof"), "--quiet"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "mul_mat_id q8_0 E,top_k,m,k=16,4,192,320" in out
    assert "mul_mat_id q8_0 E,top_k,m,k=16,4,320,96" in out and "mul_mat_id q4_0 E,top_k,m,k=16,4,320,96" in out
    assert "mul_mat_id q4_0 E,top_k,m,k=16,4,192,320" not in out    # no gate/up product in q4_0
    rc = main(["tune", "--objective", "standin", "--model", str(f), "--types", "q4_0", "--n", "64", "--trials", "2",
               "--profile-dir", str(tmp_path / "prof"), "--quiet"])
    out = capsys.readouterr().out
    assert rc == 0 and "mul_mat_id q4_0 E,top_k,m,k=16,4,320,96" in out and "q8_0 E" not in out


# -- profile commands ---------------------------------------------------------------------
def test_profile_import_export_list_show(no_gpu, capsys, tmp_path):
    pdir = tmp_path / "profiles"
    src = tmp_path / "h100.yaml"
    pm.save(make_profile(), src)
    assert main(["profile", "import", str(src), "--profile-dir", str(pdir)]) == 0
    installed = pdir / pm.file_name(fake_fp())
    assert pm.load(installed).entries == make_profile().entries
    assert main(["profile", "import", str(src), "--profile-dir", str(pdir)]) == 1
    assert "--force" in capsys.readouterr().err
    assert main(["profile", "import", str(src), "--profile-dir", str(pdir), "--force"]) == 0

    (pdir / "zz-broken.yaml").write_text("schema_version: 1\nfingerprint: {gpu: [\n")
    capsys.readouterr()
    assert main(["profile", "list", "--profile-dir", str(pdir)]) == 0
    out = capsys.readouterr().out
    assert "NVIDIA H100 80GB HBM3" in out and "5 entries" in out
    # made under other templates, without kernel hashes: none of its entries can be vouched for
    assert "(5 timed on kernels that have changed since: not used)" in out
    assert "zz-broken.yaml" in out and "CORRUPT" in out

    assert main(["profile", "show", installed.stem, "--profile-dir", str(pdir)]) == 0
    out = capsys.readouterr().out
    assert "mmq_id-q4_0-x16y64w4k8s2" in out and "per_expert" in out
    assert out.count("(kernel changed since: not used)") == 5 and "5 of 5 entries" in out

    dest = tmp_path / "out" / "exported.yaml"
    assert main(["profile", "export", str(dest), "--from", installed.stem, "--profile-dir", str(pdir)]) == 0
    assert pm.load(dest).entries == make_profile().entries

    capsys.readouterr()
    assert main(["profile", "path", "--profile-dir", str(pdir)]) == 0
    assert capsys.readouterr().out.strip() == str(pdir)
    assert main(["profile", "show", "--profile-dir", str(pdir)]) == 2   # "this GPU's": there is none


def test_profile_show_marks_an_outdated_kept_default(no_gpu, capsys, tmp_path):
    from moeforge.codegen.render import templates_hash
    from moeforge.codegen.spec import MmqSpec
    from moeforge.runtime import dispatch
    p = pm.Profile(fake_fp(templates=templates_hash()))
    old = MmqSpec("q4_0", x=64, y=128, warps=4)
    assert dispatch.default_mul_mat_id("q4_0", *QWEN, 2048).spec != old
    for n, trials in ((2048, 2), (4096, dispatch.SHORT_STUDY_TRIALS)):
        p.put(pm.Entry(TuneKey("mul_mat_id", "q4_0", QWEN, n), "mmq_id", old, 398.4, 398.4,
                       {"default_spec": old.name, "trials": trials}))
    path = tmp_path / "p.yaml"
    pm.save(p, path)
    assert main(["profile", "show", str(path)]) == 0
    out = capsys.readouterr().out
    assert "1 of 2 entries kept a default that has changed since" in out and "moeforge tune --stale" in out
    lines = [ln for ln in out.splitlines() if ln.startswith("mul_mat_id")]
    assert len(lines) == 2
    assert "kept an older default after 2 trials: today's default runs" in lines[0]
    assert "older default" not in lines[1]


def test_profile_show_says_what_runs_on_the_profiles_card(no_gpu, capsys, tmp_path):
    """An entry tuned before the wgmma tiles existed: on the sm_90 card its profile names the
    rule's wgmma tile runs in its place, and show says so (asked on a machine without a
    GPU); on an sm_89 card the same entry runs as it is. Entries whose study timed them stand."""
    from moeforge.codegen.render import templates_hash
    from moeforge.codegen.spec import MmfSpec
    from moeforge.runtime import dispatch
    shape = (32, 4, 2880, 2880)
    old = MmfSpec("mxfp4", 128, 128, 4, 4, 2, ids=True)
    wide = MmfSpec("mxfp4", 128, 256, 8, 4, 3, ids=True, wgmma=True)
    for cc, marked in (("9.0", True), ("8.9", False)):
        p = pm.Profile(fake_fp(templates=templates_hash(), cc=cc))
        p.put(pm.Entry(TuneKey("mul_mat_id", "mxfp4", shape, 2048), "mmf_id", old, 794.1, 1128.0,
                       {"default_spec": "mmq_id-mxfp4-x64y128w4k8s2", "trials": 6, "paths": ["mmq_id", "mmf_id"]}))
        p.put(pm.Entry(TuneKey("mul_mat_id", "mxfp4", shape, 4096), "mmf_id", wide, 1400.0, 1464.9,
                       {"default_spec": wide.name, "trials": 9, "paths": ["mmq_id", "mmf_id"], "wgmma": True}))
        path = tmp_path / f"p{cc}.yaml"
        pm.save(p, path)
        assert main(["profile", "show", str(path)]) == 0
        out = capsys.readouterr().out
        lines = [ln for ln in out.splitlines() if ln.startswith("mul_mat_id")]
        assert ("its study did not time the wgmma tiles: the rule's "
                "mmf_id-mxfp4-x128y256w8k4s3-wg runs") in lines[0] if marked else "runs)" not in lines[0]
        assert "runs)" not in lines[1]                         # timed the wgmma tiles: it stands
        assert ("1 of 2 entries were tuned before the f16 tiles" in out) == marked
        pdir = tmp_path / f"dir{cc}"                          # and `profile list` counts it
        pm.save(p, pdir / pm.file_name(p.fingerprint))
        assert main(["profile", "list", "--profile-dir", str(pdir)]) == 0
        listed = capsys.readouterr().out.splitlines()
        ours = listed[listed.index(str(pdir / pm.file_name(p.fingerprint))) + 1]
        assert ("2 entries (1 where another tile runs in its place" in ours) == marked, ours
    assert dispatch.device_sm_count() == 132 and dispatch._device_cc_major() is None   # this machine's again


def test_profile_import_validates(no_gpu, capsys, tmp_path):
    bad = tmp_path / "bad.yaml"
    d = yaml.safe_load(pm.dump(make_profile()))
    d["entries"][2]["spec"]["y"] = 96          # not a multiple of 16*warps
    bad.write_text(yaml.safe_dump(d))
    assert main(["profile", "import", str(bad), "--profile-dir", str(tmp_path / "p")]) == 1
    err = capsys.readouterr().err
    assert "refused" in err and "y must be a multiple" in err
    assert not (tmp_path / "p").exists()
    notyaml = tmp_path / "x.yaml"
    notyaml.write_bytes(b"\x00\x01 :: [")
    assert main(["profile", "import", str(notyaml), "--profile-dir", str(tmp_path / "p")]) == 1


def test_dense_shapes_of_a_model(tmp_path):
    """`tune --model F --op mul_mat` tunes the products the CUDA runtime runs: q, k, v
    stacked into one, the attention output, the output head."""
    from types import SimpleNamespace

    from moeforge.cli_tune import _keys
    from moeforge.runtime.model import load_model
    from moeforge.tuning.shapes import model_dense_shapes
    f = str(tmp_path / "tiny.gguf")
    assert main(["synth", "--preset", "tiny", "--type", "q4_0", f, "--quiet"]) == 0
    hp = load_model(f, backend="numpy").hp
    want = [(hp.q_dim + 2 * hp.kv_dim, hp.n_embd, "q4_0"), (hp.n_embd, hp.q_dim, "q4_0"),
            (hp.n_vocab, hp.n_embd, "q4_0")]
    assert model_dense_shapes(f) == want
    keys = _keys(SimpleNamespace(model=f, shape=None, types=None, n="1,512"), ops=("mul_mat",))
    assert {(k.op, k.qtype, k.shape, k.n) for k in keys} == {
        ("mul_mat", "q4_0", (1, 1, m, kk), n) for m, kk, _ in want for n in (1, 512)}
    with pytest.raises(ValueError, match="no dense quantized product"):
        _keys(SimpleNamespace(model=f, shape=None, types="q8_0", n="1"), ops=("mul_mat",))
