"""The MoE half of the CUDA backend (a part of runtime.backend_cuda.CudaBackend): routing,
the expert products and their fusions, the experts' weighted sum. At decode sizes the
router and its top-k are one launch, gate and up one fused mat-vec, and the down product
adds its weighted sum into the residual itself; past them the grouped products run, the
activation written by the gate|up tiles as the down's f16 x where both run on wgmma tiles
(GluF16), else applied by the down product's quantizer (GluProducts).
"""
from __future__ import annotations

import dataclasses

import numpy as np

from . import dispatch, ops
from .kernels import grid_1d, load

_i32, _f32 = np.int32, np.float32
_NULL = np.uint64(0)
ROUTER_CLUSTER_BLOCKS = 8    # routing.cuh.j2: RC_BLOCKS (the cluster's size, fixed in the kernel)
ROUTER_CLUSTER_WARPS = 16    # routing.cuh.j2: RC_WARPS
ROUTER_HELD_FLOATS = 2048    # routing.cuh.j2: 4 * 32 * ROUTER_HELD, a row's part held in registers
COMBINE_ROWS_SLOTS = 8       # model_tokens.cuh.j2: COMBINE_SLOTS (moe_combine_rms_norm_rows)
COMBINE_ROWS_GROUPS = 4      # model_tokens.cuh.j2: COMBINE_GROUPS
ROUTER_STAGE_BYTES = 200 * 1024   # the most shared memory a router block stages rows in (sm_90: 227 KiB)


