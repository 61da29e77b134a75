"""Pack several requests of a Hugging Face model into one :class:`slabstage.PrefillBatch`."""

from __future__ import annotations

from bisect import bisect_right
from itertools import accumulate
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from ..graph_runner.batch import PrefillBatch
from ..kernels.mrope import mrope_from_segments, mrope_segments
from ._checks import as_prompt_ids, check_chunk, check_items, check_mrope
from ._family import family_of
from .mrope import check_vlm_prompt, layout_rule, rope_index, rope_layout

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
    """One request after its checks: host ids, its chunk, host grids, its placeholder runs and items' rows."""

    ids: torch.Tensor
    start: int
    end: int
    images: torch.Tensor | None
    videos: torch.Tensor | None
    runs: list
    media: Sequence
    rows: list


_VLM_ONLY = ("media", "image_grid_thw", "video_grid_thw", "second_per_grid_ts", "mrope_positions")


def _check_request(fam, req, k: int) -> _Checked:
    """Everything about request ``k``: ids, chunk, grids against placeholders, items against grids. Raises
    ``TypeError``/``ValueError`` naming the request and what is wrong."""
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
        return _Checked(ids, start, end, None, None, [], (), [])
    images, videos, runs = check_vlm_prompt(fam, ids, req.image_grid_thw, req.video_grid_thw,
                                            req.second_per_grid_ts, where)
    rows = check_items(media, images, videos, where, fam.merge)
    check_mrope(req.mrope_positions, ids.shape[0], where)
    return _Checked(ids, start, end, images, videos, runs, media, rows)


def _empty(value) -> bool:
    return isinstance(value, (list, tuple)) and not value


def pack_requests(model, requests: Sequence[Request], *, device=None, expand: str = "zeros") -> PrefillBatch:
    """One :class:`PrefillBatch` holding ``requests`` back to back.

    Per request (its ``chunk``, default the whole prompt): ``input_ids``, ``positions`` (the
    prompt's token indices), for VLMs its mrope positions, and the media rows of its placeholder
    tokens (``media_index``: rows of the items laid end to end; only the items a chunk touches are
    included). Also ``seq_lens`` (tokens of each request in this batch) and ``extend_start_loc``
    (their first rows), both int32 on the host, and ``table`` (the model's embedding weights).
    ``device``: where ``media_index`` lives (default: the host, beside the other integer inputs, so
    that all of them travel to the device in the runner's one packed copy).

    The mrope positions are given as one :class:`slabstage.MropeLayout` per request (where its items
    start, their grids and temporal intervals, the chunk's offset), from which the staging launch
    computes them on the device by the rule of the installed transformers' ``get_rope_index``
    (which is not called; transformers >= 5.6). A request that gives its own ``mrope_positions``, or
    an older transformers, makes them one ``[3, n]`` host tensor instead. Nothing here loops over
    tokens in Python: the placeholders are found in a few numpy passes over each prompt.

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
    rule = None
    if fam.is_vlm:
        import transformers
        rule = layout_rule(transformers.__version__)
    as_tensor = fam.is_vlm and (rule is None or any(req.mrope_positions is not None for req in requests))
    n = sum(c.end - c.start for c in checked)
    index = np.full(n, -1, dtype=np.int64) if fam.is_vlm else None
    ids_parts, pos_parts, mrope, items = [], [], [], []
    seq_lens, starts = [], []
    dst0 = 0  # first batch row of the current request
    media_rows = 0  # rows of the items taken so far
    for req, c in zip(requests, checked):
        start, end = c.start, c.end
        ids_parts.append(c.ids.numpy()[start:end])
        pos_parts.append(np.arange(start, end, dtype=np.int64))
        if fam.is_vlm:
            if req.mrope_positions is not None:
                mrope.append(req.mrope_positions.to("cpu", torch.int64)[:, start:end])
            elif rule is None:
                mrope.append(rope_index(fam, c.ids, c.images, c.videos, req.second_per_grid_ts)[:, start:end])
            else:
                layout = rope_layout(fam, c.runs, c.images, c.videos, req.second_per_grid_ts, start, end, rule)
                mrope.append(mrope_from_segments(mrope_segments(layout, end - start), end - start)
                             if as_tensor else layout)
            media_rows = _take_media(c, index, dst0, media_rows, items)
        seq_lens.append(end - start)
        starts.append(dst0)
        dst0 += end - start
    media_index = None
    if items:
        media_index = torch.from_numpy(index)
        if device.type != "cpu":
            media_index = media_index.to(device)
    if not fam.is_vlm:
        mrope = None
    elif as_tensor:
        mrope = torch.cat(mrope, 1)
    return PrefillBatch(
        input_ids=torch.from_numpy(np.concatenate(ids_parts)),
        positions=torch.from_numpy(np.concatenate(pos_parts)), table=table, mrope_positions=mrope,
        seq_lens=torch.from_numpy(np.array(seq_lens, dtype=np.int32)),
        extend_start_loc=torch.from_numpy(np.array(starts, dtype=np.int32)),
        media=items or None, media_index=media_index, expand=expand)


def _take_media(c: _Checked, index: np.ndarray, dst0: int, media_rows: int, items: list) -> int:
    """Point the batch rows of the chunk's placeholder tokens at their media rows in ``index`` and append the
    items the chunk reads to ``items`` (rebased after the ``media_rows`` rows taken so far); returns the new
    count of media rows. Items lie end to end: the images', then the videos' (a Qwen3-VL frame is a run
    inside its video's item)."""
    start, end = c.start, c.end
    ends = list(accumulate(c.rows))  # each item's end row
    num_images = 0 if c.images is None else c.images.shape[0]
    touched = []  # (first token, tokens, first media row) of each run the chunk reads
    for s, length, kind, j, frame in c.runs:
        if s < end and s + length > start:
            item = j + num_images if kind == 2 else j
            touched.append((s, length, ends[item] - c.rows[item] + frame * length))
    if not touched:
        return media_rows
    # the media rows the chunk reads, first and last (a video's runs may come before an image's in the prompt)
    lo_row = min(f + max(s, start) - s for s, _, f in touched)
    hi_row = max(f + min(s + length, end) - s - 1 for s, length, f in touched)
    first = bisect_right(ends, lo_row)
    last = bisect_right(ends, hi_row)
    base = 0 if first == 0 else ends[first - 1]
    items += list(c.media[first:last + 1])
    shift = media_rows - base
    for s, length, f in touched:
        a, b = max(s, start), min(s + length, end)
        index[dst0 + a - start:dst0 + b - start] = np.arange(f + a - s + shift, f + b - s + shift)
    return media_rows + ends[last] - base
