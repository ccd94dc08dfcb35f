"""Profile entries under another template set: each entry records its kernel's source hash
and is used exactly while that source is unchanged; tuning merges into the same file and
drops what it can no longer vouch for."""
import pytest
import yaml

from moeforge.codegen.render import source_hash, templates_hash
from moeforge.codegen.spec import MmqSpec
from moeforge.runtime.dispatch import Choice
from moeforge.tuning import activate, merge, paths, study
from moeforge.tuning import profile as pm
from moeforge.tuning.space import TuneKey, build

from test_profiles import QWEN, fake_fp, make_profile

OTHER = "fedcba9876543210"


def hashed(fp=None, stale=(), missing=()) -> pm.Profile:
    """make_profile() with kernel hashes: right ones, except wrong ones at the `stale`
    buckets and none at the `missing` ones."""
    src = make_profile(fp)
    p = pm.Profile(dict(src.fingerprint))
    for key, e in src.entries.items():
        extra = dict(e.extra)
        if key.n not in missing:
            extra["kernel"] = "0" * 16 if key.n in stale else source_hash(e.spec)
        p.put(pm.Entry(key, e.path, e.spec, e.us, e.default_us, extra))
    return p


def test_source_hash_follows_the_rendered_source():
    a, b = MmqSpec("q4_0", x=8, y=64, warps=4), MmqSpec("q4_0", x=8, y=64, warps=4, stages=3)
    assert source_hash(a) == source_hash(MmqSpec("q4_0", x=8, y=64, warps=4))
    assert source_hash(a) != source_hash(b) and len(source_hash(a)) == 16


def test_other_templates_keep_the_entries_whose_kernels_are_unchanged(tmp_path):
    made = pm.save(hashed(stale=(16,), missing=(64,)), tmp_path / "p.yaml")
    said = []
    prof = activate.resolve(fake_fp(templates=OTHER), [made], warn=said.append)
    assert sorted(k.n for k in prof.entries) == [1, 8, 4096]
    assert len(said) == 1 and "templates" in said[0] and "3 of the 5" in said[0] and "the 2 whose" in said[0]
    # the left-out buckets fall to their nearest kept neighbour, never to the stale choice
    assert prof.choose("mul_mat_id", "q4_0", QWEN, 16).spec == prof.entries[TuneKey("mul_mat_id", "q4_0", QWEN, 8)].spec

    # under its own template set every entry counts, hashed or not (files made before hashes)
    said.clear()
    legacy = pm.save(make_profile(), tmp_path / "legacy.yaml")
    assert len(activate.resolve(fake_fp(), [legacy], warn=said.append).entries) == 5 and not said


def test_a_profile_whose_kernels_all_changed_is_not_used(tmp_path):
    said = []
    legacy = pm.save(make_profile(), tmp_path / "legacy.yaml")   # no hashes: nothing can be checked
    assert activate.resolve(fake_fp(templates=OTHER), [legacy], warn=said.append) is None
    assert len(said) == 1 and "templates" in said[0] and "default" in said[0] and "all its 5" in said[0]


def test_kernel_hash_is_validated(tmp_path):
    d = yaml.safe_load(pm.dump(hashed()))
    d["entries"][0]["kernel"] = "not-a-hash"
    with pytest.raises(pm.ProfileError, match="kernel must be 16 lowercase hex"):
        pm.from_dict(d)


def test_study_names_change_with_the_templates_and_profile_names_do_not():
    space = build(TuneKey("mul_mat_id", "q4_0", QWEN, 16))
    assert study.study_name(fake_fp(), space) != study.study_name(fake_fp(templates=OTHER), space)
    assert pm.file_name(fake_fp()) == pm.file_name(fake_fp(templates=OTHER))


def _save_profile(fp, results, profile_dir):
    import sys
    return merge.save_results(fp, results, profile_dir, lambda key: "default", warn=lambda m: print(m, file=sys.stderr))


def _result(n: int, spec, us: float) -> study.Result:
    key = TuneKey("mul_mat_id", "q4_0", QWEN, n)
    return study.Result(key, "s", trials=7, failed=0, default_us=2 * us, best_us=us, choice=Choice("mmq_id", spec))


