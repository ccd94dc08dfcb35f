"""The CUDA backend: quantized products through moeforge's kernels (runtime.ops), the rest
through the small kernels of the model graph (templates/model.cu.j2), float products
(the router) too.

Every op writes into a named, grow-only device buffer, and everything runs on one stream.
A forward pass therefore allocates nothing and never waits for the host: the decode step
and each prompt ubatch size are captured as CUDA graphs and replayed at every position
(token ids and positions live in device memory; runtime.graphs). The MoE ops (routing,
the expert products and their fusions) are in runtime.moe_cuda, the KV cache's stores and
attention in runtime.attention_cuda.
"""
from __future__ import annotations

import contextlib
import math

import numpy as np

from ..codegen.spec import ModelSpec
from . import dispatch, ops, prompt_attention, ring_memory
from .attention_cuda import CudaAttentionOps, check_mla
from .backend import AUTO_UBATCHES, Backend, choose_ubatch, prompt_bytes_per_token
from .kv_cache import KVCache
from .device import device_info, require_gpu
from .graphs import PassGraphs
from .kernels import grid_1d, load
from .moe_cuda import CudaMoeOps
from .tensor import QuantTensor

_i32, _f32 = np.int32, np.float32
_NULL = np.uint64(0)
SMALL_N = 16    # float products up to this many tokens use dense_f32 (a warp per output), past it tiles


class GpuWeight:
    def __init__(self, qtype: str, shape, q: QuantTensor | None = None, f=None):
        self.qtype, self.shape, self.q, self.f = qtype, tuple(shape), q, f


def dense_tile_form(m: int) -> tuple[str, int, int]:
    """The float product kernel for m rows, its tile's rows (and tokens) and k step: 128-row
    tiles past 64 rows (Qwen3's and GLM's 128-expert routers), 64-row ones up to 64, where
    the wide tile would leave most rows empty (Mixtral's 8, gpt-oss's 32, DeepSeek's 64)."""
    if m > ModelSpec.DENSE_TILE:
        return "dense_f32_tiled128", ModelSpec.DENSE_WIDE_TILE, ModelSpec.DENSE_WIDE_STEP
    return "dense_f32_tiled", ModelSpec.DENSE_TILE, ModelSpec.DENSE_STEP


