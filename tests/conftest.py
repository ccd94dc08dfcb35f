import dataclasses
import functools
import os

import numpy as np
import pytest

from moeforge.codegen.spec import MmqSpec, MmvqSpec


def pytest_collection_modifyitems(config, items):
    """GPU tests skip cleanly, with the reason, where no CUDA device is present."""
    from moeforge.runtime.device import has_gpu
    if has_gpu():
        return
    skip = pytest.mark.skip(reason="no CUDA device on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def run_seed() -> int:
    """A fresh seed every run, or MOEFORGE_SEED's (to replay a failure)."""
    return int(os.environ.get("MOEFORGE_SEED", np.random.SeedSequence().entropy % 2**32))


@pytest.fixture
def rng(request):
    """Fresh random inputs every run; the seed is printed so a failure can be replayed
    (MOEFORGE_SEED=... pytest ...)."""
    seed = run_seed()
    print(f"\n[seed {seed}] {request.node.name}")
    return np.random.default_rng(seed)


@pytest.fixture(scope="session")
def generated(tmp_path_factory):
    """The instances of compile_plan() compiled, once per test session."""
    import io
    from moeforge.codegen.compile import ARCHS
    from moeforge.codegen.generate import generate
    from moeforge.codegen.quant import parse_types
    build_dir = tmp_path_factory.mktemp("build")
    buf = io.StringIO()
    plan = compile_plan()
    subset = dict(plan)
    summary = generate(parse_types("all"), ARCHS, build_dir, progress=False, out=buf, subset=subset)
    return build_dir, summary, buf.getvalue()


FULL_ARCHS = ("sm_80", "sm_90")   # the templates' two code paths (see compile_plan)
TILE_EVERY = 17         # sm_90's share of the int8 tiles and mat-vecs beyond the branch signatures and named ones
SAMPLE_EVERY = 53       # sm_80's share of the instances beyond its branch signatures
OTHER_ARCH_EVERY = 199  # sm_86's and sm_89's: sm_80's code under another target
TILE_SIZES = ("x", "y", "warps", "kblocks", "stages", "tokens", "rows")


def branch_signature(spec) -> tuple:
    """A spec without its tile sizes: the template branches it takes (the sizes are only
    #defines the branches are written over; the one branch a mat-vec's rows choose, its
    launch bounds, is spec.six_blocks)."""
    fields = dataclasses.asdict(spec) if dataclasses.is_dataclass(spec) else {}
    return (type(spec).__name__, getattr(spec, "six_blocks", None),
            *((k, v) for k, v in fields.items() if k not in TILE_SIZES))


def form_signature(spec) -> tuple:
    """A branch signature without the quant format: the formats' traits have no architecture
    branch and the int8 tiles' and mat-vecs' only one is PDL's instructions (test_codegen
    checks both), so one format of each form carries sm_80's path."""
    return tuple(f for f in branch_signature(spec) if not (isinstance(f, tuple) and f[0] == "qtype"))


def compile_plan() -> dict:
    """{arch: instances} the compile test builds. The templates branch on __CUDA_ARCH__ >= 800
    and >= 900 only (test_codegen checks that), so sm_90 and sm_80 carry every code path; the
    tile sizes (x, y, warps, kblocks, stages; a mat-vec's tokens and rows) are #defines the
    branches are written over. Both build every instance the dispatch defaults name. sm_90
    builds one instance of every branch signature, those the shipped profiles name (all of
    them made on sm_90 cards), every f16 tile and model instance, and a fixed 17th of the
    other int8 tiles and mat-vecs (a stride prime to the enumeration's tile-size axes, so
    every size of every axis is compiled: test_codegen checks it); sm_80 one instance of
    every form (form_signature), the f16 tiles and model instances of the 32-weight formats
    and a fixed 53rd of the rest; sm_86 and sm_89, which compile sm_80's path, a fixed 199th.
    Why samples: CI has 2 cores and ~30 minutes. With every int8 tile of q4_0 and q8_0 and a
    sixth of the others' on sm_90, CI took 46 to 53 minutes (2026-11-30), ~40 of them here;
    a plan of a seventh and a 23rd still took 20.5 of a 29-minute run (39 core-minutes:
    compiled one at a time, an sm_90 int8 tile 0.9 s, a mat-vec 0.31, an f16 tile 1.35; an
    sm_80 int8 tile 1.53, a mat-vec 0.17; a model module ~35; two processes on 2 cores run
    each ~1.45x slower than alone)."""
    from moeforge.codegen.compile import ARCHS
    from moeforge.codegen.enumerate import all_specs
    from moeforge.codegen.quant import parse_types
    specs = all_specs(parse_types("all"))
    cheap32 = [s for s in specs if not isinstance(s, (MmqSpec, MmvqSpec))
               and (not hasattr(s, "quant") or s.quant.sub_blocks == 1)]
    one_each = list({branch_signature(s): s for s in reversed(specs)}.values())
    one_form = list({form_signature(s): s for s in reversed(specs)}.values())
    sampled = [s for s in specs if isinstance(s, (MmqSpec, MmvqSpec))]
    kept = _named_specs() | _profile_specs() | set(one_each) | set(sampled[::TILE_EVERY])
    sm90 = [s for s in specs if s in kept or not isinstance(s, (MmqSpec, MmvqSpec))]
    named = [s for s in specs if s in _named_specs()]
    sm80 = list(dict.fromkeys(cheap32 + one_form + named + specs[::SAMPLE_EVERY]))
    plan = {a: sm90 if a == "sm_90" else sm80 if a == "sm_80" else specs[::OTHER_ARCH_EVERY] for a in ARCHS}
    return {a: [s for s in v if s.supports(a)] for a, v in plan.items()}   # wgmma: sm_90 only


@functools.lru_cache(maxsize=1)
def _profile_specs() -> frozenset:
    """The instances the shipped profiles name (each made on an sm_90 card)."""
    from moeforge.tuning.paths import shipped_profiles
    from moeforge.tuning.profile import load
    return frozenset(e.spec for path in shipped_profiles() for e in load(path).entries.values())


@functools.lru_cache(maxsize=1)
def _named_specs() -> frozenset:
    """The instances the dispatch defaults choose on any card: int8 tiles of 1 to 256 tokens
    an expert (dense and MoE) and the mat-vecs of 1 to 8 tokens, plain, fused and combining,
    with the widths of the models' products."""
    from moeforge.codegen.quant import QUANT_TYPES
    from moeforge.runtime import dispatch
    out = set()
    for q in QUANT_TYPES:
        for per_tile in (1, 2, 4, 8, 16, 32, 64, 128, 256):
            out.add(dispatch.default_mmq(q, per_tile, ids=True))
            out.add(dispatch.default_mmq(q, per_tile, ids=False))
        for per_tile in (1, 4, 16):     # the expert tiles of stream-k below one wave (default_mul_mat_id)
            out.add(dispatch.default_mmq(q, per_tile, ids=True, stream_k=True))
        for n in range(1, 9):
            for ids in (True, False):
                out.add(dispatch.default_mmvq(q, n, ids))
                for act in MmvqSpec.ACTS:
                    for bias in (False, True):
                        for k in (256, 2048, 2880):
                            out.add(dispatch.default_fused(q, n, act, bias, ids, k))
                            if ids:
                                out.add(dispatch.default_fused(q, n, act, bias, ids, k, wait_first=True))
        for top_k in range(1, 9):       # the model's combining down product: short, mid and long rows
            for k in (768, 2880, 14336):
                out.add(dispatch.default_combine(q, k, top_k))
    return frozenset(out)


PARITY_DIR = os.path.join(os.path.dirname(__file__), "fixtures", "parity")


@pytest.fixture(scope="session")
def parity_models(tmp_path_factory):
    """The llama.cpp parity fixtures: GGUF files rewritten from the manifest (bit-identical
    weights, checked by hash), with llama.cpp's logits. name -> dict(path, tokens, logits)."""
    import json
    from gguf import GGUFReader
    import hashlib
    from moeforge.synth import SynthSpec, write_qwen3moe
    with open(os.path.join(PARITY_DIR, "manifest.json")) as fh:
        manifest = json.load(fh)
    out = {}
    tmp = tmp_path_factory.mktemp("parity")
    for name, e in manifest["fixtures"].items():
        path = str(tmp / f"{name}.gguf")
        write_qwen3moe(path, SynthSpec(**e["spec"]), source="float", seed=e["seed"],
                       name="moeforge parity fixture", **e["args"])
        h = hashlib.sha256()
        for t in GGUFReader(path).tensors:
            h.update(t.name.encode())
            h.update(np.ascontiguousarray(t.data).view(np.uint8).tobytes())
        assert h.hexdigest() == e["weights_sha256"], (
            f"fixture {name}: the rewritten weights differ from those llama.cpp evaluated "
            f"(gguf or numpy changed?); rerun scripts/make_parity_fixtures.py")
        z = np.load(os.path.join(PARITY_DIR, e["file"]))
        out[name] = dict(path=path, tokens=z["tokens"], logits=z["logits"], entry=e)
    return out


def kl_per_token(ref, got):
    """KL(p_ref || p_got) per position, from logits."""
    def logp(z):
        z = np.asarray(z, dtype=np.float64)
        z = z - z.max(axis=-1, keepdims=True)
        return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))
    lp, lq = logp(ref), logp(got)
    return (np.exp(lp) * (lp - lq)).sum(axis=-1)


