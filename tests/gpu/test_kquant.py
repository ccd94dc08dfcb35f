"""Super-block weights (q2_K, q3_K, q4_K, q5_K, q6_K, iq4_xs) on the GPU: every MUL_MAT_ID path against
both references, and a model whose every matrix is of the type against the numpy backend
that emulates the kernels (pytest -m gpu; the dense product and the fused gate/up take them
in test_mul_mat_id and test_fused); also the mixes' models (Q2_K, Q3_K_M, Q5_K_M, iq4_xs
with a q6_K head, MXFP4_MOE). Rows hold whole super-blocks (k a multiple of 256); m stays odd where it
can."""
import numpy as np
import pytest

from moeforge import reference as ref
from moeforge.runtime.model import load_model
from test_mul_mat_id import _check, _choices, _setup

pytestmark = pytest.mark.gpu



@pytest.fixture(params=["q2_K", "q3_K", "q4_K", "q5_K", "q6_K", "iq4_xs"])
def Q(request):
    return request.param

GRID = [
    # (E, top_k, m, k, n): one super-block, an odd count of them (11), every path's n range
    (8, 2, 96, 256, 1), (32, 4, 200, 512, 7), (128, 8, 72, 256, 16), (32, 2, 136, 768, 33),
    (128, 8, 64, 256, 128), (32, 4, 48, 2816, 511), (8, 2, 40, 256, 4096),
]


@pytest.mark.parametrize("E,top_k,m,k,n", GRID)
def test_every_path_both_references(Q, rng, E, top_k, m, k, n):
    import cupy as cp
    import moeforge
    raw, w, x, ids, xd, idsd = _setup(rng, Q, E, m, k, n, top_k, skew=n >= 16)
    for choice in _choices(Q, n, top_k):
        out = cp.full((n, top_k, m), cp.nan, dtype=cp.float32)
        moeforge.mul_mat_id(w, xd, idsd, out=out, choice=choice)
        e_emu, e_flt = _check(raw, Q, (E, m, k), x, ids, out)
        print(f"{choice.path:<10} {choice.spec.name:<34} nmse emu {e_emu:.2e} float {e_flt:.2e}")


@pytest.mark.parametrize("n", [1, 40])
def test_per_slot_activations(Q, rng, n):
    import cupy as cp
    import moeforge
    E, top_k, m, k = 16, 4, 72, 512
    raw, w, x, ids, xd, idsd = _setup(rng, Q, E, m, k, n, top_k, per_slot=True)
    for choice in _choices(Q, n, top_k):
        out = cp.full((n, top_k, m), cp.nan, dtype=cp.float32)
        moeforge.mul_mat_id(w, xd, idsd, out=out, choice=choice)
        _check(raw, Q, (E, m, k), x, ids, out)


def test_default_dispatch_anchor_shape_and_bitwise_repeats(Q, rng):
    import moeforge
    from moeforge.runtime import dispatch
    E, top_k, m, k = 128, 8, 768, 2048
    for n in (1, 4, 16, 128, 256, 512):   # q2_K and q3_K: the narrow f16 tiles from 256
        raw, w, x, ids, xd, idsd = _setup(rng, Q, E, m, k, n, top_k, skew=True)
        out = moeforge.mul_mat_id(w, xd, idsd).get()
        f16 = dispatch.choose_mul_mat_id(Q, E, top_k, m, k, n).path == "mmf_id"
        _check(raw, Q, (E, m, k), x, ids, moeforge.mul_mat_id(w, xd, idsd),
               ref.mul_mat_id_emulated_f16 if f16 else ref.mul_mat_id_emulated)
        for _ in range(3):
            again = moeforge.mul_mat_id(w, xd, idsd).get()
            assert np.array_equal(out.view(np.uint32), again.view(np.uint32)), n


def test_streamk_fixup_over_sm_counts(Q, rng):
    """Stream-k splits a tile's k range at stage boundaries: each block must find its
    super-block's scales from wherever its k range starts."""
    import cupy as cp
    import moeforge
    from moeforge.codegen.spec import MmqSpec
    from moeforge.runtime import ops
    from moeforge.runtime.dispatch import Choice
    E, top_k, m, k, n = 16, 4, 136, 2816, 77
    raw, w, x, ids, xd, idsd = _setup(rng, Q, E, m, k, n, top_k, skew=True)
    real = ops.device_info
    try:
        for sms in (1, 3, 13, 132):
            info = dict(real(cp.cuda.Device().id), sm_count=sms)
            ops.device_info = lambda _dev, info=info: info
            for kb in (8, 16):
                out = cp.full((n, top_k, m), cp.nan, dtype=cp.float32)
                spec = MmqSpec(Q, x=16, y=64, warps=4, kblocks=kb, stages=2, stream_k=True)
                moeforge.mul_mat_id(w, xd, idsd, out=out, choice=Choice("mmq_id", spec))
                _check(raw, Q, (E, m, k), x, ids, out)
    finally:
        ops.device_info = real


