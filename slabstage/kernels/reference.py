"""PyTorch references with the kernels' exact semantics.

They serve as the CPU path (when the Triton interpreter is off) and as the
ground truth the tests compare the Triton kernels against. Like the kernels,
they never index out of bounds and never synchronise with the host.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..staging.buffers import NO_ROW
from .errors import BAD_MEDIA_INDEX, BAD_TOKEN_ID, MEDIA_COUNT_MISMATCH, writing_word

__all__ = ["stage_embeddings_reference", "media_index_from_mask_reference", "stage_token_inputs_reference"]


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
    errors[0] = errors[0] | codes
    errors[1] += bad.sum(dtype=torch.int32)
    errors[2] = torch.minimum(errors[2], torch.where(bad, rows, NO_ROW).min())


def media_rows(plan) -> torch.Tensor | None:
    """The media of a :class:`~slabstage.kernels.plan.MediaPlan` as one tensor: its items laid end to end."""
    if plan is None:
        return None
    if not plan.items:
        return plan.tensor
    rows = [torch.cat(blocks, 1) if len(blocks) > 1 else blocks[0] for blocks in plan.items]
    return torch.cat(rows, 0) if len(rows) > 1 else rows[0]


@torch.no_grad()
def stage_embeddings_reference(slab, input_ids, table, plan, media_index, *, pad_to, expand, text_scale, bounds,
                               media_owner, errors) -> None:
    """The kernel's semantics in PyTorch; records no autograd history whatever its inputs require."""
    vocab_start, vocab_end, vocab_size = bounds
    media = media_rows(plan)
    n, width = input_ids.shape[0], slab.shape[1]
    ids = input_ids.long()
    mi = media_index.long() if media_index is not None else torch.full_like(ids, -1)
    num_media = media.shape[0] if media is not None else 0
    is_media = mi >= 0
    bad_id = ~is_media & ((ids < 0) | (ids >= vocab_size))
    bad_media = is_media & (mi >= num_media)
    in_shard = ~is_media & ~bad_id & (ids >= vocab_start) & (ids < vocab_end)

    text = _gather(table, ids - vocab_start, in_shard)
    if text_scale is not None:
        text = torch.where(in_shard[:, None], text.float() * text_scale, torch.zeros((), device=text.device))
    out = _expand(text.to(slab.dtype), width, expand)
    if media is not None and media_owner:
        med = _gather(media, mi, is_media & ~bad_media).to(slab.dtype)
        out = torch.where(is_media[:, None], _expand(med, width, expand), out)
    elif media is not None:
        out = torch.where(is_media[:, None], torch.zeros((), dtype=out.dtype, device=out.device), out)
    slab[:n] = out
    slab[n:pad_to] = 0
    with writing_word(errors):  # a word made under inference mode is updated under it
        _record(errors, bad_id, bad_media)


def media_index_from_mask_reference(is_media: torch.Tensor, num_media_rows: int, errors: torch.Tensor,
                                    src_start: int = 0) -> torch.Tensor:
    """Row r with is_media[r] takes media row ``src_start + (placeholders before r)``; other rows -1.

    A placeholder count different from ``num_media_rows`` sets MEDIA_COUNT_MISMATCH; word[3] = the count.
    """
    counts = torch.cumsum(is_media.to(torch.int32), 0, dtype=torch.int32)
    index = torch.where(is_media, counts + (src_start - 1), torch.full_like(counts, -1))
    total = counts[-1] if counts.numel() else torch.zeros((), dtype=torch.int32, device=is_media.device)
    with torch.inference_mode(errors.is_inference()):  # as errors.writing_word: a caller's inference word works
        errors[0] = errors[0] | ((total != num_media_rows).to(torch.int32) * MEDIA_COUNT_MISMATCH)
        errors[3] = total
    return index


def _copy_pad(dst: torch.Tensor, src: torch.Tensor | None, n: int, pad_to: int, fill) -> None:
    """dst[..., :n] = src; dst[..., n:pad_to] = fill (unless fill is None)."""
    if src is not None:
        dst[..., :n] = src.to(dst.dtype)
    if fill is not None:
        dst[..., n:pad_to] = fill


def stage_token_inputs_reference(buffers, given: dict, n: int, pad_to: int, b: int) -> None:
    """The integer half in PyTorch: each slot of ``given`` copied and its tail padded by its slot's policy
    (per-request slots to ``buffers.max_batch_size``), then the token count."""
    reg = buffers.registry
    for name in ("input_ids", "positions", "out_cache_loc", "mrope_positions", "seq_lens", "extend_start_loc"):
        if name in given:
            per_request = name in ("seq_lens", "extend_start_loc")
            _copy_pad(reg[name], given[name], b if per_request else n,
                      buffers.max_batch_size if per_request else pad_to, reg.slot(name).fill_value)
    buffers.num_tokens_non_padded.fill_(n)