def test_tuning_merges_into_the_shipped_profile_and_drops_stale_entries(tmp_path, monkeypatch, capsys):
    now = fake_fp(templates=templates_hash())
    shipped = tmp_path / "shipped" / pm.file_name(now)
    # shipped under an older template set: two of its five kernels changed since
    pm.save(hashed(fake_fp(templates=OTHER), stale=(16,), missing=(64,)), shipped)
    monkeypatch.setattr(paths, "shipped_profiles", lambda: [shipped])
    spec = MmqSpec("q4_0", x=16, y=96, warps=6, stream_k=False)
    out = _save_profile(now, [_result(32, spec, 40.0)], tmp_path / "mine")
    assert "2 entries" in capsys.readouterr().err and out.parent == tmp_path / "mine"
    p = pm.load(out)
    assert p.fingerprint == now
    assert sorted(k.n for k in p.entries) == [1, 8, 32, 4096]
    assert all(e.extra["kernel"] == source_hash(e.spec) for e in p.entries.values())
    assert activate.resolve(now, [out], warn=pytest.fail).entries == p.entries   # an exact match

    # a file of this template set without hashes (made before them) gets them on the next save
    legacy = tmp_path / "legacy"
    pm.save(make_profile(now), legacy / pm.file_name(now))
    p = pm.load(_save_profile(now, [_result(32, spec, 40.0)], legacy))
    assert len(p.entries) == 6 and all(e.extra["kernel"] == source_hash(e.spec) for e in p.entries.values())


def test_other_templates_with_every_kernel_unchanged_say_so(tmp_path):
    made = pm.save(hashed(), tmp_path / "p.yaml")
    said = []
    assert len(activate.resolve(fake_fp(templates=OTHER, driver="1.0"), [made], warn=said.append).entries) == 5
    assert len(said) == 1 and "software and kernel templates" in said[0] and "no kernel" in said[0]
    assert "driver" in said[0] and "templates" in said[0]


def test_shipped_profiles_are_valid_named_and_hashed():
    shipped = paths.shipped_profiles()
    assert len(shipped) >= 2
    for path in shipped:
        p = pm.load(path)
        assert path.name == pm.file_name(p.fingerprint), "a shipped profile under a name the runtime would not write"
        assert all("kernel" in e.extra for e in p.entries.values()), path.name
        if p.fingerprint["templates"] == templates_hash():
            # a profile that claims this template set must have timed exactly these sources
            assert all(e.extra["kernel"] == source_hash(e.spec) for e in p.entries.values()), path.name


def test_shipped_profile_kernels_still_render_as_tuned():
    """A template change must leave the source of every shipped entry as it was timed (new
    features behind spec fields that are off by default); otherwise the entry silently stops
    being used and the card falls back to defaults: re-tune and ship the profile then."""
    for path in paths.shipped_profiles():
        p = pm.load(path)
        stale = [e.spec.name for e in p.entries.values() if e.extra["kernel"] != source_hash(e.spec)]
        assert not stale, f"{path.name}: {len(stale)} entries no longer match their kernel, e.g. {stale[:3]}"


def test_other_templates_with_every_kernel_verified_are_used_silently(tmp_path):
    made = pm.save(hashed(), tmp_path / "p.yaml")
    said = []
    assert len(activate.resolve(fake_fp(templates=OTHER), [made], warn=said.append).entries) == 5
    assert said == []


