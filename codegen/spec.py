"""Kernel instances as data: frozen dataclasses with deterministic names.

A spec holds every choice that changes the generated source. Its `name` is the
instance's identity everywhere (files, profiles, logs); its `symbol` is the C name.
Launch-time facts (grid size, stream-k block count) are not part of a spec.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import ClassVar

from .quant import QuantType, quant_type


def _pad16(n: int) -> int:
    return -(-n // 16) * 16


def _pad(n: int, align: int) -> int:
    return -(-n // align) * align


@dataclass(frozen=True)
class KernelSpec:
    family: ClassVar[str] = ""
    template: ClassVar[str] = ""

    @property
    def name(self) -> str:  # pragma: no cover - every family overrides
        raise NotImplementedError

    @property
    def symbol(self) -> str:
        return self.name.replace("-", "_")

    def check(self) -> None:
        """Raise ValueError when the spec cannot be generated at all."""

    def supports(self, arch: str) -> bool:
        """Whether the instance is built for arch at all (`moeforge generate` skips the others)."""
        return True

    def nvrtc_arch(self, arch: str) -> str:
        """The target NVRTC compiles for on arch (ValueError where the instance cannot run)."""
        return arch

    def _check_whole_super_blocks(self, parts: bool = False) -> None:
        """Tiles whose stages carry kblocks: a stage's scales are whole super-blocks
        (quant_q4_K.cuh.j2 finds its own; QuantType.whole_kblocks rounds up to them).
        parts: a stage may also hold a whole fraction of one, and copy its scales whole."""
        q = self.quant
        if q.super_meta and self.kblocks % q.sub_blocks and not (parts and q.sub_blocks % self.kblocks == 0):
            raise ValueError(f"{self.name}: kblocks must hold whole {q.name} super-blocks ({q.sub_blocks} blocks)")

    def to_dict(self) -> dict:
        return {"family": self.family, **asdict(self)}

    @staticmethod
    def from_dict(d: dict) -> "KernelSpec":
        d = dict(d)
        family = d.pop("family", None)
        cls = SPEC_FAMILIES.get(family)
        if cls is None:
            raise ValueError(f"unknown kernel family {family!r}")
        allowed = {f.name for f in fields(cls)}
        unknown = set(d) - allowed
        if unknown:
            raise ValueError(f"unknown fields for {family}: {sorted(unknown)}")
        spec = cls(**d)
        spec.check()
        return spec


@dataclass(frozen=True)
class UtilSpec(KernelSpec):
    """The small kernels every path shares: q8_1 activation quantization, routing,
    the stream-k fixup, and the gather/scatter of the per-expert path."""
    family: ClassVar[str] = "util"
    template: ClassVar[str] = "util.cu.j2"

    @property
    def name(self) -> str:
        return "util"

    KERNELS: ClassVar[tuple[str, ...]] = (
        "quantize_q8_1", "prepare_moe", "streamk_fixup", "gather_rows_q8_1",
        "scatter_rows",
    )

    @property
    def kernels(self) -> tuple[str, ...]:
        return self.KERNELS


class WgmmaTarget:
    """An instance with a `wgmma` field: with it on, built for sm_90a (the warpgroup MMA is
    an arch-specific feature) and for sm_90 only; without it, for any arch."""
    wgmma: bool

    def supports(self, arch: str) -> bool:
        return not self.wgmma or arch == "sm_90"

    def nvrtc_arch(self, arch: str) -> str:
        if not self.supports(arch):
            raise ValueError(f"{self.name}: wgmma runs on sm_90 only, not {arch}")
        return "sm_90a" if self.wgmma else arch


@dataclass(frozen=True)
class ModelSpec(WgmmaTarget, KernelSpec):
    """The small kernels of the model graph (runtime.backend_cuda): embedding rows, the
    norms and their fusions, RoPE, the KV store, attention, routing, SwiGLU, the expert sum.
    The limits size fixed arrays in the kernels; the backend refuses a model past them.
    cache: the KV cache's element type, which every kernel that reads or writes the cache
    is built for ("f16": half the bytes, values rounded to nearest even when stored).
    wgmma: the module also holds prompt attention on wgmma (attn_prefill_wg128 and the V^T
    rows it reads), so it is built for sm_90a and runs on sm_90 only; without it the module
    is what it was, byte for byte."""
    family: ClassVar[str] = "model"
    template: ClassVar[str] = "model.cu.j2"
    max_experts: int = 512      # routing holds a token's logits in registers, 32 lanes wide
    max_head_dim: int = 256     # the widest head the backend takes (at most the widest decode attention)
    cache: str = "f32"
    wgmma: bool = False
    DENSE_TILE: ClassVar[int] = 64     # dense_f32_tiled: rows and tokens of a tile (products of up to 64 rows)
    DENSE_STEP: ClassVar[int] = 16     # its k of a step (a split of k is a multiple of it)
    DENSE_WIDE_TILE: ClassVar[int] = 128   # dense_f32_tiled128: the same for wider products
    DENSE_WIDE_STEP: ClassVar[int] = 8
    CACHE_TYPES: ClassVar[tuple[str, ...]] = ("f32", "f16")

    @property
    def name(self) -> str:
        return (f"model-e{self.max_experts}h{self.max_head_dim}" + ("" if self.cache == "f32" else f"-c{self.cache}")
                + ("-wg" if self.wgmma else ""))

    def check(self) -> None:
        if self.cache not in self.CACHE_TYPES:
            raise ValueError(f"{self.name}: cache must be one of {self.CACHE_TYPES}, not {self.cache!r}")
        if self.max_experts % 32 or self.max_experts <= 0:
            raise ValueError(f"{self.name}: max_experts must be a positive multiple of 32")
        if not 0 < self.max_head_dim <= self.DECODE_WIDTHS[-1]:
            raise ValueError(f"{self.name}: max_head_dim must be positive and at most {self.DECODE_WIDTHS[-1]} "
                             "(the widest decode attention)")

    # decode attention holds a head in registers, a variant per width (attn_decode.cuh.j2)
    DECODE_WIDTHS: ClassVar[tuple[int, ...]] = (64, 128, 256)

    @property
    def decode_widths(self) -> tuple[int, ...]:
        return self.DECODE_WIDTHS

    @staticmethod
    def decode_kernel(head_dim: int) -> str:
        """The decode attention variant for heads of head_dim (the narrowest that holds them)."""
        width = next((w for w in ModelSpec.DECODE_WIDTHS if head_dim <= w), None)
        if width is None:
            raise ValueError(f"head_dim {head_dim}: decode attention takes heads of up to {ModelSpec.DECODE_WIDTHS[-1]}")
        return f"attn_decode_h{width}"

    KERNELS: ClassVar[tuple[str, ...]] = (
        "get_rows_q4_0", "get_rows_q8_0", "get_rows_q2_K", "get_rows_q3_K", "get_rows_q4_K", "get_rows_q5_K", "get_rows_q6_K", "get_rows_iq4_xs", "rms_norm",
        "rope_neox", "kv_store", "attn_decode_h64", "attn_decode_h128", "attn_decode_h256", *(f"attn_decode_gqa_g{g}h{w}" for g in (2, 4, 8) for w in (64, 128)),
        *(f"attn_decode_gqa_tc_g{g}h{w}" for g in (2, 4, 8) for w in (64, 128)),
        "add_rms_norm", "moe_combine_rms_norm", "moe_combine_rms_norm_rows", "qk_norm_rope_store", "qk_norm_rope_store_h128", "softmax_causal", "router_route", "router_route_cluster",
        "route_topk", "router_route_keyed", "router_route_cluster_keyed", "route_topk_keyed", "swiglu", "swiglu_split", "dense_f32", "dense_f32_tiled", "dense_f32_tiled128", "dense_f32_reduce", "dense_f32_id",
        "moe_combine", "attn_prefill", "attn_prefill_tc", "attn_prefill_fa64", "attn_prefill_fa128", "attn_prefill_fa", "kv_rows_f16",
        "rope_yarn_store", "add_bias", "glu_oai_id", "glu_oai_id_f16", "mla_rope_store", "attn_decode_mla", "attn_decode_mla_merge", "attn_prefill_mla",
    )
    # prompt attention kernels that read a float32 cache as it is (tf32 and FMA), and the
    # rounding of its rows to f16 for attn_prefill_fa: an f16 cache's module has only
    # attn_prefill_fa (runtime.prompt_attention.kernel_for)
    F32_CACHE_ONLY: ClassVar[tuple[str, ...]] = ("attn_prefill", "attn_prefill_tc", "kv_rows_f16")

    # prompt attention on wgmma (spec.wgmma) and the V^T rows it reads
    WGMMA_KERNELS: ClassVar[tuple[str, ...]] = ("attn_prefill_wg128", "kv_tiles_f16")

    @property
    def kernels(self) -> tuple[str, ...]:
        """The kernels of this instance's module."""
        base = self.KERNELS if self.cache == "f32" else tuple(k for k in self.KERNELS if k not in self.F32_CACHE_ONLY)
        return base + (self.WGMMA_KERNELS if self.wgmma else ())


