"""The search space: drawn from the generated instances only, pruned before compiling."""
import dataclasses

import pytest

from moeforge.codegen import enumerate as enum
from moeforge.codegen.quant import quant_type
from moeforge.codegen.spec import MmqSpec, MmvqSpec
from moeforge.runtime import dispatch
from moeforge.runtime.dispatch import Choice
from moeforge.tuning import space as sp
from moeforge.tuning.space import TuneKey, build, default_choice, params_of, seeds

QWEN = (128, 8, 768, 2048)


def test_buckets_cover_the_anchor_n():
    assert set(sp.ANCHOR_N) <= set(sp.BUCKETS)
    assert sp.BUCKETS[0] == 1 and sp.BUCKETS[-1] == 4096


@pytest.mark.parametrize("qtype", ["q4_0", "q8_0", "q2_K", "q3_K", "q6_K"])
@pytest.mark.parametrize("n", sp.BUCKETS)
def test_candidates_are_generated_instances_and_the_default_is_there(qtype, n):
    key = TuneKey("mul_mat_id", qtype, QWEN, n)
    s = build(key)
    generated = {x.name for x in enum.all_specs([quant_type(qtype)])}
    for c in s.choices:
        assert c.spec.name in generated, c.spec.name
        assert sp.path_allows(key.op, c.path, c.spec, key.shape, n) is None
    d = default_choice(key)
    assert s.lookup(params_of(d)) is not None, "the default must always be measurable"
    assert seeds(s)[0].spec == d.spec, "the default is enqueued first"
    # every candidate round-trips through its Optuna parameters
    for c in s.choices:
        assert s.lookup(params_of(c)).spec == c.spec


@pytest.mark.parametrize("n", [1, 4])
def test_dense_candidates_round_trip_with_the_k_split_form(n):
    """The dense mat-vec candidates include the form that splits long rows over the warps
    (MmvqSpec.ksplit), a knob of its own: without it two candidates shared one set of
    Optuna parameters and one of them could never be looked up."""
    s = build(TuneKey("mul_mat", "q4_0", (1, 1, 4096, 12288), n))
    split = [c for c in s.choices if c.path == "mmvq" and c.spec.ksplit]
    assert len(split) == 1 and s.knob_choices("mmvq")["ksplit"] == [False, True]
    for c in s.choices:
        assert s.lookup(params_of(c)).spec == c.spec
    assert len(s.by_params) == len(s.choices)


def test_the_profile_entry_is_measured_again(monkeypatch):
    """A re-tune seeds the bucket's current profile choice right after the default, so a
    short budget cannot replace an entry by something it never compared with it."""
    from moeforge.runtime import profiles_hook
    key = TuneKey("mul_mat_id", "q8_0", QWEN, 2048)
    s = build(key)
    held = next(c for c in s.choices if c.path == "mmq_id" and c.spec != default_choice(key).spec)
    asked = []

    def lookup(op, qtype, shape, n):
        asked.append((op, qtype, shape, n))
        return Choice(held.path, held.spec, "profile")

    monkeypatch.setattr(profiles_hook, "_lookup", lookup)
    got = seeds(s)
    assert asked == [("mul_mat_id", "q8_0", QWEN, 2048)]
    assert got[0].spec == default_choice(key).spec and got[1].spec == held.spec
    assert len({c.spec for c in got}) == len(got)
    monkeypatch.setattr(profiles_hook, "_lookup", lambda *a: Choice("mmq_id", default_choice(key).spec, "profile"))
    assert [c.spec for c in seeds(s)].count(default_choice(key).spec) == 1
    monkeypatch.setattr(profiles_hook, "_lookup", None)
    assert seeds(s)[0].spec == default_choice(key).spec


