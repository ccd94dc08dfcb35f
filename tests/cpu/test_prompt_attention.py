"""runtime.prompt_attention without a GPU: which kernel a model's heads get, its shared
memory, the numpy arithmetic of the tensor-core kernels (numerics="kernel") against a
row-by-row version of the same steps and against float64, and the kernels' ldmatrix
addresses, as rendered, against the mma fragments they must deliver."""
import re

import numpy as np
import pytest
from conftest import mma_m16n8k16

from moeforge.runtime.arch_qwen3moe import HParams
from moeforge.runtime.prompt_attention import (ROUNDING, attention_tc, blocks_per_kv_head, check_precision, f16,
                                              kernel_for,
                                              rows, smem_bytes, tf32, tf32_truncated, threads, tile_buffers)


def _hp(n_head, n_head_kv, head_dim):
    return HParams(n_vocab=32, n_embd=64, n_layer=2, n_head=n_head, n_head_kv=n_head_kv, head_dim=head_dim,
                   n_ff_exp=64, n_expert=8, n_expert_used=2, rms_eps=1e-6, rope_base=1e6, n_ctx_train=4096)


def test_qwen3_heads_get_tensor_cores_from_sm80():
    assert kernel_for(_hp(32, 4, 128), "9.0") == "attn_prefill_fa128"  # Qwen3-30B-A3B
    assert kernel_for(_hp(32, 4, 128), "8.0") == "attn_prefill_fa128"
    assert kernel_for(_hp(64, 8, 64), "9.0") == "attn_prefill_fa64"    # gpt-oss
    assert kernel_for(_hp(32, 4, 128), "9.0", "tf32") == "attn_prefill_tc"
    assert kernel_for(_hp(32, 4, 128), "7.5") == "attn_prefill"
    assert kernel_for(_hp(32, 4, 128), "7.5", "tf32") == "attn_prefill"
    assert kernel_for(_hp(32, 4, 128), "9.0", "f32") == "attn_prefill"


def test_an_unknown_precision_is_refused():
    assert check_precision("tf32") == "tf32"
    with pytest.raises(ValueError, match="attn_precision must be one of"):
        kernel_for(_hp(32, 4, 128), "9.0", "bf16")


def test_heads_past_the_tensor_core_kernel_fall_back():
    assert kernel_for(_hp(64, 4, 128), "9.0") == "attn_prefill_fa128"   # 16 heads a group (Qwen3-235B) ...
    assert kernel_for(_hp(64, 4, 128), "9.0", "tf32") == "attn_prefill" # ... only the f16 kernel takes
    assert kernel_for(_hp(6, 3, 36), "9.0") == "attn_prefill"           # width not a multiple of 16
    assert kernel_for(_hp(6, 3, 48), "9.0") == "attn_prefill_fa"        # a multiple of 16 ...
    assert kernel_for(_hp(6, 3, 48), "9.0", "tf32") == "attn_prefill"   # ... not of 32
    assert kernel_for(_hp(8, 8, 256), "9.0") is None                    # wider than 128: cuBLAS
    assert kernel_for(_hp(34, 1, 64), "9.0", "tf32") is None            # 34 heads a group
    assert kernel_for(_hp(34, 1, 64), "9.0") == "attn_prefill_fa64"
    assert kernel_for(_hp(4, 2, 30), "9.0") is None                     # not a multiple of 4
    assert kernel_for(_hp(6, 4, 64), "9.0") is None                     # groups of unequal size


