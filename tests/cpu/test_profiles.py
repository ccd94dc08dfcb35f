"""Profiles: schema validation, corrupt files, the fingerprint policy, nearest-bucket
lookup, atomic writes, and the hook that dispatch calls."""
import copy
import os
import warnings

import pytest
import yaml

from moeforge.codegen.spec import MmqSpec, MmvqSpec
from moeforge.runtime import dispatch, profiles_hook
from moeforge.tuning import activate, fingerprint as fpmod
from moeforge.tuning import profile as pm
from moeforge.tuning.space import TuneKey

QWEN = (128, 8, 768, 2048)


def fake_fp(**over):
    fp = {"gpu": "NVIDIA H100 80GB HBM3", "cc": "9.0", "sm_count": 132, "memory_gib": 79.1,
          "driver": "580.159", "cuda_runtime": "13.0", "nvrtc": "12.9", "moeforge": "0.1.0",
          "templates": "0123456789abcdef"}
    fp.update(over)
    return fp


def make_profile(fp=None) -> pm.Profile:
    p = pm.Profile(fp or fake_fp())
    for n, spec, path in ((1, MmvqSpec("q4_0", tokens=1, warps=4, rows=2), "mmvq"),
                          (8, MmvqSpec("q4_0", tokens=8, warps=8, rows=1), "mmvq"),
                          (16, MmqSpec("q4_0", x=8, y=128, warps=8, stages=3), "mmq_id"),
                          (64, MmqSpec("q4_0", x=16, y=64, warps=4, stages=2, stream_k=False), "mmq_id"),
                          (4096, MmqSpec("q4_0", x=128, y=128, warps=8, stages=2, ids=False, stream_k=False),
                           "per_expert")):
        p.put(pm.Entry(TuneKey("mul_mat_id", "q4_0", QWEN, n), path, spec, 10.0 + n, 20.0 + n,
                       {"trials": 5}))
    return p


def as_dict():
    return yaml.safe_load(pm.dump(make_profile()))


def test_round_trip(tmp_path):
    p = make_profile()
    path = pm.save(p, tmp_path / "p.yaml")
    q = pm.load(path)
    assert q.fingerprint == p.fingerprint
    assert q.entries == p.entries
    assert q.to_dict()["entries"] == p.to_dict()["entries"]


MUTATIONS = {
    "schema_version": (lambda d: d.update(schema_version=2), "schema_version 2"),
    "schema type": (lambda d: d.update(schema_version="1"), "schema_version must be an integer"),
    "no fingerprint": (lambda d: d.pop("fingerprint"), "fingerprint must be a mapping"),
    "fp field type": (lambda d: d["fingerprint"].update(sm_count="132"), "fingerprint.sm_count"),
    "fp missing": (lambda d: d["fingerprint"].pop("templates"), "fingerprint.templates is missing"),
    "top-level typo": (lambda d: d.update(entrys=[]), "entrys is not a known"),
    "entries type": (lambda d: d.update(entries={}), "entries must be a list"),
    "missing us": (lambda d: d["entries"][0].pop("us"), "entries[0].us is missing"),
    "negative us": (lambda d: d["entries"][0].update(us=-1.0), "must be positive"),
    "nan us": (lambda d: d["entries"][0].update(us=float("nan")), "entries[0].us"),
    "bool n": (lambda d: d["entries"][0].update(n=True), "entries[0].n"),
    "bucket not pow2": (lambda d: d["entries"][2].update(n=48), "power of two"),
    "bucket too big": (lambda d: d["entries"][2].update(n=1 << 20), "power of two"),
    "bad op": (lambda d: d["entries"][0].update(op="conv2d"), "op must be one of"),
    "bad qtype": (lambda d: d["entries"][0].update(qtype="q9_9"), "unknown quant type"),
    "shape len": (lambda d: d["entries"][0].update(shape=[128, 8, 768]), "four positive integers"),
    "shape str": (lambda d: d["entries"][0].update(shape=["128", 8, 768, 2048]), "integers"),
    "spec x range": (lambda d: d["entries"][2]["spec"].update(x=12), "x must be a multiple of 8"),
    "spec family": (lambda d: d["entries"][2]["spec"].update(family="wgmma"), "unknown kernel family"),
    "spec field": (lambda d: d["entries"][2]["spec"].update(tile=3), "unknown fields"),
    "spec qtype": (lambda d: d["entries"][2]["spec"].update(qtype="q8_0"), "spec is for"),
    "path for spec": (lambda d: d["entries"][2].update(path="mmvq"), "plain mmvq specs"),
    "mmvq past limits": (lambda d: d["entries"][1].update(n=64), "mmvq handles"),
    "per_expert ids": (lambda d: d["entries"][4]["spec"].update(ids=True), "ids=False"),
    "unknown path": (lambda d: d["entries"][2].update(path="cublas"), "path must be one of"),
    "entry field": (lambda d: d["entries"][0].update(speed=3), "speed is not a known field"),
    "paths type": (lambda d: d["entries"][2].update(paths="mmq_id"), "paths must be list"),
    "paths unknown": (lambda d: d["entries"][2].update(paths=["mmq_id", "cublas"]), "paths must list paths"),
    "paths of the other op": (lambda d: d["entries"][2].update(paths=["mmq"]), "paths must list paths"),
    "duplicate": (lambda d: d["entries"].append(copy.deepcopy(d["entries"][0])), "repeats"),
}