def test_embedding_rows_are_ggufs_dequantization(Q, tmp_path):
    """get_rows_q2_K, _q3_K, _q4_K, _q5_K, _q6_K and _iq4_xs give gguf's own dequantized rows,
    bit for bit."""
    import cupy as cp
    from moeforge.runtime.gguf_file import GGUFFile
    from moeforge.synth import preset, write_qwen3moe
    path = str(tmp_path / "k.gguf")
    write_qwen3moe(path, preset("tiny-k"), Q, seed=int(np.random.SeedSequence().entropy % 2**31))
    m = load_model(path, backend="cuda")
    ref_rows = ref.dequantize(GGUFFile(path).tensors["token_embd.weight"].load(), Q, (m.hp.n_vocab, m.hp.n_embd))
    toks = np.random.default_rng().integers(0, m.hp.n_vocab, size=37).astype(np.int32)
    got = m.backend.embed(m.weights.tok_embd, cp.asarray(toks), "embd_test").get()
    assert np.array_equal(got.view(np.uint32), ref_rows[toks].astype(np.float32).view(np.uint32))


@pytest.mark.parametrize("skewed", [False, True])
def test_model_matches_numpy_kernel_emulation(Q, tmp_path, skewed, monkeypatch):
    """A tiny model whose every matrix is of type Q (embedding and head too): prompt pass and
    decode steps on the GPU against the numpy backend's emulation of the kernels."""
    _model_against_emulation(monkeypatch, tmp_path, Q, skewed)


def test_q5_k_m_model_matches_numpy_kernel_emulation(tmp_path, monkeypatch):
    """llama.cpp's Q5_K_M mix (q5_K, q6_K for the head, attn_v and ffn_down in layer 1),
    every tensor run as it is; llama.cpp has no fixture of it (tests/fixtures/parity)."""
    _model_against_emulation(monkeypatch, tmp_path, "q5_K_M", True)


def test_q2_k_mix_model_matches_numpy_kernel_emulation(tmp_path, monkeypatch):
    """llama.cpp's Q2_K mix (q2_K, q6_K for the head, attn_v q3_K at tiny-k's 2 query heads a
    key head, attn_output and ffn_down q3_K), every tensor run as it is."""
    _model_against_emulation(monkeypatch, tmp_path, "q2_K_mix", True)


def test_q3_k_m_model_matches_numpy_kernel_emulation(tmp_path, monkeypatch):
    """llama.cpp's Q3_K_M mix (q3_K, q6_K for the head, attn_v q5_K in layers 0 and 1,
    attn_output q4_K, ffn_down q4_K and q5_K), every tensor run as it is."""
    _model_against_emulation(monkeypatch, tmp_path, "q3_K_M", True)


def test_iq4_xs_model_with_a_q6_k_head_matches_numpy_kernel_emulation(tmp_path, monkeypatch):
    """iq4_xs with llama.cpp's q6_K head (its IQ4_XS mix keeps attn_v q5_K too: test_q5_k
    covers that type), every tensor run as it is."""
    _model_against_emulation(monkeypatch, tmp_path, "iq4_xs", True, output_type="q6_K")


@pytest.mark.parametrize("skewed", [False, True])
def test_mxfp4_moe_model_matches_numpy_kernel_emulation(tmp_path, skewed, monkeypatch):
    """llama.cpp's MXFP4_MOE mix on a Qwen3 MoE: the expert products in mxfp4 (gpt-oss's
    format), every other matrix q8_0, against the numpy backend's emulation; made from float
    weights (tests/cpu/test_synth.py says why)."""
    _model_against_emulation(monkeypatch, tmp_path, "mxfp4_moe", skewed)


def _gpu_passes_with_routes(gpu, toks, monkeypatch):
    """The prompt pass and the decode steps on the GPU, eager (no CUDA graphs: the router's
    ids are read back after each layer's route), with the expert ids of every layer of
    every pass in order: (logits, ids) for the prompt pass and for the steps."""
    from moeforge.runtime.backend_cuda import CudaBackend
    routes, route = [], CudaBackend.route_tokens

    def recording(self, *a, **kw):
        ids, wts = route(self, *a, **kw)
        routes.append(ids.get(stream=self.stream))     # the buffer is the next layer's too
        return ids, wts
    monkeypatch.setattr(CudaBackend, "route_tokens", recording)
    gpu.backend.graphs.enabled = False
    out = []
    for stepwise in (False, True):
        routes.clear()
        gpu.reset(len(toks))
        got = np.concatenate([gpu.eval([t]) for t in toks]) if stepwise else gpu.eval(toks)
        out.append((got, list(routes)))
    monkeypatch.setattr(CudaBackend, "route_tokens", route)
    gpu.backend.graphs.enabled = True
    return out


