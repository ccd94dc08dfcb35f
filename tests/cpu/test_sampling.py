"""Sampling the next token (runtime.sampling) and generation with it, on the CPU."""
import numpy as np
import pytest

from moeforge.runtime.sampling import Sampler, Sampling, candidates, penalize

OFF = dict(top_k=0, top_p=1.0, min_p=0.0)     # every filter off


def _draws(logits, settings, count):
    s = Sampler(settings)
    return np.bincount([s(logits) for _ in range(count)], minlength=logits.size)


def test_greedy_is_the_argmax_after_the_penalty(rng):
    z = rng.standard_normal(300) * 0.1
    a, b = rng.choice(300, size=2, replace=False)
    z[a], z[b] = 3.0, 2.5
    assert Sampler()(z) == a                                      # temperature 0 by default
    assert Sampler(Sampling(repeat_penalty=2.0))(z, history=[a]) == b     # 3.0 / 2 < 2.5


def test_the_sampler_never_writes_the_row_it_is_given(rng):
    """Generation hands the sampler a row in a buffer it reuses (Model.eval(reuse=True)):
    penalties and biases work on a copy; with none, no copy is made at all."""
    z = rng.standard_normal(5000).astype(np.float32)
    before = z.copy()
    for s in (Sampling(), Sampling(temperature=0.9, seed=1), Sampling(repeat_penalty=1.3, frequency_penalty=0.5),
              Sampling(temperature=0.9, seed=1, logit_bias=((3, 50.0),), presence_penalty=1.0)):
        Sampler(s)(z, history=[1, 2, 3, 2])
        np.testing.assert_array_equal(z, before)
    assert penalize(z, [1, 2], 1.0) is z
    assert penalize(z, [1, 2], 1.1) is not z


def test_penalty_is_llama_cpps_once_per_distinct_token():
    z = np.array([2.0, -2.0, 1.0, 0.0])
    got = penalize(z, [0, 1, 0, 0, 3], 1.25)
    np.testing.assert_array_equal(got, np.float32([2.0 / 1.25, -2.5, 1.0, 0.0]))
    np.testing.assert_array_equal(penalize(z, [0, 1], 1.0), z)
    # then frequency per occurrence and presence once: token 0 three times, 1 and 3 once
    np.testing.assert_array_equal(penalize(z, [0, 1, 0, 0, 3], 1.0, 0.5, 0.25),
                                  np.float32([2.0 - 1.75, -2.0 - 0.75, 1.0, -0.75]))
    # only the last repeat_last_n tokens count
    s = Sampler(Sampling(repeat_penalty=100.0, repeat_last_n=2))
    assert s(np.array([5.0, 4.0, 0.0]), history=[0, 2, 2]) == 0
    assert s(np.array([5.0, 4.0, 0.0]), history=[2, 0, 2]) == 1


def test_filters_keep_what_llama_cpp_keeps():
    z = np.log(np.array([0.05, 0.4, 0.3, 0.15, 0.1]))
    assert candidates(z, Sampling(**{**OFF, "top_k": 2})).tolist() == [1, 2]
    # the shortest most-probable run reaching top_p: 0.4 + 0.3 = 0.7 < 0.75, + 0.15 reaches it
    assert candidates(z, Sampling(**{**OFF, "top_p": 0.75})).tolist() == [1, 2, 3]
    assert candidates(z, Sampling(**{**OFF, "top_p": 0.7})).tolist() == [1, 2]
    # min_p against the most probable: 0.3 * 0.4 = 0.12 keeps 0.4, 0.3, 0.15
    assert candidates(z, Sampling(**{**OFF, "min_p": 0.3})).tolist() == [1, 2, 3]
    assert candidates(z, Sampling(**{**OFF, "top_p": 1e-9})).tolist() == [1]       # at least one
    # in the chain's order: top_k first, then top_p on the renormalised rest
    assert candidates(z, Sampling(**{**OFF, "top_k": 3, "top_p": 0.5})).tolist() == [1, 2]