def test_mmvq_only_within_its_limits():
    assert "mmvq" in build(TuneKey("mul_mat_id", "q4_0", QWEN, 8)).paths
    assert "mmvq" in build(TuneKey("mul_mat_id", "q4_0", (16, 16, 64, 256), 8)).paths  # routing tiles: any top_k
    assert "mmvq" in build(TuneKey("mul_mat_id", "q4_0", QWEN, 32)).paths    # 1-2 tokens per expert
    assert "mmvq" not in build(TuneKey("mul_mat_id", "q4_0", QWEN, 64)).paths
    assert "mmvq" not in build(TuneKey("mul_mat", "q4_0", (1, 1, 768, 2048), 16)).paths
    s = build(TuneKey("mul_mat_id", "q4_0", QWEN, 2))
    assert all(c.spec.tokens <= 2 for c in s.choices if c.path == "mmvq")
    assert any("more than n=2 can fill" in why for _, why in s.pruned)


def test_shared_memory_limit_prunes_before_compiling():
    key = TuneKey("mul_mat_id", "q8_0", QWEN, 4096)
    full = build(key)
    biggest = max(c.spec.smem_bytes() for c in full.choices if isinstance(c.spec, MmqSpec))
    limit = biggest - 1
    s = build(key, smem_limit=limit)
    assert all(c.spec.smem_bytes() <= limit for c in s.choices if isinstance(c.spec, MmqSpec))
    assert any("shared memory" in why for _, why in s.pruned)
    assert len(s) < len(full)


def test_tiles_follow_tokens_per_expert():
    # n=16, E=128, top_k=8: one token per expert on average: only the narrowest tile
    s = build(TuneKey("mul_mat_id", "q4_0", QWEN, 16))
    assert {c.spec.x for c in s.choices if c.path != "mmvq"} == {8}
    assert any("far more than" in why for _, why in s.pruned)
    # n=4096: 256 tokens per expert: no 8-wide tiles, the per-expert path is in play
    s = build(TuneKey("mul_mat_id", "q4_0", QWEN, 4096))
    assert min(c.spec.x for c in s.choices if c.path != "mmvq") >= 32
    assert "per_expert" in s.paths
    assert "per_expert" not in build(TuneKey("mul_mat_id", "q4_0", QWEN, 64)).paths


def test_rows_per_tile_bounded_by_m():
    s = build(TuneKey("mul_mat_id", "q4_0", (8, 2, 64, 256), 512))
    d = default_choice(s.key)
    assert all(c.spec.y == 64 or c.spec == d.spec for c in s.choices)


def test_dense_op_space():
    s = build(TuneKey("mul_mat", "q8_0", (1, 1, 4096, 4096), 512))
    assert s.paths == ["mmq", "mmf"]
    assert all(not c.spec.ids for c in s.choices)
    s = build(TuneKey("mul_mat", "q8_0", (1, 1, 4096, 4096), 4))
    assert "mmvq" in s.paths  # dense mmq tiles start at 16 tokens: pruned this far below
    assert all(not c.spec.ids for c in s.choices)


def test_signature_tracks_the_candidate_set():
    key = TuneKey("mul_mat_id", "q8_0", QWEN, 4096)
    assert build(key).signature() == build(key).signature()
    assert build(key).signature() != build(key, smem_limit=64 * 1024).signature()


@pytest.mark.parametrize("bad", [
    dict(op="conv", qtype="q4_0", shape=QWEN, n=16),
    dict(op="mul_mat_id", qtype="q9_9", shape=QWEN, n=16),
    dict(op="mul_mat_id", qtype="q4_0", shape=(8, 9, 64, 256), n=16),
    dict(op="mul_mat_id", qtype="q4_0", shape=(8, 2, 64, 250), n=16),
    dict(op="mul_mat_id", qtype="q4_0", shape=QWEN, n=48),
    dict(op="mul_mat_id", qtype="q4_0", shape=QWEN, n=8192),
    dict(op="mul_mat", qtype="q4_0", shape=QWEN, n=16),
])
def test_bad_keys_are_value_errors(bad):
    with pytest.raises(ValueError):
        TuneKey(**bad)


