"""Where the time of one forward pass goes, op by op.

The profiler wraps a backend's ops (the methods the model graph calls) for the length of a
`with` block. An op's label is its method and the buffer it writes ("matmul q",
"mul_mat_id down"), so the layers of a model add up into one row per kind of work; only
leaves count (an op composed of other ops shows as its parts).

On the CUDA backend an op's cost is what removing it saves: the pass is captured as a CUDA
graph (as the decode step runs) and timed, then captured again with every call of one
label replaced by its output from a warm-up pass, and timed again. Events around eager
launches would not do: each one adds a few microseconds of its own, more than most of these
kernels take, and the graph's launch gaps would be missing. Where the pass cannot be
captured (heads the prompt attention kernel does not take run through CuPy, which
allocates), events around eager calls behind a spin kernel are the fallback, and the table
says so. On the numpy backend host clocks
time each call.
"""
from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from dataclasses import dataclass

OPS = ("embed", "rms_norm", "head_norm_", "rope_", "kv_store_", "qk_norm_rope_store_", "attention", "qkv", "matmul",
       "mul_mat_id", "expert_gate_up", "route_tokens", "route", "swiglu", "swiglu_split", "moe_combine_", "add_", "add_rms_norm_",
       "moe_combine_rms_norm_", "moe_down_combine_rms_norm_", "expert_down_into_", "rope_store_", "add_bias_",
       "add_bias_id_", "glu_id")

_SPIN = r"""
extern "C" __global__ void spin_until(long long cycles) {
    const long long t0 = clock64();
    while (clock64() - t0 < cycles) { }
}
"""


@dataclass
class OpRow:
    label: str
    calls: int
    total_us: float

    @property
    def per_call_us(self) -> float:
        return self.total_us / self.calls if self.calls else 0.0


def _label(op: str, args) -> str:
    names = [a for a in args if isinstance(a, str)]
    return f"{op.rstrip('_')} {names[-1]}" if names else op.rstrip("_")


class OpProfiler:
    def __init__(self, backend, *, skip: frozenset = frozenset(), outputs: list | None = None, timed: bool = True):
        self.backend = backend
        self.marks: list[tuple[str, object, object]] = []
        self.cuda = backend.name == "cuda"
        self.skip, self.timed = skip, timed
        self.outputs = outputs if outputs is not None else []   # every call's result, in call order
        self.recording = outputs is None
        self.leaves: dict[str, int] = {}  # label -> calls
        self._calls = 0
        self._saved: dict[str, object] = {}
        self._inner: list[bool] = []      # per open call: did it call another timed op?

    def _mark(self):
        if self.cuda:
            ev = self.backend.cp.cuda.Event()
            ev.record(self.backend.stream)
            return ev
        return time.perf_counter()

    def _wrap(self, op: str, fn):
        # Only leaves are recorded (an op built from other ops shows as its parts), so the
        # rows add up to the pass without counting anything twice.
        def timed(*args, **kwargs):
            label, call = _label(op, args), self._calls
            self._calls += 1
            if self._inner:
                self._inner[-1] = True
            if label in self.skip:
                return self.outputs[call]
            if self.recording:
                self.outputs.append(None)
            self._inner.append(False)
            t0 = self._mark() if self.timed else None
            try:
                out = fn(*args, **kwargs)
            finally:
                had_inner = self._inner.pop()
            if self.recording:
                self.outputs[call] = out
            if not had_inner:
                self.leaves[label] = self.leaves.get(label, 0) + 1
                if self.timed:
                    self.marks.append((label, t0, self._mark()))
            return out
        return timed

    def __enter__(self):
        for op in OPS:
            fn = getattr(self.backend, op, None)
            if fn is not None:
                self._saved[op] = fn
                setattr(self.backend, op, self._wrap(op, fn))
        return self

    def __exit__(self, *exc):
        for op in self._saved:
            delattr(self.backend, op)       # the instance attribute hid the class's method
        self._saved.clear()
        return False

    def hold_gpu(self, ms: float = 200.0) -> None:
        """Queue a kernel that spins for `ms`, so the ops queued after it run back to back."""
        if not self.cuda:
            return
        cp = self.backend.cp
        clock_khz = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)["clockRate"]
        kern = cp.RawKernel(_SPIN, "spin_until")
        with self.backend.stream:
            kern((1,), (1,), (cp.int64(int(ms * clock_khz)),))

    def rows(self) -> list[OpRow]:
        if self.cuda:
            self.backend.stream.synchronize()
            cp = self.backend.cp
            spans = [(lab, cp.cuda.get_elapsed_time(a, b) * 1000.0) for lab, a, b in self.marks]
        else:
            spans = [(lab, (b - a) * 1e6) for lab, a, b in self.marks]
        acc: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
        for lab, us in spans:
            acc[lab][0] += 1
            acc[lab][1] += us
        return sorted((OpRow(lab, int(c), t) for lab, (c, t) in acc.items()), key=lambda r: -r.total_us)