def _candidates_by_full_sort(z, s):
    """The chain as written down: the whole vocabulary sorted, every filter on it."""
    order = np.argsort(-z, kind="stable")
    if s.top_k:
        order = order[:s.top_k]
    p = np.exp(z[order].astype(np.float64) - float(z[order[0]]))
    p /= p.sum()
    if s.top_p < 1:
        keep = int(np.searchsorted(np.cumsum(p), s.top_p)) + 1
        order, p = order[:keep], p[:keep] / p[:keep].sum()
    if s.min_p > 0:
        order = order[p >= s.min_p * p[0]]
    return order


@pytest.mark.parametrize("spread", [0.3, 3.0, 12.0])      # flat, a language model's, peaked
def test_the_windowed_filters_keep_what_a_full_sort_keeps(rng, spread):
    for _ in range(20):
        n = int(rng.integers(2, 3000))
        z = (rng.standard_normal(n) * spread).astype(np.float32)
        if rng.random() < 0.3:
            z = np.round(z)                    # ties, kept in id order by both
        s = Sampling(top_k=int(rng.choice([0, 1, 5, 40, 5000])), top_p=float(rng.choice([1.0, 0.95, 0.5, 0.1])),
                     min_p=float(rng.choice([0.0, 0.05, 0.5])))
        np.testing.assert_array_equal(candidates(z, s), _candidates_by_full_sort(z, s), err_msg=str(s))


def test_draws_follow_the_softmax_at_the_temperature(rng):
    z = rng.standard_normal(6) * 1.5
    n = 40000
    for temp in (1.0, 0.5):
        p = np.exp(z / temp - (z / temp).max())
        p /= p.sum()
        got = _draws(z, Sampling(temperature=temp, seed=int(rng.integers(2**31)), **OFF), n) / n
        sigma = np.sqrt(p * (1 - p) / n)
        assert (np.abs(got - p) <= 6 * sigma + 1e-12).all(), (temp, got, p)


def test_filtered_tokens_are_never_drawn(rng):
    z = rng.standard_normal(50) * 2
    s = Sampling(temperature=1.5, top_k=10, top_p=0.8, min_p=0.1, seed=int(rng.integers(2**31)))
    keep = set(candidates(z, s).tolist())
    counts = _draws(z, s, 3000)
    assert set(np.nonzero(counts)[0].tolist()) <= keep and len(keep) < 10


def test_a_seed_repeats_a_run_and_another_seed_does_not(rng):
    z = np.zeros(1000)                         # flat: every draw is a fresh choice
    seed = int(rng.integers(2**31))
    a = _draws(z, Sampling(temperature=1.0, seed=seed, **OFF), 200)
    b = _draws(z, Sampling(temperature=1.0, seed=seed, **OFF), 200)
    c = _draws(z, Sampling(temperature=1.0, seed=seed + 1, **OFF), 200)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)


@pytest.mark.parametrize("kw,field", [
    (dict(temperature=-0.1), "temperature"), (dict(temperature=float("nan")), "temperature"),
    (dict(top_k=-1), "top_k"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(min_p=-0.5), "min_p"), (dict(repeat_penalty=0.0), "repeat_penalty"),
    (dict(repeat_last_n=-2), "repeat_last_n"), (dict(presence_penalty=float("inf")), "presence_penalty"),
])
def test_bad_settings_name_the_field(kw, field):
    with pytest.raises(ValueError, match=f"sampling {field}="):
        Sampler(Sampling(**kw))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from moeforge.runtime.model import load_model
    from moeforge.synth import preset, write_qwen3moe
    path = str(tmp_path_factory.mktemp("sample") / "t.gguf")
    write_qwen3moe(path, preset("tiny"), "q8_0", seed=3)
    return path, load_model(path, backend="numpy")


