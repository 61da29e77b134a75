"""Build ``media_index`` (row -> media row, -1 for text) from what engines already have."""

from __future__ import annotations

import numbers

import numpy as np
import torch

from ._triton import tl, triton, use_triton
from .errors import MEDIA_COUNT_MISMATCH, check_error_word, default_error_word
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


def _int(name: str, v: object) -> int:
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {v!r}")
    return int(v)


def media_index_from_spans(spans, num_tokens: int, *, device, num_media_rows: int | None = None) -> torch.Tensor:
    """``int32[num_tokens]`` index from host-side spans, with no host sync.

    ``spans`` is an iterable of ``(dst_start, length, src_start)``: rows
    ``dst_start + i`` take media row ``src_start + i`` for ``i < length``; every
    other row is a text row (-1). Spans that overlap, run past ``num_tokens`` (or
    past ``num_media_rows`` when given) or hold negative values raise ``ValueError``.
    """
    num_tokens = _int("num_tokens", num_tokens)
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    if num_media_rows is not None and _int("num_media_rows", num_media_rows) < 0:
        raise ValueError(f"num_media_rows must be >= 0, got {num_media_rows}")
    index = np.full(num_tokens, -1, dtype=np.int32)
    parsed = []
    for k, span in enumerate(spans):
        if len(span) != 3:
            raise ValueError(f"span {k} must be (dst_start, length, src_start), got {span!r}")
        dst, length, src = (_int(f"span {k} field", v) for v in span)
        if dst < 0 or length < 0 or src < 0:
            raise ValueError(f"span {k} {span!r} has a negative value")
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
    for dst, length, src, _ in parsed:
        index[dst:dst + length] = np.arange(src, src + length, dtype=np.int32)
    return to_device_pinned(torch.from_numpy(index), torch.device(device))


if triton is not None:

    @triton.jit(do_not_specialize=["n", "num_media"])
    def _media_index_from_counts_kernel(mask_ptr, counts_ptr, index_ptr, errors_ptr, n, num_media,
                                        BLOCK: tl.constexpr, MISMATCH: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < n
        is_media = tl.load(mask_ptr + offs, mask=ok, other=0) != 0
        counts = tl.load(counts_ptr + offs, mask=ok, other=0)
        tl.store(index_ptr + offs, tl.where(is_media, counts - 1, -1), mask=ok)
        last = offs == n - 1  # the program holding the last row checks the total
        total = tl.sum(tl.where(last, counts, 0), axis=0)
        has_last = tl.sum(last.to(tl.int32), axis=0) > 0
        tl.atomic_or(errors_ptr, MISMATCH, mask=has_last & (total != num_media))
        tl.atomic_xchg(errors_ptr + 3, total, mask=has_last)


def media_index_from_mask(is_media: torch.Tensor, num_media_rows: int, *,
                          errors: torch.Tensor | None = None) -> torch.Tensor:
    """``int32[n]`` index from a device placeholder mask, by prefix sum; no host sync.

    Row ``r`` with ``is_media[r]`` takes media row ``(number of media rows before r)``;
    other rows get -1. A placeholder count different from ``num_media_rows`` sets
    ``MEDIA_COUNT_MISMATCH`` in the error word (and word[3] = the count found); the
    staging kernel then also flags any index past the media rows.
    """
    if not isinstance(is_media, torch.Tensor) or is_media.dim() != 1:
        raise ValueError(f"is_media must be a 1-D tensor, got {getattr(is_media, 'shape', is_media)!r}")
    if is_media.dtype != torch.bool:
        raise TypeError(f"is_media must be a bool tensor, got {is_media.dtype}")
    num_media_rows = _int("num_media_rows", num_media_rows)
    if num_media_rows < 0:
        raise ValueError(f"num_media_rows must be >= 0, got {num_media_rows}")
    errors = default_error_word(is_media.device) if errors is None else errors
    check_error_word(errors, is_media.device, "is_media")
    n = is_media.shape[0]
    if not use_triton(is_media) or n == 0 or (n > 1 and is_media.stride(0) != 1):
        return media_index_from_mask_reference(is_media, num_media_rows, errors)
    counts = torch.cumsum(is_media, 0, dtype=torch.int32)
    index = torch.empty(n, dtype=torch.int32, device=is_media.device)
    block = 1024
    _media_index_from_counts_kernel[(triton.cdiv(n, block),)](
        is_media, counts, index, errors, n, num_media_rows, BLOCK=block, MISMATCH=MEDIA_COUNT_MISMATCH)
    return index
