"""Pack several requests of a Hugging Face model into one :class:`slabstage.PrefillBatch`."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import Sequence

import numpy as np
import torch

from ..checks import check_int
from ..graph_runner.batch import PrefillBatch
from ..staging.mrope import mrope_segments
from ..staging.reference import mrope_from_segments
from ._checks import as_prompt_ids, check_chunk, check_items, check_mrope, check_placeholders, placeholder_runs
from ._family import family_of, transformers_version
from .mrope import check_vlm_grids, grid_tensor, layout_of_rows, layout_rule, layout_takes, rope_index

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
    ``media``, the grids, ``second_per_grid_ts`` or ``mrope_positions``. ``req_index``: the
    request's row of a :class:`KVCache`'s ``req_to_token`` (default: its place in the batch); a
    chunk that starts at token ``s`` attends to the ``s`` tokens cached by earlier chunks there.
    ``pixel_values`` / ``pixel_values_videos``: the processor's pixels for the grids, in place of ``media``,
    for :func:`generate` (which encodes them, through its encoder cache when it has one);
    :func:`pack_requests` takes encoded ``media`` and ignores them. ``media_keys``: with :func:`generate`'s
    encoder cache, one key per item (``bytes``, ``str`` or ``int``, compared whole; an engine's hash of the
    original image, say) naming its entry in place of the hash of its pixels; items given as tensors under keys
    stay in the cache after the call.
    """

    input_ids: torch.Tensor
    media: Sequence = ()
    image_grid_thw: torch.Tensor | None = None
    video_grid_thw: torch.Tensor | None = None
    second_per_grid_ts: torch.Tensor | None = None
    chunk: tuple[int, int] | None = None
    mrope_positions: torch.Tensor | None = None
    req_index: int | None = None
    pixel_values: torch.Tensor | None = None
    pixel_values_videos: torch.Tensor | None = None
    media_keys: Sequence | None = None


@dataclass
class _Checked:
    """The requests after their checks, a list entry each: chunk ``(start, end)``, grid rows (or None),
    placeholder runs (:func:`check_placeholders`), items and their rows. ``ids``: the prompts end to end (a new
    host int64 tensor; ``values`` its numpy view), request ``k``'s from ``firsts[k]``. ``own_mrope``: some
    request gives its own ``mrope_positions``."""

    chunks: list
    images: list
    videos: list
    runs: list
    media: list
    rows: list
    ids: torch.Tensor
    values: np.ndarray
    firsts: list
    own_mrope: bool


_VLM_ONLY = ("media", "image_grid_thw", "video_grid_thw", "second_per_grid_ts", "mrope_positions", "pixel_values",
             "pixel_values_videos", "media_keys")


def _check_requests(fam, requests: list) -> _Checked:
    """Every check of every request (:func:`_check`); raises ``TypeError``/``ValueError`` naming the first bad
    request and what is wrong with it."""
    try:
        return _check(fam, requests, 0)
    except (TypeError, ValueError):
        # _check runs each kind of check over the whole batch before the next kind, so the error it raised may
        # be a later request's: name the first bad one, as checking them one at a time does
        if len(requests) > 1:
            for k, req in enumerate(requests):
                _check(fam, [req], k)
        raise