def test_generate_samples_streams_and_stops(tiny, rng):
    path, m = tiny
    prompt = rng.integers(0, 512, size=7)
    hot = Sampling(temperature=1.2, top_k=0, top_p=1.0, min_p=0.0, seed=int(rng.integers(2**31)))
    seen = []
    a = m.generate(prompt, 12, hot, on_token=seen.append)
    assert len(a) == 12 and seen == a
    assert m.generate(prompt, 12, hot) == a                           # the seed repeats it
    greedy = m.generate(prompt, 6)
    assert m.generate(prompt, 6, Sampling(temperature=0.0)) == greedy
    # a stop token ends generation and is not returned
    assert m.generate(prompt, 6, stop=[greedy[0]]) == []
    cut = next((i for i in range(1, 6) if greedy[i] not in greedy[:i]), None)
    if cut is not None:
        assert m.generate(prompt, 6, stop=[greedy[cut]]) == greedy[:cut]
    assert m.generate(prompt, 0) == []
    with pytest.raises(ValueError, match="n must be >= 0"):
        m.generate(prompt, -1)
    # the synthetic vocabulary's end of turn, as a real Qwen3 file names it
    assert m.eos_ids and all(0 <= t < m.hp.n_vocab for t in m.eos_ids)


def test_run_command_samples_with_a_seed(tiny, capsys):
    pytest.importorskip("tokenizers")
    from moeforge.cli import main
    path, _ = tiny
    args = ["run", path, "-p", "Once upon", "-n", "8", "--backend", "numpy", "--temp", "0.9", "--seed", "7",
            "--ignore-eos"]
    assert main(args) == 0
    first = capsys.readouterr()
    assert main(args) == 0
    again = capsys.readouterr()
    assert first.out == again.out and first.out.startswith("Once upon")
    assert "prompt" in first.err and "generated 8 tokens" in first.err
    with pytest.raises(SystemExit, match="top_p"):      # refused before the model is read
        main(["run", "/nonexistent.gguf", "-p", "x", "--top-p", "0"])


def test_sampling_is_exported_lazily():
    import moeforge
    assert moeforge.Sampling is Sampling and "Sampling" in moeforge.__all__


def test_generation_keeps_the_prefix_the_context_holds(tiny, rng, monkeypatch):
    """A prompt that extends the last one (a conversation's next turn) evaluates only what
    is new; the logits are those of a fresh context (to float rounding), and a prompt that
    shares nothing, or would not fit, starts over."""
    from moeforge.runtime.model import load_model
    path, _ = tiny
    m = load_model(path, backend="numpy", n_ctx=64)
    evaluated = []
    real = m.eval
    monkeypatch.setattr(m, "eval", lambda ids, **kw: evaluated.append(len(ids)) or real(ids, **kw))
    first = rng.integers(0, 512, size=9)
    out = m.generate(first, 4)
    assert evaluated == [9, 1, 1, 1]
    turn = np.concatenate([first, out, rng.integers(0, 512, size=5)])
    evaluated.clear()
    again = m.generate(turn, 3)
    assert evaluated[0] == 5 + 1           # the new tokens, and the last reply token never evaluated
    fresh = load_model(path, backend="numpy", n_ctx=64)
    assert again == fresh.generate(turn, 3)
    np.testing.assert_allclose(m.eval([again[0]])[-1], fresh.eval([again[0]])[-1], rtol=1e-5, atol=1e-5)
    evaluated.clear()
    m.generate(turn[:8], 2)                # a prefix of what is held: only its last token again
    assert evaluated[0] == 1
    evaluated.clear()
    other = rng.integers(0, 512, size=6)
    other[0] = (turn[0] + 1) % 512         # shares nothing: all of it
    m.generate(other, 2)
    assert evaluated[0] == 6
    evaluated.clear()
    m.generate(turn, 60)                   # 22 + 60 > 64: a fresh, larger context
    assert evaluated[0] == turn.size and m.cache.n_ctx >= turn.size + 60
