"""The GGUF block formats moeforge knows: one QuantType value per format.

A GGUF block is a run of bytes holding the quants of `block_values` weights and their
scales. On the GPU we keep the very same bytes, split per block into two regions: the
quant bytes (`qs`, a contiguous range of the block) and everything else (`meta`: scales,
minimums, high bits that sit outside that range). The split makes every quant row 16-byte
aligned, whatever the block size, so kernels load with 16-byte copies; nothing is
requantized and `to_blocks` gives back the GGUF bytes exactly.
"""
from __future__ import annotations

from dataclasses import dataclass

import gguf


@dataclass(frozen=True)
class QuantType:
    name: str            # the GGUF/ggml name, lower case: "q4_0"
    ggml_type: gguf.GGMLQuantizationType
    block_values: int    # weights per block
    block_bytes: int     # bytes per GGUF block
    qs_offset: int       # where the quant bytes start inside the block
    qs_bytes: int        # how many quant bytes (a multiple of 16)
    # The activation quantization the kernels pair with this format; only q8_1 so far.
    act_type: str = "q8_1"

    @property
    def meta_bytes(self) -> int:
        return self.block_bytes - self.qs_bytes

    @property
    def template(self) -> str:
        """The traits template that teaches the kernels this format."""
        return f"quant_{self.name}.cuh.j2"

    @property
    def pad_blocks(self) -> int:
        """Meta rows are padded to a multiple of this many blocks (1024 weights), with
        zeros, so that a k-chunk may run past the end of a row and read zero scales."""
        return max(1, 1024 // self.block_values)

    def blocks_per_row(self, k: int) -> int:
        if k % self.block_values:
            raise ValueError(f"k={k} is not a multiple of the {self.name} block size {self.block_values}")
        return k // self.block_values

    def meta_stride(self, k: int) -> int:
        """Bytes per row of the meta region: padded blocks, rounded to 16 bytes."""
        nb = self.blocks_per_row(k)
        padded = -(-nb // self.pad_blocks) * self.pad_blocks
        return -(-(padded * self.meta_bytes) // 16) * 16

    def row_bytes(self, k: int) -> int:
        return self.blocks_per_row(k) * self.block_bytes


QUANT_TYPES: dict[str, QuantType] = {
    q.name: q
    for q in (
        # d (f16) then 16 bytes of nibbles: low nibbles are values 0..15, high 16..31
        QuantType("q4_0", gguf.GGMLQuantizationType.Q4_0, 32, 18, 2, 16),
        # d (f16) then 32 signed bytes
        QuantType("q8_0", gguf.GGMLQuantizationType.Q8_0, 32, 34, 2, 32),
    )
}


def quant_type(name: str) -> QuantType:
    try:
        return QUANT_TYPES[name.lower()]
    except KeyError:
        known = ", ".join(QUANT_TYPES)
        raise ValueError(f"unknown quant type {name!r}; moeforge knows {known}") from None


def parse_types(text: str | None) -> list[QuantType]:
    """'q4_0,q8_0' -> [QuantType, ...]; None or 'all' -> every known type."""
    if not text or text == "all":
        return list(QUANT_TYPES.values())
    return [quant_type(t.strip()) for t in text.split(",") if t.strip()]
