"""The launches of the f16 tensor-core path (MmfSpec): x converted to f16 once, then one
launch of whole tiles (dense, or MUL_MAT_ID tiles from the routing launch). Graph-capturable:
nothing synchronizes with the host."""
from __future__ import annotations

import numpy as np

from ..codegen.spec import MmfSpec
from .kernels import grid_1d, load
from .ops import WORKSPACE, _act_width, _aligned, _i32, _prepare, _ptr, _round_up
from .tensor import QuantTensor


def x_f16_buffer(spec: MmfSpec, rows: int, k: int, name: str = "x_f16"):
    """The f16 activations' buffer, (rows, kp): k padded to whole groups of X_PAD_BLOCKS
    blocks, in the kernel's k order (mmf_x_to_f16 fills it, or a kernel that writes that
    order itself: glu_oai_id_f16, a glu tile into its own workspace `name`)."""
    kp = _round_up(k // 32, MmfSpec.X_PAD_BLOCKS) * 32
    if spec.wgmma and rows * kp * 2 >= 1 << 32:
        raise ValueError(f"{spec.name}: {rows} x {kp} f16 activations pass 4 GiB; its row offsets are 32-bit")
    return WORKSPACE.get(name, rows * kp * 2, np.uint16).reshape(rows, kp), kp


def x_to_f16(spec: MmfSpec, x2d, glu: bool = False):
    """float32 (rows, k) -> f16 (rows, kp) in the kernel's k order, zero past k. glu: x2d
    holds (rows, 2k) gate|up products and what is converted is silu(gate) * up."""
    rows, k = x2d.shape[0], _act_width(x2d, glu)
    xh, kp = x_f16_buffer(spec, rows, k)
    load(spec, "mmf_x_to_f16")(grid_1d(rows * kp // 4), (_aligned(x2d), xh, _i32(rows), _i32(k), _i32(kp),
                                                      _i32(int(glu))), block=256, smem=0)
    return xh, kp


def run_mmf(spec: MmfSpec, w: QuantTensor, x2d, ids, x_div: int, out, glu: bool = False) -> None:
    """out[entry] = W[expert] @ x[entry / x_div] for every (token, slot) entry of ids, or
    with ids None the dense out = x @ W^T (w 2-D). Validated operands only."""
    check_f16(spec, w, ids)
    xh, kp = x_to_f16(spec, x2d, glu)
    run_mmf_f16(spec, w, xh, kp, ids, x_div, out)


def check_f16(spec: MmfSpec, w: QuantTensor, ids) -> None:
    """What the f16 tiles refuse, asked before anything is launched for them."""
    if spec.ids != (ids is not None):
        raise ValueError(f"{spec.name}: {'needs' if spec.ids else 'takes no'} expert ids")
    if not w.f16_fits:
        lo, hi = w.quant.f16_scale_bytes
        raise ValueError(f"{spec.name}: the {w.qtype} weights' largest scale byte lies outside [{lo}, {hi}], "
                         f"past what f16 holds: run them on the int8 tiles (dispatch does, given f16_fits)")


def run_mmf_glu(spec: MmfSpec, w: QuantTensor, x2d, ids, x_div: int, gate_b=None, up_b=None):
    """The expert gate|up product on a glu tile (spec.glu: its activation): act(gate) * up
    of every (token, slot) entry of ids (x2d's row entry / x_div), with the experts' biases
    (E, ff) where given, written as the f16 x of a down product on wgmma tiles; returns that
    x, (ids.size, kp), and kp. w: the merged gate|up experts, gate rows first. No float32
    product reaches memory; the bits are those of run_mmf on the plain tile, then
    mmf_x_to_f16 (SiLU) or glu_oai_id_f16 (SwiGLU-OAI) of its output."""
    if not spec.glu:
        raise ValueError(f"{spec.name}: not a glu tile")
    check_f16(spec, w, ids)
    E, m, _ = w.shape
    if m % 64:
        raise ValueError(f"{spec.name}: {m} gate|up rows are not two halves of whole 32-value blocks")
    if (gate_b is None) != (up_b is None) or (gate_b is not None and spec.glu == "silu"):
        raise ValueError(f"{spec.name}: biases are for swiglu_oai, gate and up both")
    for b in (gate_b, up_b):
        if b is not None and (b.shape != (E, m // 2) or b.dtype != np.float32 or not b.flags.c_contiguous):
            raise ValueError(f"{spec.name}: biases must be contiguous float32 {(E, m // 2)}, not {b.dtype} {b.shape}")
    xh, kp = x_to_f16(spec, x2d)
    xo, okp = x_f16_buffer(spec, ids.size, m // 2, "x_f16_act")
    grid, args = _tile_launch(spec, w, xh, kp, ids, x_div, xo)
    load(spec)((grid,), args + (_i32(okp), _ptr(gate_b), _ptr(up_b)))
    return xo, okp


def _tile_launch(spec: MmfSpec, w: QuantTensor, xh, kp: int, ids, x_div: int, out):
    """The grid of an f16 tile kernel and the arguments every form takes first: the
    routing's tile table for expert products (ids), none for dense ones. A glu tile's row
    tiles hold y/2 columns of gate and as many of up."""
    m = w.shape[-2]
    if ids is not None:
        (rows, tiles, ntt, _, max_tiles), _ = _prepare(ids, w.n_experts, spec.x, None)
        n_dense = 0
    else:
        rows = tiles = ntt = None
        n_dense = xh.shape[0]
        max_tiles = -(-n_dense // spec.x)
    row_tiles = -(-(m // 2) // (spec.y // 2)) if spec.glu else -(-m // spec.y)
    args = (np.uint64(w.qs_ptr()), np.uint64(w.meta_ptr()), xh, out, _ptr(rows), _ptr(tiles), _ptr(ntt), _i32(m),
            _i32(w.nb), _i32(w.meta_stride), _i32(kp), _i32(x_div), _i32(n_dense))
    return max_tiles * row_tiles * spec.splits, args


def run_mmf_f16(spec: MmfSpec, w: QuantTensor, xh, kp: int, ids, x_div: int, out) -> None:
    """run_mmf on activations already in x_f16_buffer's form, its operands checked
    (check_f16) before they were written."""
    grid, args = _tile_launch(spec, w, xh, kp, ids, x_div, out)
    if spec.splits == 1:
        load(spec)((grid,), args)
        return
    # every output is written by one tile in each split: splits partial copies, summed in order
    part = WORKSPACE.get("mmf_split", spec.splits * out.size * 4, np.float32)
    load(spec)((grid,), args[:3] + (part,) + args[4:] + (np.int64(out.size),))
    load(spec, "mmf_split_sum")(grid_1d(out.size), (part, out, np.int64(out.size)), block=256, smem=0)
