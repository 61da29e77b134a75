"""Build ``media_index`` (row -> media row, -1 for text) from what engines already have.

Kernel (from a mask): ``slabstage/kernels/media_index.py``; tests: ``tests/ops/test_media_index.py``.
"""

from __future__ import annotations

import numpy as np
import torch

from ..checks import INT32_MAX, check_int, is_int, overlap_message, tensors_overlap
from ..kernels.layout import MEDIA_COUNT_MISMATCH
from ..kernels.media_index import media_index_from_counts_kernel
from .launch import launch_context, use_triton
from .errors import check_error_word, default_error_word
from .reference import media_index_from_mask_reference

__all__ = ["media_index_from_spans", "media_index_from_mask", "to_device_pinned"]


def to_device_pinned(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Move a host tensor with one non-blocking copy from pinned memory (no host sync).

    The pinned block comes from PyTorch's caching host allocator, which does not
    hand it out again until the copy has finished, so nothing is overwritten early.
    """
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


_SPAN_FIELDS = ("dst_start", "length", "src_start")


def _count(name: str, v: object) -> int:
    """A count or offset that fits media_index (int32): ``check_int``, then ``>= 0``."""
    v = check_int(name, v, hi=INT32_MAX)
    if v < 0:
        raise ValueError(f"{name} must be >= 0, got {v}")
    return v


def _parse_span(k: int, span: object) -> tuple[int, int, int]:
    """(dst_start, length, src_start) of span ``k`` as ints in [0, INT32_MAX]; TypeError/ValueError naming it."""
    try:
        fields = tuple(span)
    except TypeError:
        raise TypeError(f"span {k} must be a (dst_start, length, src_start) tuple of ints, "
                        f"got {span!r} ({type(span).__name__})") from None
    if len(fields) != 3:
        raise ValueError(f"span {k} must be (dst_start, length, src_start), got {span!r}")
    for field, v in zip(_SPAN_FIELDS, fields):
        if not is_int(v):  # the one rule for ints (checks.is_int); the range is checked below, per field
            raise TypeError(f"span {k} field must be an int: {field} is {v!r} ({type(v).__name__}) in {span!r}")
    dst, length, src = (int(v) for v in fields)
    if dst < 0 or length < 0 or src < 0:
        raise ValueError(f"span {k} {span!r} has a negative value")
    for field, v in zip(_SPAN_FIELDS, (dst, length, src)):
        if v > INT32_MAX:
            raise ValueError(f"span {k} {field} = {v} is past int32 (media_index is int32: at most {INT32_MAX})")
    if length and src + length - 1 > INT32_MAX:
        raise ValueError(f"span {k} {span!r} reads media rows up to {src + length - 1}, past int32 "
                         f"(src_start + length - 1 must be at most {INT32_MAX})")
    return dst, length, src


def media_index_from_spans(spans, num_tokens: int, *, device, num_media_rows: int | None = None) -> torch.Tensor:
    """``int32[num_tokens]`` index from host-side spans, with no host sync.

    ``spans`` is an iterable of ``(dst_start, length, src_start)``: rows
    ``dst_start + i`` take media row ``src_start + i`` for ``i < length``; every
    other row is a text row (-1). Spans that overlap, run past ``num_tokens`` (or
    past ``num_media_rows`` when given), hold negative values or values past int32
    raise ``ValueError``; a span that is not a triple of ints raises ``TypeError`` or
    ``ValueError``. Each error names the span (its position in ``spans``).
    """
    num_tokens = _count("num_tokens", num_tokens)
    if num_media_rows is not None:
        num_media_rows = _count("num_media_rows", num_media_rows)
    try:
        spans = iter(spans)
    except TypeError:
        raise TypeError(f"spans must be an iterable of (dst_start, length, src_start) tuples, "
                        f"got {type(spans).__name__}") from None
    parsed = []
    for k, span in enumerate(spans):
        dst, length, src = _parse_span(k, span)
        if dst + length > num_tokens:
            raise ValueError(f"span {k} {span!r} runs past num_tokens={num_tokens}")
        if num_media_rows is not None and src + length > num_media_rows:
            raise ValueError(f"span {k} {span!r} reads past the {num_media_rows} media rows")
        if length:  # an empty span covers no row, so it overlaps nothing
            parsed.append((dst, length, src, k))
    parsed.sort()
    for (d0, l0, _, k0), (d1, _, _, k1) in zip(parsed, parsed[1:]):
        if d1 < d0 + l0:
            raise ValueError(f"spans {k0} and {k1} overlap at row {d1}")
    device = _usable(device)
    index = np.full(num_tokens, -1, dtype=np.int32)
    for dst, length, src, _ in parsed:
        index[dst:dst + length] = np.arange(src, src + length, dtype=np.int32)
    return to_device_pinned(torch.from_numpy(index), device)


def _usable(device) -> torch.device:
    """``device`` as a torch.device this process can use, else ``ValueError`` naming it."""
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device {device!r} is not a device: {e}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device} is not usable: this process has no CUDA device")
    return device


def media_index_from_mask(is_media: torch.Tensor, num_media_rows: int, *, src_start: int = 0,
                          errors: torch.Tensor | None = None) -> torch.Tensor:
    """``int32[n]`` index from a device placeholder mask, by prefix sum; no host sync.

    Row ``r`` with ``is_media[r]`` takes media row ``src_start + (placeholders before r)``;
    other rows get -1. ``src_start`` serves chunked prefill: a chunk whose first
    placeholder is media row ``src_start`` (an image cut by the chunk boundary) maps
    its k-th placeholder to row ``src_start + k``. ``num_media_rows`` is this chunk's
    placeholder count: a mask with a different count sets ``MEDIA_COUNT_MISMATCH`` in
    the error word (and word[3] = the count found); the staging kernel then also flags
    any index past the media rows.

    ``num_media_rows`` and ``src_start`` are ints >= 0 with ``src_start + n - 1`` and
    ``num_media_rows`` within int32; anything else raises ``TypeError``/``ValueError``
    before anything is written.
    """
    if not isinstance(is_media, torch.Tensor) or is_media.dim() != 1:
        raise ValueError(f"is_media must be a 1-D tensor, got {getattr(is_media, 'shape', is_media)!r}")
    if is_media.dtype != torch.bool:
        raise TypeError(f"is_media must be a bool tensor, got {is_media.dtype}")
    num_media_rows = _count("num_media_rows", num_media_rows)
    src_start = _count("src_start", src_start)
    n = is_media.shape[0]
    if n and src_start + n - 1 > INT32_MAX:
        raise ValueError(f"src_start={src_start} with {n} mask rows could index media row {src_start + n - 1}, "
                         f"past int32 (media_index is int32: at most {INT32_MAX})")
    errors = default_error_word(is_media.device) if errors is None else errors
    check_error_word(errors, is_media.device, "is_media")
    if tensors_overlap(is_media, errors):
        raise ValueError(overlap_message("is_media", "errors"))
    if not use_triton(is_media.device) or n == 0 or (n > 1 and is_media.stride(0) != 1):
        return media_index_from_mask_reference(is_media, num_media_rows, errors, src_start)
    counts = torch.cumsum(is_media, 0, dtype=torch.int32)
    index = torch.empty(n, dtype=torch.int32, device=is_media.device)
    block = 1024
    launch = media_index_from_counts_kernel[(-(-n // block),)]
    args = dict(mask_ptr=is_media, counts_ptr=counts, index_ptr=index, errors_ptr=errors, n=n,
                num_media=num_media_rows, src_start=src_start, BLOCK=block, MISMATCH=MEDIA_COUNT_MISMATCH)
    with launch_context(is_media.device):  # (the interpreter's launches share module state: one at a time)
        launch(**args)
    return index