def assert_top1_and_kl(ref, got, bar=1e-3):
    """Issue 4's bar on logits: the same top-1 token at every position, mean KL per token
    (ref || got) below bar."""
    top = got.argmax(-1) == ref.argmax(-1)
    assert top.all(), f"top-1 differs at positions {np.nonzero(~top)[0].tolist()}"
    kl = kl_per_token(ref, got)
    assert kl.mean() < bar, f"mean KL {kl.mean():.2e} (max {kl.max():.2e})"


F32_PARITY_BAR = 1e-4   # the numpy backend on F32 weights: max abs difference of the logits (their spread is ~1)


def assert_f32_matches_llama_cpp(fx, got):
    """A llama.cpp parity fixture of F32 weights against the numpy backend's logits: float32,
    its shape, and elementwise within F32_PARITY_BAR."""
    assert got.dtype == np.float32 and got.shape == fx["logits"].shape
    err = np.abs(got - fx["logits"]).max()
    assert err < F32_PARITY_BAR, f"max abs difference {err:.3e} vs llama.cpp"


def assert_matches_llama_cpp(fx, got, float_weights: bool):
    """A llama.cpp parity fixture's bar (issue 4) on a model's logits got: float32, its
    shape, finite, the same top-1 at every position and mean KL < 1e-3; float weights also
    elementwise (1e-3)."""
    assert got.shape == fx["logits"].shape and got.dtype == np.float32 and np.isfinite(got).all()
    assert_top1_and_kl(fx["logits"], got)
    if float_weights:
        assert np.abs(got - fx["logits"]).max() < 1e-3