def _check(fam, requests: list, first: int) -> _Checked:
    """Everything about ``requests`` (request ``first`` the first): ids, chunks, grids against placeholders,
    items against grids. Per request the few checks of its values; the placeholders of all the prompts found
    in one pass over them together."""
    vlm = fam.is_vlm
    wheres, ids, firsts, chunks, images, videos, media = [], [], [0], [], [], [], []
    for k, req in enumerate(requests, first):
        where = f"slabstage.hf.pack_requests: request {k}:"
        if not isinstance(req, Request):
            raise TypeError(f"{where} a request must be a slabstage.hf.Request, got {type(req).__name__}")
        prompt = as_prompt_ids(req.input_ids, where)
        length = prompt.shape[0]
        chunks.append(check_chunk(req.chunk, length, where))
        ids.append(prompt)
        firsts.append(firsts[-1] + length)
        wheres.append(where)
        if vlm:
            image, video = check_vlm_grids(fam, req.image_grid_thw, req.video_grid_thw, req.second_per_grid_ts,
                                           where)
            images.append(image)
            videos.append(video)
            media.append(() if req.media is None else _blocks_as_tuples(req.media))
            continue
        given = [name for name in _VLM_ONLY if getattr(req, name) is not None and not _empty(getattr(req, name))]
        if given:
            raise ValueError(f"{where} it gives {', '.join(given)} but {type(fam.model).__name__} ({fam.name}) is a "
                             f"text-only model: it would drop them")
    ids = torch.cat(ids)  # (a new tensor: the batch's ids, unless chunks leave some out; one copy of them all)
    values = ids.numpy()
    if not vlm:
        return _Checked(chunks, [], [], [], [], [], ids, values, firsts, False)
    found = placeholder_runs(values, fam.placeholder_ids, firsts[:-1])
    runs, rows, own = [], [], False
    merge, frames = fam.merge, fam.has_deepstack  # (Qwen3-VL parts a video's frames: one run per frame)
    for req, where, mine, image, video, items, a, b in zip(requests, wheres, found, images, videos, media, firsts,
                                                          firsts[1:]):
        runs.append(check_placeholders(mine, image, video, where, merge, frames))
        rows.append(check_items(items, image, video, where, merge))
        if req.mrope_positions is not None:
            check_mrope(req.mrope_positions, b - a, where)
            own = True
    return _Checked(chunks, images, videos, runs, media, rows, ids, values, firsts, own)


def _blocks_as_tuples(media):
    """An item given as a list of column blocks is the tuple of them that staging takes (HF's own blocks are
    lists); anything else is left to :func:`check_items`."""
    if type(media) in (list, tuple) and any(type(item) is list for item in media):
        return [tuple(item) if type(item) is list else item for item in media]
    return media


def _empty(value) -> bool:
    return isinstance(value, (list, tuple)) and not value


def pack_requests(model, requests: Sequence[Request], *, device=None, expand: str = "zeros",
                  cache=None) -> PrefillBatch:
    """One :class:`PrefillBatch` holding ``requests`` back to back (see :class:`Request`).

    Per request (its ``chunk``, default the whole prompt): ``input_ids``, ``positions`` (the prompt's token
    indices), for VLMs its mrope positions and the media rows of its placeholder tokens (``media_index``: rows of
    the items a chunk touches, laid end to end). Also ``seq_lens`` and ``extend_start_loc``, int32 on the host,
    and ``table`` (the model's embedding weights). ``device``: where ``media_index`` lives (default: the host,
    beside the other integer inputs, which the runner copies to the device in one packed copy).

    The mrope positions are one :class:`slabstage.MropeLayout` a request, or one ``[3, n]`` host tensor
    (docs/hf.md, "mrope positions from a layout"). ``cache``: a
    :class:`~slabstage.hf.KVCache` the batch prefills into: ``prefix_lens`` is each chunk's start, ``req_indices``
    each request's ``req_index``, ``out_cache_loc`` the default layout's slots of the chunk's tokens
    (:meth:`KVCache.slots`; nothing is written). Without it, ``prefix_lens`` is 0, ``req_indices`` their places.

    Every request is checked before anything is computed (docs/hf.md, "Checks"): ``TypeError`` for a value of
    the wrong kind, ``ValueError`` for a wrong value, a length-dependent rope, two requests of one cache row,
    or a row or chunk outside the cache.
    """
    fam = family_of(model, "pack_requests")
    device = None if device is None else torch.device(device)  # (None: the host)
    if isinstance(requests, Request) or not hasattr(requests, "__iter__"):
        raise TypeError(f"slabstage.hf.pack_requests: requests must be a list of Request, got "
                        f"{type(requests).__name__}")
    requests = list(requests)
    if not requests:
        raise ValueError("slabstage.hf.pack_requests: no requests")
    c = _check_requests(fam, requests)
    seq_lens = [end - start for start, end in c.chunks]
    dst0 = list(accumulate(seq_lens, initial=0))  # each request's first batch row
    n = dst0.pop()
    ids, positions = _chunk_tokens(c, dst0, n)
    media_index, items, mrope = None, [], None
    if fam.is_vlm:
        mrope = _mrope_positions(fam, requests, c)
        index, items = _take_media(c, dst0, n)
        if items:
            media_index = torch.from_numpy(index)
            if device is not None and device.type != "cpu":
                media_index = media_index.to(device)
    prefix_lens, req_indices, cache_loc = _cache_slots(requests, c.chunks, cache)
    return PrefillBatch(
        input_ids=ids, positions=positions, table=fam.language_model.embed_tokens.weight, out_cache_loc=cache_loc,
        prefix_lens=prefix_lens, req_indices=req_indices, mrope_positions=mrope, media=items or None,
        seq_lens=torch.from_numpy(np.array(seq_lens, dtype=np.int32)), media_index=media_index, expand=expand,
        extend_start_loc=torch.from_numpy(np.array(dst0, dtype=np.int32)))


