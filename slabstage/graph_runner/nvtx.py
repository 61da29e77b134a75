"""Named ranges that show up in Nsight Systems (NVTX) and in torch.profiler traces."""

from __future__ import annotations

from contextlib import contextmanager
from types import SimpleNamespace

import torch

__all__ = ["nvtx_range", "range_push", "range_pop", "RANGES"]

RANGES = ("slabstage.stage", "slabstage.replay", "slabstage.eager", "slabstage.capture")

_HAS_NVTX = torch.cuda.is_available()
_nvtx = torch.cuda.nvtx._nvtx if _HAS_NVTX and hasattr(torch.cuda.nvtx, "_nvtx") else None
_push = _nvtx.rangePushA if _nvtx is not None else torch.cuda.nvtx.range_push
_pop = _nvtx.rangePop if _nvtx is not None else torch.cuda.nvtx.range_pop
# torch.autograd.profiler._is_profiler_enabled is True while torch.profiler records
_profiler = torch.autograd.profiler if hasattr(torch.autograd.profiler, "_is_profiler_enabled") \
    else SimpleNamespace(_is_profiler_enabled=False)
_open: list = []  # torch.profiler records opened by range_push, or None where none recorded


def range_push(name: str) -> None:
    """Open an NVTX range (with CUDA) and, while torch.profiler records, a profiler range.

    The hot path's form: no generator, no allocation when nothing records.
    """
    if _profiler._is_profiler_enabled:
        record = torch.profiler.record_function(name)
        record.__enter__()
        _open.append(record)
    else:
        _open.append(None)
    if _HAS_NVTX:
        _push(name)


def range_pop() -> None:
    if _HAS_NVTX:
        _pop()
    record = _open.pop()
    if record is not None:
        record.__exit__(None, None, None)


@contextmanager
def nvtx_range(name: str):
    """``with nvtx_range(name):`` — :func:`range_push` / :func:`range_pop` around a block."""
    range_push(name)
    try:
        yield
    finally:
        range_pop()
