"""A stand-in for the GPU objective: a deterministic function of the spec's parameters,
computed on the CPU. It lets the whole driver (storage, workers, heartbeats, resume,
profile writing, the CLI) run and be tested where there is no GPU.

Environment (for tests): MOEFORGE_STANDIN_SLEEP seconds per trial (so a worker can be killed
mid-trial), MOEFORGE_STANDIN_LOG a file that gets one "start"/"end" line per evaluation
(appended with O_APPEND, so lines from many processes never interleave),
MOEFORGE_STANDIN_WRONG a spec-name fragment whose candidates give a wrong result.
"""
from __future__ import annotations

import math
import os
import signal
import time

from .gate import GateFailure


def value(path: str, spec: dict) -> float:
    """Smooth enough for a sampler to learn, with one best point per path."""
    if spec["family"] == "mmvq":
        return 10.0 + abs(spec["tokens"] - 4) + 0.5 * abs(spec["warps"] - 4) + 0.25 * spec["rows"]
    base = {"mmq_id": 20.0, "per_expert": 24.0, "mmq": 22.0, "mmf_id": 26.0, "mmf": 26.0}[path]
    return (base + abs(math.log2(spec["x"]) - 4) * 3 + (spec["y"] // 64) * 0.7 + spec["warps"] * 0.1
            + (0.0 if spec["stages"] == 3 else 0.4) + (0.0 if spec.get("stream_k", True) else 0.9))


def _log(event: str, req: dict) -> None:
    path = os.environ.get("MOEFORGE_STANDIN_LOG")
    if not path:
        return
    line = f"{event} {req.get('study', '-')} {req.get('trial', -1)} {os.getpid()}\n".encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


class Handler:
    def __call__(self, req: dict) -> dict:
        op = req.get("op", "trial")
        if op == "prepare":
            return {"prepared": True}
        # Misbehaviours a real kernel can show, for the isolation tests.
        if op == "crash":
            os.kill(os.getpid(), signal.SIGSEGV)
        if op == "hang":
            time.sleep(3600)
        if op == "wrong":
            raise GateFailure("NMSE vs the emulating reference 1.000e+00 > 1e-10")
        wrong = os.environ.get("MOEFORGE_STANDIN_WRONG")
        if wrong:
            from ..codegen.spec import KernelSpec
            if wrong in KernelSpec.from_dict(req["spec"]).name:
                raise GateFailure(f"NMSE vs the emulating reference 3.2e-03 > 1e-10 (stand-in: {wrong})")
        _log("start", req)
        time.sleep(float(os.environ.get("MOEFORGE_STANDIN_SLEEP", "0")))
        v = value(req["path"], req["spec"])
        _log("end", req)
        return {"value": v, "us_random": v, "us_skewed": v, "nmse_emulated": 0.0, "nmse_float": 0.0}
