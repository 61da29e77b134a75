"""Media items from a Hugging Face VLM's vision tower, in the slab's layout."""

from __future__ import annotations

import torch

from ._checks import check_grid, check_pixels, grid_rows
from ._family import family_of

__all__ = ["media_items"]


def _split(rows, sizes):
    """HF returns per-item tensors (a tuple from ``torch.split``) or, in some versions, one tensor."""
    if isinstance(rows, torch.Tensor):
        return list(torch.split(rows, sizes))
    return list(rows)


def _tower(fam, pixel_values, grid_thw, video: bool):
    get = fam.base.get_video_features if video else fam.base.get_image_features
    # the tower computes positions from the grid beside the pixels; the row counts come from the host copy
    out = get(pixel_values, grid_thw.to(pixel_values.device), return_dict=True)
    sizes = grid_rows(grid_thw, fam.vision_config.spatial_merge_size)
    main = _split(out.pooler_output, sizes)
    if not fam.has_deepstack:
        return main
    features, levels = out.deepstack_features, fam.deepstack_levels
    if len(features) < levels:  # the tower's own count and fam.deepstack_features disagree: a layout change
        raise RuntimeError(f"slabstage.hf.media_items: the vision tower emitted {len(features)} DeepStack features "
                           f"but {levels} levels were expected; this transformers version is not supported")
    levels = [_split(level, sizes) for level in features[:levels]]
    return [tuple([m] + [level[j] for level in levels]) for j, m in enumerate(main)]


def media_items(model, pixel_values=None, image_grid_thw=None, pixel_values_videos=None, video_grid_thw=None):
    """Run the vision tower of ``model``; return one media item per image (``image_grid_thw`` order), then one
    per video (``video_grid_thw`` order): the order a :class:`Request`'s ``media`` takes.

    Each item holds the rows of that image's (video's) placeholder tokens, in prompt order,
    ``t * h * w // merge**2`` of them for its grid row ``(t, h, w)``:

    - Qwen3-VL / Qwen3-VL-MoE: a tuple ``(main, ds_0, ..., ds_{k-1})`` of 2-D tensors with
      equal rows, each ``H`` wide: column block 0 and the DeepStack levels HF applies
      (``k`` as in :func:`input_embeds_width`); no ``torch.cat``;
    - Qwen2-VL / Qwen2.5-VL: one ``[rows, H]`` tensor.

    The items go to :class:`slabstage.PrefillBatch`
    (``media=``) or to :func:`pack_requests`. Grids are integer ``[N, 3]`` tensors, best on
    the host (the row counts are read from them). Raises ``TypeError`` for a model without a
    vision tower or a non-integer grid, and ``ValueError`` when pixels come without their grid
    or do not hold one row per patch of it.
    """
    fam = family_of(model, "media_items")
    if not fam.is_vlm:
        raise TypeError(f"slabstage.hf.media_items: {type(model).__name__} ({fam.name}) has no vision tower")
    merge = int(fam.vision_config.spatial_merge_size)
    items = []
    for pixels, grid, video in ((pixel_values, image_grid_thw, False), (pixel_values_videos, video_grid_thw, True)):
        name, pixels_name = ("video_grid_thw", "pixel_values_videos") if video else ("image_grid_thw", "pixel_values")
        if pixels is None:
            continue
        if grid is None:
            raise ValueError(f"slabstage.hf.media_items: {pixels_name} was given without {name}")
        host = check_grid(grid, name, "slabstage.hf.media_items:", merge)  # no copy (and no sync) for a host grid
        check_pixels(pixels, host, pixels_name, name, "slabstage.hf.media_items:")
        items += _tower(fam, pixels, host, video)
    return items
