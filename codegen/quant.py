"""The GGUF block formats moeforge knows: one QuantType value per format.

A GGUF block is a run of bytes holding the quants of `block_values` weights and their
scales. On the GPU we keep the very same bytes, split per block into two regions: the
quant bytes (`qs`, a contiguous range of the block) and everything else (`meta`: scales,
minimums, high bits that sit outside that range). The split makes every quant row 16-byte
aligned, whatever the block size, so kernels load with 16-byte copies; nothing is
requantized and `to_blocks` gives back the GGUF bytes exactly.

The kernels work in units of 32 weights (one q8_1 activation block, one k32 mma): a
"kernel block". For the 32-weight formats that is the GGUF block; a K-quant super-block of
256 weights is eight of them, and `qs_bytes` and `meta_bytes` are per kernel block (the
super-block's 16 scale bytes count as 2 a kernel block). K-quants pair two sub-blocks in
one byte (the low nibbles one, the high ones the next); the split moves each sub-block's
nibbles into q4_0's order (byte j: value j low, value j+16 high), so the kernels load a
q4_K sub-block exactly as a q4_0 block; `to_blocks` undoes it.
"""
from __future__ import annotations

from dataclasses import dataclass

import gguf

KERNEL_BLOCK = 32   # weights per q8_1 activation block, the unit every kernel steps in
# ggml's kvalues_iq4nl: the 16 int8 values a 4-bit index of iq4_nl and iq4_xs stands for
IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
# ggml's kvalues_mxfp4: the e2m1 values of MXFP4, doubled to integers (its scale is halved)
MXFP4_VALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)


def _sign(v: int) -> int:
    return -1 if v < 0 else 0


def _words(levels) -> tuple[int, ...]:
    """int8 levels as little-endian 32-bit words, four a word: a byte permute's table."""
    b = [v & 0xFF for v in levels]
    return tuple(b[i] | b[i + 1] << 8 | b[i + 2] << 16 | b[i + 3] << 24 for i in range(0, len(b), 4))


