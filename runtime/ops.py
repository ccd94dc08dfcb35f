"""The quantized products, as ggml defines them, on the GPU.

mul_mat_id(w, x, ids): out[t, j] = W[ids[t, j]] @ x[t, j or 0]   (ggml's MUL_MAT_ID)
mul_mat(w, x):         out[t]    = W @ x[t]

Every argument is checked before any kernel runs. The launch sequences below never
synchronize with the host (except the per-expert path, which must read the expert
counts), so they can be captured in a CUDA graph.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from ..codegen.spec import MmqSpec, MmvqSpec, UtilSpec
from . import dispatch, streamk
from .device import device_info, require_gpu
from .kernels import load
from .launch_ex import pdl_available
from .tensor import QuantTensor

_NULL = np.uint64(0)
_i32 = np.int32


def _ptr(a):
    """A device array's pointer as a kernel argument, null for None."""
    return np.uint64(a.data.ptr) if a is not None else _NULL


# -- validation ---------------------------------------------------------------------------
def _device_array(a, name: str, dtype, ndims: tuple[int, ...], device_id: int):
    cp = require_gpu("moeforge products")
    if isinstance(a, np.ndarray) or np.isscalar(a):
        raise ValueError(f"{name} is a host array; pass a device array (CuPy, or anything with "
                         f"__cuda_array_interface__ or DLPack)")
    if isinstance(a, cp.ndarray):
        arr = a
    elif hasattr(a, "__cuda_array_interface__"):
        arr = cp.asarray(a)
    elif hasattr(a, "__dlpack__"):
        try:
            arr = cp.from_dlpack(a)
        except Exception as e:
            raise ValueError(f"{name} could not be taken as a device array ({e})") from None
    else:
        raise ValueError(f"{name} must be a device array, got {type(a).__name__}")
    if arr.dtype != dtype:
        raise ValueError(f"{name} must be {np.dtype(dtype).name}, got {arr.dtype}")
    if arr.ndim not in ndims:
        raise ValueError(f"{name} must have {' or '.join(map(str, ndims))} dimensions, got shape {arr.shape}")
    if arr.device.id != device_id:
        raise ValueError(f"{name} is on device {arr.device.id}, the weights on device {device_id}")
    return cp.ascontiguousarray(arr)


def _check_weights(w, ndim: int, name: str = "w") -> None:
    if not isinstance(w, QuantTensor):
        raise ValueError(f"{name} must be a moeforge.QuantTensor, got {type(w).__name__}")
    if len(w.shape) != ndim:
        want = "(E, m, k)" if ndim == 3 else "(m, k)"
        raise ValueError(f"{name} must have shape {want}, got {w.shape}")


def _check_out(out, shape, device_id):
    cp = require_gpu()
    if not isinstance(out, cp.ndarray) or out.dtype != np.float32 or out.shape != shape \
            or not out.flags.c_contiguous or out.device.id != device_id:
        raise ValueError(f"out must be a contiguous float32 CuPy array of shape {shape} on device {device_id}")
    return out


# -- workspace ----------------------------------------------------------------------------
class _Workspace:
    """Grow-only scratch buffers per device, so that repeated calls (and graph capture)
    allocate nothing."""

    def __init__(self):
        self._bufs: dict[tuple[int, str], object] = {}
        # bumped whenever a buffer moves: a captured CUDA graph holding old addresses is stale
        self.generation = 0

    def get(self, name: str, nbytes: int, dtype=np.uint8):
        cp = require_gpu()
        key = (cp.cuda.Device().id, name)
        nbytes = max(16, int(nbytes))
        buf = self._bufs.get(key)
        if buf is None or buf.nbytes < nbytes:
            buf = cp.empty(nbytes, dtype=cp.uint8)
            self._bufs[key] = buf
            self.generation += 1
        itemsize = np.dtype(dtype).itemsize
        return buf[: nbytes - nbytes % itemsize].view(dtype)


WORKSPACE = _Workspace()