def _emulation_on_routes(path, toks, routes, stepwise, monkeypatch):
    """The numpy emulation's logits on the GPU's experts, and the router gaps (k-th minus
    (k+1)-th logit, relative to the largest) of the tokens whose experts the emulation
    would have chosen otherwise."""
    from moeforge.runtime.backend_numpy import NumpyBackend
    routes, choose, swaps = list(routes), NumpyBackend.route, []

    def replaying(self, logits, gating, sel_bias=None):
        ids, top_k = routes.pop(0), gating.top_k
        own, _ = choose(self, logits, gating, sel_bias)
        s = -np.sort(-logits.astype(np.float64), axis=-1)
        differ = (np.sort(own, axis=-1) != np.sort(ids, axis=-1)).any(axis=-1)
        swaps.extend((s[differ, top_k - 1] - s[differ, top_k]) / np.abs(s[differ]).max(axis=-1))
        return ids, self.route_weights(logits, ids, gating)
    monkeypatch.setattr(NumpyBackend, "route", replaying)
    emu = load_model(path, backend="numpy", numerics="kernel")
    emu.reset(len(toks))
    want = np.concatenate([emu.eval([t]) for t in toks]) if stepwise else emu.eval(toks)
    monkeypatch.setattr(NumpyBackend, "route", choose)
    assert not routes, f"the GPU routed {len(routes)} more times than the emulation"
    return want, np.array(swaps)


def _model_against_emulation(monkeypatch, tmp_path, qtype, skewed, **types):
    """The GPU's prompt pass and decode steps against the emulation routed on the GPU's own
    experts. Left to choose, the two swapped an expert wherever a router's k-th and (k+1)-th
    logits nearly tied (random tiny models have many such tokens), and the tokens after it
    parted (a tenth of the positions' top-1 had to be let go for iq4_xs). Routed alike, of
    216 passes of every format (H200, 2026-11-29) the largest token KL was 1.1e-4, the mean
    at most 5.6e-5, the largest logit difference 1.2e-2 of the largest logit (q8_1 roundings
    that float32 sums flip, carried through the layers); the GPU took other experts than the
    emulation would have at 6 of 216 x 96 token-layers, at gaps of at most 5.5e-3 of the largest
    router logit (2.2e-2 once in the next 144 passes, after such roundings). The models are quantized floats, as tests/cpu/test_synth.py's: random
    blocks (their kernels are checked in the tests above) make rows a token can cancel."""
    from conftest import kl_per_token
    from moeforge.synth import preset, write_qwen3moe
    seed = int(np.random.SeedSequence().entropy % 2**31)
    toks = np.random.default_rng(seed).integers(0, 512, size=48)
    path = str(tmp_path / "k.gguf")
    write_qwen3moe(path, preset("tiny-k"), qtype, seed=seed, skewed_router=skewed, source="float", **types)
    gpu = load_model(path, backend="cuda")
    # the real passes: the prompt's, then the decode steps' CUDA graph
    whole = gpu.logits(toks)
    gpu.reset(len(toks))
    steps = np.concatenate([gpu.eval([t]) for t in toks])
    recorded = _gpu_passes_with_routes(gpu, toks, monkeypatch)
    for stepwise, got, (eager, routes) in ((False, whole, recorded[0]), (True, steps, recorded[1])):
        what = f"seed {seed}, {'decode steps' if stepwise else 'prompt pass'}"
        np.testing.assert_array_equal(got, eager, err_msg=f"{what}: the graphs' replay differs from the launches")
        assert np.isfinite(got).all()
        want, swaps = _emulation_on_routes(path, toks, routes, stepwise, monkeypatch)
        # a router that reads its weights or picks its top-k wrong swaps most tokens, and far from ties
        assert len(swaps) <= len(toks) * gpu.hp.n_layer // 20 and (swaps < 0.1).all(), \
            f"{what}: the GPU's router took other experts at gaps {np.round(swaps, 5).tolist()}"
        kl = kl_per_token(want, got)
        assert kl.max() < 1e-3 and kl.mean() < 2e-4, f"{what}: token KL max {kl.max():.2e}, mean {kl.mean():.2e}"
        top2 = np.sort(want, axis=-1)[:, -2:]
        clear = top2[:, 1] - top2[:, 0] > 0.05 * np.abs(want).max()
        wrong = np.nonzero(clear & (got.argmax(-1) != want.argmax(-1)))[0]
        assert not wrong.size, f"{what}: top-1 differs at clear positions {wrong.tolist()}"
