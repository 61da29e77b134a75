"""Named ranges that show up in Nsight Systems (NVTX) and in torch.profiler traces."""

from __future__ import annotations

from contextlib import contextmanager

import torch

__all__ = ["nvtx_range", "RANGES"]

RANGES = ("slabstage.stage", "slabstage.replay", "slabstage.eager", "slabstage.capture")

_HAS_NVTX = torch.cuda.is_available()


def _profiler_on() -> bool:
    try:
        return torch.autograd.profiler._is_profiler_enabled
    except AttributeError:  # pragma: no cover - older torch
        return False


@contextmanager
def nvtx_range(name: str):
    """An NVTX range (when CUDA is there), and a torch.profiler range while one records.

    Cheap when nothing records: one push and one pop, no allocation.
    """
    record = torch.profiler.record_function(name) if _profiler_on() else None
    if record is not None:
        record.__enter__()
    if _HAS_NVTX:
        torch.cuda.nvtx.range_push(name)
    try:
        yield
    finally:
        if _HAS_NVTX:
            torch.cuda.nvtx.range_pop()
        if record is not None:
            record.__exit__(None, None, None)
