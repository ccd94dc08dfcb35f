"""Timing on the GPU: CUDA events around CUDA-graph replays, warm-up first, the median of
many repetitions. A graph holds `calls` consecutive calls (cycling through the input sets
the caller rotates), so launch gaps of the Python host do not count and the time per call
is what the GPU spends, as in a model's captured decode step."""
from __future__ import annotations

import statistics
from dataclasses import dataclass


@dataclass(frozen=True)
class Timing:
    median_us: float
    min_us: float
    spread: float      # (p90 - p10) / median over the repetitions
    reps: int
    graph: bool


def time_calls(fn, n_inputs: int, *, calls: int = 10, reps: int = 30, warmup: int = 3,
               use_graph: bool = True) -> Timing:
    """fn(i) launches one call on input set i (never synchronizing when use_graph)."""
    import cupy as cp
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        for i in range(max(warmup, n_inputs)):
            fn(i % n_inputs)
        stream.synchronize()
        graph = None
        if use_graph:
            stream.begin_capture()
            try:
                for i in range(calls):
                    fn(i % n_inputs)
            finally:
                graph = stream.end_capture()
            graph.launch(stream)
            stream.synchronize()
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        samples = []
        for r in range(reps):
            start.record(stream)
            if graph is not None:
                graph.launch(stream)
            else:
                for i in range(calls):
                    fn((r * calls + i) % n_inputs)
            stop.record(stream)
            stop.synchronize()
            samples.append(cp.cuda.get_elapsed_time(start, stop) * 1000.0 / calls)
    samples.sort()
    med = statistics.median(samples)
    p10, p90 = samples[len(samples) // 10], samples[(9 * len(samples)) // 10]
    return Timing(med, samples[0], (p90 - p10) / med if med else 0.0, reps, graph is not None)


def copy_bandwidth_gbs(nbytes: int = 1 << 30, reps: int = 10) -> float:
    """Device-to-device copy, bytes read plus bytes written per second (GB/s)."""
    import cupy as cp
    a = cp.empty(nbytes // 4, dtype=cp.float32)
    a[:] = 1.0
    b = cp.empty_like(a)
    b.data.copy_from_device(a.data, a.nbytes)
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    times = []
    for _ in range(reps):
        start.record()
        b.data.copy_from_device(a.data, a.nbytes)
        stop.record()
        stop.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, stop) / 1000.0)
    del a, b
    return 2 * nbytes / statistics.median(times) / 1e9
