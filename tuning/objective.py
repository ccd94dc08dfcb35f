"""The GPU objective: check a candidate against the references, then time it.

Runs inside the isolated worker process (tuning/isolate.py), never in the study process:
an illegal address or a hang there ends one trial. One case per tuning key holds the
weights (random valid GGUF blocks, several copies so that rotating through them defeats the
L2 cache, as a model's layers do), input sets for random and skewed routing (fresh random
values, never zeros), and the references of the first set of each routing.

Objective value: the mean of the median microseconds per call over the two routings.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .. import reference as ref
from ..codegen.spec import KernelSpec, MmfSpec
from ..runtime.dispatch import Choice
from . import gate
from .space import TuneKey


@dataclass(frozen=True)
class Settings:
    reps: int = 20            # timed graph replays; the median is kept
    calls: int = 10           # calls per replay (at least one per weight copy)
    warmup: int = 3
    input_sets: int = 3       # rotated per routing, so no call repeats its predecessor's inputs
    cold: bool = True         # rotate weight copies through more than the L2 holds
    max_copies: int = 8


class Case:
    def __init__(self, key: TuneKey, settings: Settings, rng: np.random.Generator, weights=None):
        import cupy as cp
        from ..runtime.device import device_info
        from ..runtime.tensor import QuantTensor
        self.key, self.settings = key, settings
        E, top_k, m, k = key.shape
        self.wshape = (E, m, k)
        if weights is None:
            raw = ref.random_blocks(key.qtype, E * m, k, rng)
            shape = (E, m, k) if key.op == "mul_mat_id" else (m, k)
            w0 = QuantTensor.from_blocks(raw, key.qtype, shape)
            copies = 1
            if settings.cold:
                info = device_info(cp.cuda.Device().id)
                free = cp.cuda.runtime.memGetInfo()[0]
                # At least two copies: at small n a call touches a few experts, which would
                # otherwise stay in L2 from one call to the next, as they never do in a model.
                copies = max(2, math.ceil(4 * info["l2_bytes"] / max(1, w0.nbytes)))
                copies = max(1, min(settings.max_copies, copies, int(0.25 * free // max(1, w0.nbytes))))
            ws = [w0] + [w0.copy() for _ in range(copies - 1)]
            weights = (raw, ws)
        self.raw, self.weights = weights
        n = key.n
        kinds = ("random", "skewed") if key.op == "mul_mat_id" and E > top_k else ("random",)
        self.inputs: dict[str, list] = {}
        self.refs: dict[str, gate.Reference] = {}
        rows = gate.check_rows(m, rng)
        for kind in kinds:
            sets = []
            for i in range(settings.input_sets):
                x = rng.standard_normal((n, k), dtype=np.float32) * np.float32(rng.uniform(0.2, 3.0))
                ids = gate.routing(kind, n, E, top_k, rng)
                if i == 0:
                    self.refs[kind] = gate.reference(self.raw, key.qtype, self.wshape, x, ids,
                                                     gate.check_tokens(n, rng), rows)
                sets.append((cp.asarray(x), cp.asarray(ids)))
            self.inputs[kind] = sets
        self.out = cp.empty((n, top_k, m), dtype=cp.float32)

    def launch(self, choice: Choice, kind: str, i: int, w_index: int = 0) -> None:
        from ..runtime.ops import run_mul_mat, run_mul_mat_id
        x, ids = self.inputs[kind][i % len(self.inputs[kind])]
        w = self.weights[w_index % len(self.weights)]
        if self.key.op == "mul_mat_id":
            run_mul_mat_id(w, x, ids, self.out, choice)
        else:
            run_mul_mat(w, x, self.out.reshape(self.key.n, -1), choice)


def preflight(choice: Choice) -> dict:
    """Compile and load before anything runs: a compile error or an instance that cannot
    launch here (registers or shared memory) fails the trial with that reason."""
    from ..runtime.kernels import load
    k = load(choice.spec)
    if k.blocks_per_sm < 1:
        raise RuntimeError(f"cannot launch: {k.registers} registers x {choice.spec.threads} threads and "
                           f"{k.smem} B shared memory leave no block per SM")
    return {"registers": k.registers, "smem": k.smem, "blocks_per_sm": k.blocks_per_sm}


def check(case: Case, choice: Choice) -> dict:
    import cupy as cp
    worst = {"nmse_emulated": 0.0, "nmse_float": 0.0}
    for kind, r in case.refs.items():
        case.out.fill(cp.nan)   # poison: every output the candidate fails to write is caught
        case.launch(choice, kind, 0)
        cp.cuda.get_current_stream().synchronize()
        got = r.pick(case.out.get())
        try:
            res = gate.compare(got, r, "f16" if isinstance(choice.spec, MmfSpec) else "q8_1")
        except gate.GateFailure as e:
            raise gate.GateFailure(f"{kind} routing: {e}") from None
        worst = {k: max(worst[k], v) for k, v in res.items()}
    return worst


def measure(case: Case, choice: Choice) -> dict:
    from .timing import time_calls
    # The per-expert path reads expert counts back to the host, so it cannot be captured in
    # a CUDA graph; it is timed with its launch overhead, as a model would run it.
    graph = choice.path != "per_expert"
    nw = len(case.weights)
    res = {}
    for kind in case.inputs:
        ni = len(case.inputs[kind])
        rot = max(ni, nw)
        t = time_calls(lambda i, kind=kind: case.launch(choice, kind, i, i), rot,
                       calls=max(case.settings.calls, rot), reps=case.settings.reps,
                       warmup=case.settings.warmup, use_graph=graph)
        res[f"us_{kind}"] = t.median_us
        res[f"spread_{kind}"] = t.spread
    res["value"] = float(np.mean([res[f"us_{k}"] for k in case.inputs]))
    return res


def evaluate(case: Case, choice: Choice) -> dict:
    info = preflight(choice)
    info.update(check(case, choice))
    info.update(measure(case, choice))
    return info


class Handler:
    """The isolated worker's side: keeps the weights of the last shape and the case of the
    last key, so consecutive trials of one study pay for neither again."""

    def __init__(self):
        self.case: Case | None = None
        self.rng = np.random.default_rng()   # fresh entropy per worker process

    def __call__(self, req: dict) -> dict:
        key = TuneKey(*req["key"][:3], req["key"][3])
        settings = Settings(**req.get("settings", {}))
        if self.case is None or self.case.key != key or self.case.settings != settings:
            same_w = self.case is not None and (self.case.key.op, self.case.key.qtype, self.case.key.shape) == \
                (key.op, key.qtype, key.shape) and self.case.settings.cold == settings.cold
            weights = (self.case.raw, self.case.weights) if same_w else None
            self.case = None   # free the old inputs before building new ones
            self.case = Case(key, settings, self.rng, weights)
        if req.get("op") == "prepare":
            return {"prepared": key.label}
        choice = Choice(req["path"], KernelSpec.from_dict(req["spec"]), "tuned")
        return evaluate(self.case, choice)