def test_tune_stale_retunes_exactly_the_changed_buckets(tmp_path, monkeypatch, capsys):
    from moeforge.cli import main
    from moeforge.cli_tune import _standin_fingerprint
    monkeypatch.setenv("MOEFORGE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("MOEFORGE_STANDIN_SLEEP", "0")
    pdir = tmp_path / "prof"
    now = _standin_fingerprint()
    path = pm.save(hashed({**now, "templates": OTHER}, stale=(16,), missing=(64,)), pdir / pm.file_name(now))
    before = pm.load(path).entries
    argv = ["tune", "--objective", "standin", "--stale", "--profile-dir", str(pdir), "--trials", "4", "--quiet"]
    assert main(argv) == 0
    assert "2 entries" in capsys.readouterr().err
    after = pm.load(path)
    assert after.fingerprint == now and set(after.entries) == set(before)
    assert all(e.extra["kernel"] == source_hash(e.spec) for e in after.entries.values())
    for key, e in after.entries.items():
        if key.n in (16, 64):
            assert e.extra["trials"] >= 4 and e.us != before[key].us      # measured again
        else:
            assert e.us == before[key].us and e.spec == before[key].spec  # kept as they were
    assert main(argv) == 0 and "nothing to re-tune" in capsys.readouterr().out

    assert main(["tune", "--objective", "standin", "--stale", "--n", "16", "--profile-dir", str(pdir)]) == 2
    assert "does not combine with --n" in capsys.readouterr().err


def test_stale_buckets_include_an_outdated_kept_default(tmp_path, monkeypatch):
    """A bucket whose short study kept a default that is no longer today's is re-tuned by
    --stale as well: the runtime runs today's default there, not the entry."""
    from moeforge.cli_tune import _standin_fingerprint
    from moeforge.runtime import dispatch
    now = _standin_fingerprint()
    p = hashed(now)
    old = MmqSpec("q4_0", x=64, y=128, warps=4)
    for n, trials in ((2048, 2), (1024, dispatch.SHORT_STUDY_TRIALS)):
        assert dispatch.default_mul_mat_id("q4_0", *QWEN, n).spec != old
        p.put(pm.Entry(TuneKey("mul_mat_id", "q4_0", QWEN, n), "mmq_id", old, 398.4, 398.4,
                       {"default_spec": old.name, "trials": trials, "kernel": source_hash(old)}))
    pdir = tmp_path / "prof"
    pm.save(p, pdir / pm.file_name(now))
    src, keys = merge.stale_keys(now, pdir, warn=pytest.fail)
    assert [k.n for k in keys] == [2048]


def test_stale_buckets_include_entries_the_f16_rule_replaces_on_their_card(tmp_path):
    """On the card a profile names (an sm_90 one here, asked on a CPU), an entry whose study
    did not time the wgmma tiles the rules take gives way to the rule's tile: --stale
    re-tunes it; one whose study timed them stands. On an sm_89 card both stand."""
    from moeforge.codegen.spec import MmfSpec
    from moeforge.runtime import dispatch
    shape = (32, 4, 2880, 2880)
    old = MmfSpec("q4_0", 128, 128, 4, 4, 2, ids=True)
    asks = dispatch._device_cc_major, dispatch.device_sm_count
    for cc, want in (("9.0", [2048]), ("8.9", [])):
        fp = fake_fp(templates=templates_hash(), cc=cc)
        p = pm.Profile(fp)
        for n, extra in ((2048, {}), (4096, {"wgmma": True})):
            p.put(pm.Entry(TuneKey("mul_mat_id", "q4_0", shape, n), "mmf_id", old, 800.0, 900.0,
                           {"default_spec": "mmq_id-q4_0-x64y128w4k8s2", "trials": 9,
                            "paths": ["mmq_id", "mmf_id"], "kernel": source_hash(old), **extra}))
        pdir = tmp_path / cc
        pm.save(p, pdir / pm.file_name(fp))
        _, keys = merge.stale_keys(fp, pdir, warn=pytest.fail)
        assert [k.n for k in keys] == want, cc
    assert (dispatch._device_cc_major, dispatch.device_sm_count) == asks    # this machine's again


def test_tune_stale_reports_a_corrupt_profile_and_leaves_it(tmp_path, monkeypatch, capsys):
    from moeforge.cli import main
    from moeforge.cli_tune import _standin_fingerprint
    monkeypatch.setenv("MOEFORGE_CACHE_DIR", str(tmp_path / "cache"))
    pdir = tmp_path / "prof"
    pdir.mkdir()
    bad = pdir / pm.file_name(_standin_fingerprint())
    bad.write_text("schema_version: 1\nfingerprint: {gpu: [\n")
    assert main(["tune", "--objective", "standin", "--stale", "--profile-dir", str(pdir), "--quiet"]) == 1
    assert "corrupt" in capsys.readouterr().err and bad.exists()
    empty = tmp_path / "none"
    assert main(["tune", "--objective", "standin", "--stale", "--profile-dir", str(empty), "--quiet"]) == 0
    assert "nothing is stale" in capsys.readouterr().out


def test_profile_list_judges_other_templates_entry_by_entry(tmp_path, monkeypatch, capsys):
    from moeforge import cli_profile
    from moeforge.cli import main
    monkeypatch.setattr(cli_profile, "_current_fp", lambda: fake_fp(templates=OTHER))
    monkeypatch.setattr(paths, "shipped_profiles", lambda: [])
    pdir = tmp_path / "p"
    pm.save(hashed(), pdir / "a-verified.yaml")
    pm.save(make_profile(), pdir / "b-unhashed.yaml")
    pm.save(hashed(fake_fp(driver="1.0")), pdir / "c-otherdriver.yaml")
    pm.save(make_profile(fake_fp(driver="1.0")), pdir / "d-otherdriver-unhashed.yaml")
    assert main(["profile", "list", "--profile-dir", str(pdir)]) == 0
    lines = capsys.readouterr().out.splitlines()
    head = {ln.split("/")[-1].split(".yaml")[0]: ln for ln in lines if ".yaml" in ln}
    assert head["a-verified"].endswith("[this GPU]")
    assert "[this GPU" not in head["b-unhashed"]
    assert head["c-otherdriver"].endswith("used with a warning]")
    assert "[this GPU" not in head["d-otherdriver-unhashed"]


def test_every_shipped_entry_still_names_the_kernel_it_timed():
    """A template change that alters a shipped entry's kernel silently demotes that entry to
    the defaults on the cards it was tuned for: the change must come with a re-tune (or
    render the old instances byte for byte, as the K-quant branches do)."""
    shipped = paths.shipped_profiles()
    assert shipped, "the package ships its H100 and H200 profiles"
    for path in shipped:
        prof = pm.load(path)
        stale = [e.spec.name for e in prof.entries.values() if e.extra.get("kernel") != source_hash(e.spec)]
        assert prof.entries and not stale, f"{path.name}: {len(stale)} entries timed other kernels: {stale[:5]}"
