"""The attention half of the CUDA backend (a part of runtime.backend_cuda.CudaBackend): the
KV cache's stores (with RoPE, biases and per-head norms), and attention itself: at decode
one of the decode kernels (runtime.decode_attention: a block per query head, or per key
head's group through a ring or on tensor cores, splits merged by the last blocks), for a
prompt the tensor-core kernels (runtime.prompt_attention) or cuBLAS on views of the cache.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from . import decode_attention, prompt_attention
from .kernels import grid_1d

_i32, _f32 = np.int32, np.float32
_NULL = np.uint64(0)
QK_HEAD_DIM_MAX = 512   # qk_norm_rope_store: 8 rotation pairs a lane (QK_PAIRS in model_tokens.cuh.j2)
QK_ITEMS_H128 = 2       # qk_norm_rope_store_h128: (head, token) items a warp (its ITEMS)
# attn_decode_mla (templates/mla.cuh.j2): query heads a block, the latent and row widths it
# holds, the splits its merge weighs at most; the fewest rows a split takes (a short
# context's rows two a warp, all in flight at once)
MLA_HEADS, MLA_MAX_R, MLA_MAX_D, MLA_MAX_SPLITS = 16, 512, 576, 512
MLA_STORE_THREADS = 256     # mla_rope_store's block (its latent: two values a thread)
MLA_THREADS = 256           # attn_decode_mla's block (a pair of the latent's values a thread)
MLA_MIN_ROWS = 16
# A prompt's latent attention on attn_decode_mla (FMA, captured) up to this many (token,
# cached position) pairs, n x its mean context; past it on cuBLAS, eagerly. H200, synthetic
# DeepSeek-V2-Lite q4_0, f16 cache: pp512 at depth 0 (~0.13M pairs) 17496 t/s on the kernel
# against 6252 eager on cuBLAS, at depth 4096 (2.2M pairs) 2659 against 6736; the kernel's
# pass grows ~41 ms a 0.5M pairs (~12 TFLOPs), the eager pass stays ~65-80 ms.
MLA_KERNEL_MAX_PAIRS = 640_000
# A decode step's latent attention at f16 precision and with an f16 cache on attn_prefill_mla
# (tensor cores, its positions split as attn_decode_mla splits them, the same merge); False:
# attn_decode_mla. H200, synthetic DeepSeek-V2-Lite q4_0, tg128 at depth 0 / 4096: f16 cache
# 544.7 / 505.5 t/s against 538.4 / 474.6 on FMA; a float32 cache (its tiles converted by
# the block, one buffer) 528.7 / 489.4 against 539.6 / 475.6, slower for short contexts,
# so it stays on FMA.
MLA_DECODE_TC = True
# attn_prefill_mla's key tile (its MLAP_KEYS). A decode step's splits there take a tile at
# least once the context gives each more than MLA_MIN_ROWS (mla_rows_per_split; the merge
# is told). Alternating processes, tg128 at depth 0 / 4096 / 16384: 545.0 / 523.3 / 471.6
# against 545.5 / 507.0 / 471.8 with splits of MLA_MIN_ROWS; in one process, whole tiles
# (16384: 128 splits of 128) 461.3 there, a split every second SM 547.8 / 520.7 / 433.2.
MLA_TC_KEYS = 64


def check_mla(hp) -> None:
    """What the latent attention kernels take (attn_decode_mla, templates/mla.cuh.j2), checked
    as the CUDA backend is made, before any kernel runs: one kv head, latents of up to
    MLA_MAX_R, rows of up to MLA_MAX_D, every part a multiple of 4 (vector loads)."""
    r, D, m = hp.v_dim, hp.head_dim, hp.mla
    if hp.n_head_kv != 1 or r > MLA_MAX_R or D > MLA_MAX_D or r % 4 or m.nope_dim % 4 or (D - r) % 4:
        raise ValueError(f"the cuda backend's latent attention takes one kv head, latents of up to {MLA_MAX_R} "
                         f"and rows of up to {MLA_MAX_D}, all parts multiples of 4; this model has "
                         f"{hp.n_head_kv} kv heads, a latent of {r}, rows of {D} and {m.nope_dim} nope values")


def mla_prefill_smem(bufs: int) -> int:
    """attn_prefill_mla's shared memory: f16 q [2][16][584], key tiles [bufs][64][584] and P
    [2][16][72], float maxima and sums [2][2][16] (templates/mla_prefill.cuh.j2)."""
    ls = MLA_MAX_D + 8
    return 2 * (2 * 16 * ls + bufs * MLA_TC_KEYS * ls + 2 * 16 * (MLA_TC_KEYS + 8)) + 4 * 2 * 2 * 16


def mla_prompt_on_kernel(n: int, pos0: int) -> bool:
    """Whether a prompt ubatch of n tokens after pos0 cached runs attn_decode_mla."""
    return n * (pos0 + (n + 1) / 2) <= MLA_KERNEL_MAX_PAIRS


@dataclass
class MlaQuery:
    """n tokens' latent-attention queries where they lie: the heads' absorbed latent parts
    (n, H, r) and q itself (n, H (nope + rope)), whose RoPE parts the kernels read."""
    lat: object
    q: object


class CudaAttentionOps:
    """Mixed into CudaBackend, whose plumbing (kernel, ws, _device, _norm_q8, the decode
    switches set in its __init__, the fusion state in _pending_qk) it uses."""

    def _decode_grouped(self, pos0: int) -> bool:
        """The decode step at position pos0 (known on the host: the step's graph is captured
        per choice) takes the grouped attention."""
        if self.decode_attn_grouped is not None:
            return self.decode_attn_grouped
        dev = self._device()
        return decode_attention.grouped_at(self.hp, pos0, dev["sm_count"], dev["smem_per_block_optin"], self.cache_type,
                                           self._decode_tc())

    def _decode_tc(self) -> bool:
        """Grouped decode attention on tensor cores: at f16 precision on sm_80+, where the
        kernel takes the heads (decode_attn_tc forces it either way)."""
        if self.decode_attn_tc is not None:
            return self.decode_attn_tc
        return (self.attn_precision == "f16" and int(self._device()["cc"].split(".")[0]) >= 8
                and decode_attention.can_tc(self.hp))

    @property
    def decode_attn_tc(self) -> bool | None:
        """The grouped decode attention on tensor cores (True), in float32 FMA (False) or None
        (tensor cores at f16 precision: _decode_tc). Setting it drops captured graphs."""
        return self._decode_attn_tc

    @decode_attn_tc.setter
    def decode_attn_tc(self, tc: bool | None) -> None:
        self._decode_attn_tc = tc
        self.generation += 1

    @property
    def decode_attn_grouped(self) -> bool | None:
        """Decode attention a block per key head (True), per query head (False) or None (by
        the step's context: decode_attention.grouped_min_kv). Setting it drops captured graphs."""
        return self._decode_attn_grouped

    @decode_attn_grouped.setter
    def decode_attn_grouped(self, grouped: bool | None) -> None:
        self._decode_attn_grouped = grouped
        self.generation += 1

    @property
    def decode_attn_splits(self) -> int | None:
        """Decode attention's blocks per head: None for decode_attention.plan's, a number forces
        it (A/B runs, tests). Setting it drops captured graphs (their launches hold the old)."""
        return self._decode_attn_splits

    @decode_attn_splits.setter
    def decode_attn_splits(self, splits: int | None) -> None:
        if splits is not None and splits < 1:
            raise ValueError(f"decode_attn_splits must be at least 1, not {splits}")
        self._decode_attn_splits = splits
        self.generation += 1

    @property
    def decode_attn_stages(self) -> int | None:
        """The grouped decode attention's ring buffers: None for as many as a block's shared
        memory holds (decode_attention.ring), a number forces fewer (tests: the ring's
        wrap-around, the merge in batches). Setting it drops captured graphs."""
        return self._decode_attn_stages

    @decode_attn_stages.setter
    def decode_attn_stages(self, stages: int | None) -> None:
        if stages is not None and not 2 <= stages <= decode_attention.GQA_MAX_STAGES:
            raise ValueError(f"decode_attn_stages must be 2 to {decode_attention.GQA_MAX_STAGES}, not {stages}")
        self._decode_attn_stages = stages
        self.generation += 1

    def kv_store_(self, cache, il, k, v, pos, pos0):
        n = k.shape[0]
        self.kernel("kv_store")(grid_1d(n * self.hp.kv_dim), (256,), (k, v, cache.k[il], cache.v[il], pos, _i32(n),
                                                                    _i32(self.hp.kv_dim)))

    def rope_store_(self, cache, il, q, k, v, pos, pos0, L=None):
        """L's q, k, v biases, RoPE (YaRN where hp.yarn says) of q and k and the KV store, in one launch."""
        hp, n = self.hp, q.shape[0]
        self._pending_qk = None
        y = hp.yarn
        lo, hi = y.corr_dims(hp.rot_dim, hp.rope_base) if y is not None else (0.0, 0.0)
        total = n * (hp.n_head + hp.n_head_kv) * (hp.head_dim // 2)
        self.kernel("rope_yarn_store")(grid_1d(total), (256,), (
            q, k, v, cache.k[il], cache.v[il], pos, _i32(hp.n_head), _i32(hp.n_head_kv), _i32(hp.head_dim),
            _f32(math.log2(hp.rope_base)), _f32(y.freq_scale if y else 1.0), _f32(y.ext_factor if y else 0.0),
            _f32(lo), _f32(hi), _f32(y.mscale() if y else 1.0), _i32(n),
            *((L.bq, L.bk, L.bv) if L is not None and L.bq is not None else (_NULL, _NULL, _NULL)), _i32(hp.rot_dim)))

    def qk_norm_rope_store_(self, cache, il, q, k, v, L, pos, pos0):
        hp = self.hp
        n = q.shape[0]
        if n == 1 and self._decoding and self.fuse_qk_rope and hp.head_dim <= self.spec.max_head_dim:
            # the decode attention right after does it (attn_decode.cuh.j2): one launch less
            self._pending_qk = (q.data.ptr, k, v, L.q_norm, L.k_norm)
            return
        self._pending_qk = None
        if hp.head_dim > QK_HEAD_DIM_MAX:
            raise ValueError(f"head_dim {hp.head_dim}: qk_norm_rope_store takes at most {QK_HEAD_DIM_MAX}")
        # a warp per (head, token) item, 8 warps a block; heads of up to 128: two items a warp
        per_warp = QK_ITEMS_H128 if hp.head_dim <= 128 else 1
        self.kernel("qk_norm_rope_store_h128" if per_warp > 1 else "qk_norm_rope_store")(
            (-(-(hp.n_head + hp.n_head_kv) * n // (8 * per_warp)),), (256,), (
            q, k, v, L.q_norm, L.k_norm, cache.k[il], cache.v[il], pos, _i32(hp.n_head), _i32(hp.n_head_kv),
            _i32(hp.head_dim), _f32(hp.rms_eps), _f32(math.log2(hp.rope_base)), _i32(n)))

    def mla_rope_store_(self, cache, il, q, kv, L, pos, pos0):
        """runtime.backend.Backend.mla_rope_store_ in one launch (a block a token)."""
        hp = self.hp
        m, y = hp.mla, hp.yarn
        lo, hi = y.corr_dims(m.rope_dim, hp.rope_base) if y is not None else (0.0, 0.0)
        self.kernel("mla_rope_store")((q.shape[0],), (MLA_STORE_THREADS,), (
            q, kv, L.mla.kv_a_norm, cache.k[il], pos, _i32(hp.n_head), _i32(m.nope_dim), _i32(m.rope_dim),
            _i32(m.kv_lora_rank), _f32(hp.rms_eps), _f32(math.log2(hp.rope_base)), _f32(y.freq_scale if y else 1.0),
            _f32(y.ext_factor if y else 0.0), _f32(lo), _f32(hi), _f32(y.mscale() if y else 1.0),
            self.ws("q_nope", (q.shape[0], hp.n_head, m.nope_dim))))

    def mla_absorb(self, L, q, name):
        """The heads' nope queries (copied out by mla_rope_store) into the latent's space;
        attention reads them and q's RoPE part where they are (MlaQuery)."""
        hp, n = self.hp, q.shape[0]
        lat = self.mul_mat_id(L.mla.k_b, self.ws("q_nope", (n, hp.n_head, hp.mla.nope_dim)), self._head_ids(n), name)
        return MlaQuery(lat, q)

    def attention(self, cache, il, q, pos, pos0, n, name, sinks=None, window: int = 0):
        hp = self.hp
        kc, vc = cache.k[il], cache.v[il]
        scale = hp.kq_scale
        extra = (_NULL if sinks is None else sinks, _i32(window))
        if hp.mla:      # runtime.arch.MLA: its own kernels; long prompts on cuBLAS, eagerly
            if self.mla_on_cublas(n, pos0):
                return self._attn_cublas(kc, vc, self.mla_join(q.lat, q.q), pos0, n, scale, extra)
            return self._attn_mla(kc, q, pos, name, cache.n_ctx, n)
        if n == 1:   # the decode step: the number of cached positions is read on the device
            out = self.ws(name, (1, hp.q_dim))
            pend, self._pending_qk = self._pending_qk, None
            if pend is not None and pend[0] == q.data.ptr:
                fused = (*pend[1:], _f32(hp.rms_eps), _f32(math.log2(hp.rope_base)))
            else:
                fused = (_NULL, _NULL, _NULL, _NULL, _f32(0.0), _f32(0.0))
            # a sliding window's layers attend to at most `window` positions
            grouped = self._decode_grouped(min(pos0, window - 1) if window else pos0)
            kernel, heads, threads, splits = decode_attention.plan(hp, cache.n_ctx, self._device()["sm_count"],
                                                                   grouped, self.decode_attn_splits, self.cache_type,
                                                                   grouped and self._decode_tc())
            part = self.ws("attn_part", (hp.n_head * splits * (hp.head_dim + 2),))
            if self._attn_counts is None or self._attn_counts.size < 4 * hp.n_head:
                # zero once: the per-head kernel's counters (the first n_head) return to zero
                # after each launch; the grouped kernels' (3 a block of heads, after them) are
                # banked (attn_decode_gqa.cuh.j2)
                self._attn_counts = self.cp.zeros(4 * hp.n_head, dtype=self.cp.uint32)
            counts = self._attn_counts[hp.n_head:] if grouped else self._attn_counts
            args = (q, kc, vc, pos, out, _i32(hp.n_head), _i32(hp.n_head_kv), _i32(hp.head_dim),
                    _f32(scale * math.log2(math.e)), *self._norm_q8(out, "attn", ok=hp.head_dim % 32 == 0), *fused,
                    part, counts, _i32(splits))
            smem = 0
            if kernel.startswith("attn_decode_gqa_tc"):
                smem = decode_attention.tc_smem(hp, self._device()["smem_per_block_optin"])
                args += (_i32(0),)                    # stages: the tensor-core kernel has no ring
            elif kernel.startswith("attn_decode_gqa"):
                stages, smem = decode_attention.ring(hp, self._device()["smem_per_block_optin"],
                                                     self.decode_attn_stages, self.cache_type)
                args += (_i32(stages),)
            args += extra
            self.kernel(kernel)((heads, splits), (threads,), args, smem=smem)
            return out
        info = self._device()
        kernel = prompt_attention.kernel_for(hp, info["cc"], self.attn_precision or "f32", info["smem_per_block_optin"],
                                             self.cache_type, self.spec.wgmma)
        if kernel is not None:
            return self._attn_prefill(kernel, kc, vc, q, pos, n, scale, name, info["smem_per_block_optin"], extra)
        return self._attn_cublas(kc, vc, q, pos0, n, scale, extra)

    def mla_on_cublas(self, n: int, pos0: int) -> bool:
        """A latent-attention pass of n > 1 tokens after pos0 cached that attn_prefill_mla
        does not take, past the FMA kernel's bound: cuBLAS with CuPy temporaries sized by
        the context, so run eagerly (prompt_step) and never captured."""
        return bool(self.hp.mla) and n > 1 and not self._mla_prefill_bufs(n) and not mla_prompt_on_kernel(n, pos0)

    def _attn_mla(self, kc, q: "MlaQuery", pos, name, n_ctx: int, n: int):
        """Latent attention (attn_decode_mla, then its merge where a token's positions are
        split). The grid is fixed by the context's length and the token count (a captured
        pass serves every position): a block an SM in all (167 registers a thread: one block
        of 256 fits), fewer where the context cannot give each MLA_MIN_ROWS; the kernels work
        out on the device which blocks have positions (at least MLA_MIN_ROWS each). From 132
        tokens (an SM's worth) a block takes all of a token's positions and writes the
        output itself. At f16 precision prompts, and an f16 cache's decode steps, run on
        tensor cores (attn_prefill_mla, a decode step's positions split as attn_decode_mla's,
        the same merge), the others on FMA: 16 heads x 576 against each cached row a token."""
        hp = self.hp
        r, D, H, m = hp.v_dim, hp.head_dim, hp.n_head, hp.mla     # within check_mla's limits
        groups = -(-H // MLA_HEADS)
        scale_log2 = _f32(hp.kq_scale * math.log2(math.e))
        bufs = self._mla_prefill_bufs(n)
        sms = self._device()["sm_count"]
        # a decode step's positions split over the SMs, and on attn_decode_mla a prompt's
        # until its tokens fill them (132); attn_prefill_mla's prompt tokens fill them as such
        splits = 1 if bufs and n > 1 else max(1, min(-(-n_ctx // MLA_MIN_ROWS), sms // (groups * n), MLA_MAX_SPLITS))
        part = self.ws("attn_part_mla", (n * groups * splits * MLA_HEADS * (r + 2),)) if splits > 1 else _NULL
        out = self.ws(name, (n, H * r))
        if bufs:
            # (a decode step's block: its second pair of warps has no token, but loads)
            self.kernel("attn_prefill_mla")((-(-n // 2), groups, splits), (128,), (
                q.lat, q.q, kc, pos, part, out, _i32(n), _i32(H), _i32(m.nope_dim), scale_log2, _i32(bufs),
                _i32(MLA_MIN_ROWS)), smem=mla_prefill_smem(bufs))
        else:
            self.kernel("attn_decode_mla")((splits, groups, n), (MLA_THREADS,), (
                q.lat, q.q, kc, pos, part, out, _i32(H), _i32(D), _i32(r), _i32(m.nope_dim), scale_log2,
                _i32(MLA_MIN_ROWS)))
        if splits > 1:
            self.kernel("attn_decode_mla_merge")((H, -(-r // 64), n), (256,), (
                part, out, pos, _i32(H), _i32(r), _i32(splits), _i32(MLA_MIN_ROWS),
                _i32(MLA_TC_KEYS if bufs else 1)))
        return out

    def _mla_prefill_bufs(self, n: int) -> int:
        """attn_prefill_mla's key tile buffers where it takes n tokens (f16 precision, sm_80+,
        DeepSeek's 512 + 64 latent rows, heads in whole groups of 16; a decode step with an
        f16 cache while MLA_DECODE_TC; two tiles of an f16 cache where they fit), else 0."""
        hp, info = self.hp, self._device()
        decode_tc = MLA_DECODE_TC and self.cache_type == "f16"
        if (n < 1 or (n == 1 and not decode_tc) or self.attn_precision != "f16" or int(info["cc"].split(".")[0]) < 8
                or hp.v_dim != MLA_MAX_R or hp.head_dim != MLA_MAX_D or hp.n_head % MLA_HEADS):
            return 0
        for bufs in (2, 1) if self.cache_type == "f16" else (1,):
            if mla_prefill_smem(bufs) <= info["smem_per_block_optin"]:
                return bufs
        return 0

    def _attn_cublas(self, kc, vc, q, pos0, n, scale, extra):
        """Heads no kernel takes: cuBLAS on views of the cache (CuPy temporaries: such a pass
        is not captured; an f16 cache's rows as float32 copies), value heads hp.v_dim wide."""
        hp, cp = self.hp, self.cp
        L, hd, dv, hkv = pos0 + n, hp.head_dim, hp.v_dim, hp.n_head_kv
        g = hp.n_head // hkv
        K = kc[:L].astype(np.float32, copy=False).reshape(L, hkv, hd).transpose(1, 2, 0)
        V = vc[:L].astype(np.float32, copy=False).reshape(L, hkv, dv).transpose(1, 0, 2)
        qh = q.reshape(n, hkv, g, hd).transpose(1, 2, 0, 3).reshape(hkv, g * n, hd)
        p = cp.ascontiguousarray(cp.matmul(qh, K))                  # (hkv, g * n, L) scores
        self.kernel("softmax_causal")((p.size // L,), (256,), (p, _i32(L), _i32(n), _i32(pos0), _f32(scale), *extra))
        o = cp.matmul(p, V).reshape(hkv, g, n, dv).transpose(2, 0, 1, 3)
        return cp.ascontiguousarray(o.reshape(n, hp.n_head * dv))

    def _attn_prefill(self, kernel, kc, vc, q, pos, n, scale, name, smem_limit: int, extra):
        hp = self.hp
        out = self.ws(name, (n, hp.q_dim))
        if kernel == prompt_attention.WG_KERNEL:
            return self._attn_prefill_wg(kc, vc, q, pos, n, scale, out, extra)
        if kernel.startswith("attn_prefill_fa") and self.cache_type == "f32":
            # attn_prefill_fa reads f16 rows: a float32 cache's, up to the pass's last
            # position, rounded once for all its blocks (the rounding its tiles had)
            kh = self.ws("attn_k_f16", kc.shape, np.float16)
            vh = self.ws("attn_v_f16", vc.shape, np.float16)
            self.kernel("kv_rows_f16")((2 * self._device()["sm_count"],), (256,), (
                kc, vc, pos, _i32(n), _i32(kc.shape[1]), extra[1], kh, vh))
            kc, vc = kh, vh
        args = (q, kc, vc, pos, out, _i32(n), _i32(hp.n_head), _i32(hp.n_head_kv), _i32(hp.head_dim),
                _f32(scale * math.log2(math.e)))
        smem = prompt_attention.smem_bytes(hp, kernel)
        if kernel != "attn_prefill":
            bufs = self.attn_tile_buffers or prompt_attention.tile_buffers(hp, smem_limit, kernel, self.cache_type)
            args += (_i32(bufs),)
            smem = prompt_attention.smem_bytes(hp, kernel, bufs, self.cache_type)
        args += extra
        self.kernel(kernel)((hp.n_head_kv * prompt_attention.blocks_per_kv_head(hp, kernel),
                             -(-n // prompt_attention.rows(hp, kernel))),
                            (prompt_attention.threads(hp, kernel),), args, smem=smem)
        return out

    def _attn_prefill_wg(self, kc, vc, q, pos, n, scale, out, extra):
        """attn_prefill_wg128: kv_tiles_f16 lays out the pass's keys and values as the
        kernel's 64-key tiles (K and V^T, f16, as its shared memory holds them), for the
        cache's length rounded up to whole tiles; then attn_prefill_fa's grid and block."""
        hp = self.hp
        kernel = prompt_attention.WG_KERNEL
        n_tiles = -(-kc.shape[0] // prompt_attention.KEYS)
        tiles = self.ws("attn_tiles_f16", (hp.n_head_kv, n_tiles, prompt_attention.WG_TILE_BYTES // 2), np.float16)
        self.kernel("kv_tiles_f16")((2 * self._device()["sm_count"],), (256,), (
            kc, vc, pos, _i32(n), _i32(hp.n_head_kv), extra[1], _i32(n_tiles), tiles))
        self.kernel(kernel)((hp.n_head_kv * prompt_attention.blocks_per_kv_head(hp, kernel),
                             -(-n // prompt_attention.rows(hp, kernel))), (prompt_attention.threads(hp, kernel),), (
            q, tiles, _i32(n_tiles), pos, out, _i32(n), _i32(hp.n_head), _i32(hp.n_head_kv),
            _f32(scale * math.log2(math.e)), *extra), smem=prompt_attention.smem_bytes(hp, kernel))
        return out
