"""The stream-k split, checked for every SM count the tuner may meet (1..264) and every
occupancy it may choose: each (tile, k-chunk) is computed exactly once; a split tile is
summed by exactly one fixup, from the right partial slots, in block order."""
import pytest

from moeforge.runtime import streamk

WORK = [(1, 1), (1, 8), (3, 7), (17, 3), (50, 8), (264, 2), (492, 8)]


def _check(tiles, iters, grid):
    pieces = streamk.pieces(tiles, iters, grid)
    seen = {}
    for p in pieces:
        for k in range(p.k_begin, p.k_end):
            assert (p.tile, k) not in seen, "a unit computed twice"
            seen[(p.tile, k)] = p.block
    assert len(seen) == tiles * iters, "a unit never computed"
    slots = {}
    for p in pieces:
        if not p.whole:
            assert (p.block, p.slot) not in slots, "two partials in one slot"
            slots[(p.block, p.slot)] = p
    fix = streamk.fixups(tiles, iters, grid)
    for p in pieces:
        assert (p.tile in fix) == (not p.whole)
    for tile, parts in fix.items():
        blocks = [b for b, _ in parts]
        assert blocks == sorted(blocks) and len(set(blocks)) == len(blocks), "fixed order"
        covered = []
        for b, s in parts:
            piece = slots[(b, s)]
            assert piece.tile == tile, "partial of another tile"
            covered += range(piece.k_begin, piece.k_end)
        assert sorted(covered) == list(range(iters))


@pytest.mark.parametrize("blocks_per_sm", [1, 2, 3, 4])
def test_every_sm_count(blocks_per_sm):
    for sms in range(1, 265):
        grid = streamk.default_grid(sms, blocks_per_sm)
        for tiles, iters in WORK:
            _check(tiles, iters, grid)


def test_block_of_unit_inverts_block_begin():
    for units in (1, 7, 100, 3937):
        for grid in (1, 2, 5, 132, 528):
            for u in range(0, units, max(1, units // 50)):
                b = streamk.block_of_unit(u, units, grid)
                assert streamk.block_begin(b, units, grid) <= u < streamk.block_begin(b + 1, units, grid)


def test_sums_are_right_and_order_is_fixed():
    """Simulate the kernels with exact integers: direct tiles plus fixed-up tiles equal
    the plain sum, for odd grids."""
    tiles, iters = 23, 5
    value = {(t, k): (t * 131 + k * 17) % 97 for t in range(tiles) for k in range(iters)}
    for grid in (3, 7, 19, 64, 200):
        out, partial = {}, {}
        for p in streamk.pieces(tiles, iters, grid):
            s = sum(value[(p.tile, k)] for k in range(p.k_begin, p.k_end))
            if p.whole:
                out[p.tile] = s
            else:
                partial[(p.block, p.slot)] = s
        for tile, parts in streamk.fixups(tiles, iters, grid).items():
            out[tile] = sum(partial[bs] for bs in parts)
        assert out == {t: sum(value[(t, k)] for k in range(iters)) for t in range(tiles)}


@pytest.mark.parametrize("tiles,iters", WORK)
def test_fixup_parts_bound(tiles, iters):
    """The fixup kernel keeps one offset per block with units that meets a tile, at most
    MAX_PARTS: at most `iters` such blocks meet a tile for any grid, also one with more
    blocks than units (the kernel's unit count can be below the launcher's plan when the
    routing fills fewer tiles than it allowed for)."""
    units = tiles * iters
    for grid in list(range(1, units + 1)) + [2 * units + 1, 5 * units + 3]:
        parts = streamk.fixups(tiles, iters, grid)
        assert all(len(p) <= iters for p in parts.values())
    streamk.check_split(streamk.MAX_PARTS)
    with pytest.raises(ValueError, match="more than"):
        streamk.check_split(streamk.MAX_PARTS + 1)
