"""The tuner on a real GPU (pytest -m gpu): the objective, one bucket tuned end to end, and
the profile policy against this machine's real fingerprint."""
import warnings

import numpy as np
import pytest
import yaml

from moeforge import reference as ref

pytestmark = pytest.mark.gpu

SMALL = (8, 2, 128, 256)


def _product_ok(rng, choice, shape=SMALL, n=64, qtype="q4_0"):
    """Run `choice` through the public API and check it against both references."""
    import cupy as cp
    import moeforge
    E, top_k, m, k = shape
    raw = ref.random_blocks(qtype, E * m, k, rng)
    w = moeforge.QuantTensor.from_blocks(raw, qtype, (E, m, k))
    x = rng.standard_normal((n, k)).astype(np.float32)
    ids = np.argsort(rng.random((n, E)), axis=1)[:, :top_k].astype(np.int32)
    out = cp.full((n, top_k, m), cp.nan, dtype=cp.float32)
    moeforge.mul_mat_id(w, cp.asarray(x), cp.asarray(ids), out=out, choice=choice)
    got = out.get()
    assert ref.nmse(got, ref.mul_mat_id_emulated(raw, qtype, (E, m, k), x, ids)) <= 1e-10
    assert ref.nmse(got, ref.mul_mat_id_float(ref.dequantize(raw, qtype, (E, m, k)), x, ids)) <= 5e-4


def test_objective_checks_then_times(rng):
    from moeforge.tuning import gate, objective
    from moeforge.tuning.space import TuneKey, build, default_choice
    key = TuneKey("mul_mat_id", "q4_0", SMALL, 64)
    case = objective.Case(key, objective.Settings(reps=5), rng)
    assert set(case.inputs) == {"random", "skewed"}
    res = objective.evaluate(case, default_choice(key))
    assert res["nmse_emulated"] <= gate.NMSE_EMULATED and res["nmse_float"] <= gate.NMSE_FLOAT
    assert 0 < res["us_random"] < 1e5 and 0 < res["us_skewed"] < 1e5
    assert res["value"] == pytest.approx((res["us_random"] + res["us_skewed"]) / 2)
    for c in build(key).choices[:6]:
        objective.check(case, c)   # the generated instances pass the gate on this GPU
    # the gate really compares: against the references of other weights, it must fail
    other = ref.random_blocks("q4_0", 8 * 128, 256, rng)
    r = case.refs["random"]
    case.refs["random"] = gate.reference(other, "q4_0", case.wshape, case.inputs["random"][0][0].get(),
                                         case.inputs["random"][0][1].get(), r.tokens, r.rows)
    with pytest.raises(gate.GateFailure, match="random routing"):
        objective.check(case, default_choice(key))


def test_isolated_gpu_trial_and_timeout():
    from moeforge.tuning.isolate import IsolatedRunner, TrialFailed
    from moeforge.tuning.space import TuneKey, default_choice
    key = TuneKey("mul_mat_id", "q8_0", SMALL, 4)
    c = default_choice(key)
    head = {"key": [key.op, key.qtype, list(key.shape), key.n], "settings": {"reps": 5}}
    with IsolatedRunner("moeforge.tuning.objective:Handler") as r:
        r.call({**head, "op": "prepare"}, 300)
        res = r.call({**head, "op": "trial", "path": c.path, "spec": c.spec.to_dict()}, 300)
        assert res["value"] > 0
        with pytest.raises(TrialFailed, match="timed out"):
            r.call({**head, "op": "trial", "path": c.path, "spec": c.spec.to_dict()}, 0.001)
        bad = dict(c.spec.to_dict(), warps=3)
        with pytest.raises(TrialFailed, match="warps"):
            r.call({**head, "op": "trial", "path": c.path, "spec": bad}, 300)