def test_block_sizes():
    # the tf32 kernel keeps sixteen warps whatever the group: they all copy key tiles
    for heads in ((32, 4, 128), (16, 4, 64), (8, 8, 32)):
        assert threads(_hp(*heads), "attn_prefill_tc") == 512
        assert rows(_hp(*heads), "attn_prefill_tc") == 16
    # attn_prefill_fa: a warp per head and 16 tokens, as many token tiles as 8 warps hold
    # (of up to 8 of the group's heads: the largest divisor of the group)
    for heads, warps, tokens, blocks in (((32, 4, 128), 8, 16, 1), ((16, 4, 64), 8, 32, 1), ((8, 8, 32), 8, 128, 1),
                                         ((12, 2, 80), 6, 16, 1), ((40, 8, 128), 5, 16, 1), ((6, 3, 48), 8, 64, 1),
                                         ((64, 4, 128), 8, 16, 2), ((34, 1, 64), 8, 64, 17), ((24, 2, 64), 6, 16, 2)):
        kernel = kernel_for(_hp(*heads), "9.0")
        assert kernel.startswith("attn_prefill_fa")
        got = threads(_hp(*heads), kernel), rows(_hp(*heads), kernel), blocks_per_kv_head(_hp(*heads), kernel)
        assert got == (32 * warps, tokens, blocks), heads
    assert threads(_hp(32, 4, 128), "attn_prefill") == 256
    assert threads(_hp(16, 4, 64), "attn_prefill") == 128
    assert threads(_hp(64, 4, 128), "attn_prefill") == 512


def test_shared_memory_of_qwen3_heads():
    hp = _hp(32, 4, 128)
    assert smem_bytes(hp, "attn_prefill_tc") == 4 * (8 * 16 * 132 + 2 * 64 * 132 + 2 * 64 * 136)
    assert smem_bytes(hp, "attn_prefill") == 4 * (8 * 8 * 128 + 2 * 32 * 129 + 2 * 32 * 128 + 8 * 8 * 32)
    assert smem_bytes(hp, "attn_prefill_tc") <= 227 * 1024             # one block on an H100
    # `bufs` f16 key and value tiles, whatever the cache (kv_rows_f16 rounds a float32 one)
    assert smem_bytes(hp, "attn_prefill_fa128") == 2 * 2 * 2 * 64 * 136
    assert smem_bytes(hp, "attn_prefill_fa128") <= 227 * 1024
    assert smem_bytes(hp, "attn_prefill_fa128", bufs=3, cache="f16") == 2 * 2 * 3 * 64 * 136
    assert 2 * (smem_bytes(_hp(64, 8, 64), "attn_prefill_fa64") + 1024) <= 228 * 1024   # two blocks an SM
    assert 2 * (smem_bytes(hp, "attn_prefill") + 1024) <= 228 * 1024  # two
    assert smem_bytes(_hp(64, 4, 128), "attn_prefill") <= 227 * 1024


@pytest.mark.parametrize("cache", ["f32", "f16"])
def test_f16_prompt_attention_is_double_buffered_on_every_card(cache):
    """attn_prefill_fa's tiles are f16 whatever the cache: two buffers of Qwen3's heads
    (68 KB) fit an H100, an A100 and the 99 KB of an sm_86/89 card."""
    hp = _hp(32, 4, 128)
    for cc, limit in (("9.0", 227), ("8.0", 163), ("8.6", 99)):
        assert kernel_for(hp, cc, "f16", smem_limit=limit * 1024, cache=cache) == "attn_prefill_fa128"
        assert tile_buffers(hp, limit * 1024, "attn_prefill_fa128", cache) == 2


@pytest.mark.parametrize("precision,kernel,small", [("tf32", "attn_prefill_tc", "attn_prefill_tc")])
def test_a_card_with_less_shared_memory_gets_a_kernel_that_fits(precision, kernel, small):
    hp = _hp(32, 4, 128)
    assert kernel_for(hp, "9.0", precision, smem_limit=227 * 1024) == kernel
    assert tile_buffers(hp, 227 * 1024, kernel) == 2                            # H100: double-buffered
    assert kernel_for(hp, "8.0", precision, smem_limit=163 * 1024) == kernel
    assert tile_buffers(hp, 163 * 1024, kernel) == 1                            # A100: one tile
    assert smem_bytes(hp, kernel, bufs=1) <= 163 * 1024 < smem_bytes(hp, kernel)
    assert kernel_for(hp, "8.6", precision, smem_limit=99 * 1024) is None       # cuBLAS then
    assert kernel_for(_hp(8, 8, 32), "8.6", precision, smem_limit=99 * 1024) == small


