"""Launches through the driver's cuLaunchKernelEx, for the launch attribute CuPy's
RawKernel does not expose: programmatic dependent launch (PDL, sm_90+). The launch joins
the current stream like any other, so it is captured into CUDA graphs as well."""
from __future__ import annotations

import ctypes
import os
from functools import lru_cache

import numpy as np

# CUlaunchAttributeID: CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
_PROGRAMMATIC_STREAM_SERIALIZATION = 6


class _Config(ctypes.Structure):      # CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("smem", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.c_void_p), ("n_attrs", ctypes.c_uint)]


class _Attribute(ctypes.Structure):   # CUlaunchAttribute: id, padding, a 64-byte value union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_int), ("value", ctypes.c_ubyte * 64)]


@lru_cache(maxsize=1)
def _driver():
    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuLaunchKernelEx.argtypes = [ctypes.POINTER(_Config), ctypes.c_void_p,
                                     ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
    lib.cuLaunchKernelEx.restype = ctypes.c_int
    return lib


@lru_cache(maxsize=1)
def _pdl_attribute() -> _Attribute:
    a = _Attribute()
    a.id = _PROGRAMMATIC_STREAM_SERIALIZATION
    ctypes.c_int.from_buffer(a.value).value = 1
    return a


def pdl_available(cc: str) -> bool:
    """PDL where the card has it (sm_90 and later), unless MOEFORGE_PDL=0 asks for ordinary
    launches everywhere (to compare, or to rule it out); the kernels run the same either way."""
    return int(cc.split(".")[0]) >= 9 and os.environ.get("MOEFORGE_PDL", "1") != "0"


def _c_arg(a):
    if isinstance(a, np.uint64):
        return ctypes.c_uint64(int(a))
    if isinstance(a, np.int64):
        return ctypes.c_int64(int(a))
    if isinstance(a, np.int32):
        return ctypes.c_int32(int(a))
    if isinstance(a, np.float32):
        return ctypes.c_float(float(a))
    if hasattr(a, "data") and hasattr(a.data, "ptr"):      # a CuPy array
        return ctypes.c_void_p(a.data.ptr)
    raise TypeError(f"cannot pass {type(a).__name__} to a kernel launched with cuLaunchKernelEx")


def launch_pdl(function, grid: tuple, threads: int, smem: int, stream_ptr: int, args: tuple) -> None:
    """function: a CuPy RawKernel (or Function); args as for RawKernel calls."""
    fn = getattr(function, "kernel", function)      # RawKernel -> its Function
    cargs = [_c_arg(a) for a in args]
    argv = (ctypes.c_void_p * len(cargs))(*[ctypes.addressof(c) for c in cargs])
    g = tuple(grid) + (1,) * (3 - len(grid))
    cfg = _Config((ctypes.c_uint * 3)(*g), (ctypes.c_uint * 3)(threads, 1, 1), smem, stream_ptr,
                  ctypes.addressof(_pdl_attribute()), 1)
    err = _driver().cuLaunchKernelEx(ctypes.byref(cfg), ctypes.c_void_p(fn.ptr), argv, None)
    if err != 0:
        raise RuntimeError(f"cuLaunchKernelEx failed with CUresult {err}")