@pytest.mark.parametrize("name", sorted(MUTATIONS))
def test_schema_violations_are_refused_with_the_reason(name):
    mutate, expect = MUTATIONS[name]
    d = as_dict()
    mutate(d)
    with pytest.raises(pm.ProfileError) as ei:
        pm.from_dict(d, "x.yaml")
    assert expect in str(ei.value), str(ei.value)


def test_corrupt_profile_is_reported_not_used(tmp_path):
    good = tmp_path / "good.yaml"
    pm.save(make_profile(), good)
    bad_yaml = tmp_path / "a-broken.yaml"
    bad_yaml.write_text("schema_version: 1\nentries: [ {op: mul_mat_id\n")
    wrong = tmp_path / "b-wrong.yaml"
    d = as_dict()
    d["entries"][0]["spec"]["warps"] = 3
    wrong.write_text(yaml.safe_dump(d))
    said = []
    prof = activate.resolve(fake_fp(), [bad_yaml, wrong], warn=said.append)
    assert prof is None
    assert any("a-broken.yaml is corrupt" in s and "not valid YAML" in s for s in said), said
    assert any("b-wrong.yaml is corrupt" in s and "warps" in s for s in said), said
    # a corrupt file does not hide a good one
    said.clear()
    assert activate.resolve(fake_fp(), [bad_yaml, good], warn=said.append) is not None
    assert any("corrupt" in s for s in said)


def test_yaml_is_loaded_safely(tmp_path):
    f = tmp_path / "evil.yaml"
    f.write_text("!!python/object/apply:os.system ['echo pwned']\n")
    with pytest.raises(pm.ProfileError, match="not valid YAML"):
        pm.load(f)


def test_fingerprint_policy(tmp_path):
    made = tmp_path / "made.yaml"
    pm.save(make_profile(), made)
    here = fake_fp()
    said = []
    assert activate.resolve(here, [made], warn=said.append) is not None and not said

    # same chip, other driver / runtime / NVRTC: used, with a warning naming what differs
    for field, value in (("driver", "575.51"), ("cuda_runtime", "12.8"), ("nvrtc", "12.4")):
        said.clear()
        prof = activate.resolve(fake_fp(**{field: value}), [made], warn=said.append)
        assert prof is not None, field
        assert len(said) == 1 and field in said[0] and value in said[0]

    # another chip or another moeforge: refused, defaults, the field named (other templates:
    # judged per entry, test_profile_kernels.py)
    for field, value in (("gpu", "NVIDIA H200"), ("cc", "8.0"), ("sm_count", 114), ("moeforge", "0.2.0"),
                         ("memory_gib", 93.0)):
        said.clear()
        prof = activate.resolve(fake_fp(**{field: value}), [made], warn=said.append)
        assert prof is None, field
        assert len(said) == 1 and field in said[0] and "default" in said[0], said
    # a few hundred MB less memory under another driver is the same card
    assert activate.resolve(fake_fp(memory_gib=78.8, driver="575.1"), [made], warn=said.append) is not None


def test_exact_match_preferred_over_soft(tmp_path):
    soft = tmp_path / "a.yaml"
    exact = tmp_path / "b.yaml"
    pm.save(make_profile(fake_fp(driver="1.0")), soft)
    pm.save(make_profile(), exact)
    said = []
    prof = activate.resolve(fake_fp(), [soft, exact], warn=said.append)
    assert prof.source == str(exact) and not said


