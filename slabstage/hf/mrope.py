"""mrope positions ``[3, T]`` for one request of a Qwen-VL model."""

from __future__ import annotations

import inspect

import torch

from ._checks import as_prompt_ids, check_grid, check_placeholders, check_seconds
from ._family import family_of

__all__ = ["mrope_positions", "mm_token_type_ids"]


def mm_token_type_ids(model, input_ids: torch.Tensor) -> torch.Tensor:
    """``int32`` like ``input_ids``: 0 text, 1 image placeholder, 2 video placeholder (from the config's token ids)."""
    config = model.config
    types = torch.zeros_like(input_ids, dtype=torch.int32)
    types[input_ids == config.image_token_id] = 1
    types[input_ids == config.video_token_id] = 2
    return types


def check_vlm_prompt(fam, ids: torch.Tensor, image_grid_thw, video_grid_thw, second_per_grid_ts, where: str):
    """``(image grid, video grid)`` as host ``int64[N, 3]`` (or None) once the grids, ``second_per_grid_ts``
    and the placeholders of the prompt ``ids`` agree; raises ``TypeError``/``ValueError`` naming what does not."""
    merge = int(fam.vision_config.spatial_merge_size)
    images = check_grid(image_grid_thw, "image_grid_thw", where, merge)
    videos = check_grid(video_grid_thw, "video_grid_thw", where, merge)
    if second_per_grid_ts is not None and fam.name != "qwen2_5_vl":
        raise ValueError(f"{where} {fam.name} takes no second_per_grid_ts (it is Qwen2.5-VL's)")
    check_seconds(second_per_grid_ts, videos, where)
    # Qwen3-VL parts a video's frames by timestamps: one placeholder run per frame
    check_placeholders(ids, fam.model.config, images, videos, where, merge, frames=fam.has_deepstack)
    return images, videos


def rope_index(fam, ids: torch.Tensor, images, videos, second_per_grid_ts) -> torch.Tensor:
    """``int64[3, L]`` from the model's own ``get_rope_index``, for checked host inputs."""
    get = fam.base.get_rope_index
    kwargs = dict(image_grid_thw=images, video_grid_thw=videos)
    if fam.name == "qwen2_5_vl":
        kwargs["second_per_grid_ts"] = second_per_grid_ts
    if videos is not None:  # Qwen3-VL rewrites the grid in place (one row per frame)
        kwargs["video_grid_thw"] = videos.clone()
    ids = ids.reshape(1, -1)
    # transformers >= 5.3 groups the prompt by these token types (without them Qwen3-VL raises and
    # Qwen2.5-VL silently falls back to 1-D positions); 5.1 and 5.2 find the placeholders from the ids
    # themselves, and 5.1 does not take the argument at all
    params = inspect.signature(get).parameters
    if "mm_token_type_ids" in params or any(p.kind is p.VAR_KEYWORD for p in params.values()):
        kwargs["mm_token_type_ids"] = mm_token_type_ids(fam.model, ids)
    positions, _ = get(ids, **kwargs)
    if positions.dim() != 3 or positions.shape[0] != 3:
        raise RuntimeError(f"slabstage.hf.mrope_positions: get_rope_index returned shape {tuple(positions.shape)}, "
                           f"expected [3, 1, T]; this transformers version is not supported (checked with 5.1 "
                           f"to 5.x)")
    return positions[:, 0].to(torch.int64)


def mrope_positions(model, input_ids: torch.Tensor, image_grid_thw=None, video_grid_thw=None,
                    second_per_grid_ts=None) -> torch.Tensor:
    """``int64[3, T]``: the (temporal, height, width) rope positions of one whole prompt.

    ``input_ids`` is an integer ``[T]`` (or ``[1, T]``); grids as the processor returns them
    (integer ``[N, 3]`` of ``(t, h, w)``), for this request's images and videos only: the
    prompt's image placeholder runs take the ``image_grid_thw`` rows in order, its video runs
    the ``video_grid_thw`` rows (Qwen3-VL: one run per frame). ``second_per_grid_ts`` (one
    number per video) is Qwen2.5-VL's only. Calls the model's own ``get_rope_index``, with
    the ``mm_token_type_ids`` that transformers >= 5.3 requires (derived from the image and
    video token ids); the positions are those of the installed transformers' own forward.
    Runs on the host side of the pipeline (HF's loop reads the ids); give host tensors.
    For a chunk of the prompt, slice the columns of the whole prompt's positions.

    Raises ``TypeError`` for a text-only model, non-integer ids or grids, and ``ValueError``
    for ids that are not one prompt, or grids that disagree with the placeholders.
    """
    fam = family_of(model, "mrope_positions")
    if not fam.is_vlm:
        raise TypeError(f"slabstage.hf.mrope_positions: {type(model).__name__} ({fam.name}) uses 1-D positions")
    where = "slabstage.hf.mrope_positions:"
    ids = as_prompt_ids(input_ids, where)
    images, videos = check_vlm_prompt(fam, ids, image_grid_thw, video_grid_thw, second_per_grid_ts, where)
    return rope_index(fam, ids, images, videos, second_per_grid_ts)
