"""The media-index kernel: ``media_index`` from a placeholder mask's running count
(:func:`slabstage.media_index_from_mask` launches it)."""

from __future__ import annotations

from .layout import device as K
from .runtime import tl, triton

__all__ = ["media_index_from_counts_kernel"]

if triton is not None:

    @triton.jit(do_not_specialize=["n", "num_media", "src_start"])
    def media_index_from_counts_kernel(mask_ptr, counts_ptr, index_ptr, errors_ptr, n, num_media, src_start,
                                        BLOCK: tl.constexpr, MISMATCH: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < n
        is_media = tl.load(mask_ptr + offs, mask=ok, other=0) != 0
        counts = tl.load(counts_ptr + offs, mask=ok, other=0)
        # the host checked src_start + n - 1 <= INT32_MAX: no int32 overflow here
        tl.store(index_ptr + offs, tl.where(is_media, counts + (src_start - 1), -1), mask=ok)
        last = offs == n - 1  # the program holding the last row checks the total
        total = tl.sum(tl.where(last, counts, 0), axis=0)
        has_last = tl.sum(last.to(tl.int32), axis=0) > 0
        tl.atomic_or(errors_ptr + K.ERROR_CODES, MISMATCH, mask=has_last & (total != num_media))
        tl.atomic_xchg(errors_ptr + K.ERROR_PLACEHOLDERS, total, mask=has_last)