def test_tf32_rounds_to_nearest_ties_away_or_truncates():
    x = np.array([1.0, 1 + 2**-11, 1 + 2**-10 + 2**-12, -1 - 2**-11, 3 * 2**-13], dtype=np.float32)
    want = np.array([1.0, 1 + 2**-10, 1 + 2**-10, -1 - 2**-10, 3 * 2**-13], dtype=np.float32)
    np.testing.assert_array_equal(tf32(x), want)
    np.testing.assert_array_equal(tf32_truncated(x), np.array([1.0, 1.0, 1 + 2**-10, -1.0, 3 * 2**-13], np.float32))


def test_f16_rounds_to_nearest_even_and_keeps_subnormals():
    x = np.array([1 + 2**-11, 1 + 3 * 2**-11, -(1 + 2**-11), 2**-24 * 1.5, 2**-26, 65504.0, 65520.0], np.float32)
    want = np.array([1.0, 1 + 2**-9, -1.0, 2**-23, 0.0, 65504.0, np.inf], np.float32)
    np.testing.assert_array_equal(f16(x), want)


# the kernels' softmax steps: attn_prefill_tc two online softmaxes a row, over keys 0-31,
# 64-95, ... and 32-63, 96-127, ...; attn_prefill_fa one, over keys 0-63, 64-127, ...
STEPS = {"tf32": (32, (0, 32)), "f16": (64, (0,))}


