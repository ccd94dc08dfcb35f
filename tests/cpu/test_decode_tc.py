"""The tensor-core decode attention without a GPU: its plan and shared memory, the numpy
emulation of its arithmetic (decode_attention.emulate_tc) against float64 and against a
worker-by-worker version of its tiles, and the lanes' loads, as rendered, through mma
m16n8k16 as PTX defines it: S must be q . k^T and O the probabilities times the value rows,
with the permuted dimensions undone where the kernel reads O back."""
import numpy as np
import pytest
from conftest import attention64, attn_hparams, mma_m16n8k16

from moeforge.codegen.render import render
from moeforge.codegen.spec import ModelSpec
from moeforge.runtime.decode_attention import (GQA_SPLIT_CAP, TC_STATIC, TC_TILE, can_tc, emulate_tc, grouped_at, plan, tc_group,
                                               tc_smem)
from moeforge.runtime.prompt_attention import f16


def test_tc_plan_groups_and_shared_memory():
    qwen, q235, oss = attn_hparams(32, 4, 128), attn_hparams(64, 4, 128), attn_hparams(64, 8, 64)
    assert plan(qwen, 8192, 132, True, tc=True) == ("attn_decode_gqa_tc_g8h128", 4, 256, 32)
    assert plan(q235, 8192, 132, True, tc=True) == ("attn_decode_gqa_tc_g8h128", 8, 256, 16)   # two blocks a key head
    assert plan(oss, 8192, 132, True, tc=True) == ("attn_decode_gqa_tc_g8h64", 8, 256, 16)
    assert plan(qwen, 40, 132, True, tc=True)[3] == 1                   # a tile a warp at least
    assert plan(qwen, 2048, 132, True, tc=True)[3] == 16
    assert plan(qwen, 8192, 132, True, splits=10**4, tc=True)[3] == GQA_SPLIT_CAP
    assert plan(qwen, 8192, 132, False, tc=True)[0] == "attn_decode_h128"   # tc only where grouped
    assert [tc_group(attn_hparams(*h)) for h in ((48, 4, 128), (6, 3, 80), (64, 2, 64), (8, 8, 128), (9, 3, 64))] == \
        [4, 2, 8, None, None]
    assert can_tc(attn_hparams(6, 3, 80)) and not can_tc(attn_hparams(8, 4, 72)) and not can_tc(attn_hparams(4, 1, 256))
    with pytest.raises(ValueError, match="tensor-core decode attention takes"):
        plan(attn_hparams(8, 4, 72), 4096, 132, True, tc=True)
    assert tc_smem(qwen) == 4 * 8 * 8 * 130 and tc_smem(oss) == 4 * 8 * 8 * 66
    # on a card: room for a wave's records (32 splits), within the block's shared memory
    assert tc_smem(qwen, 232448) == 4 * 32 * 8 * 130 and tc_smem(oss, 232448) == 4 * 32 * 8 * 66
    assert tc_smem(qwen, 101376) == 101376 - TC_STATIC and tc_smem(qwen, 40000) == tc_smem(qwen)
    # heads the FMA grouped kernel does not take (groups of 12) still go grouped on tensor cores
    assert grouped_at(attn_hparams(48, 4, 128), 8191, 132, 232448, tc=True)
    assert not grouped_at(attn_hparams(48, 4, 128), 8191, 132, 232448)
    assert not grouped_at(q235, 8191, 132, tc_smem(q235) + 1000, tc=True)    # the block's shared memory
    src = render(ModelSpec())
    for g in (2, 4, 8):
        for w in (64, 128):
            assert f"void __launch_bounds__(GQA_THREADS, 1) attn_decode_gqa_tc_g{g}h{w}(" in src
            assert f"attn_decode_gqa_tc_g{g}h{w}" in ModelSpec.KERNELS