def assert_cache_consistent(m, toks, cuts, rel=None):
    """All at once == token by token == in the uneven chunks that `cuts` (ascending ends)
    make: what one pass writes into the KV cache, later passes read as the whole prompt's.
    rel: the bar relative to the largest logit, where prompt and decode kernels add in
    other orders (the GPU); else 1e-5 absolute (one arithmetic for both)."""
    whole = m.logits(toks)
    m.reset(len(toks))
    one = np.concatenate([m.eval([t]) for t in toks])
    m.reset()
    chunks = np.concatenate([m.eval(toks[a:b]) for a, b in zip((0, *cuts[:-1]), cuts)])
    atol = 1e-5 if rel is None else rel * np.abs(whole).max()
    np.testing.assert_allclose(one, whole, atol=atol, rtol=0)
    np.testing.assert_allclose(chunks, whole, atol=atol, rtol=0)


def record_router_gaps(monkeypatch) -> list:
    """Every numpy route call from now on appends, per token, the gap between the k-th and
    (k+1)-th of its choice keys (softmax routing: the logits; sigmoid: the probabilities
    plus the selection bias). At a near tie the GPU and the emulation may each take either
    expert, and as later positions attend to it their logits part too (first_near_tie).
    f16 and tf32 attention, the f16 KV cache and the GPU's ex2.approx (an ulp from float64's
    exp2) moved a router logit by up to 2.5e-4 (tiny gpt-oss, seed 1020490866)."""
    from moeforge.runtime.backend_numpy import NumpyBackend
    gaps, route = [], NumpyBackend.route

    def recording(self, logits, gating, sel_bias=None):
        z = logits.astype(np.float64)
        if gating.func == "sigmoid":
            z = 1.0 / (1.0 + np.exp(-z)) + (0.0 if sel_bias is None else np.asarray(sel_bias, np.float64))
        srt = -np.sort(-z, axis=-1)
        gaps.append(srt[:, gating.top_k - 1] - srt[:, gating.top_k])
        return route(self, logits, gating, sel_bias)
    monkeypatch.setattr(NumpyBackend, "route", recording)
    return gaps


