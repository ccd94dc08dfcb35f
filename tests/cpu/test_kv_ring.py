"""Sliding-window layers' KV rings (runtime.kv_cache) on the numpy backend: the ring's size,
which layers take one, logits bit for bit those of a cache that keeps every position
(prompt passes and decode steps well past the ring's length, both numerics), and the
context rules a ring brings: a prefix is kept only while the ring still holds the window
before it, and a pass larger than the ring was made for is refused."""
import numpy as np
import pytest

from moeforge.runtime.kv_cache import KVCache, ring_rows
from moeforge.runtime.model import load_model
from moeforge.synth import preset, write_model

WINDOW = 8            # tiny-oss's


@pytest.fixture(scope="module")
def tiny_oss(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("ring") / "tiny-oss-q8_0.gguf")
    write_model(path, preset("tiny-oss"), "q8_0", seed=11)
    return path


@pytest.mark.parametrize("window,max_pass,row_bytes,unit,want", [
    (128, 4096, 2048, 2 << 20, 5120),        # gpt-oss-20b, float32 cache: 4223 rows, 1024 a 2 MiB unit
    (128, 4096, 1024, 2 << 20, 6144),        # f16: 2048 rows a unit
    (128, 512, 2560, 2 << 20, 4096),         # 2560-byte rows: 4096 of them are the first whole unit (10 MiB)
    (8, 16, 256, 1, 23),                     # numpy: no granularity
])
def test_ring_rows_hold_a_window_and_a_pass_in_whole_units(window, max_pass, row_bytes, unit, want):
    rows = ring_rows(window, max_pass, row_bytes, unit)
    assert rows == want
    assert rows >= window - 1 + max_pass and rows * row_bytes % unit == 0


def test_only_sliding_layers_take_a_ring_and_only_where_it_is_shorter(tiny_oss):
    m = load_model(tiny_oss, backend="numpy", n_ctx=100, n_ubatch=16)
    hp, c = m.hp, m.cache
    assert c.rows == tuple(23 if hp.window(il) else 100 for il in range(hp.n_layer))
    assert c.rings == hp.n_layer // 2 and "2 sliding layers in rings of 23)" in m.describe()
    assert c.nbytes == 2 * hp.kv_dim * 4 * sum(c.rows) and all(k.shape[0] == r for k, r in zip(c.k, c.rows))
    full = load_model(tiny_oss, backend="numpy", n_ctx=100, n_ubatch=16, swa_full=True).cache
    assert full.rows == (100,) * hp.n_layer and full.rings == 0 and full.nbytes > c.nbytes
    # a ring no shorter than the context is not taken
    assert load_model(tiny_oss, backend="numpy", n_ctx=20, n_ubatch=16).cache.rings == 0


def test_holds_needs_the_window_before_the_kept_prefix():
    from moeforge.runtime.arch import HParams
    hp = HParams(n_vocab=8, n_embd=8, n_layer=2, n_head=1, n_head_kv=1, head_dim=8, n_ff_exp=8, n_expert=2,
                 n_expert_used=1, rms_eps=1e-5, rope_base=1e4, n_ctx_train=64, n_swa=WINDOW, swa_pattern=2)
    c = KVCache(np, hp, 64, max_pass=4, ring_layer=lambda rows, n_ctx, d, dt: np.zeros((rows, d), dt))
    assert c.rows == (11, 64)                   # 8 - 1 + 4 positions held
    # after 40 positions the ring holds 29..39: continuing at keep needs keep - 7 .. keep - 1
    assert c.holds(40, 40) and c.holds(36, 40) and not c.holds(35, 40)
    assert c.holds(5, 11) and not c.holds(5, 12)            # the window before 5 starts at 0