def _by_workers(q, k, v, hp, pos0, splits, window=0):
    """emulate_tc written out worker by worker: worker u of U = 8 * active takes tiles t0 + u,
    t0 + u + U, ..; q * scale * log2 e, keys, values and p rounded to f16."""
    g, hd, n_kv = hp.n_head // hp.n_head_kv, hp.head_dim, pos0 + 1
    first = max(0, n_kv - window) if window else 0
    t0, t_end = first // TC_TILE, -(-n_kv // TC_TILE)
    U = 8 * min(splits, -(-(t_end - t0) // 8))      # a tile a warp at least
    scale_log2 = np.float32(1.0 / np.sqrt(hd) * np.log2(np.e))
    out = np.empty(hp.q_dim)
    for h in range(hp.n_head):
        c = slice((h // g) * hd, (h // g + 1) * hd)
        qs = f16(q[0, h * hd:(h + 1) * hd] * scale_log2).astype(np.float64)
        parts = []
        for u in range(U):
            m, total, o = -np.inf, 0.0, np.zeros(hd)
            for t in range(t0 + u, t_end, U):
                j = np.arange(t * TC_TILE, (t + 1) * TC_TILE)
                s = np.full(TC_TILE, -np.inf)
                ok = (j >= first) & (j < n_kv)
                s[ok] = f16(k[j[ok], c]).astype(np.float64) @ qs
                mn = max(m, s.max())
                p = np.exp2(s - mn)
                total = total * np.exp2(m - mn) + p.sum()
                o = o * np.exp2(m - mn) + f16(p[ok]).astype(np.float64) @ f16(v[j[ok], c]).astype(np.float64)
                m = mn
            parts.append((m, total, o))
        top = max(m for m, _, _ in parts)
        f = [np.exp2(m - top) for m, _, _ in parts]
        out[h * hd:(h + 1) * hd] = sum(o * fi for (_, _, o), fi in zip(parts, f)) / sum(
            t * fi for (_, t, _), fi in zip(parts, f))
    return out


@pytest.mark.parametrize("n_kv,splits,window", [(1, 4, 0), (17, 1, 0), (300, 3, 0), (300, 32, 0), (300, 2, 100),
                                                 (260, 5, 128), (2000, 9, 0)])
def test_tc_emulation_is_its_tiles_and_close_to_float64(n_kv, splits, window, rng):
    hp = attn_hparams(8, 2, 32)
    q = (2 * rng.standard_normal((1, hp.q_dim))).astype(np.float32)
    k = rng.standard_normal((n_kv + 7, hp.kv_dim)).astype(np.float32)
    v = rng.standard_normal((n_kv + 7, hp.kv_dim)).astype(np.float32)
    got = emulate_tc(q, k, v, hp, n_kv - 1, splits, window=window)[0]
    np.testing.assert_allclose(got, _by_workers(q, k, v, hp, n_kv - 1, splits, window), rtol=0, atol=1e-12)
    exact = attention64(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), np.array([n_kv - 1]), hp,
                        window=window)[0]
    nmse = ((got - exact) ** 2).sum() / (exact ** 2).sum()
    assert (1e-12 < nmse or n_kv == 1) and nmse < 1e-5, nmse     # the rounding shows, far inside the 5e-4 bar


# The kernel's lines that place a lane's operands (the simulation below follows them)
TC_LINES = (
    "const int d = 32 * i + 8 * tq;",
    "for (int e = 0; e < 8; ++e) x[e] = gr < G && d < hd ? qs[gr < G ? gr : 0][d + e] * scale_log2 : 0.0f;",
    "qf[2 * i + e][0] = f16x2_of(x[4 * e], x[4 * e + 1]);",
    "qf[2 * i + e][1] = f16x2_of(x[4 * e + 2], x[4 * e + 3]);",
    "const unsigned a0[4] = {qf[2 * i][0], 0u, qf[2 * i][1], 0u};",
    "const unsigned a1[4] = {qf[2 * i + 1][0], 0u, qf[2 * i + 1][1], 0u};",
    "mma_f16(s[n], a0, tl.k[n][i].pair(0), tl.k[n][i].pair(2));",
    "mma_f16(s[n], a1, tl.k[n][i].pair(4), tl.k[n][i].pair(6));",
    "const int p = min(max(tb + 8 * n + gr, first), cur);",
    "const int p = min(max(tb + 2 * tq + (a & 1) + 8 * (a >> 1), first), cur);",
    "const int d = gr * (W / 8) + 8 * c;",
    "const unsigned pb0 = f16x2_of(s[0][0], s[0][1]), pb1 = f16x2_of(s[1][0], s[1][1]);",
    "const float ca = __shfl_sync(0xffffffffu, corr, 8 * tq), cb = __shfl_sync(0xffffffffu, corr, 8 * tq + 4);",
    "ot[j][0] *= ca; ot[j][1] *= cb; ot[j][2] *= ca; ot[j][3] *= cb;",
    "const int c = (2 * j) >> 3, e = (2 * j) & 7;",
    "const unsigned a[4] = {oct_zip(tl.v[0][c], tl.v[1][c], e), oct_zip(tl.v[0][c], tl.v[1][c], e + 1),",
    "oct_zip(tl.v[2][c], tl.v[3][c], e), oct_zip(tl.v[2][c], tl.v[3][c], e + 1)};",
    "mma_f16(ot[j], a, pb0, pb1);",
    "const int d = gr * (W / 8) + 2 * j;",
    "if (ha < G) *(float2*)(ring_f + (warp * G + ha) * OS + d) = make_float2(ot[j][0] * fa, ot[j][2] * fa);",
    "if (hb < G) *(float2*)(ring_f + (warp * G + hb) * OS + d) = make_float2(ot[j][1] * fb, ot[j][3] * fb);",
    "for (int w = 0; w < NW; ++w) o[j] += ring_f[(w * G + g) * OS + i];",
)


@pytest.mark.parametrize("cache", ["f32", "f16"])
@pytest.mark.parametrize("G,W,hd", [(8, 128, 128), (2, 128, 80), (4, 64, 64), (8, 64, 32), (8, 64, 48)])
def test_lanes_fragments_give_q_k_and_p_v(G, W, hd, cache, rng):
    src = render(ModelSpec(cache=cache))
    body = src[src.index("struct TcTile {"):src.index(f"attn_decode_gqa_tc_g{G}h{W}(")]
    body += src[src.index(f"attn_decode_gqa_tc_g{G}h{W}("):][:14000]
    for line in TC_LINES:
        assert line in body, line
    q = np.zeros((16, W))                # rows 8-15 and past G: zeros, as the kernel's A
    q[:G, :hd] = rng.standard_normal((G, hd))
    k, v = rng.standard_normal((16, W)), rng.standard_normal((16, W))
    k[:, hd:] = v[:, hd:] = np.nan       # past the head: never loaded (zeros)

    def row8(x, r, d):
        return np.zeros(8) if d >= hd else x[r, d:d + 8]

    s = np.zeros((2, 32, 4))
    for i in range(W // 32):
        qf, kp = [], []
        for t in range(32):
            gr, tq = t // 4, t % 4
            d = 32 * i + 8 * tq
            x = q[gr, d:d + 8] if gr < G and d < hd else np.zeros(8)
            qf.append([[(x[4 * e], x[4 * e + 1]), (0.0, 0.0), (x[4 * e + 2], x[4 * e + 3]), (0.0, 0.0)]
                       for e in range(2)])
            kp.append([row8(k, 8 * n + gr, d) for n in range(2)])
        for e in range(2):
            a = [[qf[t][e][r] for t in range(32)] for r in range(4)]
            for n in range(2):
                mma_m16n8k16(s[n], a, [tuple(kp[t][n][4 * e:4 * e + 2]) for t in range(32)],
                             [tuple(kp[t][n][4 * e + 2:4 * e + 4]) for t in range(32)])
    S = q @ np.nan_to_num(k).T
    for t in range(32):
        gr, c = t // 4, 2 * (t % 4)
        for n in range(2):
            np.testing.assert_allclose(s[n][t], [S[gr, 8 * n + c], S[gr, 8 * n + c + 1], 0, 0], atol=1e-9)
    # O^T = V^T P^T with P = S as the accumulators hold it (heads 0-7)
    pb0 = [(s[0][t][0], s[0][t][1]) for t in range(32)]
    pb1 = [(s[1][t][0], s[1][t][1]) for t in range(32)]
    vr = [[np.concatenate([row8(v, 2 * (t % 4) + (a & 1) + 8 * (a >> 1), (t // 4) * (W // 8) + 8 * c)
                           for c in range(W // 64)]) for a in range(4)] for t in range(32)]
    ot = np.zeros((W // 16, 32, 4))
    for j in range(W // 16):
        e = 2 * j
        a = [[(vr[t][0][e], vr[t][1][e]) for t in range(32)], [(vr[t][0][e + 1], vr[t][1][e + 1]) for t in range(32)],
             [(vr[t][2][e], vr[t][3][e]) for t in range(32)], [(vr[t][2][e + 1], vr[t][3][e + 1]) for t in range(32)]]
        mma_m16n8k16(ot[j], a, pb0, pb1)
    ring = np.zeros((8, W))      # a warp's O rows as the kernel stores them
    for j in range(W // 16):
        for t in range(32):
            gr, tq = t // 4, t % 4
            d = gr * (W // 8) + 2 * j
            ring[2 * tq, d:d + 2] = ot[j][t][0], ot[j][t][2]
            ring[2 * tq + 1, d:d + 2] = ot[j][t][1], ot[j][t][3]
    np.testing.assert_allclose(ring[:G, :hd], (S[:8] @ np.nan_to_num(v))[:G, :hd], atol=1e-9)