def first_near_tie(gaps, n_routed: int, below: float) -> int:
    """The first position whose routing had a gap under `below` in one of its n_routed
    layers (every eval call, a ubatch or a decode step, routes them one after the other),
    or the count of positions."""
    per_pos = np.concatenate([np.min(gaps[i:i + n_routed], axis=0) for i in range(0, len(gaps), n_routed)])
    near = np.nonzero(per_pos < below)[0]
    return int(near[0]) if len(near) else len(per_pos)


def decode_on_cuda_and_emulation(path, toks, prompt: int, knobs: dict, **load_kw):
    """The logits of decode steps (toks[prompt:], one token a step) after a prompt of the
    first `prompt` tokens: on the cuda backend with its attributes `knobs` set (the decode
    graph checked captured), then on the numpy backend with the kernels' numerics, both with
    warnings as errors. Returns (cuda logits, numpy logits, the numpy model)."""
    import warnings
    from moeforge.runtime.model import load_model
    outs = []
    for backend in ("cuda", "numpy"):
        m = load_model(path, backend=backend, **load_kw, **({} if backend == "cuda" else {"numerics": "kernel"}))
        if backend == "cuda":
            for name, value in knobs.items():
                assert hasattr(m.backend, name), name
                setattr(m.backend, name, value)
        m.reset(len(toks))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            m.eval(toks[:prompt])
            outs.append(np.concatenate([m.eval([t]) for t in toks[prompt:]]))
        if backend == "cuda":
            assert m.backend.graphs.captured("decode-grouped" if knobs.get("decode_attn_grouped") else "decode")
    return outs[0], outs[1], m


# a pick trailing ref's top-1 by less than this share of its logits' spread is a near tie
NEAR_TIE = 0.02


