"""Pack several requests of a Hugging Face model into one :class:`slabstage.PrefillBatch`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from ..graph_runner.batch import PrefillBatch
from ..kernels.media_index import media_index_from_spans
from ._checks import as_prompt_ids, check_chunk, check_items, check_mrope
from ._family import family_of
from .mrope import check_vlm_prompt, rope_index

__all__ = ["Request", "pack_requests"]


@dataclass
class Request:
    """One prompt to prefill (or one chunk of it).

    ``input_ids``: the whole prompt, an integer ``[L]`` (or ``[1, L]``) tensor on the host.
    ``media``: this request's items from :func:`media_items`, one per image in
    ``image_grid_thw`` order, then one per video in ``video_grid_thw`` order (each grid lists
    its modality in prompt order, as the processor returns it); item ``j`` holds
    ``t * h * w // merge**2`` rows for its grid row. ``second_per_grid_ts``: one number per
    video, Qwen2.5-VL only. ``chunk``: the token range ``[start, end)`` (two ints) of the
    prompt to prefill in this batch (default: all of it); a chunk may cut an image, its first
    media row is then a row inside that image. ``mrope_positions``: the whole prompt's
    ``[3, L]`` (computed from the grids when not given). A text-only model takes none of
    ``media``, the grids, ``second_per_grid_ts`` or ``mrope_positions``.
    """

    input_ids: torch.Tensor
    media: Sequence = ()
    image_grid_thw: torch.Tensor | None = None
    video_grid_thw: torch.Tensor | None = None
    second_per_grid_ts: torch.Tensor | None = None
    chunk: tuple[int, int] | None = None
    mrope_positions: torch.Tensor | None = None


@dataclass
class _Checked:
    """One request after its checks: host ids, its chunk, host grids and its items' rows."""

    ids: torch.Tensor
    start: int
    end: int
    images: torch.Tensor | None
    videos: torch.Tensor | None
    media: Sequence
    rows: list


_VLM_ONLY = ("media", "image_grid_thw", "video_grid_thw", "second_per_grid_ts", "mrope_positions")


def _check_request(fam, req, k: int) -> _Checked:
    """Everything about request ``k`` that needs no rope index: ids, chunk, grids against placeholders, items
    against grids. Raises ``TypeError``/``ValueError`` naming the request and what is wrong."""
    where = f"slabstage.hf.pack_requests: request {k}:"
    if not isinstance(req, Request):
        raise TypeError(f"{where} a request must be a slabstage.hf.Request, got {type(req).__name__}")
    ids = as_prompt_ids(req.input_ids, where)
    start, end = check_chunk(req.chunk, ids.shape[0], where)
    media = () if req.media is None else req.media
    if not fam.is_vlm:
        given = [name for name in _VLM_ONLY if getattr(req, name) is not None and not _empty(getattr(req, name))]
        if given:
            raise ValueError(f"{where} it gives {', '.join(given)} but {type(fam.model).__name__} ({fam.name}) is a "
                             f"text-only model: it would drop them")
        return _Checked(ids, start, end, None, None, (), [])
    images, videos = check_vlm_prompt(fam, ids, req.image_grid_thw, req.video_grid_thw, req.second_per_grid_ts,
                                      where)
    rows = check_items(media, images, videos, where, int(fam.vision_config.spatial_merge_size))
    check_mrope(req.mrope_positions, ids.shape[0], where)
    return _Checked(ids, start, end, images, videos, media, rows)


def _empty(value) -> bool:
    return isinstance(value, (list, tuple)) and not value


def _media_source_rows(model, ids: torch.Tensor, rows: Sequence[int], num_images: int) -> torch.Tensor:
    """``int64[L]``: for each placeholder row of the prompt, its row in the request's items laid end to end
    (images, then videos); -1 for text rows. The checks have matched the placeholders with the items' rows."""
    config = model.config
    src = torch.full(ids.shape, -1, dtype=torch.int64, device="cpu")
    offset = 0
    for token, group in ((config.image_token_id, rows[:num_images]), (config.video_token_id, rows[num_images:])):
        is_ph = ids == token
        src[is_ph] = offset + torch.arange(int(is_ph.sum()), device="cpu")
        offset += sum(group)
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

    Every request is checked before anything is computed. Raises ``TypeError`` for a value of the
    wrong kind (ids or grids not integer tensors, a chunk not two ints, an item not a tensor or tuple
    of them) and ``ValueError`` for ids that are not one prompt (``[L]`` or ``[1, L]``), a chunk
    outside its prompt, grids that disagree with the placeholders (or placeholders without a grid),
    items out of their order or with other rows than their grid's (see :class:`Request`), media or
    grids given to a text-only model, and a model whose rope depends on the sequence length
    (``dynamic``, ``longrope``: the packed batch would give every request the longest one's
    frequencies).
    """
    fam = family_of(model, "pack_requests")
    table = fam.language_model.embed_tokens.weight
    device = torch.device("cpu") if device is None else torch.device(device)
    if isinstance(requests, Request) or not hasattr(requests, "__iter__"):
        raise TypeError(f"slabstage.hf.pack_requests: requests must be a list of Request, got "
                        f"{type(requests).__name__}")
    requests = list(requests)
    if not requests:
        raise ValueError("slabstage.hf.pack_requests: no requests")
    checked = [_check_request(fam, req, k) for k, req in enumerate(requests)]
    ids_parts, pos_parts, mrope_parts, items, spans = [], [], [], [], []
    seq_lens, starts = [], []
    dst0 = 0  # first batch row of the current request
    media_rows = 0  # rows of the items taken so far
    for req, c in zip(requests, checked):
        ids, start, end = c.ids, c.start, c.end
        ids_parts.append(ids[start:end])
        pos_parts.append(torch.arange(start, end, device="cpu"))
        if fam.is_vlm:
            mrope = req.mrope_positions
            if mrope is None:
                mrope = rope_index(fam, ids, c.images, c.videos, req.second_per_grid_ts)
            mrope_parts.append(mrope.to("cpu", torch.int64)[:, start:end])
            num_images = 0 if c.images is None else c.images.shape[0]
            src = _media_source_rows(model, ids, c.rows, num_images)[start:end]
            used = src[src >= 0]
            if used.numel():
                # keep only the items the chunk reads; rebase their rows onto the batch's items
                ends = torch.tensor(c.rows, device="cpu").cumsum(0)
                first, last = (int(torch.searchsorted(ends, r, right=True)) for r in (used.min(), used.max()))
                base = 0 if first == 0 else int(ends[first - 1])
                items += list(c.media[first:last + 1])
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
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device="cpu"),
        extend_start_loc=torch.tensor(starts, dtype=torch.int32, device="cpu"),
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