def _chunk_tokens(c: _Checked, dst0: list, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, positions)`` of the ``n`` batch rows: each chunk's ids and token indices, request ``k``'s
    from row ``dst0[k]``."""
    ids = c.ids  # the prompts end to end: the batch's ids unless a chunk leaves some of them out
    if n != c.firsts[-1]:
        ids = torch.from_numpy(np.concatenate([c.values[a + start:a + end]
                                               for (start, end), a in zip(c.chunks, c.firsts)]))
    count = _count(c.firsts[-1])  # (no chunk ends past its prompt)
    positions = np.empty(n, dtype=np.int64)
    for row0, (start, end) in zip(dst0, c.chunks):  # (slices: the numpy calls the media index makes too)
        positions[row0:row0 + end - start] = count[start:end]
    return ids, torch.from_numpy(positions)


def _mrope_positions(fam, requests: list, c: _Checked):
    """Each chunk's mrope positions: a list of :class:`MropeLayout`, one a request, or one ``[3, n]`` host
    tensor when some request gives its own or the installed transformers' rule is not one a layout takes."""
    rule = layout_rule(transformers_version() or "0")
    hf = [req.mrope_positions is None and not layout_takes(req.second_per_grid_ts, rule) for req in requests]
    as_tensor = c.own_mrope or any(hf)
    mrope = []
    for req, a, b, (start, end), images, videos, runs, by_hf in zip(requests, c.firsts, c.firsts[1:], c.chunks,
                                                                     c.images, c.videos, c.runs, hf):
        if req.mrope_positions is not None:
            mrope.append(req.mrope_positions.to("cpu", torch.int64)[:, start:end])
        elif by_hf:
            whole = rope_index(fam, c.ids[a:b], grid_tensor(images), grid_tensor(videos), req.second_per_grid_ts)
            mrope.append(whole[:, start:end])
        else:
            layout = layout_of_rows(fam, runs, images, videos, req.second_per_grid_ts, start, end, rule)
            mrope.append(mrope_from_segments(mrope_segments(layout, end - start), end - start)
                         if as_tensor else layout)
    return torch.cat(mrope, 1) if as_tensor else mrope


def _cache_slots(requests: list, chunks: list, cache) -> tuple:
    """``(prefix_lens, req_indices, out_cache_loc)`` host tensors (``out_cache_loc`` None without a cache); with
    one, the slots of the cache's default layout (``req_to_token`` holds it from ``allocate``: nothing is
    written)."""
    rows = [k if req.req_index is None else req.req_index for k, req in enumerate(requests)]
    for k, req in enumerate(requests):
        if req.req_index is not None:  # (an int32 slot: a row of the cache's req_to_token)
            check_int(f"slabstage.hf.pack_requests: request {k}: req_index", req.req_index, lo=0, hi=2**31 - 1)
    if cache is None:
        return torch.zeros(len(rows), dtype=torch.int32), torch.tensor(rows, dtype=torch.int32), None
    from .kv_cache import KVCache

    if not isinstance(cache, KVCache):
        raise TypeError(f"slabstage.hf.pack_requests: cache must be a slabstage.hf.KVCache, got {type(cache).__name__}")
    if len(set(rows)) != len(rows):
        raise ValueError(f"slabstage.hf.pack_requests: requests share a req_index ({rows}): one row each")
    for k, (row, (start, end)) in enumerate(zip(rows, chunks)):
        check_int(f"slabstage.hf.pack_requests: request {k}: req_index", row)
        try:
            cache.slots(row, start, end - start)
        except ValueError as e:
            raise ValueError(f"slabstage.hf.pack_requests: request {k}: {e}") from None
    got = cache.batch_slots(rows, [a for a, _ in chunks], [b - a for a, b in chunks])
    return got["prefix_lens"], got["req_indices"], got["out_cache_loc"]