def _round_up(v: int, m: int) -> int:
    return -(-v // m) * m


# -- launch pieces ------------------------------------------------------------------------
def _util(name: str):
    return load(UtilSpec(), name)


def q8_1_blocks_padded(k: int) -> int:
    """Blocks per row of the q8_1 scales (xds): k/32 rounded up to 32, the tail zeroed."""
    return _round_up(k // 32, 32)


def _x_buffers(rows: int, k: int):
    nbp = q8_1_blocks_padded(k)
    xq = WORKSPACE.get("xq", rows * k, np.int8).reshape(rows, k)
    xds = WORKSPACE.get("xds", rows * nbp * 8, np.float32).reshape(rows, nbp, 2)
    return xq, xds, nbp


def _aligned(x2d):
    """The quantizers read x 16 bytes at a time."""
    return x2d if x2d.data.ptr % 16 == 0 else x2d.copy()


def _act_width(x2d, glu: bool) -> int:
    """k of the activations x2d holds: its width, or half of it for gate|up products (glu)."""
    width = x2d.shape[1]
    if glu and width % 2:
        raise ValueError(f"gate|up products must have an even width, got {width}")
    return width // 2 if glu else width


def quantize_activations(x2d, pdl: bool = False, release_first: bool = False, glu: bool = False):
    """float32 (rows, k) -> q8_1 (xq int8 (rows, k), xds float32 (rows, nbp, 2), nbp).
    pdl: launched with PDL (the kernel waits for x's writer on the device first), as the
    one-token products after it are: the chain of a decode step has no launch gaps.
    release_first: the product after it may launch before this kernel's wait, because it
    reads nothing before its own wait that a kernel in flight could still be writing
    (weights only, or expert ids settled earlier: see _mmvq).
    glu: x2d is (rows, 2k) gate|up products and what is quantized is silu(gate) * up."""
    rows, k = x2d.shape[0], _act_width(x2d, glu)
    xq, xds, nbp = _x_buffers(rows, k)
    _util("quantize_q8_1")((-(-rows * nbp // 64),), (_aligned(x2d), xq, xds, _i32(rows), _i32(k), _i32(nbp),
                                                      _i32(int(release_first)), _i32(int(glu))),
                           block=512, pdl=pdl)
    return xq, xds, nbp


def _prepare(ids, E: int, tile_x: int, x2d, pdl: bool = False, glu: bool = False):
    """Routing and q8_1 quantization of x in one launch (pdl: as the product after it is;
    the kernel waits for the writer of ids and x on the device first). glu: as in
    quantize_activations. x2d None: the routing alone (the f16 tiles convert x themselves),
    and (None, None, 0) for x."""
    N = ids.size
    max_tiles = N // tile_x + min(E, N)
    rows = WORKSPACE.get("rows", N * 4, np.int32)
    tiles = WORKSPACE.get("tiles", max_tiles * 16, np.int32)
    ntt = WORKSPACE.get("ntt", 4, np.int32)
    eoff = WORKSPACE.get("eoff", (E + 1) * 4, np.int32)
    if x2d is None:
        xq, xds, nbp, qblocks = None, None, 0, 0
        x_args = (_NULL, _NULL, _NULL, _i32(0), _i32(0), _i32(0), _i32(0))
    else:
        rows_x, k = x2d.shape[0], _act_width(x2d, glu)
        xq, xds, nbp = _x_buffers(rows_x, k)
        qblocks = -(-rows_x * nbp // 64)
        x_args = (_aligned(x2d), xq, xds, _i32(rows_x), _i32(k), _i32(nbp), _i32(int(glu)))
    _util("prepare_moe")((E + qblocks,), (ids, _i32(N), _i32(E), _i32(tile_x), rows, tiles, ntt, eoff, *x_args),
                         block=512, smem=(3 * E + 32) * 4, pdl=pdl)
    return (rows, tiles, ntt, eoff, max_tiles), (xq, xds, nbp)


# The lean form keeps a tile's x rows in registers; past this many a thread the extra
# registers cost more than the divisions they save (H100: q8_0 x128 y128 8 warps, 10 slots,
# 1050 -> 1092 us where the 5-slot tiles gained 9-22%).
LEAN_MAX_ROW_SLOTS = 8


def lean_form(spec: MmqSpec) -> MmqSpec:
    """How every MMQ tile is launched: its lean form (MmqSpec.lean) where the tile keeps at
    most LEAN_MAX_ROW_SLOTS x rows a thread. Bitwise the same output. H100, same call, hot
    (BENCHMARKS.md): q4_0 Qwen3 gate_up (1536x2048) n=512 234.6 -> 207.3 us, n=2048 682.5 ->
    605.3; dense 2048x4096 n=512 76.4 -> 67.3; q8_0 gate_up n=512 316.4 -> 263.1."""
    if spec.lean or spec.x_row_slots > LEAN_MAX_ROW_SLOTS:
        return spec
    return dataclasses.replace(spec, lean=True)


def _mmq(spec: MmqSpec, w: QuantTensor, w_row0: int, xq, xds, nbp: int, out_ptr: int, m: int,
         rows, tiles, ntt, max_tiles: int, n_dense: int, x_div: int, xq_ptr=None, xds_ptr=None):
    """One MMQ launch (and its stream-k fixup). Dense when rows/tiles are None. Direct
    routing (spec.direct): rows is ids, max_tiles the column slots, n_dense the entry count.
    The tile runs in its lean form (lean_form) unless MMQ_LEAN is off."""
    if MMQ_LEAN:
        spec = lean_form(spec)
    kern = load(spec)
    info = device_info(require_gpu().cuda.Device().id)
    n_mt = -(-m // spec.y)
    iters = -(-w.nb // spec.kblocks)
    if max_tiles * n_mt * iters >= 2**31:
        raise ValueError(f"product too large for one launch ({max_tiles * n_mt * iters} work units)")
    if spec.stream_k:
        grid = streamk.default_grid(info["sm_count"], max(1, kern.blocks_per_sm), max_tiles * n_mt * iters)
        streamk.check_split(iters)
        partials = WORKSPACE.get("partials", grid * 2 * spec.x * spec.y * 4, np.float32)
    else:
        grid, partials = max_tiles * n_mt, None
    args = (np.uint64(w.qs_ptr(w_row0)), np.uint64(w.meta_ptr(w_row0)),
            np.uint64(xq_ptr if xq_ptr is not None else xq.data.ptr),
            np.uint64(xds_ptr if xds_ptr is not None else xds.data.ptr),
            np.uint64(out_ptr), _ptr(rows), _ptr(tiles), _ptr(ntt),
            _ptr(partials), _i32(m), _i32(w.k), _i32(w.nb), _i32(w.meta_stride), _i32(nbp),
            _i32(x_div), _i32(n_dense), _i32(grid))
    kern((grid,), args)
    if spec.stream_k:
        _util("streamk_fixup")((grid,), (partials, np.uint64(out_ptr), _ptr(rows),
                                         _ptr(tiles), _ptr(ntt), _i32(n_dense),
                                         _i32(spec.x), _i32(spec.y), _i32(m), _i32(w.nb),
                                         _i32(spec.kblocks), _i32(grid)), block=256)


def _mmvq(spec: MmvqSpec, w: QuantTensor, x2d, ids, x_div: int, out, m: int,
          up: QuantTensor | None = None, up_off: int = 0, rows_e: int | None = None,
          bias_g=None, bias_u=None, bias_e: int = 0, entry_scale=None, x_q8=None,
          ids_settled: bool = False, combine=None, ids_guess=None):
    """Mat-vec launch after one preparing launch: with ids, routing into tiles of at most
    spec.tokens tokens plus q8_1 quantization of x (prepare_moe); dense, quantization only.
    x_q8 (xq, xds, nbp): x already quantized by an earlier kernel; only a prequant spec
    reads it (the others quantize x themselves). ids_settled: the kernel launched last
    waited for the writer of ids to end before it released its dependents (the model's
    expert gate/up after the router), so a prequant product may launch with its quantizer
    (as a guessing one always does: it checks its ids after its wait).
    combine (wts, xres), for a combine spec: xres[t] += sum_j wts[t, j] * out[t, j] instead
    of writing out. ids_guess (tests): what a guessing spec reads before its wait in place
    of the ids (a wrong guess must give the bits of a right one)."""
    if spec.combine != (combine is not None):
        raise ValueError(f"{spec.name}: a combine spec takes (wts, xres), and only it does")
    if spec.combine:
        top_k = ids.shape[1]
        if top_k > spec.warps:
            raise ValueError(f"{spec.name}: {top_k} slots per token, the block has {spec.warps} warps")
        if spec.ksplit and spec.warps % top_k:
            raise ValueError(f"{spec.name}: the block's {spec.warps} warps split k evenly over {top_k} slots "
                             f"only where {top_k} divides them")
    kern = load(spec)
    if spec.per_pair:
        # the kernel quantizes its x row itself, or reads the rows quantized before
        # (prequant); the "rows" argument carries the ids
        if spec.prequant:
            # released at once where the product reads nothing before its wait that a
            # kernel in flight may write, but weights and guessed ids (MmvqSpec.guess)
            early = spec.pdl and (ids is None or ids_settled or spec.guess)
            xq, xds, nbp = x_q8 if x_q8 is not None else quantize_activations(x2d, spec.pdl, early)
        else:
            xq, xds, nbp = _aligned(x2d), None, 0
        rows, tiles, ntt, n_dense = ids, None, None, 0
        max_tiles = ids.size if spec.ids else x2d.shape[0]
    elif spec.ids:
        (rows, tiles, ntt, _, max_tiles), (xq, xds, nbp) = _prepare(ids, w.n_experts, spec.tokens, x2d)
        n_dense = 0
    else:
        xq, xds, nbp = quantize_activations(x2d)
        rows = tiles = ntt = None
        n_dense = x2d.shape[0]
        max_tiles = -(-n_dense // spec.tokens)
    wu = up if up is not None else w
    grid = (-(-m // (spec.rows if spec.ksplit else spec.warps * spec.rows)), max_tiles)
    if spec.combine:
        grid = (-(-m // spec.rows), ids.shape[0])
    args = (np.uint64(w.qs_ptr()), np.uint64(w.meta_ptr()), np.uint64(wu.qs_ptr()), np.uint64(wu.meta_ptr()),
            _i32(rows_e if rows_e is not None else w.m), _i32(up_off),
            _ptr(bias_g), _ptr(bias_u), _i32(bias_e), _ptr(xq), _ptr(xds),
            _i32(w.k), _i32(w.nb), _i32(w.meta_stride), _i32(nbp), _i32(x_div),
            _ptr(rows), _ptr(tiles), _ptr(ntt), _i32(n_dense), _ptr(entry_scale), out, _i32(m))
    if spec.guess:
        args += (_i32(w.n_experts), _ptr(ids_guess if ids_guess is not None else ids))
    if spec.combine:
        args += (_i32(top_k), _ptr(combine[0]), _ptr(combine[1]))
    kern(grid, args, smem=spec.smem_bytes(w.k))


# -- the products -------------------------------------------------------------------------
MMQ_LAUNCH_FORMS = True     # tests compare against the plain launches
MMQ_LEAN = True             # tests compare the lean form against the plain one


# Direct routing pays off while experts get at most this many tokens each on average
# (below, the routing launch it saves and the weights it requests before the wait for x
# outweigh a block per expert, used or not).
DIRECT_MAX_TOKENS_PER_EXPERT = 2


def mmq_launch_form(spec: MmqSpec, entries: int, experts: int, pdl: bool) -> MmqSpec:
    """How a MUL_MAT_ID tile chosen by a profile or the defaults is launched here, for
    `entries` (token, expert) pairs over `experts` experts. Where each expert's rows are read
    by one column of tiles (on average at most x tokens each), the product streams its
    weights once and launch gaps are a good part of its time: the weight copies then carry
    an L2 evict-first policy, and the routing launch and the product are chained with PDL
    where the card has it (each waits on the device for the kernel before). Same tile, same
    arithmetic, same bits. H100, same call (BENCHMARKS.md), hot: q4_0 Qwen3 shape n=16
    37.8 -> 36.0 us, 256: 93.3 -> 89.9, 512: 128.2 -> 125.0; q8_0 n=16 62.4 -> 58.8. Where
    tiles re-read weights (n >= 1024 there) PDL alone cost 2-3% (n=2048, 4096), so those
    launch as tuned. The tuner times its candidates through this too.

    With PDL and at most DIRECT_MAX_TOKENS_PER_EXPERT tokens per expert, the tile also routes
    itself (MmqSpec.direct): no routing launch, weights requested before the wait. H100,
    same call, hot, random / skewed routing: q4_0 n=16 36.2 -> 34.3 / 29.3 -> 30.0, n=32
    47.2 -> 45.4 / 42.9 -> 41.8; at n=64 and past it, it lost (skewed routing)."""
    tokens_per_expert = entries / experts
    if not MMQ_LAUNCH_FORMS or not spec.ids or tokens_per_expert > spec.x:
        return spec
    direct = (pdl and not spec.stream_k and tokens_per_expert <= DIRECT_MAX_TOKENS_PER_EXPERT
              and 4 * experts <= spec.smem_bytes())  # the extra-column search counts in shared memory
    return dataclasses.replace(spec, evict_first=True, pdl=spec.pdl or pdl, direct=spec.direct or direct)


def run_mul_mat_id_combine(w: QuantTensor, x, ids, wts, xres, ids_settled: bool = False) -> None:
    """xres (n, m) += sum_j wts[:, j] * (W[ids[:, j]] @ x[:, j]) in one mat-vec launch (after
    x's quantizer): the model's down product and the weighted sum of its experts' outputs at
    decode, with moe_combine_rms_norm's arithmetic (n <= 8, top_k <= 8). No validation."""
    E, m, k = w.shape
    spec = dispatch.default_combine(w.qtype, k, ids.shape[1])
    _mmvq(spec, w, x.reshape(-1, k), ids, 1, xres, m, ids_settled=ids_settled, combine=(wts, xres))


GLU_PATHS = ("mmq_id", "per_expert", "mmf_id")   # the paths that prepare x in a launch of their own


def run_mul_mat_id(w: QuantTensor, x, ids, out, choice: dispatch.Choice, weights=None,
                   ids_settled: bool = False, glu: bool = False) -> None:
    """No validation: callers (mul_mat_id, the model runtime, the tuner) have done it.
    weights (n, top_k) float32, optional: each entry's row is multiplied by its weight.
    ids_settled: see _mmvq. glu (the paths in GLU_PATHS): x holds gate|up products, 2k
    wide, and the product reads silu(gate) * up, applied as x is quantized."""
    E, m, k = w.shape
    n, top_k = ids.shape
    x_div = top_k if x.ndim == 2 else 1
    x2d = x.reshape(-1, 2 * k if glu else k)
    spec = choice.spec
    if glu and choice.path not in GLU_PATHS:
        raise ValueError(f"the {choice.path} path does not take gate|up products")
    if choice.path == "mmvq":
        _mmvq(spec, w, x2d, ids, x_div, out, m, entry_scale=weights, ids_settled=ids_settled)
        return
    elif choice.path == "mmq_id":
        spec = mmq_launch_form(spec, n * top_k, E, pdl_available(device_info(w.buffer.device.id)["cc"]))
        if spec.direct:
            # one block per (expert, row tile) reads ids itself: only x is prepared
            xq, xds, nbp = quantize_activations(x2d, spec.pdl, glu=glu)
            slots = (ids.size - 1) // spec.x + E  # experts' extra columns, then every expert's first
            _mmq(spec, w, 0, xq, xds, nbp, out.data.ptr, m, ids, None, None, slots, ids.size, x_div)
        else:
            (rows, tiles, ntt, _, max_tiles), (xq, xds, nbp) = _prepare(ids, E, spec.x, x2d, spec.pdl, glu)
            _mmq(spec, w, 0, xq, xds, nbp, out.data.ptr, m, rows, tiles, ntt, max_tiles, 0, x_div)
    elif choice.path == "per_expert":
        _per_expert(spec, w, x2d, ids, x_div, out, glu)
    elif choice.path == "mmf_id":
        from .mmf import run_mmf
        run_mmf(spec, w, x2d, ids, x_div, out, glu)
    else:
        raise ValueError(f"unknown path {choice.path!r}")
    if weights is not None:
        out *= weights[:, :, None]


def _per_expert(spec: MmqSpec, w: QuantTensor, x2d, ids, x_div: int, out, glu: bool = False) -> None:
    E, m, k = w.shape
    N = ids.size
    (rows, _, _, eoff, _), (xq, xds, nbp) = _prepare(ids, E, spec.x, x2d, glu=glu)
    xq_s = WORKSPACE.get("xq_sorted", N * k, np.int8)
    xds_s = WORKSPACE.get("xds_sorted", N * nbp * 8, np.float32)
    out_s = WORKSPACE.get("out_sorted", N * m * 4, np.float32)
    _util("gather_rows_q8_1")((N,), (xq, xds, rows, _i32(x_div), _i32(N), _i32(k), _i32(nbp), xq_s, xds_s),
                              block=256)
    offsets = eoff.get()  # the one host synchronization of this path
    for e in range(E):
        lo, hi = int(offsets[e]), int(offsets[e + 1])
        if hi == lo:
            continue
        _mmq(spec, w, e * m, None, None, nbp, out_s.data.ptr + lo * m * 4, m, None, None, None,
             -(-(hi - lo) // spec.x), hi - lo, 1,
             xq_ptr=xq_s.data.ptr + lo * k, xds_ptr=xds_s.data.ptr + lo * nbp * 8)
    _util("scatter_rows")((N,), (out_s, rows, _i32(N), _i32(m), out), block=256)


def mul_mat_id(w: QuantTensor, x, ids, *, weights=None, out=None, choice: dispatch.Choice | None = None):
    """ggml's MUL_MAT_ID. w: QuantTensor (E, m, k); x: float32 (n, k) or (n, top_k, k);
    ids: int32 (n, top_k) in [0, E). Returns float32 (n, top_k, m). weights (n, top_k),
    optional: the router's weights, applied to each entry's row (the down projection)."""
    cp = require_gpu("mul_mat_id")
    _check_weights(w, 3)
    E, m, k = w.shape
    dev = w.buffer.device.id
    x = _device_array(x, "x", np.float32, (2, 3), dev)
    ids = _device_array(ids, "ids", np.int32, (2,), dev)
    n, top_k = ids.shape
    if x.shape[0] != n:
        raise ValueError(f"x has {x.shape[0]} tokens but ids has {n}")
    if x.shape[-1] != k:
        raise ValueError(f"x has k={x.shape[-1]}, w has k={k}")
    if x.ndim == 3 and x.shape[1] != top_k:
        raise ValueError(f"x is (n, {x.shape[1]}, k) but ids chooses top_k={top_k} experts")
    if weights is not None:
        weights = _device_array(weights, "weights", np.float32, (2,), dev)
        if weights.shape != ids.shape:
            raise ValueError(f"weights has shape {weights.shape}, ids {ids.shape}")
    shape = (n, top_k, m)
    out = _check_out(out, shape, dev) if out is not None else cp.empty(shape, dtype=cp.float32)
    if n == 0 or top_k == 0:
        return out
    lo, hi = (int(v) for v in cp.stack([ids.min(), ids.max()]).get())
    if lo < 0 or hi >= E:
        raise ValueError(f"ids holds values in [{lo}, {hi}], outside [0, {E}) for w with {E} experts")
    choice = choice or dispatch.choose_mul_mat_id(w.qtype, E, top_k, m, k, n, w.f16_fits)
    run_mul_mat_id(w, x, ids, out, choice, weights=weights)
    return out


def run_mul_mat(w: QuantTensor, x, out, choice: dispatch.Choice, x_q8=None) -> None:
    """x_q8: see _mmvq. With PDL the weights are requested before the wait for the kernel
    before, so they must not be written by a kernel in flight (model weights never are)."""
    m, k = w.shape
    n = x.shape[0]
    if choice.path == "mmvq":
        _mmvq(choice.spec, w, x, None, 1, out, m, x_q8=x_q8)
    elif choice.path == "mmq":
        xq, xds, nbp = quantize_activations(x)
        _mmq(choice.spec, w, 0, xq, xds, nbp, out.data.ptr, m, None, None, None,
             -(-n // choice.spec.x), n, 1)
    elif choice.path == "mmf":
        from .mmf import run_mmf
        run_mmf(choice.spec, w, x, None, 1, out)
    else:
        raise ValueError(f"unknown path {choice.path!r} for mul_mat")


def mul_mat(w: QuantTensor, x, *, out=None, choice: dispatch.Choice | None = None):
    """Dense quantized product: w (m, k), x float32 (n, k) -> (n, m)."""
    cp = require_gpu("mul_mat")
    _check_weights(w, 2)
    m, k = w.shape
    dev = w.buffer.device.id
    x = _device_array(x, "x", np.float32, (2,), dev)
    if x.shape[1] != k:
        raise ValueError(f"x has k={x.shape[1]}, w has k={k}")
    n = x.shape[0]
    out = _check_out(out, (n, m), dev) if out is not None else cp.empty((n, m), dtype=cp.float32)
    if n == 0:
        return out
    run_mul_mat(w, x, out, choice or dispatch.choose_mul_mat(w.qtype, m, k, n, w.f16_fits))
    return out