@dataclass(frozen=True)
class QuantType:
    name: str            # ggml's name: "q4_0", "q4_K"
    ggml_type: gguf.GGMLQuantizationType
    block_values: int    # weights per GGUF block
    block_bytes: int     # bytes per GGUF block
    qs_offset: int       # where the quant bytes start inside the GGUF block
    qs_bytes: int        # quant bytes per kernel block of 32 weights (a multiple of 16)
    # K-quant nibble order: the GGUF block's quant bytes hold sub-blocks 2i and 2i+1 in the
    # low and high nibbles of the same 32 bytes (the split reorders them, module doc).
    paired_nibbles: bool = False
    # The activation quantization the kernels pair with this format; only q8_1 so far.
    act_type: str = "q8_1"
    # Bits of each weight above the four in qs, kept in the meta region (q5_K: 1, q6_K: 2).
    high_bits: int = 0
    # Meta bytes per kernel block where the split gives each kernel block meta of its own
    # (q6_K: its high bits, two scales and a copy of d); 0: the GGUF block's bytes outside
    # qs, shared by its kernel blocks (a super-block's, `super_meta`).
    own_meta_bytes: int = 0
    # A kernel block's scales ride in its own qs bytes (q3_K: 2-bit parts, high bits, two
    # scales and d in 16 bytes, 4 bits a weight): no meta region at all.
    inline_meta: bool = False
    # Each 16 weights have a min as well as a scale (q2_K: w = d * sc * q - dmin * m): the
    # kernels take a second integer dot, of the mins against the activations' 16-sums.
    half_mins: bool = False
    # Formats whose 4-bit codes stand for levels: the int8 level of each code (iq4_xs's
    # lattice, mxfp4's doubled e2m1 values); empty where the quant is the value itself
    # (offset by the format's own rule).
    codebook: tuple[int, ...] = ()
    # Formats whose scale is a power of two beyond f16's range (mxfp4's e8m0 byte): the
    # f16 tiles hold 2^(e - 128) * level as f16, usable while a tensor's largest scale byte
    # lies in this range (QuantTensor.f16_fits); None where the scale is an f16.
    f16_scale_bytes: tuple[int, int] | None = None
    # Where a GGUF block holds its f16 scales, each with the largest integer it multiplies in
    # a weight (q6_K: d times an int8 scale times q - 32, |.| <= 128 * 32): the f16 tiles hold
    # a tensor while the sum of its largest |scale| times those stays within f16
    # (QuantTensor.f16_fits), where the int8 tiles' float32 scales always would.
    f16_scales: tuple[tuple[int, int], ...] = ()

    @property
    def sub_blocks(self) -> int:
        """Kernel blocks (32 weights) per GGUF block."""
        return self.block_values // KERNEL_BLOCK

    @property
    def meta_bytes(self) -> int:
        """Scale bytes per kernel block (a K-quant super-block's are shared by its eight)."""
        if self.inline_meta:
            return 0
        if self.own_meta_bytes:
            return self.own_meta_bytes
        return (self.block_bytes - self.qs_bytes * self.sub_blocks) // self.sub_blocks

    @property
    def super_meta(self) -> bool:
        """A kernel block's scales are found in its super-block's shared bytes (q4_K), so
        that stages hold whole super-blocks; otherwise each block's meta is its own."""
        return self.sub_blocks > 1 and not self.own_meta_bytes and not self.inline_meta

    @property
    def two_scales(self) -> bool:
        """Each kernel block has two int8 scales, one a 16 weights, folded into its integer
        dot as two k16 products (q6_K, q3_K); the float multiplier is d alone."""
        return bool(self.own_meta_bytes) or (self.inline_meta and not self.half_mins)

    def codebook_words(self, bias: int = 0) -> tuple[int, ...]:
        """The codebook as four little-endian words of bytes level + bias (mod 256): the
        table the f16 tiles look a code's level up in (mmf.cu.j2, with bias 128)."""
        return _words(v + bias for v in self.codebook)

    def codebook_halves(self) -> tuple[int, int, int, int]:
        """The two tables the mat-vec and the int8 tiles look an index up in
        (quant_codebook.cuh.j2), as words: L (two words, entries 0..7) read with the index,
        U (entries 8..15) with its bit 3 flipped. A byte permute whose selector has that bit
        set reads no entry but repeats the sign of the one it points at, so an index i gets
        L[i] + sign(U[i]) below 8 and sign(L[i - 8]) + U[i - 8] from 8: both must be V[i]. Per
        pair j the signs are chosen so that they are the signs of the entries they make."""
        v = self.codebook
        lo, hi = [], []
        for j in range(8):
            for s_lo, s_hi in ((0, 0), (0, -1), (-1, 0), (-1, -1)):
                a, b = v[j] - s_hi, v[8 + j] - s_lo
                if _sign(a) == s_lo and _sign(b) == s_hi and -128 <= a <= 127 and -128 <= b <= 127:
                    lo.append(a)
                    hi.append(b)
                    break
            else:
                raise ValueError(f"{self.name}: levels {v[j]} and {v[8 + j]} cannot be split by sign")
        return _words(lo + hi)

    @property
    def template(self) -> str:
        """The traits template that teaches the kernels this format."""
        return f"quant_{self.name}.cuh.j2"

    @property
    def pad_blocks(self) -> int:
        """Meta rows are padded to a multiple of this many kernel blocks (1024 weights),
        with zeros, so that a k-chunk may run past the end of a row and read zero scales."""
        return 1024 // KERNEL_BLOCK

    def whole_kblocks(self, kblocks: int) -> int:
        """kblocks raised to whole super-blocks: the stage depth of a tile that asked for
        kblocks (a stage's scales are whole super-blocks, quant_q4_K.cuh.j2)."""
        step = self.sub_blocks if self.super_meta else 1
        return -(-kblocks // step) * step

    def blocks_per_row(self, k: int) -> int:
        """Kernel blocks (32 weights) per row of k weights."""
        if k % self.block_values:
            raise ValueError(f"k={k} is not a multiple of the {self.name} block size {self.block_values}")
        return k // KERNEL_BLOCK

    def meta_stride(self, k: int) -> int:
        """Bytes per row of the meta region: padded blocks, rounded to 16 bytes."""
        nb = self.blocks_per_row(k)
        padded = -(-nb // self.pad_blocks) * self.pad_blocks
        return -(-(padded * self.meta_bytes) // 16) * 16

    def row_bytes(self, k: int) -> int:
        """GGUF bytes of a row of k weights."""
        return self.blocks_per_row(k) // self.sub_blocks * self.block_bytes


QUANT_TYPES: dict[str, QuantType] = {
    q.name: q
    for q in (
        # d (f16) then 16 bytes of nibbles: low nibbles are values 0..15, high 16..31
        QuantType("q4_0", gguf.GGMLQuantizationType.Q4_0, 32, 18, 2, 16, f16_scales=((0, 8),)),
        # d (f16) then 32 signed bytes
        QuantType("q8_0", gguf.GGMLQuantizationType.Q8_0, 32, 34, 2, 32, f16_scales=((0, 128),)),
        # super-block of 256: d, dmin (f16), 12 bytes of eight 6-bit (scale, min) pairs,
        # 128 bytes of nibbles; sub-block i: w = d * sc_i * q - dmin * m_i
        QuantType("q4_K", gguf.GGMLQuantizationType.Q4_K, 256, 144, 16, 16, paired_nibbles=True,
                  f16_scales=((0, 63 * 15), (2, 63))),
        # q4_K's super-block with a fifth bit a weight: d, dmin, the 12 scale bytes, 32 bytes
        # of high bits (bit i of byte l: value l of sub-block i), 128 bytes of nibbles; the
        # split keeps the super-block's 16 scale bytes and gives each kernel block one word
        # of its high bits (quant_q5_K.cuh.j2): 48 meta bytes a super-block, the file's 5.5
        # bits a weight.
        QuantType("q5_K", gguf.GGMLQuantizationType.Q5_K, 256, 176, 48, 16, paired_nibbles=True, high_bits=1,
                  f16_scales=((0, 63 * 31), (2, 63))),
        # super-block of 256: sixteen bytes of 4-bit (scale, min) pairs (one a 16 weights), 64
        # bytes of 2-bit quants, d and dmin (f16); w = d * sc * q - dmin * m. The split packs
        # a kernel block's quants, its two scale bytes, d and dmin into its 16 qs bytes
        # (quant_q2_K.cuh.j2): 4 bits a weight on the GPU, the file's 2.625.
        QuantType("q2_K", gguf.GGMLQuantizationType.Q2_K, 256, 84, 0, 16, inline_meta=True, half_mins=True,
                  f16_scales=((80, 15 * 3), (82, 15))),
        # super-block of 256: 32 bytes of high bits (hmask), 64 of 2-bit low parts, 12 bytes
        # of sixteen 6-bit scales (one a 16 weights), d (f16); w = d * (s - 32) * (q - 4).
        # The split packs a kernel block's low parts, high bits, two scales and d into its
        # 16 qs bytes (quant_q3_K.cuh.j2): 4 bits a weight on the GPU, the file's 3.4375.
        QuantType("q3_K", gguf.GGMLQuantizationType.Q3_K, 256, 110, 0, 16, inline_meta=True,
                  f16_scales=((108, 32 * 4),)),
        # super-block of 256: 128 bytes of low nibbles (ql), 64 of 2-bit high parts (qh),
        # sixteen int8 scales (one a 16 weights), d (f16); w = d * sc * (q - 32). The split
        # gives each kernel block 12 meta bytes: its high bits, its two scales, d
        # (quant_q6_K.cuh.j2): 7 bits a weight on the GPU, the file's 6.5625.
        QuantType("q6_K", gguf.GGMLQuantizationType.Q6_K, 256, 210, 0, 16, high_bits=2, own_meta_bytes=12,
                  f16_scales=((208, 128 * 32),)),
        # super-block of 256: d (f16), 2 bytes of the eight 6-bit scales' top two bits, 4
        # bytes of their low nibbles, 128 bytes of 4-bit indices in q4_0's order a 32-weight
        # sub-block; w = d * (ls_i - 32) * IQ4_VALUES[index]. The 8 bytes before the indices
        # are the meta, as they are (quant_iq4_xs.cuh.j2): 4.25 bits a weight.
        QuantType("iq4_xs", gguf.GGMLQuantizationType.IQ4_XS, 256, 136, 8, 16, codebook=IQ4_VALUES,
                  f16_scales=((0, 32 * 127),)),
        # gpt-oss's experts: a block of 32 is an e8m0 scale byte (2^(e - 128) with the levels
        # doubled) then 16 bytes of 4-bit e2m1 codes in q4_0's order; w = d * MXFP4_VALUES[code].
        # In f16: 12 * 2^12 < 65504 (e <= 140), and the largest blocks normal (e >= 114).
        QuantType("mxfp4", gguf.GGMLQuantizationType.MXFP4, 32, 17, 1, 16, codebook=MXFP4_VALUES,
                  f16_scale_bytes=(114, 140)),
    )
}
_BY_LOWER = {name.lower(): q for name, q in QUANT_TYPES.items()}


def type_name(t: gguf.GGMLQuantizationType) -> str:
    """ggml's own name of a tensor type: "q4_0", "f16", "q4_K" (K-quants keep the capital)."""
    n = t.name.lower()
    return n[:-2] + "_K" if n.endswith("_k") else n


def quant_type(name: str) -> QuantType:
    """The quant type of a name, any case ("q4_k", "Q4_K" and "q4_K" are one)."""
    try:
        return _BY_LOWER[name.lower()]
    except KeyError:
        known = ", ".join(QUANT_TYPES)
        raise ValueError(f"unknown quant type {name!r}; moeforge knows {known}") from None


def parse_types(text: str | None) -> list[QuantType]:
    """'q4_0,q8_0' -> [QuantType, ...]; None or 'all' -> every known type."""
    if not text or text == "all":
        return list(QUANT_TYPES.values())
    return [quant_type(t.strip()) for t in text.split(",") if t.strip()]