def test_path_rules_refuse_mismatched_specs():
    mmvq = MmvqSpec("q4_0", tokens=1, warps=4, rows=1, ids=True)
    mmq = MmqSpec("q4_0", x=8, y=128, warps=8, ids=True)
    assert sp.path_allows("mul_mat_id", "mmvq", mmvq, QWEN, 1) is None
    assert sp.path_allows("mul_mat_id", "mmvq", mmvq, QWEN, 32) is None
    assert sp.path_allows("mul_mat_id", "mmvq", mmvq, QWEN, 64) is not None
    assert sp.path_allows("mul_mat_id", "per_expert", mmq, QWEN, 512) is not None   # needs ids=False
    assert sp.path_allows("mul_mat_id", "mmq", mmq, QWEN, 512) is not None           # no such path
    assert sp.path_allows("mul_mat_id", "mmvq", MmvqSpec("q4_0", act="silu"), QWEN, 1) is not None
    assert sp.path_allows("mul_mat_id", "mmq_id", Choice("x", mmvq).spec, QWEN, 1) is not None


def test_every_shipped_entry_can_be_seeded(monkeypatch):
    """A re-tune of any shipped bucket measures the shipped choice again: each entry's
    choice is in its bucket's space and comes out of seeds() when it is the incumbent."""
    from pathlib import Path

    import moeforge
    from moeforge.runtime import profiles_hook
    from moeforge.tuning.profile import load
    files = sorted((Path(moeforge.__file__).parent / "profiles").glob("*.yaml"))
    assert files
    for f in files:
        for key, e in load(f).entries.items():
            monkeypatch.setattr(profiles_hook, "_lookup", lambda *a, e=e: Choice(e.path, e.spec, "profile"))
            assert any(c.spec == e.spec for c in seeds(build(key))), (f.name, key.label, e.spec.name)


def test_f16_tiles_join_the_space_where_they_can_win():
    """The f16 path is a candidate past the mat-vec range, with its own knob names; seeds
    include its default-like tile, so every study times it at least once."""
    from moeforge.codegen.spec import MmfSpec
    from moeforge.tuning.space import seeds
    s = build(TuneKey("mul_mat_id", "q4_0", QWEN, 4096))
    f16 = [c for c in s.choices if c.path == "mmf_id"]
    assert f16 and all(isinstance(c.spec, MmfSpec) and c.spec.ids for c in f16)
    assert any(c.path == "mmf_id" for c in seeds(s))
    assert all(k.startswith("mmf_id.") for c in f16 for k in params_of(c) if k != "path")
    assert "mmf_id" not in build(TuneKey("mul_mat_id", "q4_0", QWEN, 8)).paths
    small = build(TuneKey("mul_mat_id", "q4_0", QWEN, 4096), smem_limit=64 * 1024)
    assert not any(c.path == "mmf_id" for c in small.choices)
    assert any(name.startswith("mmf_id:") and "shared memory" in why for name, why in small.pruned)


MIXTRAL_DOWN = (8, 2, 4096, 14336)


@pytest.mark.parametrize("n", [16, 32, 64, 128, 256, 1024])
def test_expert_tiles_below_one_wave_take_stream_k(n, monkeypatch):
    """Mixtral's down (8 experts x 32 row tiles of 128) stays under two tiles an SM of a
    132-SM card up to 128 tokens: its default takes stream-k there and only there, and the
    tuner can measure it; Qwen3's 128 experts never do, nor Mixtral's down on 64 SMs."""
    from moeforge.runtime import dispatch
    monkeypatch.setattr(dispatch, "device_sm_count", lambda: 132)
    key = TuneKey("mul_mat_id", "q4_0", MIXTRAL_DOWN, n)
    d = default_choice(key)
    assert d.path == "mmq_id" and d.spec.stream_k == (n <= 128)
    assert dispatch.moe_tiles(*MIXTRAL_DOWN[:3], n, d.spec.x, d.spec.y) == (256 if n <= 128 else 512 if n == 256 else 1024)
    assert build(key).lookup(params_of(d)) is not None
    assert not default_choice(TuneKey("mul_mat_id", "q4_0", QWEN, n)).spec.stream_k
    monkeypatch.setattr(dispatch, "device_sm_count", lambda: 64)
    assert not default_choice(key).spec.stream_k