def assert_matches_emulation(got, ref, weights, seed, exact_until=None):
    """A random model's logits on the GPU (got) against the numpy backend emulating the
    kernels (ref). Float weights (weights "f32"): within 1e-3 of the largest logit, at the
    positions before exact_until (all where None), the quantized bar at all of them.
    Quantized: a last-bit difference in one product (another summation order) can move a
    value across a rounding boundary of the next layer's q8_1 quantizer, and random tiny
    models amplify such flips (numpy, q8_0: q8_1 activations against float ones KL 3e-3 to
    5e-3 on a tiny gpt-oss, 6e-5 to 6e-4 on a tiny qwen3moe; the MXFP4 gpt-oss reached 1.1e-3
    to 1.9e-3 against the emulation on 4 seeds of 16, H200 2026-11-28). So top-1 at 90% of
    the positions and mean KL < 5e-3, which a wrong bias, expert, row or window still misses
    by orders of magnitude; the kernels' own arithmetic is held elementwise on f32. A near
    tie is no difference: where got's pick trails ref's top-1 by under NEAR_TIE of ref's
    spread of logits it counts as the same top-1 (H200, 2026-11-30, DeepSeek-V2-Lite's heads
    q4_0 on 10 seeds: top-1 alike at 90.0-97.5% of 80 positions, KL 2.9e-4 to 3.5e-4, and
    every difference a near tie, ref's lead 0.01-1.5% of its spread: 90% failed one seed in ten)."""
    assert got.shape == ref.shape and np.isfinite(got).all()
    if weights == "f32":
        n = len(ref) if exact_until is None else exact_until
        err = np.abs(got[:n] - ref[:n]).max(-1, initial=0.0) / np.abs(ref).max()
        assert err.max(initial=0.0) < 1e-3, (f"seed {seed}: max abs difference {err.max():.2e} relative to the "
                                             f"largest logit, at positions {np.nonzero(err >= 1e-3)[0].tolist()}")
        if exact_until is None or exact_until >= len(ref):
            return
    lead = (ref.max(-1) - ref[np.arange(len(ref)), got.argmax(-1)]) / (ref.max(-1) - ref.min(-1))
    top = lead < NEAR_TIE
    kl = kl_per_token(ref, got)
    if top.mean() <= 0.9:
        pos = np.nonzero(~top)[0]
        raise AssertionError(f"seed {seed}: top-1 differs at positions {pos.tolist()} (of {len(ref)}); ref's lead "
                             f"over got's pick {np.round(lead[pos], 4).tolist()} of its spread; KL there "
                             f"{np.round(kl[pos], 5).tolist()}, mean {kl.mean():.2e}")
    assert kl.mean() < 5e-3, f"seed {seed}: mean KL {kl.mean():.2e}"


def attn_hparams(n_head, n_head_kv, head_dim):
    """A small model's hyperparameters with the given heads (for attention alone)."""
    from moeforge.runtime.arch_qwen3moe import HParams
    return HParams(n_vocab=32, n_embd=64, n_layer=2, n_head=n_head, n_head_kv=n_head_kv, head_dim=head_dim,
                   n_ff_exp=64, n_expert=8, n_expert_used=2, rms_eps=1e-6, rope_base=1e6, n_ctx_train=4096)


def attention64(q, kc, vc, pos, hp, sinks=None, window=0):
    """Causal grouped-query attention in float64: query t sees cached positions <= pos[t]
    (and > pos[t] - window where window > 0); sinks: a logit per query head that joins
    the softmax's denominator only (gpt-oss)."""
    n, g, hd = q.shape[0], hp.n_head // hp.n_head_kv, hp.head_dim
    out = np.empty((n, hp.q_dim))
    for t in range(n):
        L = pos[t] + 1
        F = max(0, L - window) if window else 0
        for h in range(hp.n_head):
            kvh = h // g
            s = kc[F:L, kvh * hd:(kvh + 1) * hd] @ q[t, h * hd:(h + 1) * hd] / np.sqrt(hd)
            m = s.max() if sinks is None else max(s.max(), float(sinks[h]))
            p = np.exp(s - m)
            den = p.sum() + (0.0 if sinks is None else np.exp(float(sinks[h]) - m))
            out[t, h * hd:(h + 1) * hd] = (p / den) @ vc[F:L, kvh * hd:(kvh + 1) * hd]
    return out


def split_counters_ready(B, hp) -> bool:
    """Decode attention's split counters after a launch: the per-head kernel's (the first
    n_head) all zero again; the grouped kernels' [bank, count 0, count 1] a block of heads
    after them: the bank 0 or 1, and the count the next launch takes zero."""
    c = B._attn_counts.get()
    head, grouped = c[:hp.n_head], c[hp.n_head:].reshape(-1, 3)
    bank = grouped[:, 0]
    return bool((head == 0).all() and (bank <= 1).all()
                and (grouped[np.arange(len(grouped)), 1 + np.minimum(bank, 1)] == 0).all())


