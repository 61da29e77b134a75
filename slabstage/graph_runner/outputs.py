"""A forward's outputs (a tensor, or a tuple/list/dict of tensors, token axis first): cut to their first
rows, written into another graph's static outputs, compared bit for bit."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["first_rows", "into_static", "bit_equal"]


def first_rows(out: Any, n: int, clone: bool) -> Any:
    """``out`` (a tensor, or a tuple/list/dict of them) cut to its first ``n`` rows; ``TypeError`` for anything
    else, ``ValueError`` for a 0-d tensor (no token axis)."""
    if isinstance(out, torch.Tensor):
        if not out.dim():
            raise ValueError("forward must return tensors whose first axis is the token axis; got a 0-d tensor")
        return out[:n].clone() if clone else out[:n]
    if isinstance(out, dict):
        return {k: first_rows(v, n, clone) for k, v in out.items()}
    if isinstance(out, (tuple, list)):
        return type(out)(first_rows(v, n, clone) for v in out)
    raise TypeError(f"forward must return a tensor, or a tuple/list/dict of tensors; got {type(out).__name__}")


def into_static(out: Any, static: Any) -> Any:
    """Copy ``out`` into the first rows of ``static`` (same structure) and return those views.

    Inside a capture this adds one copy per output to the graph and lets the
    graph's own output tensors go back to the pool, so the whole ladder takes
    about the memory of its largest bucket. Outputs that do not line up with the
    static ones (another structure, dtype or row shape) are kept as they are.
    """
    if isinstance(out, torch.Tensor):
        if (isinstance(static, torch.Tensor) and out.dtype == static.dtype and out.dim() >= 1
                and out.shape[1:] == static.shape[1:] and out.shape[0] <= static.shape[0]):
            dst = static[:out.shape[0]]
            if dst.data_ptr() != out.data_ptr():
                dst.copy_(out)
            return dst
        return out
    if isinstance(out, dict) and isinstance(static, dict) and out.keys() == static.keys():
        return {k: into_static(v, static[k]) for k, v in out.items()}
    if isinstance(out, (tuple, list)) and isinstance(static, (tuple, list)) and len(out) == len(static):
        return type(out)(into_static(v, w) for v, w in zip(out, static))
    return out


def bit_equal(a: Any, b: Any) -> tuple[bool, float]:
    """Whether two outputs (tensors or containers of them) are equal bit for bit, and their largest difference.

    Reads the difference back to the host (a sync): for the capture check, not for the run path.
    """
    if isinstance(a, torch.Tensor):
        if a.shape != b.shape or a.dtype != b.dtype:
            return False, float("inf")
        same = torch.equal(_bits(a), _bits(b))  # (NaN equals NaN, -0.0 differs from 0.0: bit for bit)
        diff = 0.0 if same else (a.double() - b.double()).abs().nan_to_num(float("inf")).max().item()
        return same, diff
    pairs = zip(a.values(), b.values()) if isinstance(a, dict) else zip(a, b)
    results = [bit_equal(x, y) for x, y in pairs]
    return all(r[0] for r in results), max([r[1] for r in results], default=0.0)


def _bits(t: torch.Tensor) -> torch.Tensor:
    if not t.dtype.is_floating_point or not t.dim():
        return t
    return t.contiguous().view(torch.uint8)