def _rows_one_by_one(q, k, v, hp, pos0, precision):
    """Each row and head on its own: the kernel's online softmaxes up to the row's
    position (STEPS), merged."""
    round_q, round_kv, round_p = ROUNDING[precision]
    n, g, hd = q.shape[0], hp.n_head // hp.n_head_kv, hp.head_dim
    qs = round_q(q * np.float32(1.0 / np.sqrt(hd) * np.log2(np.e))).astype(np.float64)
    ks, vs = round_kv(k).astype(np.float64), round_kv(v).astype(np.float64)
    out = np.empty((n, hp.q_dim))
    for t in range(n):
        for h in range(hp.n_head):
            c = slice((h // g) * hd, (h // g + 1) * hd)
            parts = []
            step, firsts = STEPS[precision]
            for first in firsts:
                m, total, o = -np.inf, 0.0, np.zeros(hd)
                for j0 in range(first, pos0 + t + 1, 64):
                    j1 = min(pos0 + t + 1, j0 + step)
                    s = ks[j0:j1, c] @ qs[t, h * hd:(h + 1) * hd]
                    mn = max(m, s.max())
                    alpha, p = 2.0 ** (m - mn), 2.0 ** (s - mn)
                    total = total * alpha + p.sum()
                    o = o * alpha + round_p(p).astype(np.float64) @ vs[j0:j1, c]
                    m = mn
                parts.append((m, total, o))
            top = max(m for m, _, _ in parts)
            f = [2.0 ** (m - top) for m, _, _ in parts]
            out[t, h * hd:(h + 1) * hd] = (sum(o * fi for (_, _, o), fi in zip(parts, f))
                                           / sum(total * fi for (_, total, _), fi in zip(parts, f)))
    return out


@pytest.mark.parametrize("precision", ["f16", "tf32"])
def test_tensor_core_emulation_steps_and_accuracy(precision, rng):
    hp = _hp(8, 2, 32)
    n, pos0 = 21, 43
    q = (2 * rng.standard_normal((n, hp.q_dim))).astype(np.float32)
    k = rng.standard_normal((pos0 + n + 5, hp.kv_dim)).astype(np.float32)
    v = rng.standard_normal((pos0 + n + 5, hp.kv_dim)).astype(np.float32)
    got = attention_tc(q, k, v, hp, pos0, precision)
    np.testing.assert_allclose(got, _rows_one_by_one(q, k, v, hp, pos0, precision), rtol=0, atol=1e-12)
    g, hd = 4, 32
    exact = np.empty_like(got)
    for t in range(n):
        for h in range(hp.n_head):
            c = slice((h // g) * hd, (h // g + 1) * hd)
            s = k[:pos0 + t + 1, c].astype(np.float64) @ q[t, h * hd:(h + 1) * hd] / np.sqrt(hd)
            p = np.exp(s - s.max())
            exact[t, h * hd:(h + 1) * hd] = p @ v[:pos0 + t + 1, c] / p.sum()
    nmse = ((got - exact) ** 2).sum() / (exact ** 2).sum()
    assert 1e-12 < nmse < 1e-5, nmse       # the rounding shows, far inside the 5e-4 bar


def test_ldmatrix_fragments_are_the_tf32_fragments_of_the_mma(rng):
    """attn_prefill_tc loads q and key fragments with ldmatrix (lane l gives the address of
    row l%8 of matrix l/8; lane t receives word t%4 of row t/4 of each matrix). With the row
    addresses as the kernel writes them, each lane must receive the words of mma m16n8k8's
    tf32 fragments: A (gr, tq), (gr+8, tq), (gr, tq+4), (gr+8, tq+4) of q's 16 rows; B (key
    row of S's column gr in the order 0 4 1 5 2 6 3 7, words tq and tq+4) for 4 n8 blocks."""
    from moeforge.codegen.render import render
    from moeforge.codegen.spec import ModelSpec
    src = render(ModelSpec())
    body = src[src.index("attn_prefill_tc("):]
    expr = {name: re.search(rf"const unsigned\* {name} = (\w+) \+ (.+?);", body).group(2) for name in ("qa", "ka")}
    assert "ldsm_x4(a, qa + c);" in body and "ldsm_x4(b01, ka + c);" in body and "ldsm_x4(b23, ka + 16 * lk + c);" in body
    hd, lq, lk = 128, 132, 132
    q = rng.integers(0, 2**31, size=16 * lq)     # words: any distinct-enough pattern
    k = rng.integers(0, 2**31, size=32 * lk)

    def ldsm(words, addr_of_lane):
        return [[words[addr_of_lane[8 * i + t // 4] + t % 4] for t in range(32)] for i in range(4)]

    qa = [eval(expr["qa"], {}, dict(lane=ln, lm=ln >> 3, lr=ln & 7, lq=lq)) for ln in range(32)]   # noqa: S307
    ka = [eval(expr["ka"], {}, dict(lane=ln, lm=ln >> 3, lr=ln & 7, lk=lk)) for ln in range(32)]   # noqa: S307
    for c in range(0, hd, 8):
        a = ldsm(q, [x + c for x in qa])
        b01, b23 = ldsm(k, [x + c for x in ka]), ldsm(k, [x + 16 * lk + c for x in ka])
        for t in range(32):
            gr, tq = t >> 2, t & 3
            assert [a[i][t] for i in range(4)] == [q[gr * lq + c + tq], q[(gr + 8) * lq + c + tq],
                                                   q[gr * lq + c + tq + 4], q[(gr + 8) * lq + c + tq + 4]]
            kperm = (gr >> 1) + 4 * (gr & 1)
            for nb, (m0, m1) in enumerate([(b01[0], b01[1]), (b01[2], b01[3]), (b23[0], b23[1]), (b23[2], b23[3])]):
                kr = (nb * 8 + kperm) * lk + c + tq
                assert (m0[t], m1[t]) == (k[kr], k[kr + 4])


def _ldmatrix(halves, row_of_lane, trans=False):
    """ldmatrix.x4 on a flat array of 16-bit values: lane l gives the address of row l%8 of
    matrix l/8; lane t receives the pair (row t/4, elements 2(t%4), 2(t%4)+1) of each matrix,
    or with .trans the pair (rows 2(t%4), 2(t%4)+1, element t/4)."""
    out = []
    for i in range(4):
        m = np.array([halves[row_of_lane[8 * i + r]:row_of_lane[8 * i + r] + 8] for r in range(8)])
        if trans:
            m = m.T
        out.append([(m[t // 4, 2 * (t % 4)], m[t // 4, 2 * (t % 4) + 1]) for t in range(32)])
    return out


@pytest.mark.parametrize("cache", ["f32", "f16"])
@pytest.mark.parametrize("hd", [128, 48])
def test_fragments_of_the_f16_kernel_give_q_k_and_p_v(hd, cache, rng):
    """attn_prefill_fa's q fragments (from global memory) and its key and (transposed) value
    row addresses, as the rendered kernel writes them (for either cache: the tiles' layout
    is the same), fed through ldmatrix and m16n8k16 as PTX defines them: a warp's S must be
    q . k^T of the tile's 64 keys in natural order, and O its S (as P, in the registers S
    left it in) times the value rows."""
    from moeforge.codegen.render import render
    from moeforge.codegen.spec import ModelSpec
    src = render(ModelSpec(cache=cache))
    body = src[src.index("attn_fa_body("):]
    expr = {}
    for name in ("ka", "va"):     # the tile's base plus an offset
        assert re.search(rf"const unsigned short\* {name} = [KV]h \+ {name}_off;", body), name
        expr[name] = re.search(rf"const int {name}_off = (.+?);", body).group(1)
    for call in ("const int col = (kvh * g + head) * hd + 2 * tq;",       # q: rows gr, gr + 8 from col
                 "const float* qa = q + (size_t)(t0 + min(r0 + gr, nr - 1)) * q_dim + col;",
                 "const float* qb = q + (size_t)(t0 + min(r0 + gr + 8, nr - 1)) * q_dim + col;",
                 "const float2 x0 = *(const float2*)(qa + 16 * c), x1 = *(const float2*)(qb + 16 * c);",
                 "const float2 x2 = *(const float2*)(qa + 16 * c + 8), x3 = *(const float2*)(qb + 16 * c + 8);",
                 "ldsm_x4(b, ka + p * 16 * ls + c * 16);", "mma_f16(s[2 * p], qf[c], b[0], b[1]);",
                 "mma_f16(s[2 * p + 1], qf[c], b[2], b[3]);",
                 "ldsm_x4_trans(b, va + kb * 16 * ls + np * 16);", "mma_f16(o[2 * np], a, b[0], b[1]);",
                 "mma_f16(o[2 * np + 1], a, b[2], b[3]);", "const unsigned a[4] = {f16x2_of(s[2 * kb][0], "
                 "s[2 * kb][1]), f16x2_of(s[2 * kb][2], s[2 * kb][3]),"):
        assert call in body, call
    for i, x in enumerate(("x0", "x1", "x2", "x3")):
        assert f"qf[c][{i}] = f16x2_of({x}.x * scale_log2, {x}.y * scale_log2);" in body
    ls = hd + 8
    q = rng.standard_normal((16, hd))
    k, v = (rng.standard_normal(64 * ls) for _ in range(2))
    lanes = [dict(lm=ln >> 3, lr=ln & 7, ls=ls) for ln in range(32)]
    ka, va = ([eval(expr[x], {}, env) for env in lanes] for x in ("ka", "va"))  # noqa: S307
    s = np.zeros((8, 32, 4))
    for c in range(hd // 16):
        # lane t's pairs: x0 (gr, 16c + 2tq ..), x1 (gr + 8, ..), x2 and x3 eight columns on
        a = [[(q[r, 16 * c + 2 * (t % 4) + d], q[r, 16 * c + 2 * (t % 4) + d + 1])
              for t in range(32) for r in [t // 4 + 8 * (i % 2)]] for i in range(4) for d in [8 * (i // 2)]]
        for p in range(4):
            b = _ldmatrix(k, [x + p * 16 * ls + c * 16 for x in ka])
            mma_m16n8k16(s[2 * p], a, b[0], b[1])
            mma_m16n8k16(s[2 * p + 1], a, b[2], b[3])
    S = q @ k.reshape(64, ls)[:, :hd].T
    PV = S @ v.reshape(64, ls)[:, :hd]
    o = np.zeros((hd // 8, 32, 4))
    for kb in range(4):
        a = [[(s[2 * kb + i // 2][t][2 * (i % 2)], s[2 * kb + i // 2][t][2 * (i % 2) + 1]) for t in range(32)]
             for i in range(4)]
        for npair in range(hd // 16):
            b = _ldmatrix(v, [x + kb * 16 * ls + npair * 16 for x in va], trans=True)
            mma_m16n8k16(o[2 * npair], a, b[0], b[1])
            mma_m16n8k16(o[2 * npair + 1], a, b[2], b[3])
    for t in range(32):
        gr, c = t // 4, 2 * (t % 4)
        for nb in range(8):
            np.testing.assert_allclose(s[nb][t], [S[gr, nb * 8 + c], S[gr, nb * 8 + c + 1],
                                                  S[gr + 8, nb * 8 + c], S[gr + 8, nb * 8 + c + 1]], atol=1e-9)
        for nb in range(hd // 8):
            np.testing.assert_allclose(o[nb][t], [PV[gr, nb * 8 + c], PV[gr, nb * 8 + c + 1],
                                                  PV[gr + 8, nb * 8 + c], PV[gr + 8, nb * 8 + c + 1]], atol=1e-9)


def test_wgmma_prompt_attention_takes_128_wide_f16_heads_on_sm_90():
    """attn_prefill_wg128 where the module has it (ModelSpec.wgmma), f16 precision, heads
    128 wide, sm_90 and its shared memory (three 32 KB tiles and the 1 KB of alignment);
    attn_prefill_fa's block layout; everything else as without it."""
    hp = _hp(32, 4, 128)
    assert kernel_for(hp, "9.0", "f16", smem_limit=227 * 1024, wgmma=True) == "attn_prefill_wg128"
    assert kernel_for(hp, "9.0", "f16", smem_limit=227 * 1024, cache="f16", wgmma=True) == "attn_prefill_wg128"
    assert kernel_for(hp, "9.0", "f16", smem_limit=227 * 1024) == "attn_prefill_fa128"        # not in the module
    assert kernel_for(hp, "8.0", "f16", smem_limit=163 * 1024, wgmma=True) == "attn_prefill_fa128"
    assert kernel_for(hp, "9.0", "tf32", smem_limit=227 * 1024, wgmma=True) == "attn_prefill_tc"
    assert kernel_for(_hp(64, 8, 64), "9.0", "f16", wgmma=True) == "attn_prefill_fa64"      # gpt-oss's 64 wide
    assert smem_bytes(hp, "attn_prefill_wg128") == 3 * 2 * 64 * 128 * 2 + 1024
    for heads in ((32, 4, 128), (64, 4, 128), (8, 2, 128), (16, 16, 128), (40, 8, 128), (24, 8, 128)):
        h = _hp(*heads)
        assert (rows(h, "attn_prefill_wg128"), blocks_per_kv_head(h, "attn_prefill_wg128")) == (
            rows(h, "attn_prefill_fa128"), blocks_per_kv_head(h, "attn_prefill_fa128"))
        # two whole warpgroups whatever the group (fa's block has 5 warps for groups of 5, 6 of 3)
        assert threads(h, "attn_prefill_wg128") == 256
    assert threads(_hp(40, 8, 128), "attn_prefill_fa128") == 160