def router_staged4(k: int, smem_limit: int = ROUTER_STAGE_BYTES) -> int:
    """How many float4 of each router row past the registers' part router_route_cluster
    copies into shared memory before its PDL wait (a row's rest, as far as
    ROUTER_STAGE_BYTES and the device's smem_limit allow: sm_120 cards give a block 99 KiB);
    0 for rows the registers hold or that are not float4 rows."""
    if k % 4 or k <= ROUTER_HELD_FLOATS:
        return 0
    budget = max(0, min(ROUTER_STAGE_BYTES, smem_limit))
    return min((k - ROUTER_HELD_FLOATS) // 4, budget // (16 * ROUTER_CLUSTER_WARPS))


def _gating_args(gating, sel_bias):
    """routing.cuh.j2's gating word (GATE_SIGMOID, GATE_NO_NORM), selection bias, shared slots."""
    word = (1 if gating.func == "sigmoid" else 0) | (0 if gating.norm else 2)
    return _i32(word), _NULL if sel_bias is None else sel_bias, _i32(gating.shared)


def _keyed(gating, sel_bias) -> str:
    """The routing kernels' variant: the plain softmax's, or the one that chooses by
    probability plus selection bias (routing.cuh.j2, KEYED)."""
    return "_keyed" if gating.func != "softmax" or sel_bias is not None else ""


class GluProducts:
    """The expert gate|up products (n, top_k, 2 n_ff) standing for act(gate) * up, which
    only the down product reads. SiLU: its quantizer computes the activation as it
    quantizes (ops.run_mul_mat_id, glu), the same bits as the swiglu kernel. SwiGLU-OAI
    (gpt-oss, with each expert's gate and up biases): on the f16 tiles, glu_oai_id_f16
    writes the down product's f16 activations, the same bits as glu_oai_id and the
    conversion after it. Either way no launch and no float32 buffer of its own. `choice` is
    the down product's path, one that prepares x in a launch of its own."""

    def __init__(self, gu, choice: dispatch.Choice, act: str = "silu", gate_b=None, up_b=None, ids=None):
        self.gu, self.choice, self.act = gu, choice, act
        self.gate_b, self.up_b, self.ids = gate_b, up_b, ids
        self.shape = (*gu.shape[:-1], gu.shape[-1] // 2)


class GluF16:
    """act(gate) * up of the expert FFN as the down product's f16 x, (rows, kp), written
    by the gate|up tiles themselves (MmfSpec.glu: mmf.run_mmf_glu): no float32 products, no
    launch between. `choice` is the down product's path, wgmma tiles of that x order."""

    def __init__(self, xh, kp: int, choice: dispatch.Choice, shape: tuple[int, ...]):
        self.xh, self.kp, self.choice, self.shape = xh, kp, choice, shape


def _aligned16(*arrays) -> bool:
    return all(a is None or a.data.ptr % 16 == 0 for a in arrays)


class CudaMoeOps:
    """Mixed into CudaBackend, whose plumbing (kernel, ws, _q8_of, the fusion switches and
    the PDL bookkeeping in _waited_ids) it uses."""

    def moe_combine_rms_norm_(self, x, y, wts, w, eps, name, bias=None, ids=None):
        """y None: the experts' sum is already in x (expert_down_into_); only the norm, with
        the same arithmetic (x + 0 over no slots), and each chosen expert's bias (weighted)
        where the model has down biases (bias (E, d), with the ids)."""
        n, d = x.shape
        top_k = 0 if y is None else y.shape[1]
        out = self.ws(name, x.shape)
        if n > dispatch.MMVQ_MAX_TOKENS and self._combine_rows_fit(x, y, w, out, bias, d, top_k):
            self.kernel("moe_combine_rms_norm_rows")((n,), (dispatch.COMBINE_PROMPT_THREADS,), (
                x, y, wts, w, out, _i32(top_k), _i32(d), _f32(eps), _NULL if bias is None else bias,
                _NULL if ids is None else ids, _i32(wts.shape[1])))
            return out
        threads = 1024 if n <= dispatch.MMVQ_MAX_TOKENS else dispatch.COMBINE_PROMPT_THREADS
        self.kernel("moe_combine_rms_norm")((n,), (threads,), (
            x, x if y is None else y, wts, w, out, _i32(top_k), _i32(d), _f32(eps), *self._norm_q8(out),
            _NULL if bias is None else bias, _NULL if ids is None else ids, _i32(wts.shape[1])))
        return out

    @staticmethod
    def _combine_rows_fit(x, y, w, out, bias, d: int, top_k: int) -> bool:
        """moe_combine_rms_norm_rows takes the slots' rows: 1..COMBINE_SLOTS of them, float4
        columns (d % 4, every row 16-byte aligned), up to COMBINE_GROUPS float4 a thread."""
        return (y is not None and 1 <= top_k <= COMBINE_ROWS_SLOTS and d % 4 == 0
                and d <= 4 * COMBINE_ROWS_GROUPS * dispatch.COMBINE_PROMPT_THREADS
                and _aligned16(x, y, w, out, bias))

    def moe_down_combine_rms_norm_(self, L, x, act, ids, wts, w, eps, name):
        n, top_k = ids.shape
        if (self.fuse_down_combine and self._decoding and L.down.q is not None and n <= dispatch.MMVQ_MAX_TOKENS
                and top_k <= 8):
            self.expert_down_into_(L, x, act, ids, wts)
            return self.moe_combine_rms_norm_(x, None, wts, w, eps, name, L.down_b, ids)
        y = self.mul_mat_id(L.down, act, ids, "down")
        return self.moe_combine_rms_norm_(x, y, wts, w, eps, name, L.down_b, ids)

    def expert_down_into_(self, L, x, act, ids, wts):
        """x += sum_j wts[:, j] * (W_down[ids[:, j]] act[:, j]) in the down product's own launch
        (ops.run_mul_mat_id_combine): the expert outputs never reach memory."""
        settled = self._waited_ids == (ids.data.ptr, act.data.ptr)
        self._waited_ids = None
        ops.run_mul_mat_id_combine(L.down.q, act, ids, wts, x, ids_settled=settled)

    def mul_mat_id(self, w, x, ids, name, glu=None):
        """glu: (the glu tile, the down product's choice, gate and up biases) for the merged
        gate|up experts w, whose activations it returns as the down's x (GluF16)."""
        n, top_k = ids.shape
        E, m, k = w.shape
        if glu is not None:
            from .mmf import run_mmf_glu
            spec, down, gate_b, up_b = glu
            xh, kp = run_mmf_glu(spec, w.q, x.reshape(-1, k), ids, top_k if x.ndim == 2 else 1, gate_b, up_b)
            return GluF16(xh, kp, down, (n, top_k, m // 2))
        out = self.ws(name, (n, top_k, m))
        if isinstance(x, GluF16):
            from .mmf import run_mmf_f16
            if w.q is None or x.shape != (n, top_k, k):
                raise ValueError(f"{name}: activations of shape {x.shape} cannot feed {w.qtype} {w.shape}")
            run_mmf_f16(x.choice.spec, w.q, x.xh, x.kp, ids, 1, out)
            return out
        if isinstance(x, GluProducts):
            if w.q is None or x.shape != (n, top_k, k):
                raise ValueError(f"{name}: gate|up products of shape {x.gu.shape} cannot feed {w.qtype} {w.shape}")
            if x.act == "silu":
                ops.run_mul_mat_id(w.q, x.gu, ids, out, x.choice, glu=True)
            else:
                from .mmf import check_f16, run_mmf_f16
                if x.choice.path != "mmf_id":
                    raise ValueError(f"{name}: {x.act} products feed the f16 tiles only, not {x.choice.path}")
                check_f16(x.choice.spec, w.q, ids)
                run_mmf_f16(x.choice.spec, w.q, *self._glu_oai_f16(x, x.choice.spec), ids, 1, out)
            return out
        if w.q is not None:
            # the down product right after the expert gate/up, whose launch waited for the
            # router: its quantizer may release the product at once (ops._mmvq)
            settled = self._waited_ids == (ids.data.ptr, x.data.ptr)
            self._waited_ids = None
            ops.run_mul_mat_id(w.q, x, ids, out, dispatch.choose_mul_mat_id(w.qtype, E, top_k, m, k, n, w.q.f16_fits),
                               ids_settled=settled)
            return out
        # float experts: test models only (a warp per output, no tensor cores)
        x_div = top_k if x.ndim == 2 else 1
        self.kernel("dense_f32_id")((-(-m // 8), n * top_k), (256,), (w.f, x, ids, out, _i32(m), _i32(k),
                                                                      _i32(x_div)))
        return out

    def expert_gate_up(self, L, x, ids, name):
        """Decoding (n <= 8, quantized experts): one fused mat-vec launch reads gate and up
        and applies SiLU, instead of a product, a round trip through memory and a kernel.
        Larger batches with merged gate/up: the product alone, its SiLU(gate) * up left to
        the down product's quantizer (GluProducts)."""
        n, top_k = ids.shape
        w = L.gate_up if L.gate_up is not None else L.gate
        act = self.hp.expert_act
        if w.q is None or n > dispatch.MMVQ_MAX_TOKENS:
            glu = self._glu_form(L, n, top_k) if L.gate_up is not None and w.q is not None else None
            if glu is not None:
                tile = self._glu_tile(L, ids, glu)
                if tile is not None:
                    return self.mul_mat_id(L.gate_up, x, ids, "gate_up", (tile, glu, L.gate_b, L.up_b))
                return GluProducts(self.mul_mat_id(L.gate_up, x, ids, "gate_up"), glu, act, L.gate_b, L.up_b, ids)
            return super().expert_gate_up(L, x, ids, name)
        from .fused import Operands, run_moe_gate_up
        o = Operands(x, w.q if L.gate_up is not None else None, L.gate.q if L.gate is not None else None,
                     L.up.q if L.up is not None else None, L.gate_b, L.up_b, experts=True)
        out = self.ws(name, (n, top_k, o.n_ff))
        q8 = self._q8_of(x)
        run_moe_gate_up(o, ids, out, act, x_q8=q8)
        # with x quantized before, its launch is the wait-first form (or an ordinary one):
        # it passed its wait for the router before any kernel after it could launch
        self._waited_ids = (ids.data.ptr, out.data.ptr) if q8 is not None else None
        return out

    def _glu_form(self, L, n: int, top_k: int):
        """The down product's choice where it takes the gate|up products and applies the
        activation itself (GluProducts), else None: SiLU on every path that prepares x in a
        launch of its own; SwiGLU-OAI on the f16 tiles (its biases read as float4)."""
        act = self.hp.expert_act
        if not self.fuse_glu_quant or L.down.q is None or act not in ("silu", "swiglu_oai"):
            return None
        if act == "silu" and L.gate_b is not None:
            return None
        E, m, k = L.down.shape
        choice = dispatch.choose_mul_mat_id(L.down.qtype, E, top_k, m, k, n, L.down.q.f16_fits)
        if act == "silu":
            return choice if choice.path in ops.GLU_PATHS else None
        fits = k % 4 == 0 and (L.gate_b is None) == (L.up_b is None) and _aligned16(L.gate_b, L.up_b)
        return choice if choice.path == "mmf_id" and fits else None

    def _glu_tile(self, L, ids, down: dispatch.Choice):
        """The gate|up product's glu tile (MmfSpec.glu), where it and the down product (its
        choice `down`, from _glu_form) both run on wgmma tiles and it compiled without
        spilling, else None. The down's operands are checked here, before the gate|up tiles
        write its x."""
        if not (self.fuse_glu_tiles and down.path == "mmf_id" and down.spec.wgmma):
            return None
        n, top_k = ids.shape
        E, m, k = L.gate_up.shape
        gu = dispatch.choose_mul_mat_id(L.gate_up.qtype, E, top_k, m, k, n, L.gate_up.q.f16_fits)
        if gu.path != "mmf_id" or not gu.spec.wgmma or m % 64:
            return None
        spec = dataclasses.replace(gu.spec, glu=self.hp.expert_act)
        try:
            spec.check()
        except ValueError:
            return None
        if load(spec).spilled:
            # its plain tile does not spill (q5_K's and q6_K's 256-row tiles do as glu
            # tiles, by 20-48 bytes): the measured gain is of tiles that do not either
            return None
        from .mmf import check_f16
        check_f16(down.spec, L.down.q, ids)
        return spec

    def _glu_oai_f16(self, g: GluProducts, spec):
        """SwiGLU-OAI of the gate|up products with their experts' biases, as the f16
        activations of the down product's tiles (spec: its MmfSpec)."""
        from .mmf import x_f16_buffer
        rows, ff = g.gu.size // g.gu.shape[-1], g.shape[-1]
        xh, kp = x_f16_buffer(spec, rows, ff)
        self.kernel("glu_oai_id_f16")(grid_1d(rows * kp // 4), (256,), (
            g.gu, _NULL if g.gate_b is None else g.gate_b, _NULL if g.up_b is None else g.up_b, g.ids, xh,
            np.int64(rows), _i32(ff), _i32(kp), _i32(int(spec.wgmma))))
        return xh, kp

    def route_tokens(self, router, x, gating, bias=None, sel_bias=None):
        n, k = x.shape
        if router.f is None or n > dispatch.MMVQ_MAX_TOKENS:
            return super().route_tokens(router, x, gating, bias, sel_bias)
        b = _NULL if bias is None else bias
        m = router.shape[0]
        logits = self.ws("router", (n, m))
        ids, wts = self._route_out(n, gating)
        tail = (b, *_gating_args(gating, sel_bias))
        if self.router_cluster and int(self._device()["cc"].split(".")[0]) >= 9:
            # a cluster of blocks per token, the logits gathered in one block's shared memory
            # the block's static logits row (up to 2 KiB) also counts against the limit
            staged4 = router_staged4(k, self._device()["smem_per_block_optin"] - 4096)
            self.kernel("router_route_cluster" + _keyed(gating, sel_bias))(
                (ROUTER_CLUSTER_BLOCKS, n), (32 * ROUTER_CLUSTER_WARPS,), (
                    router.f, x, logits, _i32(m), _i32(k), _i32(n), _i32(gating.top_k), _f32(gating.scale), ids, wts,
                    *tail, _i32(staged4)), smem=16 * ROUTER_CLUSTER_WARPS * staged4)
            return ids, wts
        if self._counter is None:
            self._counter = self.cp.zeros(1, dtype=self.cp.uint32)   # router_route resets it after use
            self.generation += 1
        self.kernel("router_route" + _keyed(gating, sel_bias))((-(-m // 8), n), (256,), (router.f, x, logits, _i32(m), _i32(k), _i32(n),
                                                            _i32(gating.top_k), _f32(gating.scale), ids, wts,
                                                            self._counter, *tail))
        return ids, wts

    def route(self, logits, gating, sel_bias=None):
        n, E = logits.shape
        ids, wts = self._route_out(n, gating)
        self.kernel("route_topk" + _keyed(gating, sel_bias))(grid_1d(n, 4), (128,), (logits, _i32(n), _i32(E), _i32(gating.top_k),
                                                           _f32(gating.scale), ids, wts,
                                                           *_gating_args(gating, sel_bias)))
        return ids, wts

    def _route_out(self, n: int, gating):
        if gating.func not in gating.FUNCS:
            raise ValueError(f"expert gating {gating.func!r}: the router kernels take {', '.join(gating.FUNCS)}")
        if gating.shared > 32:
            raise ValueError(f"{gating.shared} shared experts: the router kernels write up to 32")
        return self.ws("ids", (n, gating.slots), np.int32), self.ws("wts", (n, gating.slots))

    def dense_route(self, n: int):
        """Buffers of their own, filled where they are new or longer than before: a pass
        captured after its eager run (runtime.graphs) replays no memset, which is a graph
        node the kernels after it cannot overlap (it ends their PDL chain)."""
        ids, wts = self.ws("dense_ids", (n, 1), np.int32), self.ws("dense_wts", (n, 1))
        key = (ids.data.ptr, wts.data.ptr)
        if self._dense_filled[0] != key or self._dense_filled[1] < n:
            ids.fill(0)
            wts.fill(1.0)
            self._dense_filled = (key, n)
        return ids, wts

    def shared_expert_(self, S, x, h):
        """At decode the shared FFN's down product adds itself to x (expert_down_into_ with
        weight 1: one launch in the PDL chain, not a product and an elementwise add)."""
        n = h.shape[0]
        if not (self.fuse_down_combine and self._decoding and S.down.q is not None
                and n <= dispatch.MMVQ_MAX_TOKENS):
            return super().shared_expert_(S, x, h)
        ids, wts = self.dense_route(n)
        self.expert_down_into_(S, x, self.expert_gate_up(S, h, ids, "shared_act"), ids, wts)

    def swiglu(self, gu, name):
        *lead, two_ff = gu.shape
        ff = two_ff // 2
        out = self.ws(name, (*lead, ff))
        rows = out.size // ff
        self.kernel("swiglu")(grid_1d(out.size), (256,), (gu, out, np.int64(rows), _i32(ff)))
        return out

    def swiglu_split(self, g, u, name):
        out = self.ws(name, g.shape)
        self.kernel("swiglu_split")(grid_1d(out.size), (256,), (g, u, out, np.int64(out.size)))
        return out

    def moe_combine_(self, x, y, wts):
        n, top_k, d = y.shape
        self.kernel("moe_combine")(grid_1d(n * d), (256,), (x, y, wts, _i32(n), _i32(top_k), _i32(d)))
