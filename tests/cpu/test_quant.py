import gguf
import numpy as np
import pytest

from moeforge import reference as ref
from moeforge.codegen.quant import QUANT_TYPES, parse_types, quant_type
from moeforge.runtime.tensor import join_blocks, split_blocks


@pytest.mark.parametrize("name", list(QUANT_TYPES))
def test_table_agrees_with_gguf(name):
    q = quant_type(name)
    block_values, block_bytes = gguf.GGML_QUANT_SIZES[q.ggml_type]
    assert (q.block_values, q.block_bytes) == (block_values, block_bytes)
    assert q.qs_bytes % 16 == 0 and 0 <= q.qs_offset and q.qs_offset + q.qs_bytes <= q.block_bytes


@pytest.mark.parametrize("name", list(QUANT_TYPES))
@pytest.mark.parametrize("k", [32, 96, 1024, 2880])
def test_split_layout_round_trips_and_aligns(rng, name, k):
    q = quant_type(name)
    rows = 7
    raw = ref.random_blocks(name, rows, k, rng)
    qs, meta = split_blocks(raw, q, rows, k)
    assert qs.shape[1] % 16 == 0 and meta.shape[1] % 16 == 0
    assert np.array_equal(join_blocks(qs, meta, q, rows, k), raw)
    nb = k // 32
    # padding of the meta rows is zero: a k-chunk past the row end reads zero scales
    assert not meta[:, nb * q.meta_bytes:].any()
    assert meta.shape[1] >= -(-nb // q.pad_blocks) * q.pad_blocks * q.meta_bytes


def test_bad_k_and_unknown_type_are_named():
    with pytest.raises(ValueError, match="k=100"):
        quant_type("q4_0").blocks_per_row(100)
    with pytest.raises(ValueError, match="q3_x"):
        quant_type("q3_x")
    assert [q.name for q in parse_types("q8_0, q4_0")] == ["q8_0", "q4_0"]
    assert len(parse_types(None)) == len(QUANT_TYPES)