def test_verdict_unit():
    assert fpmod.verdict(fake_fp(), fake_fp())[0] == "match"
    assert fpmod.verdict(fake_fp(), fake_fp(driver="x", nvrtc="y"))[0] == "soft"
    assert fpmod.verdict(fake_fp(), fake_fp(driver="x", sm_count=1))[0] == "refuse"
    assert fpmod.validate(fake_fp()) == []
    assert fpmod.validate({**fake_fp(), "extra": 1})
    assert fpmod.ident(fake_fp()) != fpmod.ident(fake_fp(driver="x"))
    # a re-tune under new templates merges into the same file
    assert fpmod.ident(fake_fp()) == fpmod.ident(fake_fp(templates="fedcba9876543210"))


@pytest.mark.parametrize("n,expect", [
    # tuned buckets 1, 8, 16, 64, 4096; distance is |log2 n - log2 bucket|
    (1, 1), (2, 1), (3, 8),          # log2 3 = 1.58: 1.42 from 8, 1.58 from 1
    (5, 8), (8, 8), (6, 8),
    (9, 8), (11, 8), (12, 16), (23, 16), (24, 16), (31, 16),   # between 16 and 64 the midpoint is 32
    (33, 64), (64, 64), (100, 64), (511, 64),
    (600, 4096), (4096, 4096), (100000, 4096),
])
def test_nearest_bucket(n, expect):
    p = make_profile()
    c = p.choose("mul_mat_id", "q4_0", QWEN, n)
    assert c is not None and c.source == "profile"
    assert c.spec == p.entries[TuneKey("mul_mat_id", "q4_0", QWEN, expect)].spec, (n, c.spec.name)


def test_nearest_bucket_never_returns_an_illegal_path():
    p = pm.Profile(fake_fp())
    p.put(pm.Entry(TuneKey("mul_mat_id", "q4_0", QWEN, 8), "mmvq", MmvqSpec("q4_0", tokens=8), 5.0, 6.0))
    p.put(pm.Entry(TuneKey("mul_mat_id", "q4_0", QWEN, 1024), "mmq_id", MmqSpec("q4_0", x=64, y=64, warps=4),
                   5.0, 6.0))
    # 40 tokens: 8 is nearest, but the mat-vec stops at 32; the next legal one is taken
    assert p.choose("mul_mat_id", "q4_0", QWEN, 40).path == "mmq_id"
    assert p.choose("mul_mat_id", "q4_0", QWEN, 12).path == "mmvq"
    assert p.choose("mul_mat_id", "q4_0", QWEN, 7).path == "mmvq"
    assert p.choose("mul_mat_id", "q4_0", (64, 6, 1408, 2048), 7) is None   # other shape: defaults
    assert p.choose("mul_mat_id", "q8_0", QWEN, 7) is None


def test_an_entry_that_kept_an_outdated_default_gives_way_to_todays_rules(monkeypatch):
    """An entry whose short study kept the default of its day says nothing once the defaults
    have moved on; one that found a faster spec stands, and so does a default that won a
    longer study (dispatch.outdated)."""
    monkeypatch.setattr(dispatch, "_device_cc_major", lambda: 9)
    monkeypatch.setattr(dispatch, "WGMMA", False)   # its rule would take 2048 tokens (128 an expert) to f16
    today = dispatch.default_mul_mat_id("q4_0", *QWEN, 2048).spec
    old_default = MmqSpec("q4_0", x=64, y=128, warps=4)
    assert today != old_default
    p = pm.Profile(fake_fp())
    p.put(pm.Entry(TuneKey("mul_mat_id", "q4_0", QWEN, 2048), "mmq_id", old_default, 398.4, 398.4,
                   {"default_spec": old_default.name, "trials": 1}))
    p.put(pm.Entry(TuneKey("mul_mat_id", "q4_0", QWEN, 1024), "mmq_id", MmqSpec("q4_0", x=16, y=64, warps=4),
                   150.0, 210.0, {"default_spec": today.name, "trials": 40}))
    kept = p.choose("mul_mat_id", "q4_0", QWEN, 2048)
    assert kept.kept_default and kept.spec == old_default
    assert not p.choose("mul_mat_id", "q4_0", QWEN, 1024).kept_default
    monkeypatch.setattr(profiles_hook, "lookup", lambda *a: p.choose(*a))
    assert dispatch.choose_mul_mat_id("q4_0", *QWEN, 2048).spec == today
    assert dispatch.choose_mul_mat_id("q4_0", *QWEN, 1024).spec == MmqSpec("q4_0", x=16, y=64, warps=4)
    # a longer study that kept the old default: it stands
    p.put(pm.Entry(TuneKey("mul_mat_id", "q4_0", QWEN, 2048), "mmq_id", old_default, 398.4, 398.4,
                   {"default_spec": old_default.name, "trials": dispatch.SHORT_STUDY_TRIALS}))
    assert dispatch.choose_mul_mat_id("q4_0", *QWEN, 2048).spec == old_default
    # the default of its day is today's: the entry is today's default anyway
    monkeypatch.setattr(dispatch, "default_mul_mat_id", lambda *a: dispatch.Choice("mmq_id", old_default))
    assert dispatch.choose_mul_mat_id("q4_0", *QWEN, 2048).source == "profile"


