"""CUDA source -> cubin with NVRTC, cached on disk by everything that changes the result.

Uses the raw NVRTC bindings that CuPy ships, which need neither a GPU nor a driver, so
every instance compiles on a CPU-only machine. The cache key is the hash of the source,
the options, the NVRTC version and the architecture; files are written atomically.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from ..fsutil import atomic_write
from .render import render
from .spec import KernelSpec

ARCHS = ("sm_80", "sm_86", "sm_89", "sm_90")
BASE_OPTIONS = ("-std=c++17", "--ptxas-options=-v")


def nvrtc_version() -> str:
    from cupy_backends.cuda.libs import nvrtc
    major, minor = nvrtc.getVersion()
    return f"{major}.{minor}"


def default_build_dir() -> Path:
    """MOEFORGE_BUILD_DIR, else build/ of a source checkout, else the user cache."""
    env = os.environ.get("MOEFORGE_BUILD_DIR")
    if env:
        return Path(env)
    checkout = Path(__file__).resolve().parent.parent
    if (checkout / "pyproject.toml").exists() and os.access(checkout, os.W_OK):
        return checkout / "build"
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return cache / "moeforge" / "build"


@dataclass(frozen=True)
class CompiledKernel:
    name: str
    arch: str
    cubin: Path
    info: dict            # per C symbol: registers, spill bytes, stack, shared memory (wgmma_serialized: C7520)
    cached: bool


class CompileError(RuntimeError):
    pass


_PTXAS_FUNC = re.compile(r"Compiling entry function '(\w+)'")
_PTXAS_STACK = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_PTXAS_REGS = re.compile(r"Used (\d+) registers(?:.*?(\d+) bytes smem)?")
# ptxas issues a kernel's wgmma one at a time where it cannot prove the accumulators safe
# (C7520): still right, but the asynchronous pipeline the kernel was written for is gone
_PTXAS_WGMMA_SERIAL = re.compile(r"wgmma\.mma_async instructions are serialized.*function '(\w+)'")


def parse_ptxas(log: str) -> dict[str, dict]:
    info: dict[str, dict] = {}
    current = None
    serialized = set()
    for line in log.splitlines():
        if m := _PTXAS_WGMMA_SERIAL.search(line):
            serialized.add(m.group(1))
        elif m := _PTXAS_FUNC.search(line):
            current = info.setdefault(m.group(1), {"registers": 0, "spill_stores": 0,
                                                   "spill_loads": 0, "stack": 0, "smem": 0})
        elif current is not None and (m := _PTXAS_STACK.search(line)):
            current["stack"], current["spill_stores"], current["spill_loads"] = map(int, m.groups())
        elif current is not None and (m := _PTXAS_REGS.search(line)):
            current["registers"] = int(m.group(1))
            current["smem"] = int(m.group(2) or 0)
    for name in serialized:
        info.setdefault(name, {})["wgmma_serialized"] = True
    return info


def _atomic_write(path: Path, data: bytes) -> None:
    # a cache entry can be rebuilt: no fsync, just never a half-written file
    atomic_write(path, data, fsync=False)


def nvrtc_compile(source: str, name: str, arch: str, options: tuple[str, ...] = BASE_OPTIONS) -> tuple[bytes, str]:
    from cupy_backends.cuda.libs import nvrtc
    prog = nvrtc.createProgram(source, name + ".cu", [], [])
    try:
        try:
            nvrtc.compileProgram(prog, [f"--gpu-architecture={arch}", *options])
        except nvrtc.NVRTCError as e:
            raise CompileError(f"{name} ({arch}): {e}\n{nvrtc.getProgramLog(prog)}") from None
        return nvrtc.getCUBIN(prog), nvrtc.getProgramLog(prog)
    finally:
        nvrtc.destroyProgram(prog)


def compile_spec(spec: KernelSpec, arch: str, build_dir: Path | None = None) -> CompiledKernel:
    build_dir = Path(build_dir) if build_dir else default_build_dir()
    source = render(spec)
    target = spec.nvrtc_arch(arch)    # sm_90a for the instances that use its wgmma
    key = hashlib.sha256("\0".join([source, target, *BASE_OPTIONS, nvrtc_version()]).encode()).hexdigest()[:16]
    stem = build_dir / arch / f"{spec.name}.{key}"
    cubin, meta, src = (stem.parent / f"{stem.name}{ext}" for ext in (".cubin", ".json", ".cu"))
    if cubin.exists() and meta.exists():
        try:
            info = json.loads(meta.read_text())["kernels"]
            return CompiledKernel(spec.name, arch, cubin, info, cached=True)
        except (ValueError, KeyError):
            pass  # a damaged entry is rebuilt, never trusted
    binary, log = nvrtc_compile(source, spec.name, target)
    info = parse_ptxas(log)
    _atomic_write(src, source.encode())
    _atomic_write(cubin, binary)
    _atomic_write(meta, json.dumps({"spec": spec.to_dict(), "arch": arch, "nvrtc": nvrtc_version(),
                                    "kernels": info, "log": log}, indent=1).encode())
    return CompiledKernel(spec.name, arch, cubin, info, cached=False)
