"""Media items from a Hugging Face VLM's vision tower, in the slab's layout."""

from __future__ import annotations

from itertools import accumulate

import torch

from ..cache.encoder_cache import CacheFullError
from ._checks import check_grid, check_pixels, grid_rows
from ._family import family_of

__all__ = ["media_items"]


def _split(rows, sizes):
    """HF returns per-item tensors (a tuple from ``torch.split``) or, in some versions, one tensor."""
    if isinstance(rows, torch.Tensor):
        return list(torch.split(rows, sizes))
    return list(rows)


def pick_items(pixels: torch.Tensor, grid: torch.Tensor, which: list) -> tuple[torch.Tensor, torch.Tensor]:
    """``(pixels, grid)`` of the items ``which`` (indices of rows of the host ``grid``, in order) alone: their
    pixel rows (one row a patch, ``t * h * w`` an item) end to end, their grid rows (all of them: as given)."""
    if len(which) == len(grid):
        return pixels, grid
    ends = list(accumulate(grid.prod(-1).tolist()))
    return torch.cat([pixels[ends[j] - int(grid[j].prod()):ends[j]] for j in which]), grid[which]


@torch.no_grad()  # (encoder outputs for inference: no autograd history, whatever the parameters say)
def _tower(fam, pixel_values, grid_thw, video: bool):
    get = fam.base.get_video_features if video else fam.base.get_image_features
    # the tower computes positions from the grid beside the pixels; the row counts come from the host copy
    out = get(pixel_values, grid_thw.to(pixel_values.device), return_dict=True)
    sizes = grid_rows(grid_thw, fam.merge)
    main = _split(out.pooler_output, sizes)
    if not fam.has_deepstack:
        return main
    features, levels = out.deepstack_features, fam.deepstack_levels
    if len(features) < levels:  # the tower's own count and fam.deepstack_features disagree: a layout change
        raise RuntimeError(f"slabstage.hf.media_items: the vision tower emitted {len(features)} DeepStack features "
                           f"but {levels} levels were expected; this transformers version is not supported")
    levels = [_split(level, sizes) for level in features[:levels]]
    return [tuple([m] + [level[j] for level in levels]) for j, m in enumerate(main)]


def media_items(model, pixel_values=None, image_grid_thw=None, pixel_values_videos=None, video_grid_thw=None, *,
                encoder_cache=None, keys=None):
    """Run the vision tower of ``model``; return one media item per image (``image_grid_thw`` order), then one
    per video (``video_grid_thw`` order): the order a :class:`Request`'s ``media`` takes.

    Each item holds the rows of that image's (video's) placeholder tokens, in prompt order,
    ``t * h * w // merge**2`` of them for its grid row ``(t, h, w)``:

    - Qwen3-VL / Qwen3-VL-MoE: a tuple ``(main, ds_0, ..., ds_{k-1})`` of 2-D tensors with equal rows, each
      ``H`` wide: column block 0 and the DeepStack levels HF applies (``k`` as in :func:`input_embeds_width`);
    - Qwen2-VL / Qwen2.5-VL: one ``[rows, H]`` tensor.

    The items go to :class:`slabstage.PrefillBatch` (``media=``) or to :func:`pack_requests`. Grids are integer
    ``[N, 3]`` tensors, best on the host (the row counts are read from them). Raises ``TypeError`` for a model
    without a vision tower or a non-integer grid, and ``ValueError`` when pixels come without their grid or do
    not hold one row per patch of it.

    ``encoder_cache`` (an :class:`~slabstage.cache.EncoderCache` at the slab's width) with ``keys`` (one per item, in
    the same order: the item's content hash or any ``bytes``/``str``/``int`` naming it whole): items already
    cached are not encoded again (their rows are checked against their grid); the tower runs on the others'
    pixels alone and their outputs are put in the cache. Returns the items' cache handles
    (:class:`~slabstage.cache.Entry`), which :func:`pack_requests` and :class:`slabstage.PrefillBatch` take as
    items; raises :class:`~slabstage.cache.CacheFullError` (a ``ValueError``) when the cache cannot hold them all
    at once.
    """
    fam = family_of(model, "media_items")
    if not fam.is_vlm:
        raise TypeError(f"slabstage.hf.media_items: {type(model).__name__} ({fam.name}) has no vision tower")
    cache = encoder_cache
    if cache is not None:
        _check_keys(keys, image_grid_thw, video_grid_thw)
    items, at = [], 0
    for pixels, grid, video in ((pixel_values, image_grid_thw, False), (pixel_values_videos, video_grid_thw, True)):
        if pixels is None:
            continue
        name, pixels_name = ("video_grid_thw", "pixel_values_videos") if video else ("image_grid_thw", "pixel_values")
        if grid is None:
            raise ValueError(f"slabstage.hf.media_items: {pixels_name} was given without {name}")
        host = check_grid(grid, name, "slabstage.hf.media_items:", fam.merge)  # no copy (no sync) for a host grid
        check_pixels(pixels, host, pixels_name, name, "slabstage.hf.media_items:")
        if not len(host):  # no items: no tower call (HF's towers refuse an empty grid)
            continue
        if cache is None:
            items += _tower(fam, pixels, host, video)
        else:
            items += _through_cache(fam, cache, keys[at:at + len(host)], pixels, host, video)
            at += len(host)
    return items


def _check_keys(keys, *grids) -> None:
    """``keys``: a list (or tuple) of one key per row of the grids given."""
    count = sum(0 if g is None else len(g) for g in grids)
    if type(keys) not in (list, tuple) or len(keys) != count:
        raise ValueError(f"slabstage.hf.media_items: encoder_cache= needs keys=, a list of one key per item ({count})")


def _through_cache(fam, cache, keys: list, pixels, grid, video: bool) -> list:
    """The cache handles of the items of ``grid`` (host) named by ``keys``: the tower runs on the pixels of the
    items not cached alone, and puts its outputs in ``cache``."""
    sizes = grid_rows(grid, fam.merge)
    first = {}  # (an item twice in the call is encoded once)
    miss = [first.setdefault(key, j) for j, (key, rows) in enumerate(zip(keys, sizes))
            if key not in first and cache.get(key, rows=rows) is None]
    if miss:
        pixels, grid = pick_items(pixels, grid, miss)  # the misses alone
        for j, item in zip(miss, _tower(fam, pixels, grid, video)):
            cache.put(keys[j], item)
    items = []
    for key, rows in zip(keys, sizes):
        entry = cache.get(key, rows=rows)
        if entry is None:
            raise CacheFullError(f"slabstage.hf.media_items: the cache's budget cannot hold this call's items "
                                 f"at once (item {key!r} of {rows} rows was evicted by the next ones)")
        items.append(entry)
    return items