@pytest.mark.parametrize("numerics", ["float", "kernel"])
def test_ring_logits_are_those_of_the_full_cache(tiny_oss, numerics, rng):
    """Passes of 16 in a ring of 23 positions: each pass overwrites most of the ring."""
    toks = rng.integers(0, preset("tiny-oss").n_vocab, size=90)
    got = {}
    for swa_full in (False, True):
        m = load_model(tiny_oss, backend="numpy", n_ctx=120, n_ubatch=16, numerics=numerics, swa_full=swa_full)
        assert m.cache.rings == (0 if swa_full else 2)
        prompt = m.eval(toks[:70])
        steps = [m.eval([int(t)]) for t in toks[70:]]          # one-token steps
        got[swa_full] = np.concatenate([prompt, *steps])
    np.testing.assert_array_equal(got[False], got[True])
    assert np.isfinite(got[False]).all()


def test_a_prefix_is_kept_only_while_the_ring_holds_its_window(tiny_oss, rng):
    n_vocab = preset("tiny-oss").n_vocab
    m = load_model(tiny_oss, backend="numpy", n_ctx=120, n_ubatch=16)
    ref = load_model(tiny_oss, backend="numpy", n_ctx=120, n_ubatch=16, swa_full=True)
    first = rng.integers(0, n_vocab, size=60)
    m._prefill(first, 0)
    evaluated = []
    step = m._step
    m._step = lambda ids, last_only=False: (evaluated.append(ids.size), step(ids, last_only))[1]
    # a turn that rewrites the text after position 58: the ring (positions 37..59) still holds 51..57
    second = np.concatenate([first[:58], rng.integers(0, n_vocab, size=5)])
    got = m._prefill(second, 0)
    assert sum(evaluated) == 5 and m.n_past == 63
    np.testing.assert_array_equal(got, ref.logits(second)[-1])
    # one that departs at position 20: its window (13..19) left the ring long ago
    evaluated.clear()
    third = np.concatenate([first[:20], rng.integers(0, n_vocab, size=4)])
    got = m._prefill(third, 0)
    assert sum(evaluated) == 24
    np.testing.assert_array_equal(got, ref.logits(third)[-1])
    # the same with every position kept: the prefix stays
    ref._prefill(first, 0)
    evaluated.clear()
    rstep = ref._step
    ref._step = lambda ids, last_only=False: (evaluated.append(ids.size), rstep(ids, last_only))[1]
    ref._prefill(third, 0)
    assert sum(evaluated) == 4


def test_a_pass_larger_than_the_ring_is_refused_until_reset(tiny_oss, rng):
    m = load_model(tiny_oss, backend="numpy", n_ctx=120, n_ubatch=16)
    toks = rng.integers(0, preset("tiny-oss").n_vocab, size=40)
    m.eval(toks[:10])
    m.n_ubatch = 32
    with pytest.raises(ValueError, match=r"n_ubatch 32 is more than .* rings hold a pass of \(16\)"):
        m.eval(toks)
    m.reset()
    assert m.cache.max_pass == 32 and m.cache.rows[0] == 39
    full = load_model(tiny_oss, backend="numpy", n_ctx=120, n_ubatch=32, swa_full=True)
    np.testing.assert_array_equal(m.eval(toks), full.eval(toks))


def test_bench_keeps_rings_unless_swa_full(tiny_oss, tmp_path, capsys):
    """moeforge bench (and every command that loads a model) takes --swa-full; the JSON
    says what the cache took."""
    import json

    from moeforge.cli import main
    got = {}
    for flag in ([], ["--swa-full"]):
        out = tmp_path / f"b{len(flag)}.json"
        assert main(["bench", tiny_oss, "--backend", "numpy", "-p", "8", "-n", "2", "-r", "1", "-d", "40",
                     "-ub", "16", "--json", str(out), *flag]) == 0
        err = capsys.readouterr().err
        got[bool(flag)] = json.loads(out.read_text())
        assert ("2 sliding layers in rings of 23)" in err) == (not flag)
    assert got[False]["kv_ring_layers"] == 2 and got[True]["kv_ring_layers"] == 0
    assert got[False]["kv_cache_bytes"] < got[True]["kv_cache_bytes"]
