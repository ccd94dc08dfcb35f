"""The stream-k work split, in Python: the same integer arithmetic as the CUDA kernels
(templates/common.cuh.j2 sk_begin, mmq.cu.j2, util.cu.j2 streamk_fixup), so the CPU tests
can check the property that the GPU relies on for every grid size.

Work is `tiles * iters` units (a unit: one tile, one k-chunk). Block b of `grid` owns the
units [b*U//grid, (b+1)*U//grid). A tile inside one block's range is written directly;
a tile split over blocks leaves one partial per block (slot 0 for the block's first tile,
1 for its last), and the fixup owned by the first block boundary inside the tile adds
them in block order.
"""
from __future__ import annotations

from dataclasses import dataclass

# Partials the fixup kernel can add for one tile (util.cu.j2 SK_MAX_PARTS): only blocks that
# hold units have partials, and at most `iters` of them meet a tile, whatever the grid.
MAX_PARTS = 1024


def block_begin(b: int, units: int, grid: int) -> int:
    return b * units // grid


def block_of_unit(u: int, units: int, grid: int) -> int:
    """The block whose range holds unit u (the largest b with block_begin(b) <= u)."""
    return ((u + 1) * grid - 1) // units


@dataclass(frozen=True)
class Piece:
    block: int
    tile: int
    k_begin: int
    k_end: int
    whole: bool
    slot: int


def pieces(tiles: int, iters: int, grid: int) -> list[Piece]:
    """What each block computes, in the order the mmq kernel does it."""
    units = tiles * iters
    out = []
    for b in range(grid):
        u0, u1 = block_begin(b, units, grid), block_begin(b + 1, units, grid)
        first_tile = u0 // iters if u0 < u1 else -1
        u = u0
        while u < u1:
            tile = u // iters
            end = min(u1, (tile + 1) * iters)
            whole = tile * iters >= u0 and (tile + 1) * iters <= u1
            out.append(Piece(b, tile, u - tile * iters, end - tile * iters, whole,
                             0 if tile == first_tile else 1))
            u = end
    return out


def fixups(tiles: int, iters: int, grid: int) -> dict[int, list[tuple[int, int]]]:
    """tile -> the (block, slot) partials the fixup kernel adds, in its order."""
    units = tiles * iters
    out: dict[int, list[tuple[int, int]]] = {}
    for b in range(1, grid):
        u = block_begin(b, units, grid)
        if u >= units or u % iters == 0:
            continue
        tile, t0 = u // iters, (u // iters) * iters
        if block_begin(b - 1, units, grid) > t0:
            continue  # an earlier boundary inside this tile owns it
        if tile in out:
            raise AssertionError(f"tile {tile} has two fixup owners")
        b_lo = block_of_unit(t0, units, grid)
        b_hi = block_of_unit(t0 + iters - 1, units, grid)
        parts = []
        for bb in range(b_lo, b_hi + 1):
            ub0, ub1 = block_begin(bb, units, grid), block_begin(bb + 1, units, grid)
            if ub0 == ub1:
                continue
            parts.append((bb, 0 if ub0 // iters == tile else 1))
        out[tile] = parts
    return out


def check_split(iters: int) -> None:
    """The launcher's guard: the fixup holds at most MAX_PARTS partial offsets a tile."""
    if iters > MAX_PARTS:
        raise ValueError(f"a tile of {iters} k-chunks may be split over more than {MAX_PARTS} blocks")


def default_grid(sm_count: int, blocks_per_sm: int, units: int | None = None) -> int:
    """A persistent grid: every SM busy; never more blocks than units when that is known."""
    g = max(1, sm_count * blocks_per_sm)
    return min(g, units) if units else g
