"""The CUDA driver calls that move a replay's parameter record (docs/design.md, "A replay's parameter record").

Four calls a replay, through ctypes: a few hundred ns each on the host, where the same four steps through
torch's streams and events took 44-55 µs on an H200's host. Each returns the driver's ``CUresult``; callers OR
the results of a run of calls and hand a nonzero one to :func:`fail`.
"""

from __future__ import annotations

import ctypes
import sys

__all__ = ["calls", "fail", "Event"]

_LIB = None
EVENT_DISABLE_TIMING = 2  # CU_EVENT_DISABLE_TIMING
EVENT_RECORD_EXTERNAL = 1  # CU_EVENT_RECORD_EXTERNAL: captured as an event-record node
_INVALID_CONTEXT = 201  # CUDA_ERROR_INVALID_CONTEXT: no context current on this thread yet


class _Calls:
    """The driver's functions, typed: ``wait(stream, event)``, ``copy_in(dst, src, bytes, stream)`` (host to
    device), ``record(event, stream)``, ``record_external(event, stream)`` (captured as an event-record node)."""

    def __init__(self, lib) -> None:
        p, u, z = ctypes.c_void_p, ctypes.c_uint, ctypes.c_size_t
        u64 = ctypes.c_uint64

        def fn(name, *argtypes):
            f = getattr(lib, name)
            f.argtypes, f.restype = argtypes, ctypes.c_int
            return f

        self._wait = fn("cuStreamWaitEvent", p, p, u)
        self.copy_in = fn("cuMemcpyHtoDAsync_v2", u64, p, z, p)
        self.record = fn("cuEventRecord", p, p)
        self._record_flags = fn("cuEventRecordWithFlags", p, p, u)
        self.event_create = fn("cuEventCreate", ctypes.POINTER(p), u)
        self.event_destroy = fn("cuEventDestroy_v2", p)
        self.error_name = fn("cuGetErrorName", ctypes.c_int, ctypes.POINTER(ctypes.c_char_p))
        self.device_get = fn("cuDeviceGet", ctypes.POINTER(ctypes.c_int), ctypes.c_int)
        self.primary_retain = fn("cuDevicePrimaryCtxRetain", ctypes.POINTER(p), ctypes.c_int)
        self.context_set = fn("cuCtxSetCurrent", p)

    def wait(self, stream: int, event: int) -> int:
        return self._wait(stream, event, 0)

    def record_external(self, event: int, stream: int) -> int:
        return self._record_flags(event, stream, EVENT_RECORD_EXTERNAL)


def calls() -> _Calls:
    """The driver's calls (loaded on first use: only a CUDA device's graphs need them)."""
    global _LIB
    if _LIB is None:
        _LIB = _Calls(ctypes.CDLL("nvcuda.dll" if sys.platform == "win32" else "libcuda.so.1"))
    return _LIB


def fail(result: int, what: str, device_index: int, retried: bool = False) -> bool:
    """Raise for a nonzero ``result`` of ``what`` (the OR of a run of calls' results); True for
    CUDA_ERROR_INVALID_CONTEXT not ``retried`` yet, after making the device's primary context current on this
    thread (a thread whose first CUDA call is ours): the caller retries once."""
    lib = calls()
    if result == _INVALID_CONTEXT and not retried:
        dev, ctx = ctypes.c_int(), ctypes.c_void_p()
        if not (lib.device_get(ctypes.byref(dev), device_index) or lib.primary_retain(ctypes.byref(ctx), dev)
                or lib.context_set(ctx)):
            return True
    name = ctypes.c_char_p()
    lib.error_name(result, ctypes.byref(name))
    raise RuntimeError(f"slabstage: {what} failed in the CUDA driver: {(name.value or b'?').decode()} ({result})")


class Event:
    """A CUDA event without timing, made by the driver (its handle is ``handle``), destroyed with this object."""

    def __init__(self, device_index: int) -> None:
        lib, h = calls(), ctypes.c_void_p()
        for retry in (False, True):
            r = lib.event_create(ctypes.byref(h), EVENT_DISABLE_TIMING)
            if not r or not fail(r, "cuEventCreate", device_index, retry):
                break
        self.handle, self._lib = h.value, lib

    def __del__(self) -> None:
        if self.handle:
            self._lib.event_destroy(self.handle)  # (an event still pending is freed once it completes)
            self.handle = 0
