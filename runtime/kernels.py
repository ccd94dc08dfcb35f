"""Loading compiled instances on the GPU. Compilation (and rendering) is codegen's job:
the runtime asks for a cubin and loads it, once per spec and device."""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from ..codegen.compile import compile_spec
from ..codegen.spec import KernelSpec, MmfSpec, MmqSpec
from .device import device_info, require_gpu
from .launch_ex import launch_pdl, pdl_available


@dataclass
class LoadedKernel:
    spec: KernelSpec
    function: object       # cupy RawKernel-like callable
    registers: int
    spilled: bool          # ptxas spilled registers to local memory (-v: spill stores)
    smem: int              # dynamic shared memory of a launch, when the spec fixes it
    blocks_per_sm: int     # occupancy from registers, shared memory and threads
    smem_limit: int        # the device's per-block opt-in maximum
    pdl: bool = False      # launched with programmatic dependent launch (spec asks, sm_90+)
    pdl_ok: bool = False   # the device has PDL (and MOEFORGE_PDL is not 0)
    _raised: int = 0        # the opt-in limit raised to this; static + dynamic past 48 KiB needs it

    def __call__(self, grid, args, *, block=None, smem=None, stream=None, pdl=None):
        """pdl: None as the spec asks; True for a kernel that waits for the grid before it
        (griddepcontrol.wait) before touching memory; ignored where the device lacks PDL."""
        threads = block or getattr(self.spec, "threads", 256)
        smem = self.smem if smem is None else smem
        if smem > self._raised:
            if smem > self.smem_limit:
                raise ValueError(f"{self.spec.name} needs {smem} bytes of shared memory; the device allows "
                                 f"{self.smem_limit}")
            self.function.max_dynamic_shared_size_bytes = smem
            self._raised = smem
        if (self.pdl if pdl is None else pdl) and self.pdl_ok:
            cp = require_gpu()
            launch_pdl(self.function, grid, threads, smem, (stream or cp.cuda.get_current_stream()).ptr, args)
        else:
            self.function(grid, (threads,), args, shared_mem=smem, stream=stream)


def grid_1d(total: int, block: int = 256) -> tuple[int]:
    """Blocks of `block` threads covering `total` items (at least one block)."""
    return (max(1, -(-int(total) // block)),)


def _occupancy(info: dict, regs: int, threads: int, smem: int) -> int:
    by_regs = info["regs_per_sm"] // max(1, regs * threads) if regs else 32
    by_smem = (info["smem_per_sm"] - 1024) // (smem + 1024) if smem else 32
    by_threads = info["max_threads_per_sm"] // threads
    return max(0, min(by_regs, by_smem, by_threads, 32))


@lru_cache(maxsize=None)
def _module(spec: KernelSpec, device_id: int):
    cp = require_gpu(f"loading {spec.name}")
    info = device_info(device_id)
    compiled = compile_spec(spec, info["arch"])
    with cp.cuda.Device(device_id):
        return cp.RawModule(path=str(compiled.cubin)), compiled


def load(spec: KernelSpec, symbol: str | None = None) -> LoadedKernel:
    cp = require_gpu(f"running {spec.name}")
    dev = cp.cuda.Device().id
    return _loaded(spec, symbol or spec.symbol, dev)


@lru_cache(maxsize=None)
def _loaded(spec: KernelSpec, symbol: str, dev: int) -> LoadedKernel:
    module, compiled = _module(spec, dev)
    info = device_info(dev)
    fn = module.get_function(symbol)
    smem = spec.smem_bytes() if isinstance(spec, (MmqSpec, MmfSpec)) and symbol == spec.symbol else 0
    if smem > info["smem_per_block_optin"]:
        raise ValueError(f"{spec.name} needs {smem} bytes of shared memory; {info['name']} allows "
                         f"{info['smem_per_block_optin']}")
    regs = compiled.info.get(symbol, {}).get("registers", 0)
    threads = getattr(spec, "threads", 256)
    ok = pdl_available(info["cc"])
    spilled = compiled.info.get(symbol, {}).get("spill_stores", 0) > 0
    return LoadedKernel(spec, fn, regs, spilled, smem, _occupancy(info, regs, threads, smem),
                        info["smem_per_block_optin"], bool(getattr(spec, "pdl", False)) and ok, ok)