def test_atomic_write_keeps_the_old_file_on_failure(tmp_path, monkeypatch):
    path = tmp_path / "p.yaml"
    pm.save(make_profile(), path)
    before = path.read_bytes()
    newer = make_profile()
    newer.put(pm.Entry(TuneKey("mul_mat_id", "q4_0", QWEN, 2), "mmvq", MmvqSpec("q4_0", tokens=2), 1.0, 2.0))

    def boom(src, dst):
        raise OSError("disk full")
    monkeypatch.setattr(pm.os, "replace", boom)
    with pytest.raises(OSError):
        pm.save(newer, path)
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["p.yaml"], "no temporary file left behind"
    pm.save(newer, path)
    assert TuneKey("mul_mat_id", "q4_0", QWEN, 2) in pm.load(path).entries


def test_save_refuses_what_load_would_refuse(tmp_path):
    p = make_profile()
    p.fingerprint["sm_count"] = "many"
    with pytest.raises(pm.ProfileError):
        pm.save(p, tmp_path / "p.yaml")
    assert not (tmp_path / "p.yaml").exists()


def test_dispatch_uses_the_profile_through_the_hook(tmp_path, monkeypatch):
    """The path `import moeforge` sets up: dispatch -> profiles_hook -> activate -> profile."""
    import moeforge  # noqa: F401  (installs the hook)
    from moeforge.runtime import device
    here = fake_fp()
    pm.save(make_profile(), tmp_path / pm.file_name(here))
    monkeypatch.setenv("MOEFORGE_PROFILE_DIR", str(tmp_path))
    monkeypatch.setattr(device, "has_gpu", lambda: True)
    monkeypatch.setattr(fpmod, "current", lambda dev=None: here)
    monkeypatch.setattr(dispatch, "device_sm_count", lambda: 132)   # the defaults' rules read it
    monkeypatch.setattr(activate, "active", lambda device=None, _orig=activate.active: _orig(device=0))
    activate.reset()
    try:
        assert profiles_hook._lookup is activate.lookup
        c = dispatch.choose_mul_mat_id("q4_0", *QWEN, 64)
        assert c.source == "profile" and c.spec == MmqSpec("q4_0", x=16, y=64, warps=4, stages=2, stream_k=False)
        # an untuned shape falls back to the defaults
        d = dispatch.choose_mul_mat_id("q4_0", 64, 6, 1408, 2048, 64)
        assert d.source == "default"
        # a profile for another GPU: refused once, with a warning, then defaults
        monkeypatch.setattr(fpmod, "current", lambda dev=None: fake_fp(gpu="NVIDIA A100-SXM4-80GB", cc="8.0"))
        activate.reset()
        activate._said.clear()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(3):
                assert dispatch.choose_mul_mat_id("q4_0", *QWEN, 64).source == "default"
        msgs = [str(w.message) for w in caught if issubclass(w.category, activate.ProfileWarning)]
        assert len(msgs) == 1 and "gpu" in msgs[0] and "cc" in msgs[0], msgs
    finally:
        activate.reset()


def test_entries_record_the_paths_their_study_measured(tmp_path):
    """save_results writes them, load gives them back, and the run-time choice carries them
    (dispatch lets such an entry stand over its f16 rule)."""
    from moeforge.tuning.merge import save_results
    from moeforge.tuning.study import Result
    key = TuneKey("mul_mat_id", "q4_0", QWEN, 4096)
    win = dispatch.Choice("mmq_id", MmqSpec("q4_0", x=64, y=128, warps=4, stages=2, stream_k=False), "tuned")
    res = Result(key, "s", 9, 0, 30.0, 20.0, win, paths=["mmq_id", "per_expert", "mmf_id"])
    path = save_results(fake_fp(), [res], tmp_path, lambda k: "default", lambda m: None)
    prof = pm.load(path)
    assert prof.entries[key].extra["paths"] == ["mmq_id", "per_expert", "mmf_id"]
    c = prof.choose("mul_mat_id", "q4_0", QWEN, 4096)
    assert c.spec == win.spec and c.paths == ("mmq_id", "per_expert", "mmf_id")