def test_tune_one_bucket_end_to_end(rng, tmp_path, monkeypatch):
    from moeforge.cli import main
    from moeforge.runtime import dispatch
    from moeforge.tuning import activate, fingerprint as fpmod
    from moeforge.tuning import profile as pm
    monkeypatch.setenv("MOEFORGE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("MOEFORGE_PROFILE_DIR", str(tmp_path / "prof"))
    rc = main(["tune", "--shape", ",".join(map(str, SMALL)), "--types", "q4_0", "--n", "64", "--trials", "8",
               "--quiet"])
    assert rc == 0
    from moeforge.tuning.paths import shipped_profiles
    from moeforge.tuning.space import TuneKey
    here = fpmod.current()
    path = tmp_path / "prof" / pm.file_name(here)
    prof = pm.load(path)
    entry = prof.entries[TuneKey("mul_mat_id", "q4_0", SMALL, 64)]
    assert entry.us <= entry.default_us
    # on a card with a shipped profile of this very fingerprint, the new entry joins its entries
    shipped = [p for p in shipped_profiles() if p.name == path.name]
    assert len(prof.entries) == 1 + (len(pm.load(shipped[0]).entries) if shipped else 0)
    activate.reset()
    try:
        choice = dispatch.choose_mul_mat_id("q4_0", *SMALL, 64)
        assert choice.source == "profile" and choice.spec == entry.spec
        assert dispatch.choose_mul_mat_id("q4_0", *SMALL, 80).spec == entry.spec   # nearest bucket
        _product_ok(rng, choice)
        # running it again resumes the same study: 8 measured trials are not redone
        import optuna
        from moeforge.tuning import paths
        names = optuna.study.get_all_study_names(paths.default_storage_url())
        before = len(optuna.load_study(study_name=names[0], storage=paths.default_storage_url()).trials)
        assert main(["tune", "--shape", ",".join(map(str, SMALL)), "--types", "q4_0", "--n", "64",
                     "--trials", "8", "--quiet"]) == 0
        after = len(optuna.load_study(study_name=names[0], storage=paths.default_storage_url()).trials)
        assert after == before
    finally:
        activate.reset()


def test_profile_policy_on_the_real_fingerprint(rng, tmp_path, monkeypatch):
    from moeforge.codegen.spec import MmqSpec
    from moeforge.runtime import dispatch
    from moeforge.tuning import activate, fingerprint as fpmod
    from moeforge.tuning import profile as pm
    from moeforge.tuning.space import TuneKey
    here = fpmod.current()
    marked = MmqSpec("q4_0", x=32, y=64, warps=4, stages=2, stream_k=False)   # not the default at n=64

    def write(fp, name, extra=None):
        p = pm.Profile(dict(fp))
        p.put(pm.Entry(TuneKey("mul_mat_id", "q4_0", SMALL, 64), "mmq_id", marked, 10.0, 12.0, extra or {}))
        pm.save(p, tmp_path / name)

    monkeypatch.setenv("MOEFORGE_PROFILE_DIR", str(tmp_path))
    # the policy under test is between these files alone: a shipped profile for this very
    # card (an exact match, which rightly wins over a downgraded one) stays out of it
    monkeypatch.setattr(activate, "shipped_profiles", lambda: [])

    def choose():
        activate.reset()
        activate._said.clear()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            c = dispatch.choose_mul_mat_id("q4_0", *SMALL, 64)
        return c, [str(w.message) for w in caught if issubclass(w.category, activate.ProfileWarning)]

    try:
        write(here, "exact.yaml")
        c, said = choose()
        assert c.source == "profile" and c.spec == marked and not said
        _product_ok(rng, c)

        (tmp_path / "exact.yaml").unlink()
        write({**here, "driver": "1.0", "nvrtc": "11.0"}, "olddriver.yaml")
        c, said = choose()
        assert c.source == "profile" and c.spec == marked
        assert len(said) == 1 and "driver" in said[0] and "nvrtc" in said[0]

        (tmp_path / "olddriver.yaml").unlink()
        write({**here, "sm_count": here["sm_count"] + 2}, "othergpu.yaml")
        c, said = choose()
        assert c.source == "default"
        assert len(said) == 1 and "sm_count" in said[0]

        write({**here, "templates": "0" * 16}, "othertemplates.yaml")
        (tmp_path / "othergpu.yaml").unlink()
        c, said = choose()
        assert c.source == "default" and "templates" in said[0]

        # other templates, but this entry's kernel source is unchanged: used as it is
        from moeforge.codegen.render import source_hash
        write({**here, "templates": "0" * 16}, "unchangedkernel.yaml", {"kernel": source_hash(marked)})
        c, said = choose()
        assert c.source == "profile" and c.spec == marked and not said
        (tmp_path / "unchangedkernel.yaml").unlink()

        d = yaml.safe_load(pm.dump(pm.load(tmp_path / "othertemplates.yaml")))
        d["fingerprint"] = dict(here)
        d["entries"][0]["spec"]["stages"] = 9
        (tmp_path / "othertemplates.yaml").unlink()
        (tmp_path / "corrupt.yaml").write_text(yaml.safe_dump(d))
        c, said = choose()
        assert c.source == "default"
        assert any("corrupt" in s and "stages" in s for s in said), said
    finally:
        activate.reset()


def test_shipped_profile_is_found_for_its_card():
    """On the card a shipped profile was made on, dispatch uses it without any tuning."""
    from moeforge.runtime import dispatch
    from moeforge.tuning import activate, fingerprint as fpmod
    from moeforge.tuning import profile as pm
    from moeforge.tuning.paths import shipped_profiles
    here = fpmod.current()
    mine = [p for p in shipped_profiles() if pm.load(p).fingerprint.get("gpu") == here["gpu"]]
    if not mine:
        pytest.skip(f"no shipped profile for {here['gpu']}")
    activate.reset()
    c = dispatch.choose_mul_mat_id("q4_0", 128, 8, 768, 2048, 64)
    assert c.source == "profile", "a shipped profile for this GPU was not used"
