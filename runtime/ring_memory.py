"""Device memory whose rows repeat: a range of n_ctx rows backed by `rows` rows of memory,
row p and row p + rows being one and the same. A sliding-window layer's KV cache lives in
one (runtime.kv_cache): every kernel keeps addressing it by position, and the ring
costs nothing where it runs.

CUDA's virtual memory management (driver API, through ctypes: CuPy does not wrap it)
reserves the range and maps one physical allocation into it again and again. The ring's
size must be a whole number of the device's granularity (2 MiB on the cards moeforge
builds for), which kv_cache.ring_rows takes as its unit.
"""
from __future__ import annotations

import ctypes
import functools
import weakref

import numpy as np

_PINNED, _DEVICE, _READWRITE, _GRANULARITY_MINIMUM = 1, 1, 3, 0


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class _AllocationProp(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", _Location),
                ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", _AllocFlags)]


class _AccessDesc(ctypes.Structure):
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


@functools.cache
def _driver():
    return ctypes.CDLL("libcuda.so.1")


def _check(rc: int, what: str) -> None:
    if rc != 0:
        name = ctypes.c_char_p()
        _driver().cuGetErrorName(rc, ctypes.byref(name))
        raise RuntimeError(f"moeforge ring memory: {what} failed: {(name.value or b'?').decode()} ({rc})")


def _prop(device: int) -> _AllocationProp:
    p = _AllocationProp()
    p.type, p.location.type, p.location.id = _PINNED, _DEVICE, device
    return p


@functools.cache
def granularity(device: int) -> int:
    """Bytes a mapping's size and offset are whole multiples of."""
    g = ctypes.c_size_t()
    _check(_driver().cuMemGetAllocationGranularity(ctypes.byref(g), ctypes.byref(_prop(device)),
                                                   _GRANULARITY_MINIMUM), "cuMemGetAllocationGranularity")
    return g.value


def _release(ptr: int, size: int, pieces: list[int]) -> None:
    """Unmap and free a range, once the kernels that may still read it are done (at exit,
    where the context is gone already, the calls fail harmlessly)."""
    d = _driver()
    d.cuCtxSynchronize()
    for off, n in pieces:
        d.cuMemUnmap(ctypes.c_uint64(ptr + off), ctypes.c_size_t(n))
    d.cuMemAddressFree(ctypes.c_uint64(ptr), ctypes.c_size_t(size))


class RingMemory:
    """`ring_bytes` of device memory seen over a range of at least `span_bytes` (zeroed)."""

    def __init__(self, cp, ring_bytes: int, span_bytes: int):
        device = cp.cuda.Device().id
        gran = granularity(device)
        if ring_bytes % gran:
            raise ValueError(f"a ring of {ring_bytes} bytes is not a whole number of the device's "
                             f"{gran}-byte granularity")
        cp.cuda.runtime.free(0)                     # the device's context is current from here on
        d = _driver()
        self.size = -(-span_bytes // ring_bytes) * ring_bytes
        handle, ptr = ctypes.c_uint64(), ctypes.c_uint64()
        _check(d.cuMemCreate(ctypes.byref(handle), ctypes.c_size_t(ring_bytes), ctypes.byref(_prop(device)),
                             ctypes.c_uint64(0)), f"cuMemCreate of {ring_bytes} bytes")
        pieces = []
        try:
            _check(d.cuMemAddressReserve(ctypes.byref(ptr), ctypes.c_size_t(self.size), ctypes.c_size_t(0),
                                         ctypes.c_uint64(0), ctypes.c_uint64(0)), f"cuMemAddressReserve of {self.size}")
            for off in range(0, self.size, ring_bytes):
                _check(d.cuMemMap(ctypes.c_uint64(ptr.value + off), ctypes.c_size_t(ring_bytes), ctypes.c_size_t(0),
                                  handle, ctypes.c_uint64(0)), "cuMemMap")
                pieces.append((off, ring_bytes))
            access = _AccessDesc()
            access.location.type, access.location.id, access.flags = _DEVICE, device, _READWRITE
            _check(d.cuMemSetAccess(ctypes.c_uint64(ptr.value), ctypes.c_size_t(self.size), ctypes.byref(access),
                                    ctypes.c_size_t(1)), "cuMemSetAccess")
        except BaseException:
            if ptr.value:
                _release(ptr.value, self.size, pieces)
            raise
        finally:
            # the mappings keep the memory alive; it is freed with the last of them
            d.cuMemRelease(handle)
        self.ptr, self.ring_bytes = ptr.value, ring_bytes
        self._free = weakref.finalize(self, _release, ptr.value, self.size, pieces)
        cp.cuda.runtime.memset(self.ptr, 0, ring_bytes)


def ring_array(cp, rows: int, n_ctx: int, kv_dim: int, dtype):
    """A (n_ctx, kv_dim) array whose row p is row p mod rows (rows * kv_dim * itemsize a
    whole number of granularity())."""
    row_bytes = kv_dim * np.dtype(dtype).itemsize
    mem = RingMemory(cp, rows * row_bytes, n_ctx * row_bytes)
    ptr = cp.cuda.MemoryPointer(cp.cuda.UnownedMemory(mem.ptr, mem.size, mem, cp.cuda.Device().id), 0)
    return cp.ndarray((n_ctx, kv_dim), dtype=dtype, memptr=ptr)
