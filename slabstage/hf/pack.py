"""Pack several requests of a Hugging Face model into one :class:`slabstage.PrefillBatch`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


from ..graph_runner.batch import PrefillBatch
from ..kernels.media_index import media_index_from_spans
from ._family import family_of
from .mrope import mrope_positions as _mrope_positions

__all__ = ["Request", "pack_requests"]


@dataclass
class Request:
    """One prompt to prefill (or one chunk of it).

    ``input_ids``: the whole prompt, ``[L]``, on the host. ``media``: this request's items from
    :func:`media_items` (images, then videos, as the grids list them). ``chunk``: the token
    range ``[start, end)`` of the prompt to prefill in this batch (default: all of it); a chunk
    may cut an image, its first media row is then a row inside that image. ``mrope_positions``:
    the whole prompt's ``[3, L]`` (computed from the grids when not given).
    """

    input_ids: torch.Tensor
    media: Sequence = ()
    image_grid_thw: torch.Tensor | None = None
    video_grid_thw: torch.Tensor | None = None
    second_per_grid_ts: torch.Tensor | None = None
    chunk: tuple[int, int] | None = None
    mrope_positions: torch.Tensor | None = None


def _rows(item) -> int:
    return (item[0] if isinstance(item, (tuple, list)) else item).shape[0]


def _media_source_rows(model, ids: torch.Tensor, items: Sequence, num_images: int, k: int) -> torch.Tensor:
    """``int64[L]``: for each placeholder row of the prompt, its row in the request's items laid end to end
    (images, then videos); -1 for text rows. Checks that the placeholder counts match the items' rows."""
    config = model.config
    src = torch.full(ids.shape, -1, dtype=torch.int64)
    offset = 0
    for token, group, what in ((config.image_token_id, items[:num_images], "image"),
                               (config.video_token_id, items[num_images:], "video")):
        is_ph = ids == token
        rows = sum(_rows(i) for i in group)
        count = int(is_ph.sum())
        if count != rows:
            raise ValueError(f"slabstage.hf.pack_requests: request {k} has {count} {what} placeholder tokens but "
                             f"its {len(group)} {what} items hold {rows} rows")
        src[is_ph] = offset + torch.arange(count)
        offset += rows
    return src


def pack_requests(model, requests: Sequence[Request], *, device=None, expand: str = "zeros") -> PrefillBatch:
    """One :class:`PrefillBatch` holding ``requests`` back to back.

    Per request (its ``chunk``, default the whole prompt): ``input_ids``, ``positions`` (the
    prompt's token indices), for VLMs the columns of :func:`mrope_positions`, and the media
    rows of its placeholder tokens (``media_index`` from :func:`slabstage.media_index_from_spans`,
    rows of the items laid end to end; only the items a chunk touches are included). Also
    ``seq_lens`` (tokens of each request in this batch) and ``extend_start_loc`` (their first
    rows), both int32 on the host, and ``table`` (the model's embedding weights).
    ``device``: where ``media_index`` lives (default: the host, beside the other integer inputs, so
    that all of them travel to the device in the runner's one packed copy).

    Raises ``ValueError`` when a request's placeholder count does not match its items' rows,
    or a chunk lies outside its prompt.
    """
    fam = family_of(model, "pack_requests")
    table = fam.language_model.embed_tokens.weight
    device = torch.device("cpu") if device is None else torch.device(device)
    if not requests:
        raise ValueError("slabstage.hf.pack_requests: no requests")
    ids_parts, pos_parts, mrope_parts, items, spans = [], [], [], [], []
    seq_lens, starts = [], []
    dst0 = 0  # first batch row of the current request
    media_rows = 0  # rows of the items taken so far
    for k, req in enumerate(requests):
        ids = req.input_ids.reshape(-1).to("cpu", torch.int64)
        L = ids.shape[0]
        start, end = req.chunk if req.chunk is not None else (0, L)
        if not 0 <= start < end <= L:
            raise ValueError(f"slabstage.hf.pack_requests: request {k} chunk {req.chunk} is not inside its "
                             f"{L} tokens")
        ids_parts.append(ids[start:end])
        pos_parts.append(torch.arange(start, end))
        if fam.is_vlm:
            mrope = req.mrope_positions
            if mrope is None:
                mrope = _mrope_positions(model, ids, req.image_grid_thw, req.video_grid_thw, req.second_per_grid_ts)
            mrope_parts.append(mrope.to("cpu", torch.int64)[:, start:end])
            num_images = 0 if req.image_grid_thw is None else req.image_grid_thw.shape[0]
            src = _media_source_rows(model, ids, req.media, num_images, k)[start:end]
            used = src[src >= 0]
            if used.numel():
                # keep only the items the chunk reads; rebase their rows onto the batch's items
                ends = torch.tensor([_rows(i) for i in req.media]).cumsum(0)
                first, last = (int(torch.searchsorted(ends, r, right=True)) for r in (used.min(), used.max()))
                base = 0 if first == 0 else int(ends[first - 1])
                items += list(req.media[first:last + 1])
                src = torch.where(src >= 0, src - base + media_rows, -1)
                media_rows += int(ends[last]) - base
                spans += _spans(src, dst0)
        seq_lens.append(end - start)
        starts.append(dst0)
        dst0 += end - start
    n = dst0
    media = media_index = None
    if items:
        media = items
        media_index = media_index_from_spans(spans, n, device=device, num_media_rows=media_rows)
    return PrefillBatch(
        input_ids=torch.cat(ids_parts), positions=torch.cat(pos_parts), table=table,
        mrope_positions=torch.cat(mrope_parts, 1) if mrope_parts else None,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), extend_start_loc=torch.tensor(starts, dtype=torch.int32),
        media=media, media_index=media_index, expand=expand)


def _spans(src: torch.Tensor, dst0: int) -> list[tuple[int, int, int]]:
    """Runs of consecutive media rows in ``src`` (a row's media row, -1 for text) as ``(dst, length, src)``."""
    values = src.tolist()
    spans: list[tuple[int, int, int]] = []
    for r, s in enumerate(values):
        if s < 0:
            continue
        if spans and spans[-1][0] + spans[-1][1] == dst0 + r and spans[-1][2] + spans[-1][1] == s:
            d, length, s0 = spans[-1]
            spans[-1] = (d, length + 1, s0)
        else:
            spans.append((dst0 + r, 1, s))
    return spans
