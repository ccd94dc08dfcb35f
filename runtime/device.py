"""The CUDA device as moeforge sees it: whether there is one, and its fingerprint."""
from __future__ import annotations

from functools import lru_cache


class NoGPUError(RuntimeError):
    pass


def cupy_or_none():
    try:
        import cupy
    except Exception:  # ImportError, or a broken CUDA install
        return None
    return cupy


@lru_cache(maxsize=None)
def has_gpu() -> bool:
    cp = cupy_or_none()
    if cp is None:
        return False
    try:
        return cp.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def require_gpu(what: str = "this operation"):
    if not has_gpu():
        raise NoGPUError(f"{what} needs a CUDA device, and none was found")
    return cupy_or_none()


@lru_cache(maxsize=None)
def device_info(device: int | None = None) -> dict:
    """Everything that can change which kernel is fastest or what it computes."""
    cp = require_gpu("reading the device fingerprint")
    from cupy_backends.cuda.libs import nvrtc
    dev = cp.cuda.Device(device) if device is not None else cp.cuda.Device()
    props = cp.cuda.runtime.getDeviceProperties(dev.id)
    name = props["name"]
    name = name.decode() if isinstance(name, bytes) else str(name)
    major, minor = props["major"], props["minor"]
    drv = cp.cuda.runtime.driverGetVersion()
    rt = cp.cuda.runtime.runtimeGetVersion()
    nv = nvrtc.getVersion()
    return {
        "id": dev.id,
        "name": name,
        "cc": f"{major}.{minor}",
        "arch": f"sm_{major}{minor}",
        "sm_count": int(props["multiProcessorCount"]),
        "memory_gib": round(props["totalGlobalMem"] / 2**30, 1),
        "l2_bytes": int(props["l2CacheSize"]),
        "smem_per_block_optin": int(props.get("sharedMemPerBlockOptin", 49152)),
        "smem_per_sm": int(props.get("sharedMemPerMultiprocessor", 65536)),
        "regs_per_sm": int(props.get("regsPerMultiprocessor", 65536)),
        "max_threads_per_sm": int(props.get("maxThreadsPerMultiProcessor", 2048)),
        "driver": f"{drv // 1000}.{(drv % 1000) // 10}",
        "cuda_runtime": f"{rt // 1000}.{(rt % 1000) // 10}",
        "nvrtc": f"{nv[0]}.{nv[1]}",
    }
