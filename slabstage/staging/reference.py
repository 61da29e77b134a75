"""PyTorch references with the kernels' exact semantics.

They serve as the CPU path (when Triton's interpreter is off) and as the ground
truth the tests compare the kernels against. They take a batch that passed the
one validation (:func:`~slabstage.staging.validate.check_batch`), never index out
of bounds and never synchronise with the host. They run under inference mode, so
destinations made in or outside it are written alike.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

from ..kernels.layout import (BAD_MEDIA_INDEX, BAD_TOKEN_ID, COUNT, ERROR_CODES, ERROR_FIRST_ROW, ERROR_PLACEHOLDERS,
                              ERROR_ROWS, NO_ROW, INTERVAL_F32, INTERVAL_F64, INTERVAL_INT,
                              MEDIA_COUNT_MISMATCH, REQUESTS, SEG_AREA, SEG_BASE, SEG_CODE, SEG_COLUMNS, SEG_FIRST_ROW,
                              SEG_INTERVAL, SEG_OFFSET, SEGMENT_WORDS)
from .destinations import Destinations
from .errors import writing_word
from .slots import SLOTS
from .validate import LAYOUT_SLOT, Inputs, check_batch

__all__ = ["stage_reference", "stage_embeddings_reference", "media_index_from_mask_reference"]


def _expand(rows: torch.Tensor, width: int, expand: str) -> torch.Tensor:
    src = rows.shape[1]
    if src == width:
        return rows
    if expand == "repeat":
        return rows.repeat(1, width // src)
    return F.pad(rows, (0, width - src))


def _gather(source: torch.Tensor, index: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """source[index] where keep, else zeros; indices where not keep are never dereferenced."""
    if source.shape[0] == 0:
        return source.new_zeros(index.shape[0], source.shape[1])
    safe = torch.where(keep, index, torch.zeros_like(index))
    rows = source.index_select(0, safe)
    return torch.where(keep[:, None], rows, torch.zeros((), dtype=rows.dtype, device=rows.device))


def _record(errors: torch.Tensor, bad_id: torch.Tensor, bad_media: torch.Tensor) -> None:
    """Set the error word as the kernel does (codes, rows flagged, first row)."""
    if bad_id.numel() == 0:
        return
    bad = bad_id | bad_media
    rows = torch.arange(bad.shape[0], device=bad.device, dtype=torch.int32)
    codes = bad_id.any().to(torch.int32) * BAD_TOKEN_ID | bad_media.any().to(torch.int32) * BAD_MEDIA_INDEX
    errors[ERROR_CODES] = errors[ERROR_CODES] | codes
    errors[ERROR_ROWS] += bad.sum(dtype=torch.int32)
    errors[ERROR_FIRST_ROW] = torch.minimum(errors[ERROR_FIRST_ROW], torch.where(bad, rows, NO_ROW).min())


def media_rows(plan) -> torch.Tensor | None:
    """The media of a :class:`~slabstage.staging.validate.MediaPlan` as one tensor: its items end to end
    (empty items are skipped: they are never read, wherever they are)."""
    if plan is None:
        return None
    if plan.entries is not None:
        cache = plan.entries[0]
        return torch.cat([cache.rows_of(e).to(cache.device) for e in plan.media], 0)
    rows = [torch.cat(blocks, 1) if len(blocks) > 1 else blocks[0] for blocks in plan.items if blocks[0].shape[0]]
    if not rows:
        return torch.zeros(0, plan.width, dtype=plan.dtype, device=plan.items[0][0].device)
    return torch.cat([r.to(rows[0].device) for r in rows], 0) if len(rows) > 1 else rows[0]


def _embeddings(slab: torch.Tensor, c, errors: torch.Tensor) -> None:
    vocab_start, vocab_end, vocab_size = c.bounds
    n, width = c.n, slab.shape[1]
    ids = c.ids.long()
    media = media_rows(c.media)
    if media is not None:
        media = media.to(slab.device)
    mi = c.media_index.long() if c.media_index is not None else torch.full_like(ids, -1)
    num_media = media.shape[0] if media is not None else 0
    is_media = mi >= 0
    bad_id = ~is_media & ((ids < 0) | (ids >= vocab_size))
    bad_media = is_media & (mi >= num_media)
    in_shard = ~is_media & ~bad_id & (ids >= vocab_start) & (ids < vocab_end)

    text = _gather(c.table, ids - vocab_start, in_shard)
    if c.scale is not None:
        text = torch.where(in_shard[:, None], text.float() * c.scale, torch.zeros((), device=text.device))
    out = _expand(text.to(slab.dtype), width, c.expand)
    if media is not None and c.media_owner:
        med = _gather(media, mi, is_media & ~bad_media).to(slab.dtype)
        out = torch.where(is_media[:, None], _expand(med, width, c.expand), out)
    else:
        out = torch.where(is_media[:, None], torch.zeros((), dtype=out.dtype, device=out.device), out)
    slab[:n] = out
    slab[n:c.pad_to] = 0
    _record(errors, bad_id, bad_media)


@torch.no_grad()
def stage_reference(dst, c) -> None:
    """What the staging kernel writes for the checked batch ``c`` into the destinations ``dst``."""
    with torch.inference_mode():  # in-place writes into tensors made in or outside inference mode
        if dst.slab is not None:
            _embeddings(dst.slab, c, dst.errors)
        sources = c.sources
        for k, (spec, slot, fill) in enumerate(zip(SLOTS, dst.slots, dst.fills)):
            if slot is None:
                continue
            if spec.kind == COUNT:
                slot[0] = c.n
                continue
            src = sources[k]
            if src is None and k == LAYOUT_SLOT and c.segments is not None:
                src = mrope_from_segments(c.segments, c.n, slot.device)
            if src is None:
                continue
            count, limit = (c.b, slot.shape[0]) if spec.kind == REQUESTS else (c.n, c.pad_to)
            slot[..., :count] = src.to(slot.device, slot.dtype)
            if fill is not None:
                slot[..., count:limit] = fill


def media_index_from_mask_reference(is_media: torch.Tensor, num_media_rows: int, errors: torch.Tensor,
                                    src_start: int = 0) -> torch.Tensor:
    """Row r with is_media[r] takes media row ``src_start + (placeholders before r)``; other rows -1.

    A placeholder count different from ``num_media_rows`` sets MEDIA_COUNT_MISMATCH; word[3] = the count.
    """
    counts = torch.cumsum(is_media.to(torch.int32), 0, dtype=torch.int32)
    index = torch.where(is_media, counts + (src_start - 1), torch.full_like(counts, -1))
    total = counts[-1] if counts.numel() else torch.zeros((), dtype=torch.int32, device=is_media.device)
    with writing_word(errors):  # a caller's inference-mode word works too
        errors[ERROR_CODES] = errors[ERROR_CODES] | ((total != num_media_rows).to(torch.int32) * MEDIA_COUNT_MISMATCH)
        errors[ERROR_PLACEHOLDERS] = total
    return index


def stage_embeddings_reference(slab, input_ids, table, *, errors, pad_to=None, media=None, media_index=None,
                               expand="zeros", text_scale=None, vocab_range=None, vocab_size=None, media_owner=True):
    """:func:`slabstage.stage_embeddings` in PyTorch, whatever the device: the same validation, then
    :func:`stage_reference` (for tests and tools that compare the kernel with it)."""
    dst = Destinations(slab=slab, errors=errors, host_ok=False)
    src = Inputs(input_ids=input_ids, table=table, media=media, media_index=media_index, expand=expand,
                 text_scale=text_scale, vocab_range=vocab_range, vocab_size=vocab_size, media_owner=media_owner)
    stage_reference(dst, check_batch(dst, src, pad_to, {}))


def mrope_from_segments(words: Sequence[int], n: int, device=None) -> torch.Tensor:
    """``int64[3, n]`` on ``device`` (default: the host, whatever torch's default device is): the positions the
    kernel writes from the segment list ``words`` (PyTorch reference)."""
    device = torch.device("cpu") if device is None else torch.device(device)
    segs = torch.tensor(words, dtype=torch.int64, device=device).view(-1, SEGMENT_WORDS)
    rows = torch.arange(n, dtype=torch.int64, device=device)
    seg = torch.searchsorted(segs[:, SEG_FIRST_ROW].contiguous(), rows, right=True) - 1
    row0, base, area, lw, q0, code, word = (segs[seg, k] for k in (SEG_FIRST_ROW, SEG_BASE, SEG_AREA, SEG_COLUMNS,
                                                                   SEG_OFFSET, SEG_CODE, SEG_INTERVAL))
    text = area == 0
    q = rows - row0 + q0
    area, lw = torch.where(text, 1, area), torch.where(text, 1, lw)
    i = q // area
    f32 = torch.where(code == INTERVAL_F32, word, 0).to(torch.int32).view(torch.float32)  # (others: 0.0)
    f64 = torch.where(code == INTERVAL_F64, word, 0).view(torch.float64)
    temporal = torch.where(code == INTERVAL_INT, i * word,
                           torch.where(code == INTERVAL_F32, (i.to(torch.float32) * f32).to(torch.int64),
                                       (i.to(torch.float64) * f64).to(torch.int64)))
    out = torch.stack([base + temporal, base + (q % area) // lw, base + q % lw])
    return torch.where(text, rows + base, out)