class CudaBackend(CudaAttentionOps, CudaMoeOps, Backend):
    name = "cuda"

    def __init__(self, hp, attn_precision: str | None = None, cache_type: str = "f32", attn_wgmma: bool | None = None):
        cp = require_gpu("the cuda backend")
        super().__init__(hp, attn_precision, cache_type)
        # the model kernels, built for the cache's type; with prompt attention on wgmma
        # (attn_wgmma None: dispatch.attn_wgmma_available()) a module of its own, for sm_90a
        if attn_wgmma is None:
            attn_wgmma = dispatch.attn_wgmma_available()
        elif attn_wgmma and dispatch._device_cc_major() != 9:
            raise ValueError("attn_wgmma: prompt attention on wgmma runs on sm_90 (H100, H200) only")
        self.spec = lim = ModelSpec(cache=self.cache_type, wgmma=bool(attn_wgmma))
        # latent attention's rows (576 wide) have kernels of their own (attn_decode_mla) and cuBLAS
        if hp.n_expert > lim.max_experts or (hp.head_dim > lim.max_head_dim and not hp.mla) or hp.n_expert_used > 32:
            raise ValueError(f"the cuda backend handles up to {lim.max_experts} experts, 32 of them per token, and "
                             f"heads of up to {lim.max_head_dim}; this model has {hp.n_expert}, {hp.n_expert_used} "
                             f"and {hp.head_dim}")
        if hp.mla:
            check_mla(hp)
        self.cp = self.xp = cp
        self.stream = cp.cuda.Stream(non_blocking=True)
        self._bufs: dict[str, object] = {}
        self._kernels: dict[str, object] = {}
        self.generation = 0          # bumped whenever a buffer is (re)allocated
        self.graphs = PassGraphs(cp, self.stream)
        self._step_in = None
        self._counter = None
        self._attn_counts = None     # decode attention's split counters
        self._decode_attn_splits = None
        self._decode_attn_grouped = None
        self._decode_attn_stages = None
        self._decode_attn_tc = None
        self._decoding = False       # inside decode_step: model kernels launch with PDL
        self.fuse_norm_q8 = True     # at decode the norms and attention also write q8_1 of their output
        self._q8 = None              # (output pointer, xq, xds, nbp) of the last such norm
        self._waited_ids = None      # (ids pointer, output pointer) of the last expert gate/up
        self._dense_filled = (None, 0)  # dense_route's buffers (pointers) and how many rows hold expert 0, weight 1
        self.fuse_qk_rope = True     # at decode attention normalises, rotates and stores q and k itself
        self.fuse_down_combine = True  # at decode the down product adds its weighted sum to x itself
        self.router_cluster = True   # sm_90+: the decode router and routing in a cluster per token
        self.fuse_glu_quant = True     # past decode sizes the down product's quantizer applies SwiGLU
        self.fuse_glu_tiles = dispatch.glu_tiles_enabled()  # ... or the gate|up wgmma tiles write
                                                             # it as the down's f16 x
        self._pending_qk = None      # (q pointer, k, v, q_norm, k_norm) it then takes over
        self.attn_tile_buffers = None  # tensor-core prompt attention's key tiles: 1 or 2 (None: as
                                       # the card's shared memory allows)
        self._pinned = None          # to_host_reused's page-locked buffer

    def context(self):
        return self.stream

    # -- plumbing -----------------------------------------------------------------------------
    def kernel(self, name: str):
        """A model kernel as fn(grid, block, args, smem=0). Every one of them waits for the grid
        before it on entry (templates/model.cu.j2, pdl_enter), so in the decode step each is
        launched with PDL where the card has it: its launch overlaps the kernel before, and
        a step of ~600 small kernels loses no launch gaps. Prompt ubatches launch them as
        usual (their kernels are long, and a ctypes launch costs more host time)."""
        fn = self._kernels.get(name)
        if fn is None:
            k = load(self.spec, name)
            fn = self._kernels[name] = lambda grid, block, args, smem=0: k(grid, args, block=block[0], smem=smem,
                                                                            pdl=self._decoding)
        return fn

    def ws(self, name: str, shape, dtype=np.float32):
        n = int(np.prod(shape)) * np.dtype(dtype).itemsize
        buf = self._bufs.get(name)
        if buf is None or buf.nbytes < n:
            self._bufs[name] = buf = self.cp.empty(max(n, 256), dtype=self.cp.uint8)
            self.generation += 1
        return buf[:n].view(dtype).reshape(shape)

    def to_device(self, a: np.ndarray, name: str):
        buf = self.ws(name, a.shape, a.dtype)
        buf.set(np.ascontiguousarray(a), stream=self.stream)
        return buf

    def to_host(self, a) -> np.ndarray:
        return a.get(stream=self.stream)

    def to_host_reused(self, a) -> np.ndarray:
        """Into one page-locked buffer, kept: a decode step's 600 KB logits row took 135-160
        us a token as a fresh pageable array (the copy staged, the new pages faulted in),
        ~25 us this way (H200)."""
        if self._pinned is None or self._pinned.size < a.size or self._pinned.dtype != a.dtype:
            import cupyx
            self._pinned = cupyx.empty_pinned((a.size,), dtype=a.dtype)
        out = self._pinned[:a.size].reshape(a.shape)
        a.get(stream=self.stream, out=out)
        self.stream.synchronize()
        return out

    def synchronize(self) -> None:
        self.stream.synchronize()

    def auto_ubatch(self, n_ctx: int) -> int:
        """The largest ubatch whose buffers fit in a quarter of the memory free now (after
        the weights and the cache; CuPy's pool's free blocks count as free)."""
        free = self.cp.cuda.runtime.memGetInfo()[0] + self.cp.get_default_memory_pool().free_bytes()
        info = self._device()
        cublas = prompt_attention.kernel_for(self.hp, info["cc"], self.attn_precision or "f32",
                                             info["smem_per_block_optin"], self.cache_type) is None
        return choose_ubatch(free, prompt_bytes_per_token(self.hp, n_ctx if cublas else 0))

    def auto_ubatch_limit(self) -> int:
        return AUTO_UBATCHES[0]

    @property
    def ring_unit(self) -> int:
        return ring_memory.granularity(self.cp.cuda.Device().id)

    def ring_layer(self, rows, n_ctx, kv_dim, dtype):
        """n_ctx rows over `rows` rows of memory (runtime.ring_memory): the kernels address
        a ring by position, as any layer."""
        return ring_memory.ring_array(self.cp, rows, n_ctx, kv_dim, dtype)

    def new_cache(self, n_ctx: int, max_pass: int | None = None) -> KVCache:
        with self.stream:
            cache = super().new_cache(n_ctx, max_pass)
        self.generation += 1
        return cache

    # -- weights ------------------------------------------------------------------------------
    def matrix(self, ref, embedding: bool = False):
        if ref.quantized:
            if embedding and f"get_rows_{ref.qtype}" not in ModelSpec.KERNELS:
                raise ValueError(f"{ref.name}: embedding rows of {ref.qtype} cannot be read on the GPU yet")
            return GpuWeight(ref.qtype, ref.shape, q=QuantTensor.from_blocks(ref.load(self.cp), ref.qtype, ref.shape))
        from .backend_numpy import _float_rows
        host = _float_rows(np.asarray(ref.load()).reshape(-1, ref.shape[-1]), ref.qtype).reshape(ref.shape)
        return GpuWeight(ref.qtype, ref.shape, f=self.cp.asarray(host))

    def upload(self, refs, progress=None):
        weights = super().upload(refs, progress)
        # the device-side splits and merges (QuantTensor.from_blocks) leave their
        # temporaries in CuPy's pool: give them back to the device, for the cache and others
        self.cp.get_default_memory_pool().free_all_blocks()
        return weights

    def stacked_qkv(self, L):
        """Quantized q, k, v of one type become one matrix: one product (at decode one launch
        instead of three); the separate ones are not uploaded."""
        parts = (L.wq, L.wk, L.wv)
        if not all(p.quantized and p.qtype == L.wq.qtype for p in parts):
            return None
        from .arch import merge_rows
        return self.matrix(merge_rows(list(parts), L.wq.name.replace("attn_q", "attn_qkv")))

    # -- ops ------------------------------------------------------------------------------------
    def qkv(self, L, x, bias: bool = True):
        if L.wqkv is None:
            return super().qkv(L, x, bias)
        hp = self.hp
        both = self.matmul(L.wqkv, x, "qkv", bias=L.bqkv if bias else None)
        cuts = (0, hp.q_dim, hp.q_dim + hp.kv_dim, hp.q_dim + 2 * hp.kv_dim)
        views = [both[:, a:b] for a, b in zip(cuts, cuts[1:])]
        if x.shape[0] == 1:
            return views                      # one row: the slices are contiguous
        outs = []
        for name, v in zip(("q", "k", "v"), views):
            out = self.ws(name, v.shape)
            out[...] = v
            outs.append(out)
        return outs

    def embed(self, w: GpuWeight, tokens, name):
        n, k = tokens.shape[0], w.shape[-1]
        out = self.ws(name, (n, k))
        if w.q is None:
            self.cp.take(w.f, tokens, axis=0, out=out)
        else:
            self.kernel(f"get_rows_{w.qtype}")((-(-k // 256), n), (256,), (
                np.uint64(w.q.qs_ptr()), np.uint64(w.q.meta_ptr()), _i32(w.q.nb), _i32(w.q.meta_stride),
                tokens, out, _i32(k)))
        return out

    def _norm_q8(self, out, writer: str = "norm", ok: bool = True):
        """The last three arguments of a norm kernel (and of decode attention). In the decode
        step a norm's one output row is also written as q8_1 (model.cu.j2, norm_out), bit for
        bit what the quantizer would make of it, for the one-token product that reads it
        next: that product then needs no quantizing launch (matmul, expert_gate_up)."""
        d = out.shape[-1]
        if not (ok and self._decoding and self.fuse_norm_q8 and out.shape[0] == 1 and d % 32 == 0):
            self._q8 = None
            return _NULL, _NULL, _i32(0)
        nbp = ops.q8_1_blocks_padded(d)
        xq = self.ws(f"{writer}_xq", (1, d), np.int8)
        xds = self.ws(f"{writer}_xds", (1, nbp, 2))
        self._q8 = (out.data.ptr, xq, xds, nbp)
        return xq, xds, _i32(nbp)

    def _q8_of(self, x):
        """The q8_1 of x written by the norm that produced it, if x is that norm's output."""
        return self._q8[1:] if self._q8 is not None and x.shape[0] == 1 and x.data.ptr == self._q8[0] else None

    def rms_norm(self, x, w, eps, name):
        out = self.ws(name, x.shape)
        d = x.shape[-1]
        self.kernel("rms_norm")((x.size // d,), (256,), (x, w, out, _i32(d), _f32(eps), *self._norm_q8(out)))
        return out

    def head_norm_(self, x, w, n_heads, eps):
        hd = x.shape[-1] // n_heads
        self.kernel("rms_norm")((x.size // hd,), (min(256, 32 * -(-hd // 32)),), (x, w, x, _i32(hd), _f32(eps),
                                                                                 _NULL, _NULL, _i32(0)))

    def rope_(self, x, pos, n_heads, base, yarn=None):
        if yarn is not None:
            raise NotImplementedError("YaRN RoPE runs in rope_store_ (rope_yarn_store)")
        n, hd = x.shape[0], x.shape[1] // n_heads
        total = n * n_heads * (hd // 2)
        self.kernel("rope_neox")(grid_1d(total), (256,), (x, pos, _i32(n), _i32(n_heads), _i32(hd),
                                                        _f32(math.log2(base))))

    def add_bias_(self, y, b):
        self._add_bias(y, b)

    def _add_bias(self, y, b):
        m = y.shape[-1]
        self.kernel("add_bias")(grid_1d(y.size), (256,), (y, b, np.int64(y.size // m), _i32(m)))

    def glu_id(self, g, u, gate_b, up_b, ids, act, name):
        """SwiGLU-OAI of each slot's gate and up products (views of one gate|up buffer, or
        two buffers), with its expert's biases."""
        if act != "swiglu_oai":
            raise NotImplementedError(f"glu_id: {act}")
        *lead, ff = g.shape
        out = self.ws(name, (*lead, ff))
        slots = out.size // ff
        stride = g.strides[-2] // 4 if g.ndim > 1 else ff
        self.kernel("glu_oai_id")(grid_1d(out.size), (256,), (
            np.uint64(g.data.ptr), np.uint64(u.data.ptr), np.int64(stride), _NULL if gate_b is None else gate_b,
            _NULL if up_b is None else up_b, ids, out, np.int64(slots), _i32(ff)))
        return out

    def add_rms_norm_(self, x, y, w, eps, name, bias=None):
        out = self.ws(name, x.shape)
        d = x.shape[-1]
        self.kernel("add_rms_norm")((x.size // d,), (1024,), (x, y, w, out, _i32(d), _f32(eps), *self._norm_q8(out),
                                                              _NULL if bias is None else bias))
        return out

    def matmul(self, w: GpuWeight, x, name, bias=None):
        out = self._matmul(w, x, name)
        if bias is not None:
            self._add_bias(out, bias)    # not the op add_bias_: a profiled matmul stays one leaf
        return out

    def _matmul(self, w: GpuWeight, x, name):
        n, k = x.shape
        m = w.shape[0]
        out = self.ws(name, (n, m))
        if w.q is not None:
            q8 = self._q8_of(x)
            if q8 is not None:
                # x comes quantized: the one-token form reads it and has no launch before it
                # (a profile's n=1 entry timed its kernel with the quantization included)
                ops.run_mul_mat(w.q, x, out, dispatch.Choice("mmvq", dispatch.default_mmvq(w.qtype, 1, False, k, m)),
                                x_q8=q8)
            else:
                ops.run_mul_mat(w.q, x, out, dispatch.choose_mul_mat(w.qtype, m, k, n, w.q.f16_fits))
        elif n <= SMALL_N:
            self.kernel("dense_f32")((-(-m // 8), n), (256,), (w.f, x, out, _i32(m), _i32(k)))
        else:
            self._dense_tiled(w.f, x, out)
        return out

    def _dense_tiled(self, w, x, out):
        """out = x @ w.T in square tiles, split over k until the SMs have two blocks each."""
        (n, k), m = x.shape, w.shape[0]
        name, T, K = dense_tile_form(m)
        tiles = -(-m // T) * -(-n // T)
        splits = max(1, min(-(-2 * self._device()["sm_count"] // tiles), k // 256))
        kc = -(-k // (splits * K)) * K
        splits = -(-k // kc)
        dst = out if splits == 1 else self.ws("dense_partials", (splits, n, m))
        self.kernel(name)((-(-m // T), -(-n // T), splits), (256,), (w, x, dst, _i32(m), _i32(k), _i32(n), _i32(kc)))
        if splits > 1:
            self.kernel("dense_f32_reduce")(grid_1d(n * m), (256,), (dst, out, _i32(splits), np.int64(n * m)))

    def _device(self) -> dict:
        return device_info(self.cp.cuda.Device().id)

    def add_(self, x, y):
        self.cp.add(x, y, out=x)

    # -- the decode step as a CUDA graph ----------------------------------------------------------
    def _layout_key(self, model):
        """Everything the captured graph points at: our buffers, the cache, ops' workspace."""
        return (id(model.cache), self.generation, ops.WORKSPACE.generation)

    @contextlib.contextmanager
    def decoding(self):
        self._decoding = True
        try:
            yield
        finally:
            self._decoding = False

    @property
    def use_graphs(self) -> bool:
        return self.graphs.enabled

    @use_graphs.setter
    def use_graphs(self, on: bool) -> None:
        self.graphs.enabled = on

    def decode_step(self, model, token: int, pos0: int):
        if self._step_in is None:
            self._step_in = self.ws("step_in", (2,), np.int32)
        self._step_in.set(np.array([token, pos0], dtype=np.int32), stream=self.stream)
        tok, pos = self._step_in[0:1], self._step_in[1:2]

        def forward():
            with self.decoding():
                return model._forward(model, tok, pos, pos0, 1)
        # a graph for each attention kernel: one per query head, or per key head (long contexts)
        key = "decode" if self.hp.mla else "decode-grouped" if self._decode_grouped(pos0) else "decode"
        return self.graphs.run(key, lambda: self._layout_key(model), forward)

    def prompt_step(self, model, ids: np.ndarray, pos0: int, last_only: bool):
        """A prompt ubatch: one graph per (token count, last_only) serves every position."""
        n = ids.size
        tokens = self.to_device(ids, "tokens")
        pos = self.to_device(np.arange(pos0, pos0 + n, dtype=np.int32), "pos")
        if self.mla_on_cublas(n, pos0):
            # deep in the context cuBLAS's latent attention beats the kernel's FMA even eagerly
            return model._forward(model, tokens, pos, pos0, n, last_only)
        return self.graphs.run(("prompt", n, last_only), lambda: self._layout_key(model),
                               lambda: model._forward(model, tokens, pos, pos0, n, last_only))
