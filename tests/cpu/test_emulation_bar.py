"""The GPU model tests' bar against the emulation (conftest.assert_matches_emulation), held
on made-up logits: near ties pass, a wrong pick or a shifted distribution does not."""
import numpy as np
import pytest

from conftest import NEAR_TIE, assert_matches_emulation


def _logits(rng, n=80, vocab=512):
    return rng.standard_normal((n, vocab)).astype(np.float32) * 3


def test_near_ties_are_no_difference(rng):
    ref = _logits(rng)
    got = ref.copy()
    second = np.argsort(ref, -1)[:, -2]
    spread = ref.max(-1) - ref.min(-1)
    # on a fifth of the positions the runner-up, a tenth of NEAR_TIE behind, overtakes
    flip = rng.choice(len(ref), len(ref) // 5, replace=False)
    ref[flip, second[flip]] = ref[flip].max(-1) - 0.1 * NEAR_TIE * spread[flip]
    got[flip, second[flip]] = ref[flip].max(-1) + 1e-3
    assert (got.argmax(-1) != ref.argmax(-1)).sum() == len(flip)     # 80% alike: below the 90% bar
    assert_matches_emulation(got, ref, "q4_0", seed=0)


def test_a_wrong_pick_past_a_near_tie_fails(rng):
    ref = _logits(rng)
    got = ref.copy()
    flip = rng.choice(len(ref), len(ref) // 5, replace=False)
    worst = ref.argmin(-1)
    got[flip, worst[flip]] = ref[flip].max(-1) + 1.0      # far from a tie in ref
    with pytest.raises(AssertionError, match="top-1 differs"):
        assert_matches_emulation(got, ref, "q4_0", seed=0)


def test_a_shifted_distribution_fails_on_its_kl(rng):
    ref = _logits(rng)
    got = ref + rng.standard_normal(ref.shape).astype(np.float32) * 0.5
    got[np.arange(len(ref)), ref.argmax(-1)] = ref.max(-1) + 5.0     # top-1 kept, the rest moved
    with pytest.raises(AssertionError, match="mean KL"):
        assert_matches_emulation(got, ref, "q4_0", seed=0)


@pytest.mark.parametrize("name", ["f32", "glm-f32"])
def test_router_gaps_a_layer_a_call(parity_models, monkeypatch, name):
    """conftest.record_router_gaps: one array a routed layer and eval call, a gap a token
    (softmax: logits; glm's sigmoid: probability plus selection bias), never negative;
    first_near_tie counts positions across the calls."""
    from conftest import first_near_tie, record_router_gaps
    from moeforge.runtime.model import load_model
    fx = parity_models[name]
    m = load_model(fx["path"], backend="numpy")
    gaps = record_router_gaps(monkeypatch)
    m.reset(8)
    m.eval(fx["tokens"][:5])
    m.eval(fx["tokens"][5:6])
    routed = m.hp.n_layer - m.hp.n_dense_lead
    assert [len(g) for g in gaps] == [5] * routed + [1] * routed
    assert all((g >= 0).all() for g in gaps)
    assert first_near_tie(gaps, routed, 0.0) == 6 and first_near_tie(gaps, routed, np.inf) == 0
    smallest = np.concatenate([np.min(gaps[:routed], axis=0), gaps[routed]])
    at = int(np.argmin(smallest))
    assert first_near_tie(gaps, routed, smallest[at] * (1 + 1e-9) + 1e-300) == at