@dataclass(frozen=True)
class MmqSpec(KernelSpec):
    """Quantized GEMM on int8 tensor cores (mma.sync m16n8k32).

    x: tokens per tile (llama.cpp's mmq_x), y: weight rows per tile (mmq_y),
    kblocks: quant blocks per pipeline stage, stages: cp.async pipeline depth.
    ids=True is MUL_MAT_ID (all experts in one launch, tiles from the routing kernel);
    stream_k=True splits the (tile, k-chunk) work evenly over a persistent grid.
    evict_first: the weight copies carry an L2 evict-first policy (rows read once per call
    should leave L2 before the activations). pdl: the kernel waits for the grid before it on
    the device first thing and is launched with programmatic dependent launch (sm_90+). Both
    are launch forms the runtime applies to a tuned tile (runtime.ops.mmq_launch_form); off,
    the source is the one the shipped profiles were tuned with. direct: one block per (expert,
    row tile) finds the expert's tokens in ids itself: no routing launch (small batches).
    lean: the block walks its units with counters and looks a tile's x rows up once (no
    runtime divisions per unit): the same copies, the same bits, fewer instructions; a launch
    form as well (runtime.ops.lean_form) until the profiles are next tuned.
    """
    family: ClassVar[str] = "mmq"
    template: ClassVar[str] = "mmq.cu.j2"
    qtype: str
    x: int
    y: int
    warps: int
    kblocks: int = 8
    stages: int = 2
    ids: bool = True
    stream_k: bool = True
    evict_first: bool = False
    pdl: bool = False
    direct: bool = False
    lean: bool = False

    @property
    def quant(self) -> QuantType:
        return quant_type(self.qtype)

    @property
    def name(self) -> str:
        fam = "mmq_id" if self.ids else "mmq"
        sk = "-sk" if self.stream_k else ""
        ef = "-ef" if self.evict_first else ""
        pdl = "-pdl" if self.pdl else ""
        dr = "-dr" if self.direct else ""
        ln = "-ln" if self.lean else ""
        return f"{fam}-{self.qtype}-x{self.x}y{self.y}w{self.warps}k{self.kblocks}s{self.stages}{sk}{ef}{pdl}{dr}{ln}"

    @property
    def threads(self) -> int:
        return 32 * self.warps

    @property
    def x_q_slots(self) -> int:
        """16-byte x copies a thread of the lean form keeps per tile (its x rows' quants)."""
        return -(-self.x * self.kblocks * 2 // self.threads)

    @property
    def x_d_slots(self) -> int:
        """The same for the x rows' (d, s) pairs."""
        return -(-self.x * (self.kblocks // 2) // self.threads)

    @property
    def x_row_slots(self) -> int:
        """Registers a thread of the lean form keeps for a tile's x rows (its x copies)."""
        return self.x_q_slots + self.x_d_slots

    def check(self) -> None:
        self._check_whole_super_blocks()
        if self.x % 8 or not 8 <= self.x <= 128:
            raise ValueError(f"{self.name}: x must be a multiple of 8 in [8, 128]")
        if self.y % (16 * self.warps):
            raise ValueError(f"{self.name}: y must be a multiple of 16*warps")
        if self.kblocks not in (2, 4, 8, 16):
            raise ValueError(f"{self.name}: kblocks must be 2, 4, 8 or 16")
        if self.kblocks * 32 > 1024:
            raise ValueError(f"{self.name}: a stage spans more than 1024 values")
        if self.stages not in (2, 3, 4):
            raise ValueError(f"{self.name}: stages must be 2, 3 or 4")
        if self.direct and not self.ids:
            raise ValueError(f"{self.name}: direct routing belongs to MUL_MAT_ID")
        if self.direct and self.stream_k:
            raise ValueError(f"{self.name}: direct routing takes whole tiles, not stream-k")

    # Shared-memory layout of one pipeline stage. Rows are padded by 16 bytes so that the
    # 8 rows a warp reads at once fall in different banks; every region stays 16-byte
    # aligned for cp.async.
    def layout(self) -> dict[str, int]:
        q = self.quant
        wq_row = self.kblocks * q.qs_bytes + 16
        wm_row = _pad16(self.kblocks * q.meta_bytes)
        xq_row = self.kblocks * 32 + 16
        xd_row = self.kblocks * 8 + 16
        wq = 0
        wm = wq + self.y * wq_row
        xq = wm + self.y * wm_row
        xd = xq + self.x * xq_row
        stage = xd + self.x * xd_row
        return dict(wq_row=wq_row, wm_row=wm_row, xq_row=xq_row, xd_row=xd_row,
                    wq=wq, wm=wm, xq=xq, xd=xd, stage=stage)

    def smem_bytes(self) -> int:
        return self.layout()["stage"] * self.stages


@dataclass(frozen=True)
class MmvqSpec(KernelSpec):
    """Quantized mat-vec for 1..8 token vectors: every weight row read once per launch.

    tokens: vectors per block (the routing tiles hold at most this many),
    warps per block, rows: weight rows per warp (more rows, more loads in flight).
    act: None for a plain product; "silu", "gelu" or "swiglu_oai" for the fused
    act(gate) * up form, with optional biases on gate and up. per_pair: one block column
    per (token, slot) pair, which quantizes its own x row: a single launch, no routing,
    an expert chosen by several tokens is read once per token (tokens must be 1).
    evict_first: weights are loaded as streaming data (ld.global.cs): read once per call,
    they leave L2 first and keep the activations and the KV cache there. pdl: programmatic
    dependent launch (sm_90 and later; elsewhere an ordinary launch): the grid is launched
    while the previous kernel of the stream ends and waits for it on the device.
    prequant (per-pair): x is quantized once by a launch just before instead of in every
    block; with pdl the blocks request their weights first and wait for x after.
    wait_first (prequant, pdl): x was quantized by an earlier kernel (the model's norms) and
    the kernel just before wrote the expert ids (the router): wait first, then request.
    combine (per-pair, ids, plain product): block (x, t) computes rows of all of token t's
    slots (warp j: slot j, top_k <= warps) and adds their weighted sum to the residual row
    instead of writing the slots' outputs (the model's down product at decode).
    guess (prequant, pdl, ids; not wait_first, not combine): the blocks request the weights
    of the expert ids read before the wait, which a kernel in flight may still be writing,
    and check them after it (a stale guess is computed again), so the quantizer before may
    release the product at once (the one-token default).
    ksplit (per-pair; not guess): the block's warps take the same ROWS rows, each every
    WARPS-th k-unit of them, their partial sums added in warp order (long rows at one
    token: the attention output product of 96 heads is 12 units a row; the wait-first
    expert gate/up walks 4096-wide rows one unit at a time). With combine the warps split
    over the slots first: warp w takes slot w % top_k and every (WARPS / top_k)-th unit
    from w / top_k, top_k dividing WARPS (Mixtral's down, 14 units a row, 2 slots).
    units (guess or wait_first): k-units of 32 blocks a lane has in flight, 2 (the next one
    requested while the current one is computed) or 1 (half the registers: wider rows in
    one wave).
    All off by default, which renders the source the shipped profiles were tuned with.
    """
    family: ClassVar[str] = "mmvq"
    template: ClassVar[str] = "mmvq.cu.j2"
    qtype: str
    tokens: int = 8
    warps: int = 4
    rows: int = 1
    ids: bool = True
    act: str | None = None
    bias: bool = False
    per_pair: bool = False
    evict_first: bool = False
    pdl: bool = False
    prequant: bool = False
    wait_first: bool = False
    combine: bool = False
    guess: bool = False
    units: int = 2
    ksplit: bool = False

    ACTS: ClassVar[tuple[str, ...]] = ("silu", "gelu", "swiglu_oai")

    @classmethod
    def decode(cls, qtype: str, *, ids: bool = True, rows: int = 4, act: str | None = None,
               bias: bool = False, wait_first: bool = False, guess: bool = False, units: int = 2) -> "MmvqSpec":
        """The one-token form: per pair, x quantized just before, streaming weights, PDL."""
        return cls(qtype, tokens=1, warps=4, rows=rows, ids=ids, act=act, bias=bias, per_pair=True,
                   prequant=True, evict_first=True, pdl=True, wait_first=wait_first, guess=guess, units=units)

    @property
    def quant(self) -> QuantType:
        return quant_type(self.qtype)

    @property
    def name(self) -> str:
        fam = "mmvq_id" if self.ids else "mmvq"
        fused = f"-{self.act}" if self.act else ""
        bias = "-bias" if self.bias else ""
        pp = "-pp" if self.per_pair else ""
        ef = "-ef" if self.evict_first else ""
        pdl = "-pdl" if self.pdl else ""
        xq = "-xq" if self.prequant else ""
        wf = "-wf" if self.wait_first else ""
        cmb = "-cmb" if self.combine else ""
        g = "-g" if self.guess else ""
        u = f"-u{self.units}" if self.units != 2 else ""
        ks = "-ks" if self.ksplit else ""
        return f"{fam}-{self.qtype}-t{self.tokens}w{self.warps}r{self.rows}{fused}{bias}{pp}{xq}{ef}{pdl}{wf}{cmb}{g}{u}{ks}"

    @property
    def threads(self) -> int:
        return 32 * self.warps

    @property
    def six_blocks(self) -> bool:
        """Launch bounds of six blocks an SM: the forms with one k-unit in flight, or guessing,
        whose weight buffers are small (at most eight 16-byte pieces a lane, both units)."""
        if self.combine:
            return False
        pieces = self.rows * (2 if self.act else 1) * (self.quant.qs_bytes // 16) * self.units
        return (self.guess or self.units == 1) and pieces <= 8

    @property
    def combine_blocks(self) -> int:
        """Launch bounds of the combining form with one k-unit in flight: 32 warps an SM
        (64 registers), so that a one-token down product of up to ~4 x SMs blocks of 8
        warps (2048 rows of Qwen3's or DeepSeek's experts, 4 rows a block) runs in one
        wave; with two units in flight it took 78-116 registers, three blocks or two. 0:
        no bound."""
        return 32 // self.warps if self.combine and self.units == 1 else 0

    def smem_bytes(self, k: int) -> int:
        """Dynamic shared memory of a launch for activations of width k."""
        return _pad16((k // 32) * 40) if self.per_pair and not self.prequant else 0

    def check(self) -> None:
        self.quant  # noqa: B018 - an unknown type raises here
        if self.per_pair and self.tokens != 1:
            raise ValueError(f"{self.name}: a per-pair kernel handles one token per block")
        if not 1 <= self.tokens <= 8:
            raise ValueError(f"{self.name}: tokens must be in [1, 8]")
        if self.warps not in (1, 2, 4, 8):
            raise ValueError(f"{self.name}: warps must be 1, 2, 4 or 8")
        if self.rows not in (1, 2, 4):
            raise ValueError(f"{self.name}: rows must be 1, 2 or 4")
        if self.act is not None and self.act not in self.ACTS:
            raise ValueError(f"{self.name}: act must be one of {self.ACTS}")
        if self.bias and self.act is None:
            raise ValueError(f"{self.name}: biases belong to the fused gate/up form")
        if self.prequant and not self.per_pair:
            raise ValueError(f"{self.name}: prequant belongs to the per-pair form (the others read x quantized)")
        if self.wait_first and not (self.prequant and self.pdl):
            raise ValueError(f"{self.name}: wait_first belongs to the prequant form launched with pdl")
        if self.combine and not (self.per_pair and self.ids and self.act is None):
            raise ValueError(f"{self.name}: combine belongs to the per-pair expert product without activation")
        if self.guess and not (self.prequant and self.pdl and self.ids and not self.wait_first and not self.combine):
            raise ValueError(f"{self.name}: guess belongs to the prequant expert form launched with pdl that does "
                             f"not wait first (nor combine)")
        if self.ksplit and not (self.per_pair and not self.guess):
            raise ValueError(f"{self.name}: ksplit belongs to the per-pair forms that do not guess")
        if self.units not in (1, 2):
            raise ValueError(f"{self.name}: units must be 1 or 2")
        if self.units == 1 and not (self.guess or self.wait_first or self.combine):
            raise ValueError(f"{self.name}: one unit in flight belongs to the one-token expert forms (guess, "
                             f"wait_first, combine)")


@dataclass(frozen=True)
class MmfSpec(WgmmaTarget, KernelSpec):
    """Quantized GEMM on f16 tensor cores (mma.sync m16n8k16, f32 accumulation), for
    prompt-sized batches. The weights are dequantized to f16 in registers, d * (q - 8)
    rounded once, and x is converted to f16 once by a launch before; the product then
    accumulates over all of k with no per-block scale arithmetic, where MMQ spends three
    instructions per output and per 32-value block on it (the int32 -> float conversion
    and two FMAs: ~27 issued instructions per int8 mma on the H100, BENCHMARKS.md).
    Numerics: x and w rounded to f16 (11-bit significands) instead of x to q8_1 (8-bit),
    ggml's cuBLAS path. x: tokens per tile, y: weight rows per tile, warps split y,
    kblocks: 32-value blocks per pipeline stage, stages: cp.async depth. ids: MUL_MAT_ID
    tiles from the routing launch. wn: warps along the tokens (2-D warp tiles: fewer
    accumulators a thread for wide tiles, the rows' dequantization done once per wn warps).
    wgmma: sm_90a's warpgroup MMA instead of mma.sync (two warpgroups, y/128 m64 slices
    each): x read by the tensor cores from shared memory, the rows from registers, each warp
    dequantizing its own 16 rows of each slice into the A fragment a block at a time under
    the MMAs of the block before (DESIGN-NOTES "Prompt products on wgmma", "wgmma's rows
    from registers")."""
    family: ClassVar[str] = "mmf"
    template: ClassVar[str] = "mmf.cu.j2"
    qtype: str
    x: int
    y: int
    warps: int
    kblocks: int = 4
    stages: int = 3
    ids: bool = True
    wn: int = 1          # warps along the tile's tokens (the others split its rows)
    splits: int = 1      # blocks sharing an output tile's k (partials summed in order by mmf_split_sum)
    wgmma: bool = False  # sm_90a warpgroup MMA, the rows dequantized into its A registers
    glu: str | None = None  # an expert gate|up tile that writes act(gate) * up as the down's f16 x
    QTYPES: ClassVar[tuple[str, ...]] = ("q4_0", "q8_0", "q2_K", "q3_K", "q4_K", "q5_K", "q6_K", "iq4_xs", "mxfp4")
    X_PAD_BLOCKS: ClassVar[int] = 16   # x16 rows are zero-padded to a multiple of this many blocks
    GLU_ACTS: ClassVar[dict[str, str]] = {"silu": "silu", "swiglu_oai": "oai"}   # glu -> name suffix

    @property
    def quant(self) -> QuantType:
        return quant_type(self.qtype)

    @property
    def name(self) -> str:
        fam = "mmf_id" if self.ids else "mmf"
        wn = f"n{self.wn}" if self.wn > 1 else ""
        sk = f"-k{self.splits}" if self.splits > 1 else ""
        wg = "-wg" if self.wgmma else ""
        glu = f"-{self.GLU_ACTS[self.glu]}" if self.glu in self.GLU_ACTS else ""
        return f"{fam}-{self.qtype}-x{self.x}y{self.y}w{self.warps}{wn}k{self.kblocks}s{self.stages}{sk}{wg}{glu}"

    @property
    def threads(self) -> int:
        return 32 * self.warps

    @property
    def part_super(self) -> bool:
        """A stage holds part of a super-block (wgmma: its stages of whole ones would leave
        room for few of them) and copies its scales whole, every stage."""
        return self.quant.super_meta and self.kblocks < self.quant.sub_blocks

    @property
    def meta_kblocks(self) -> int:
        """Blocks whose scales a stage copies: its own, or its super-block's."""
        return self.quant.sub_blocks if self.part_super else self.kblocks

    def check(self) -> None:
        if self.qtype not in self.QTYPES:
            raise ValueError(f"{self.name}: mmf dequantizes {', '.join(self.QTYPES)} only")
        if self.wn not in (1, 2, 4) or self.warps % self.wn:
            raise ValueError(f"{self.name}: wn must be 1, 2 or 4 and divide warps")
        if self.x % (8 * self.wn) or not 8 <= self.x <= 128:
            raise ValueError(f"{self.name}: x must be a multiple of 8*wn in [8, 128]")
        if self.y % (16 * (self.warps // self.wn)) or self.y > 256:
            raise ValueError(f"{self.name}: y must be a multiple of 16 * the row warps, at most 256")
        if self.kblocks not in (2, 4, 8, 16):
            raise ValueError(f"{self.name}: kblocks must be 2, 4, 8 or 16")
        self._check_whole_super_blocks(parts=self.wgmma)
        if self.meta_kblocks * self.quant.meta_bytes < 4 and not self.quant.inline_meta:
            # a stage's scales are copied 4 bytes at a time at least (mxfp4: one byte a block)
            raise ValueError(f"{self.name}: a stage must hold 4 scale bytes: kblocks at least "
                             f"{-(-4 // self.quant.meta_bytes)} for {self.qtype}")
        if self.stages not in ((3, 4, 5) if self.wgmma else (2, 3, 4)):
            raise ValueError(f"{self.name}: stages must be 2, 3 or 4 (wgmma: 3, 4 or 5)")
        if self.splits not in (1, 2, 3, 4):
            raise ValueError(f"{self.name}: splits must be 1 to 4")
        if self.wgmma and (self.warps != 8 or self.wn != 1 or self.y not in (128, 256) or self.x not in (64, 128)
                           or self.splits != 1 or self.kblocks % 2):
            # two warpgroups, each y / 128 m64 slices of the rows over all of the tile's tokens
            raise ValueError(f"{self.name}: wgmma tiles are x64 or x128, y128 or y256, 8 warps, wn 1, no split, "
                             f"whole 64-value panels (kblocks even)")
        if self.epilogue_smem_bytes() > self.smem_bytes():
            raise ValueError(f"{self.name}: its epilogue needs {self.epilogue_smem_bytes()} bytes of shared "
                             f"memory, its stages {self.smem_bytes()}")
        if self.glu is not None:
            if self.glu not in self.GLU_ACTS:
                raise ValueError(f"{self.name}: glu must be one of {', '.join(self.GLU_ACTS)}, not {self.glu!r}")
            if not (self.ids and self.wgmma):
                raise ValueError(f"{self.name}: glu tiles are expert wgmma tiles (ids, wgmma)")

    # One pipeline stage: weight quants (rows padded by 16 bytes: the 8 rows a warp reads
    # at once fall in different banks), weight scales, then x in f16 (rows padded by 32
    # bytes: the 8-byte loads of a half-warp's four rows fall in different banks).
    def layout(self) -> dict[str, int]:
        q = self.quant
        wq_row = self.kblocks * q.qs_bytes + 16
        wm_row = _pad16(self.meta_kblocks * q.meta_bytes)
        x_row = self.kblocks * 64 + 32
        wq = 0
        wm = wq + self.y * wq_row
        xh = wm + self.y * wm_row
        stage = xh + self.x * x_row
        if not self.wgmma:
            return dict(wq_row=wq_row, wm_row=wm_row, x_row=x_row, wq=wq, wm=wm, xh=xh, stage=stage)
        # wgmma reads x in 128-byte-swizzled panels, 1024-byte aligned
        xh = _pad(xh, 1024)
        stage = _pad(xh + self.x * self.kblocks * 64, 1024)
        return dict(wq_row=wq_row, wm_row=wm_row, x_row=x_row, wq=wq, wm=wm, xh=xh, stage=stage)

    def smem_bytes(self) -> int:
        L = self.layout()
        return L["stage"] * self.stages

    def epilogue_smem_bytes(self) -> int:
        """An expert wgmma tile's epilogue, in the stages' memory: the tile's float32
        accumulators, whole, its x output rows, and a glu tile's y/2 gate and y/2 up biases
        (mmf_wgmma.cuh.j2, mmf_glu.cuh.j2). Dense tiles store from registers: none."""
        if not (self.wgmma and self.ids):
            return 0
        return self.x * self.y * 4 + self.x * 4 + (self.y * 4 if self.glu else 0)


SPEC_FAMILIES: dict[str, type[KernelSpec]] = {c.family: c for c in (UtilSpec, ModelSpec, MmqSpec, MmvqSpec, MmfSpec)}