@dataclass
class Profile:
    rows: list[OpRow]
    total_us: float          # the whole pass (graph replay, or the sum of the rows)
    method: str


def profile_forward(model, n_tokens: int, rng, n_past: int = 0, reps: int = 20) -> Profile:
    """One forward pass of n_tokens random tokens after n_past cached positions (a decode
    step for n_tokens == 1). The context is reset first."""
    import numpy as np
    model.reset(max(model.cache.n_ctx, n_past + n_tokens + 1))
    B = model.backend
    with B.context():
        if n_past:
            model.eval(rng.integers(0, model.hp.n_vocab, size=n_past), want_logits=False)
        run = _Pass(model, rng.integers(0, model.hp.n_vocab, size=n_tokens).astype(np.int32), n_past)
        # warm-up: compiles every kernel, sizes every buffer, records every call's output
        with OpProfiler(B, timed=False) as warm:
            run()
        B.synchronize()
        prof = None
        if B.name == "cuda":
            try:
                prof = _by_removal(B, run, warm, reps)
            except Exception as e:      # noqa: BLE001 - capture is not possible for every pass
                B.synchronize()
                method = f"events around eager calls (not capturable: {type(e).__name__})"
        else:
            method = "host clock per call"
        if prof is None:
            with OpProfiler(B) as timer:
                timer.hold_gpu()
                run()
            rows = timer.rows()
            prof = Profile(rows, sum(r.total_us for r in rows), method)
    model.n_past = n_past
    return prof


def _by_removal(B, run: _Pass, warm: OpProfiler, reps: int) -> Profile:
    cp = B.cp

    def timed_graph(skip) -> float:
        B.stream.begin_capture()
        try:
            with OpProfiler(B, skip=skip, outputs=warm.outputs, timed=False):
                run()
        finally:
            graph = B.stream.end_capture()
        for _ in range(2):
            graph.launch(B.stream)
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        samples = []
        for _ in range(reps):
            start.record(B.stream)
            graph.launch(B.stream)
            stop.record(B.stream)
            stop.synchronize()
            samples.append(cp.cuda.get_elapsed_time(start, stop) * 1000.0)
        return float(sorted(samples)[len(samples) // 2])
    full = timed_graph(frozenset())
    rows = [OpRow(label, calls, full - timed_graph(frozenset({label}))) for label, calls in warm.leaves.items()]
    return Profile(sorted(rows, key=lambda r: -r.total_us), full,
                   "CUDA graph of the pass, each row the time saved by removing that op's calls")


class _Pass:
    """The forward pass on fixed device inputs (uploaded once: no copy from the host may
    sit inside a captured graph)."""

    def __init__(self, model, toks, n_past: int):
        import numpy as np
        B = model.backend
        self.model, self.n_past, self.n = model, n_past, toks.size
        self.tokens = B.to_device(toks, "prof_tokens")
        self.pos = B.to_device(np.arange(n_past, n_past + toks.size, dtype=np.int32), "prof_pos")

    def __call__(self):
        B = self.model.backend
        with B.decoding() if self.n == 1 else contextlib.nullcontext():   # launched as decode_step does
            return self.model._forward(self.model, self.tokens, self.pos, self.n_past, self.n, True)


def format_profile(p: Profile, title: str) -> str:
    total = p.total_us or 1.0
    out = [f"{title} ({p.method})", f"{'op':<26} {'calls':>6} {'us/call':>9} {'total us':>10} {'share':>7}"]
    for r in p.rows:
        out.append(f"{r.label:<26} {r.calls:>6} {r.per_call_us:>9.2f} {r.total_us:>10.1f} "
                   f"{100 * r.total_us / total:>6.1f}%")
    rest = p.total_us - sum(r.total_us for r in p.rows)
    if abs(rest) > 0.005 * total:
        out.append(f"{'(not attributed)':<26} {'':>6} {'':>9} {rest:>10.1f} {100 * rest / total:>6.1f}%")
    out.append(f"{'whole pass':<26} {sum(r.calls for r in p.rows):>6} {'':>9} {p.total_us:>10.1f}")
    if p.method.startswith("CUDA graph"):
        out.append("(a removed op also leaves later ops other data to read, the residual stream and the next "
                   "layer's routing among them: small rows carry that noise, large rows and the whole pass do not)")
    return "\n".join(out)