@pytest.mark.parametrize("qtype", ["q4_0", "mxfp4", "q4_K"])
@pytest.mark.parametrize("n", [512, 4096])
def test_the_wgmma_space_round_trips_and_holds_no_glu_tile(qtype, n, monkeypatch):
    """On sm_90 the expert products' space holds the wgmma tiles, each looked up again
    from its own Optuna parameters; the glu tiles (the model's gate|up form, which write the
    down's f16 x and share their plain tile's knobs) are never candidates: one had taken
    its plain tile's parameters, and the rule's own tile could not be timed."""
    monkeypatch.setattr(dispatch, "wgmma_available", lambda: True)
    monkeypatch.setattr(dispatch, "_device_cc_major", lambda: 9)
    dense = build(TuneKey("mul_mat", qtype, (1, 1, 4096, 2048), n))
    assert any(getattr(c.spec, "wgmma", False) for c in dense.choices)
    assert all(dense.lookup(params_of(c)).spec == c.spec for c in dense.choices)
    key = TuneKey("mul_mat_id", qtype, (32, 4, 5760, 2880) if qtype == "mxfp4" else QWEN, n)
    s = build(key)
    wg = [c for c in s.choices if getattr(c.spec, "wgmma", False)]
    assert wg and not any(c.spec.glu for c in s.choices if c.path == "mmf_id")
    for c in s.choices:
        assert s.lookup(params_of(c)).spec == c.spec
    assert len(s.by_params) == len(s.choices)
    d = default_choice(key)
    assert s.lookup(params_of(d)).spec == d.spec
    glu = dataclasses.replace(wg[0].spec, glu="silu")
    assert "glu tiles" in sp.path_allows(key.op, "mmf_id", glu, key.shape, n)


@pytest.mark.parametrize("op,shape", [("mul_mat_id", QWEN), ("mul_mat", (1, 1, 4096, 2048))])
def test_the_baseline_is_what_runs_without_a_profile(op, shape, monkeypatch):
    """A study's default, enqueued first and the base of each tuned entry's speedup, is what
    dispatch runs where the profile has no entry: on sm_90 past the f16 rule's threshold the
    rule's wgmma tile (the int8 default, which nothing runs there, stays a seed of its own
    path), below it the int8 default. It was the int8 default alone, and a study's table
    gave the tuned tile's gain over a path nothing ran (1.68x on an H200)."""
    from moeforge.runtime import profiles_hook
    monkeypatch.setattr(dispatch, "wgmma_available", lambda: True)
    monkeypatch.setattr(dispatch, "_device_cc_major", lambda: 9)
    monkeypatch.setattr(profiles_hook, "_lookup", None)
    _, _, m, k = shape

    def ran(n):
        if op == "mul_mat_id":
            return dispatch.choose_mul_mat_id("q4_0", *shape, n), dispatch.default_mul_mat_id("q4_0", *shape, n)
        return dispatch.choose_mul_mat("q4_0", m, k, n), dispatch.default_mul_mat("q4_0", m, k, n)
    for n in (64, 4096):
        key = TuneKey(op, "q4_0", shape, n)
        d, (runs, int8) = default_choice(key), ran(n)
        assert (d.path, d.spec) == (runs.path, runs.spec)
        got = seeds(build(key))
        assert got[0].spec == d.spec, "the default is enqueued first"
        assert any((c.path, c.spec) == (int8.path, int8.spec) for c in got), "the int8 default is still timed"
        if n == 4096:
            assert d.path in ("mmf", "mmf_id") and d.spec.wgmma and int8.path in ("mmq", "mmq_id")
        else:
            assert d.spec == int8.spec
