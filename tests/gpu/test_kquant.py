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
def test_model_matches_numpy_kernel_emulation(Q, tmp_path, skewed):
    """A tiny model whose every matrix is of type Q (embedding and head too): prompt pass and
    decode steps on the GPU against the numpy backend's emulation of the kernels."""
    _model_against_emulation(tmp_path, Q, skewed, chaotic=Q in CHAOTIC)


# Random tiny models of these types are chaotic: in the numpy emulation itself, a relative
# 1e-6 nudge of the norm outputs moves the logits by a mean KL of 4e-5..1.6e-4 (iq4_xs),
# 2.5e-5..1.4e-3 (mxfp4_moe of random blocks), against 5e-6..2e-5 for q6_K and 1e-11 for
# q4_K (CPU, 2026-11-28): where two router logits nearly tie, a q8_1 rounding that the nudge (or the
# GPU's float32 sums) flips swaps an expert, and the tokens after it move. On an H200 2 of 6
# iq4_xs models had one top-1 swap at a clear position (KL <= 5e-4). For them a tenth of
# the clear positions may swap, the median token's KL is held to 1e-3 and the mean to
# 2e-2; a kernel that reads the format wrong moves every position far past both. q2_K and q3_K
# sit between (the same nudge, 5 models each, CPU, 2026-11-29: q2_K 2e-6..3.3e-5, q3_K
# 6e-6..1.5e-5 with a single top-1 flip in 2 of 5, their mixes below 6.3e-6): the one swap
# the bar allows.
CHAOTIC = {"iq4_xs", "mxfp4_moe"}


def test_q5_k_m_model_matches_numpy_kernel_emulation(tmp_path):
    """llama.cpp's Q5_K_M mix (q5_K, q6_K for the head, attn_v and ffn_down in layer 1),
    every tensor run as it is; llama.cpp has no fixture of it (tests/fixtures/parity)."""
    _model_against_emulation(tmp_path, "q5_K_M", True)


def test_q2_k_mix_model_matches_numpy_kernel_emulation(tmp_path):
    """llama.cpp's Q2_K mix (q2_K, q6_K for the head, attn_v q3_K at tiny-k's 2 query heads a
    key head, attn_output and ffn_down q3_K), every tensor run as it is."""
    _model_against_emulation(tmp_path, "q2_K_mix", True)


def test_q3_k_m_model_matches_numpy_kernel_emulation(tmp_path):
    """llama.cpp's Q3_K_M mix (q3_K, q6_K for the head, attn_v q5_K in layers 0 and 1,
    attn_output q4_K, ffn_down q4_K and q5_K), every tensor run as it is."""
    _model_against_emulation(tmp_path, "q3_K_M", True)


def test_iq4_xs_model_with_a_q6_k_head_matches_numpy_kernel_emulation(tmp_path):
    """iq4_xs with llama.cpp's q6_K head (its IQ4_XS mix keeps attn_v q5_K too: test_q5_k
    covers that type), every tensor run as it is."""
    _model_against_emulation(tmp_path, "iq4_xs", True, chaotic=True, output_type="q6_K")


@pytest.mark.parametrize("skewed", [False, True])
def test_mxfp4_moe_model_matches_numpy_kernel_emulation(tmp_path, skewed):
    """llama.cpp's MXFP4_MOE mix on a Qwen3 MoE: the expert products in mxfp4 (gpt-oss's
    format), every other matrix q8_0, against the numpy backend's emulation; made from float
    weights (tests/cpu/test_synth.py says why)."""
    _model_against_emulation(tmp_path, "mxfp4_moe", skewed, chaotic=True, source="float")


def _model_against_emulation(tmp_path, qtype, skewed, chaotic=False, **types):
    from conftest import kl_per_token
    from moeforge.synth import preset, write_qwen3moe
    toks = np.random.default_rng().integers(0, 512, size=48)
    # random weights make near-ties a fixture's token choice would avoid: top-1 must agree
    # wherever the emulation's leader is clear of the runner-up (by far more than the
    # q8_1 re-quantization flips move a logit). A random model with flat logits has too
    # few such positions to test anything (a q4_K one on an H200 had 1 of 48): another
    # random model then, up to three
    for attempt in range(3):
        path = str(tmp_path / f"k{attempt}.gguf")
        write_qwen3moe(path, preset("tiny-k"), qtype, seed=int(np.random.SeedSequence().entropy % 2**31),
                       skewed_router=skewed, **types)
        want = load_model(path, backend="numpy", numerics="kernel").logits(toks)
        top2 = np.sort(want, axis=-1)[:, -2:]
        clear = top2[:, 1] - top2[:, 0] > 0.005 * np.abs(want).max()
        if clear.sum() >= len(toks) // 4:
            break
    assert clear.sum() >= len(toks) // 4, f"only {clear.sum()} positions with a clear leader"
    gpu = load_model(path, backend="cuda")
    whole = gpu.logits(toks)
    gpu.reset(len(toks))
    steps = np.concatenate([gpu.eval([t]) for t in toks])
    for got in (whole, steps):
        assert np.isfinite(got).all()
        top = got.argmax(-1) == want.argmax(-1)
        wrong = np.nonzero(~top & clear)[0]
        kl = kl_per_token(want, got)
        print(f"mean KL {kl.mean():.2e}, median {np.median(kl):.2e}, top-1 swaps {wrong.tolist()}")
        if chaotic:
            assert len(wrong) <= 0.1 * clear.sum(), f"top-1 differs at positions {wrong.tolist()}"
            assert np.median(kl) < 1e-3 and kl.mean() < 2e-2
        else:
            # one swap is the rare expert flip (an H200 run, 2026-11-28: a q6_K model's decode
            # steps, one swap at 48 positions with a mean KL of 5e-6); a kernel error swaps many
            assert len(wrong) <= 1, f"top-1 differs at positions {wrong.tolist()}"
            assert kl.mean() < 1e-3