_COUNT = np.arange(4096, dtype=np.int64)


def _count(size: int) -> np.ndarray:
    """``0, 1, 2, ...``, at least ``size`` of them: the batch's positions and media rows are copied out of its
    slices (a slice costs the host a fraction of an ``np.arange``; the array itself is never handed out). It
    grows to the longest batch seen."""
    global _COUNT
    if _COUNT.shape[0] < size:
        _COUNT = np.arange(max(size, 2 * _COUNT.shape[0]), dtype=np.int64)
    return _COUNT


def _item(kind: int, j: int, images) -> int:
    """The item of a placeholder run (:func:`check_placeholders`): a request's images', then its videos'."""
    return j if kind == 1 else len(images or ()) + j


def item_spans(model, requests: Sequence[Request]) -> list[list[tuple[int, int]]]:
    """Per request, each media item's ``(first token, end)`` in its prompt (items in ``media`` order: the
    images, then the videos; a Qwen3-VL video from its first frame's run to its last's): a chunk ``[a, b)``
    reads item ``j`` when ``first < b`` and ``end > a``. The requests are checked as :func:`pack_requests`
    checks them (their items only by their rows)."""
    c = _check_requests(family_of(model, "item_spans"), list(requests))
    out = []
    for runs, images, rows in zip(c.runs, c.images, c.rows):
        spans = [None] * len(rows)
        for s, length, kind, j, _ in runs:
            item = _item(kind, j, images)
            first = s if spans[item] is None else spans[item][0]
            spans[item] = (first, s + length)
        out.append(spans)
    return out


def _take_media(c: _Checked, dst0: list, n: int) -> tuple[np.ndarray | None, list]:
    """``(index, items)``: the items the chunks read (only those: a chunk may skip an item between two it
    reads), each request's after the one before, in item order, and ``index`` (``n`` rows, request ``k``'s from
    ``dst0[k]``): each placeholder token's media row among them, -1 for text. A request's items are its images',
    then its videos' (a Qwen3-VL frame is a run inside its video's item). A few operations a run."""
    spans, items = [], []  # (first batch row, media row among the items taken, tokens) of each run a chunk reads
    media_rows = 0  # rows of the items taken so far
    for row0, (start, end), runs, media, rows, images in zip(dst0, c.chunks, c.runs, c.media, c.rows, c.images):
        touched, read = [], {}  # runs read: (first batch row, media row in the request, tokens, item); item: shift
        for s, length, kind, j, row in runs:
            a = s if s > start else start
            b = s + length if s + length < end else end
            if a < b:
                item = _item(kind, j, images)
                touched.append((row0 + a - start, row + a - s, b - a, item))
                read[item] = 0
        if not read:
            continue
        firsts = [0, *accumulate(rows)]  # each item's first row among the request's items
        for item in sorted(read):
            read[item] = media_rows - firsts[item]
            items.append(media[item])
            media_rows += rows[item]
        spans += ((row, f + read[item], tokens) for row, f, tokens, item in touched)
    if not items:
        return None, items
    count = _count(media_rows)
    index = np.empty(n, dtype=np.int64)
    index.fill(-1)
    for row, f, tokens in spans:  # (a run: a slice, no loop over its tokens)
        index[row:row + tokens] = count[f:f + tokens]
    return index, items