def decode_cache_rows(kc, vc, n_kv, window, cache):
    """A decode attention test's cache rows: NaN past the current position (never read);
    1e4 before a window (a chunk or tile partly before it is read and masked, so they must be
    finite, as a cache's old rows are; unmasked, their scores would take all the weight); in
    the cache's type (an f16 cache: what it holds)."""
    kc[n_kv:] = np.nan
    vc[n_kv:] = np.nan
    if window:
        kc[:max(0, n_kv - window)] = 1e4
        vc[:max(0, n_kv - window)] = 1e4
    return kc.astype(cache.dtype), vc.astype(cache.dtype)


def decode_fused_is_separate(B, cache, il, kc, vc, q, pos, n_kv, rng):
    """Decode attention fused (q, k and v straight from the projections, as inside a decode
    step) and after the separate qk_norm_rope_store launch, on the same cache with the rows
    from the current position on poisoned (the current one must come from the kernel, not
    the cache): the outputs and the whole caches agree bit for bit, the stored rows are
    finite. Returns the output, q as rotated and the cache's keys and values."""
    from types import SimpleNamespace

    import cupy as cp
    hp = B.hp
    k = rng.standard_normal((1, hp.kv_dim)).astype(np.float32)
    v = rng.standard_normal((1, hp.kv_dim)).astype(np.float32)
    L = SimpleNamespace(q_norm=cp.asarray(rng.uniform(0.5, 1.5, hp.head_dim).astype(np.float32)),
                        k_norm=cp.asarray(rng.uniform(0.5, 1.5, hp.head_dim).astype(np.float32)))
    kc[n_kv - 1:] = np.nan
    vc[n_kv - 1:] = np.nan
    kc, vc = kc.astype(cache.dtype), vc.astype(cache.dtype)
    results = []
    with B.context():
        for fused in (False, True):
            cache.k[il].set(kc)
            cache.v[il].set(vc)
            B.ws("attn", (1, hp.q_dim)).fill(cp.nan)
            qd, kd, vd = cp.asarray(q), cp.asarray(k), cp.asarray(v)
            if fused:     # what qk_norm_rope_store_ leaves for the attention inside a decode step
                B._pending_qk = (qd.data.ptr, kd, vd, L.q_norm, L.k_norm)
            else:
                B.qk_norm_rope_store_(cache, il, qd, kd, vd, L, pos, n_kv - 1)
                q_rot = qd.get()
            out = B.attention(cache, il, qd, pos, n_kv - 1, 1, "attn").get()
            results.append((out, cache.k[il].get(), cache.v[il].get()))
    (out0, k0, v0), (out1, k1, v1) = results
    np.testing.assert_array_equal(out1, out0)
    np.testing.assert_array_equal(k1, k0)
    np.testing.assert_array_equal(v1, v0)
    assert np.isfinite(k0[:n_kv]).all() and np.isfinite(v0[:n_kv]).all()
    return out0, q_rot, k0, v0


# where a K-quant block keeps its f16 scales (d, and dmin where it has one)
K_F16_AT = {"q2_K": (80, 82), "q3_K": (108,), "q5_K": (0, 2), "q6_K": (208,), "iq4_xs": (0,)}


def kquant_blocks(rng, name, n):
    """n random blocks of a K-quant with finite f16 scales (random bytes make some of them
    inf or nan), then four all-zero blocks (d = 0: q8_0's zero-scale branch)."""
    from moeforge.runtime.convert import block_size
    nbytes = block_size(name)[1]
    raw = rng.integers(0, 256, size=(n + 4, nbytes), dtype=np.uint8)
    for at in K_F16_AT[name]:
        raw[:, at:at + 2] = (rng.standard_normal(n + 4) * 1e-2).astype(np.float16).view(np.uint8).reshape(-1, 2)
    raw[n:] = 0
    return raw


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    """A tiny model whose generate emits a scripted reply (model.script, token ids; the
    synthetic vocabulary has no reasoning or tool-call markers, so they come as text:
    byte-level BPE spells anything)."""
    pytest.importorskip("tokenizers")
    from moeforge.runtime.model import load_model
    from moeforge.synth import preset, write_model
    path = str(tmp_path_factory.mktemp("reasoning") / "t.gguf")
    write_model(path, preset("tiny"), "q8_0", seed=3)
    model = load_model(path, backend="numpy", n_ctx=256)
    model.script = []

    def generate(prompt_ids, n, sampling=None, *, stop=(), on_token=None):
        out = []
        for t in model.script[:n]:
            out.append(t)
            if on_token is not None and on_token(t):
                break
        return out
    model.generate = generate
    return model


