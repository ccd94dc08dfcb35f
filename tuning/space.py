"""The search space of one tuning key (op, quant type, shape class, token bucket).

Candidates are drawn only from codegen.enumerate's instances: the tuner may pick nothing
that `moeforge generate` did not build. Whatever cannot launch on this device, or cannot
possibly fill its tile, is pruned here, before anything is compiled, so that a short budget
is spent on candidates that could win. Every pruned instance keeps its reason (`--verbose`
and the tests read them).
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field

from ..codegen import enumerate as enum
from ..codegen.quant import quant_type
from ..codegen.spec import KernelSpec, MmfSpec, MmqSpec, MmvqSpec
from ..runtime import dispatch
from ..runtime.dispatch import Choice

OPS = ("mul_mat_id", "mul_mat")
PATHS = {"mul_mat_id": ("mmvq", "mmq_id", "per_expert", "mmf_id"), "mul_mat": ("mmvq", "mmq", "mmf")}
F16_PATHS = ("mmf_id", "mmf")
# Token buckets: powers of two, so that the nearest bucket at run time is at most a factor
# sqrt(2) away; 1..4096 covers every n of the anchor tables (decode to long prefill).
BUCKETS = tuple(2 ** i for i in range(13))
ANCHOR_N = (1, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
# sm_90's opt-in limit per block, for planning on a machine without a GPU.
DEFAULT_SMEM_LIMIT = enum.SM90_SMEM_PER_BLOCK
# A per-expert launch sequence costs E launches and one host synchronization; with fewer
# tokens than this per expert on average it loses to one MMQ-ID launch on any GPU we know.
PER_EXPERT_MIN_TOKENS = 8


@dataclass(frozen=True, order=True)
class TuneKey:
    op: str
    qtype: str
    shape: tuple[int, int, int, int]   # (E, top_k, m, k); (1, 1, m, k) for mul_mat
    n: int

    def __post_init__(self):
        object.__setattr__(self, "shape", tuple(int(v) for v in self.shape))
        self.check()

    def check(self) -> None:
        if self.op not in OPS:
            raise ValueError(f"op must be one of {OPS}, got {self.op!r}")
        q = quant_type(self.qtype)
        if len(self.shape) != 4 or min(self.shape) <= 0:
            raise ValueError(f"shape must be four positive integers (E, top_k, m, k), got {self.shape}")
        E, top_k, m, k = self.shape
        if top_k > E:
            raise ValueError(f"top_k={top_k} exceeds E={E}")
        if self.op == "mul_mat" and (E, top_k) != (1, 1):
            raise ValueError(f"mul_mat shapes are (1, 1, m, k), got {self.shape}")
        q.blocks_per_row(k)
        if self.n not in BUCKETS:
            raise ValueError(f"token bucket n={self.n} is not a power of two in [1, {BUCKETS[-1]}]")

    @property
    def label(self) -> str:
        return f"{self.op}/{self.qtype}/{'x'.join(map(str, self.shape))}/n{self.n}"

    @property
    def tokens_per_expert(self) -> float:
        """What one expert receives on average with uniform routing (the tile should fit this)."""
        E, top_k, _, _ = self.shape
        return self.n * top_k / E


def mmvq_limit(op: str) -> int:
    return dispatch.MMVQ_ID_TUNABLE_TOKENS if op == "mul_mat_id" else dispatch.MMVQ_MAX_TOKENS


def mmvq_allowed(op: str, shape, n: int) -> bool:
    """Where the mat-vec path may be chosen (the same test profile lookup applies)."""
    return n <= mmvq_limit(op)


def path_allows(op: str, path: str, spec: KernelSpec, shape, n: int) -> str | None:
    """Why `spec` on `path` cannot run this product at all (None when it can). Shared with
    profile validation and lookup, which must never hand dispatch an illegal pairing."""
    if path not in PATHS.get(op, ()):
        return f"path {path!r} does not exist for {op}"
    if path == "mmvq":
        if not isinstance(spec, MmvqSpec) or spec.act or spec.bias or spec.combine:
            return "the mmvq path runs plain mmvq specs (combine is the model's launch form)"
        if spec.ids != (op == "mul_mat_id"):
            return f"mmvq spec ids={spec.ids} does not match {op}"
        if not mmvq_allowed(op, shape, n):
            return f"mmvq handles n <= {mmvq_limit(op)} for {op}"
        return None
    if path in F16_PATHS:
        if not isinstance(spec, MmfSpec):
            return f"the {path} path runs mmf specs"
        if spec.ids != (path == "mmf_id"):
            return f"path {path} needs an mmf spec with ids={path == 'mmf_id'}"
        if spec.glu:
            # the model's gate|up launch form: it writes the down's f16 x, not this product's
            # output, and shares its plain tile's knobs
            return "glu tiles write the down product's f16 x, not a product's output"
        return None
    if not isinstance(spec, MmqSpec):
        return f"the {path} path runs mmq specs"
    if spec.ids != (path == "mmq_id"):
        return f"path {path} needs an mmq spec with ids={path == 'mmq_id'}"
    return None


# -- knobs: how a candidate appears to Optuna -----------------------------------------------
# y and warps are enumerated as pairs, so they are one knob: separate knobs would let the
# sampler propose pairs that were never generated.
def knobs(choice: Choice) -> dict:
    s = choice.spec
    if isinstance(s, MmvqSpec):
        # prequant instances are generated only with streaming loads and PDL: one knob;
        # guess (their one-token default) is another, so that the tuner measures both forms,
        # and so is ksplit (the dense one-token form of long rows)
        return {"tokens": s.tokens, "warps": s.warps, "rows": s.rows, "per_pair": s.per_pair,
                "prequant": s.prequant, "guess": s.guess, "ksplit": s.ksplit}
    if isinstance(s, MmfSpec):
        return {"x": s.x, "yw": f"y{s.y}w{s.warps}n{s.wn}", "kblocks": s.kblocks, "stages": s.stages,
                "splits": s.splits}
    return {"x": s.x, "yw": f"y{s.y}w{s.warps}", "kblocks": s.kblocks, "stages": s.stages,
            "stream_k": s.stream_k}


def params_of(choice: Choice) -> dict:
    """Optuna parameters of a candidate: the path, then `<path>.<knob>` (conditional knobs
    keep their own names per path, so each path's distributions stay fixed)."""
    return {"path": choice.path, **{f"{choice.path}.{k}": v for k, v in knobs(choice).items()}}


@dataclass
class Space:
    key: TuneKey
    choices: list[Choice]
    pruned: list[tuple[str, str]]            # (instance name, reason)
    by_params: dict = field(default_factory=dict)

    def __post_init__(self):
        self.by_params = {_freeze(params_of(c)): c for c in self.choices}

    @property
    def paths(self) -> list[str]:
        return sorted({c.path for c in self.choices}, key=PATHS[self.key.op].index)

    def knob_choices(self, path: str) -> dict[str, list]:
        """Every value each knob of `path` takes in this space (Optuna categorical choices)."""
        out: dict[str, set] = {}
        for c in self.choices:
            if c.path == path:
                for k, v in knobs(c).items():
                    out.setdefault(k, set()).add(v)
        return {k: sorted(v, key=lambda x: (str(type(x)), x)) for k, v in out.items()}

    def lookup(self, params: dict) -> Choice | None:
        return self.by_params.get(_freeze(params))

    def signature(self) -> str:
        """Changes whenever the set of candidates changes, so a study never mixes two
        spaces (Optuna refuses a categorical parameter whose choices changed)."""
        h = hashlib.sha256("\n".join(sorted(c.spec.name + "@" + c.path for c in self.choices)).encode())
        return h.hexdigest()[:10]

    def __len__(self) -> int:
        return len(self.choices)


def _freeze(params: dict) -> tuple:
    return tuple(sorted(params.items()))


def _pow2_ceil(v: float) -> int:
    return 1 << max(0, math.ceil(math.log2(max(v, 1))))


def _tile_reason(x: int, tokens: float, n: int) -> str | None:
    """Tiles far wider than what an expert receives are mostly empty; far narrower ones
    multiply launches and re-reads of the weights. Skewed routing sends hot experts several
    times the average, so the upper bound leaves room for that."""
    hi = min(128, _pow2_ceil(max(8.0, 4 * tokens)), max(8, _pow2_ceil(n)))
    lo = min(hi, 32, max(8, 1 << int(math.log2(max(tokens / 8, 1)))))
    if x > hi:
        return f"x={x} tokens per tile, far more than the ~{tokens:g} an expert receives"
    if x < lo:
        return f"x={x} tokens per tile, far fewer than the ~{tokens:g} an expert receives"
    return None


def build(key: TuneKey, smem_limit: int = DEFAULT_SMEM_LIMIT) -> Space:
    q = quant_type(key.qtype)
    E, top_k, m, k = key.shape
    choices: list[Choice] = []
    pruned: list[tuple[str, str]] = []
    ids = key.op == "mul_mat_id"
    for spec in enum.mmvq_specs(q):
        if spec.act or spec.bias or spec.ids != ids:
            continue   # the fused and the other-op instances belong to other products
        c = Choice("mmvq", spec, "tuned")
        why = path_allows(key.op, "mmvq", spec, key.shape, key.n)
        if why is None and spec.tokens > _pow2_ceil(key.n):
            why = f"tokens={spec.tokens} vector slots, more than n={key.n} can fill"
        (pruned.append((spec.name, why)) if why else choices.append(c))
    # the tiles: int8 (one spec may serve two paths) and f16, pruned by the same rules
    tile_paths = ("mmq_id", "per_expert") if ids else ("mmq",)
    tiles = [(path, spec) for spec in enum.mmq_specs(q) for path in tile_paths]
    tiles += [("mmf_id" if ids else "mmf", spec) for spec in enum.mmf_specs(q)]
    for path, spec in tiles:
        if path_allows(key.op, path, spec, key.shape, key.n) is not None:
            continue
        tokens = float(key.n) if path in ("mmq", "mmf") else key.tokens_per_expert
        why = None
        if path in F16_PATHS and key.n <= dispatch.MMVQ_MAX_TOKENS:
            why = f"f16 tiles at n={key.n}: the mat-vec path's range"
        elif getattr(spec, "wgmma", False) and not dispatch.wgmma_available():
            why = "wgmma tiles run on sm_90 only"
        elif spec.smem_bytes() > smem_limit:
            why = f"needs {spec.smem_bytes()} B of shared memory, the device allows {smem_limit}"
        elif path == "per_expert" and tokens < PER_EXPERT_MIN_TOKENS:
            why = f"per-expert launches with ~{tokens:g} tokens per expert (< {PER_EXPERT_MIN_TOKENS})"
        elif spec.y > max(64, _pow2_ceil(m)):
            why = f"y={spec.y} rows per tile, more than m={m}"
        else:
            why = _tile_reason(spec.x, tokens, key.n)
        (pruned.append((f"{path}:{spec.name}", why)) if why else choices.append(Choice(path, spec, "tuned")))
    # dispatch runs the default whatever the rules above say, so the baseline is always
    # measurable; only an instance that cannot launch here is left out.
    default = default_choice(key)
    dparams = params_of(default)
    default_smem = default.spec.smem_bytes() if isinstance(default.spec, (MmqSpec, MmfSpec)) else 0
    if not any(params_of(c) == dparams for c in choices) and default_smem <= smem_limit:
        choices.append(Choice(default.path, default.spec, "tuned"))
        pruned = [(name, why) for name, why in pruned if not name.endswith(default.spec.name)]
    if not choices:
        raise ValueError(f"{key.label}: every instance was pruned ({len(pruned)}); nothing to tune")
    return Space(key, choices, pruned)


def default_choice(key: TuneKey) -> Choice:
    """What dispatch runs without a profile (the f16 rule's tile where it applies, else the
    int8 or mat-vec default): the baseline every study measures first and a tuned entry's
    speedup is of. (Until the eighteenth session the int8 default alone: on sm_90, where the
    rule takes the wgmma tiles, a study's table compared the tuned tile with a path nothing
    ran there: 1.68x on an H200.)"""
    return dispatch.unprofiled(key.op, key.qtype, key.shape, key.n)


def _int8_default(key: TuneKey) -> Choice:
    E, top_k, m, k = key.shape
    if key.op == "mul_mat_id":
        return dispatch.default_mul_mat_id(key.qtype, E, top_k, m, k, key.n)
    return dispatch.default_mul_mat(key.qtype, m, k, key.n)


def incumbent(key: TuneKey) -> Choice | None:
    """What the active profile runs for this bucket now (None without one)."""
    from ..runtime.profiles_hook import lookup
    E, top_k, m, k = key.shape
    found = lookup(key.op, key.qtype, (E, top_k, m, k), key.n)
    return Choice(found.path, found.spec, "tuned") if found is not None else None


def seeds(space: Space) -> list[Choice]:
    """Enqueued before the sampler runs: the default first (a short budget never ends worse
    than it), then what the active profile runs for the bucket (a short re-tune never ends
    worse than the entry it replaces: both are timed in the same study), then the
    default-like choice of every other path, so that the path question (where per-expert
    starts to win, where mat-vec stops) is answered in every study."""
    default = default_choice(space.key)
    out = [default]
    held = incumbent(space.key)
    if held is not None and held.spec != default.spec and space.lookup(params_of(held)) is not None:
        out.append(held)
    k = space.key
    base = _int8_default(k)
    for path in space.paths:
        if path == default.path:
            continue
        if path == base.path:
            spec = base.spec    # the default without the f16 rule (stream-k where it applies)
        elif path == "mmvq":
            spec = dispatch.default_mmvq(k.qtype, k.n, ids=k.op == "mul_mat_id")
        elif path in F16_PATHS:
            ids = path == "mmf_id"
            spec = dispatch.mmf_rule_spec(k.qtype, k.n, ids, k.shape[2], dispatch.device_sm_count(),
                                          k.tokens_per_expert if ids else None, dispatch.wgmma_available(),
                                          k.shape[:2] if ids else None)
        else:
            t = k.tokens_per_expert if path != "mmq" else k.n
            spec = dispatch.default_mmq(k.qtype, t, ids=path == "mmq_id")
        c = Choice(path, spec, "tuned")
        if space.lookup(params_of(c)) is not None and all(c.spec != o.spec for o in out):
            out.append(c)
    return out
