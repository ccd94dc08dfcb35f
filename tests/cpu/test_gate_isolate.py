"""The correctness gate's CPU half (routing, subset references, the comparison) and the
worker-process isolation (crash, hang, wrong result end one trial, not the caller)."""
import time

import numpy as np
import pytest

from moeforge import reference as ref
from moeforge.tuning import gate
from moeforge.tuning.isolate import IsolatedRunner, TrialFailed


def test_random_routing_is_distinct_experts(rng):
    ids = gate.routing("random", 300, 16, 4, rng)
    assert ids.shape == (300, 4) and ids.dtype == np.int32
    assert all(len(set(r)) == 4 for r in ids)
    assert ids.min() >= 0 and ids.max() < 16
    counts = np.bincount(ids.ravel(), minlength=16)
    assert counts.max() < 3 * counts.mean()


def test_skewed_routing_has_hot_experts(rng):
    E, top_k, n = 128, 8, 512
    ids = gate.routing("skewed", n, E, top_k, rng)
    assert all(len(set(r)) == top_k for r in ids)
    counts = np.sort(np.bincount(ids.ravel(), minlength=E))[::-1]
    hot = min(4, E // 8)
    assert counts[:hot].min() > 0.6 * n, "each hot expert should take most tokens"
    assert counts[hot:].mean() < 0.1 * n
    assert (counts == 0).any() or counts[-1] < counts[0] / 20


@pytest.mark.parametrize("qtype", ["q4_0", "q8_0", "q2_K", "q3_K", "q6_K"])
def test_subset_reference_equals_the_full_reference(rng, qtype):
    E, top_k, m, k, n = 8, 2, 200, 128 if qtype not in ("q2_K", "q3_K", "q6_K") else 256, 700
    raw = ref.random_blocks(qtype, E * m, k, rng)
    x = rng.standard_normal((n, k)).astype(np.float32)
    ids = gate.routing("skewed", n, E, top_k, rng)
    rows, tokens = gate.check_rows(m, rng), gate.check_tokens(n, rng)
    assert len(tokens) == gate.MAX_TOKENS and tokens[0] == 0 and tokens[-1] == n - 1
    for edge in (63, 64, 127, 128, 199):
        assert edge in rows
    r = gate.reference(raw, qtype, (E, m, k), x, ids, tokens, rows)
    full = ref.mul_mat_id_emulated(raw, qtype, (E, m, k), x, ids)
    np.testing.assert_allclose(r.emulated, r.pick(full), rtol=1e-12, atol=1e-12)
    # a correct (float32) output passes; the checked part is what is compared
    out = full.astype(np.float32)
    res = gate.compare(r.pick(out), r)
    assert res["nmse_emulated"] <= gate.NMSE_EMULATED and res["nmse_float"] <= gate.NMSE_FLOAT
    # the f16 tiles' own rounding, every type having them
    np.testing.assert_allclose(r.emulated_f16, r.pick(ref.mul_mat_id_emulated_f16(raw, qtype, (E, m, k), x, ids)),
                               rtol=1e-12, atol=1e-12)


def test_compare_catches_unwritten_and_wrong_outputs(rng):
    E, top_k, m, k, n = 4, 2, 64, 64, 40
    raw = ref.random_blocks("q4_0", E * m, k, rng)
    x = rng.standard_normal((n, k)).astype(np.float32)
    ids = gate.routing("random", n, E, top_k, rng)
    r = gate.reference(raw, "q4_0", (E, m, k), x, ids, gate.check_tokens(n, rng), gate.check_rows(m, rng))
    good = r.emulated.astype(np.float32)
    poisoned = good.copy()
    poisoned[3, 1, 5] = np.nan
    with pytest.raises(gate.GateFailure, match="NaN"):
        gate.compare(poisoned, r)
    swapped = good.copy()
    swapped[[0, 1]] = swapped[[1, 0]]    # partial sums added to the wrong tokens
    with pytest.raises(gate.GateFailure, match="emulating"):
        gate.compare(swapped, r)
    subtle = good * np.float32(1 + 1e-4)   # a slightly wrong scale: passes float, fails emulation
    with pytest.raises(gate.GateFailure, match="emulating"):
        gate.compare(subtle, r)


def test_f16_candidates_are_held_to_their_own_emulation(rng):
    """An f16-path output passes with numerics="f16" and fails the q8_1 emulation (the two
    roundings differ by far more than 1e-10), and vice versa: the gate must pick per path."""
    E, top_k, m, k, n = 4, 2, 64, 256, 40
    raw = ref.random_blocks("q8_0", E * m, k, rng)
    x = rng.standard_normal((n, k)).astype(np.float32)
    ids = gate.routing("random", n, E, top_k, rng)
    r = gate.reference(raw, "q8_0", (E, m, k), x, ids, gate.check_tokens(n, rng), gate.check_rows(m, rng))
    f16 = r.emulated_f16.astype(np.float32)
    assert gate.compare(f16, r, "f16")["nmse_emulated"] <= gate.NMSE_EMULATED
    with pytest.raises(gate.GateFailure, match="emulating"):
        gate.compare(f16, r)
    with pytest.raises(gate.GateFailure, match="emulating"):
        gate.compare(r.emulated.astype(np.float32), r, "f16")
    with pytest.raises(ValueError, match="numerics"):
        gate.compare(f16, r, "bf16")


STANDIN = "moeforge.tuning.standin:Handler"
TRIAL = {"op": "trial", "path": "mmq_id",
         "spec": {"family": "mmq", "qtype": "q4_0", "x": 16, "y": 64, "warps": 4, "kblocks": 8, "stages": 3,
                  "ids": True, "stream_k": True}}


def test_isolated_runner_survives_crash_hang_and_wrong_results():
    with IsolatedRunner(STANDIN) as r:
        ok = r.call(TRIAL, timeout=60)
        assert ok["value"] == pytest.approx(20.0 + 0.7 + 0.4)
        assert r.spawned == 1
        assert r.call(TRIAL, timeout=60)["value"] == ok["value"] and r.spawned == 1, "kept between trials"

        with pytest.raises(TrialFailed, match="died .*SIGSEGV"):
            r.call({"op": "crash"}, timeout=60)
        assert r.call(TRIAL, timeout=60)["value"] == ok["value"] and r.spawned == 2

        t = time.time()
        with pytest.raises(TrialFailed, match="timed out after 2 s"):
            r.call({"op": "hang"}, timeout=2)
        assert time.time() - t < 20
        assert r.call(TRIAL, timeout=60)["value"] == ok["value"] and r.spawned == 3

        with pytest.raises(TrialFailed, match="GateFailure: NMSE"):
            r.call({"op": "wrong"}, timeout=60)
        # a process that produced a wrong result is not trusted again
        assert r.call(TRIAL, timeout=60)["value"] == ok["value"] and r.spawned == 4


def _truncating_dot(w: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Rows of w . x as Hopper's f16 MMA accumulates them: a k16 step's exact sum added to a
    float32 accumulator rounded toward zero."""
    acc = np.zeros(w.shape[0], dtype=np.float32)
    for c in range(0, w.shape[1], 16):
        s = (w[:, c:c + 16] * x[c:c + 16]).sum(axis=1) + acc
        f = s.astype(np.float32)
        over = np.abs(f.astype(np.float64)) > np.abs(s)
        f[over] = np.nextafter(f[over], np.float32(0))
        acc = f
    return acc


def test_the_f16_bar_grows_with_k_as_truncating_accumulators_do(rng):
    """ref.nmse_emulated_bar: flat to 4096 and for the int8 paths; past it the f16 tiles'
    bar admits a truncating float32 accumulator at Mixtral's k = 14336 (which the flat bar
    refuses) and still refuses a lost k-block or a scale 1e-4 off."""
    assert ref.nmse_emulated_bar(2048, True) == ref.nmse_emulated_bar(4096, True) == gate.NMSE_EMULATED
    assert ref.nmse_emulated_bar(14336, False) == gate.NMSE_EMULATED
    k = 14336
    w = rng.standard_normal((48, k)).astype(np.float16).astype(np.float64)
    x = rng.standard_normal(k).astype(np.float16).astype(np.float64)
    exact = w @ x
    e = ref.nmse(_truncating_dot(w, x), exact)
    assert gate.NMSE_EMULATED < e <= ref.nmse_emulated_bar(k, True)
    lost = w.copy()
    lost[:, 4096:4128] = 0                       # one 32-weight block never added
    assert ref.nmse(_truncating_dot(lost, x), exact) > 1e3 * ref.nmse_emulated_bar(k, True)
    assert ref.nmse(exact * (1 + 1e-4), exact) > ref.nmse_emulated_bar(k, True)