def fed_in_pieces(splitter, text: str, rng, most: int = 8) -> list:
    """splitter.add() over text cut at random (pieces of 1 to `most` characters), then
    flush(): every (kind, value) handed out, in order (runtime.reasoning, runtime.tool_calls)."""
    parts, i = [], 0
    while i < len(text):
        k = int(rng.integers(1, most + 1))
        parts += splitter.add(text[i:i + k])
        i += k
    return parts + splitter.flush()


def mma_m16n8k16(d, a, b0, b1):
    """d += A . B with the PTX fragment layouts (gr = t/4, tq = t%4): A pairs (gr, 2tq..),
    (gr+8, 2tq..), (gr, 8+2tq..), (gr+8, 8+2tq..); B pairs (k 2tq.., n gr), (k 8+2tq.., n gr);
    C (gr, 2tq), (gr, 2tq+1), (gr+8, 2tq), (gr+8, 2tq+1)."""
    A, B = np.zeros((16, 16)), np.zeros((16, 8))
    for t in range(32):
        gr, c = t // 4, 2 * (t % 4)
        A[gr, c:c + 2], A[gr + 8, c:c + 2], A[gr, c + 8:c + 10], A[gr + 8, c + 8:c + 10] = (x[t] for x in a)
        B[c:c + 2, gr], B[c + 8:c + 10, gr] = b0[t], b1[t]
    C = A @ B
    for t in range(32):
        gr, c = t // 4, 2 * (t % 4)
        d[t] += np.array([C[gr, c], C[gr, c + 1], C[gr + 8, c], C[gr + 8, c + 1]])


def rewrite(src, dst, tensors=None, kv=None, add=()):
    """Copy a GGUF, letting tensors(name, array, type) -> [(name, array, type)] and
    kv(key, value, types) -> value or None (drop) change it on the way; add: more
    (key, value, GGUFValueType[, element type]) entries."""
    import gguf
    from gguf import GGUFValueType
    r = gguf.GGUFReader(src)
    from moeforge.runtime.gguf_file import GGUFFile
    w = gguf.GGUFWriter(dst, arch=GGUFFile(src).architecture)
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        val = GGUFFile._value(f)
        if kv:
            val = kv(name, val, f.types)
            if val is None:
                continue
        sub = f.types[1] if f.types[0] == GGUFValueType.ARRAY else None
        w.add_key_value(name, val, f.types[0], sub_type=sub)
    for key, val, vtype, *sub in add:
        w.add_key_value(key, val, vtype, sub_type=sub[0] if sub else None)
    for t in r.tensors:
        items = [(t.name, np.array(t.data), t.tensor_type)]
        if tensors:
            items = tensors(t.name, np.array(t.data), t.tensor_type)
        for name, arr, ty in items:
            raw = None if ty in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16) else ty
            w.add_tensor(name, arr, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def error_after_rewrite(fx, dst, tensors=None, kv: dict | None = None) -> float:
    """The largest abs difference between the numpy backend's logits on a parity fixture
    rewritten (rewrite's tensors; kv: key -> new value, None dropping it) and llama.cpp's
    on the fixture as it is: what a feature's test asserts is far off once it is gone."""
    from moeforge.runtime.model import load_model
    kv = kv or {}
    path = rewrite(fx["path"], str(dst), tensors=tensors, kv=lambda k, v, t: kv.get(k, v))
    return float(np.abs(load_model(path, backend="numpy").logits(fx["tokens"]) - fx["logits"]).max())
