"""mrope positions ``[3, T]`` for one request of a Qwen-VL model."""

from __future__ import annotations

import torch

from ._family import family_of

__all__ = ["mrope_positions", "mm_token_type_ids"]


def mm_token_type_ids(model, input_ids: torch.Tensor) -> torch.Tensor:
    """``int32`` like ``input_ids``: 0 text, 1 image placeholder, 2 video placeholder (from the config's token ids)."""
    config = model.config
    types = torch.zeros_like(input_ids, dtype=torch.int32)
    types[input_ids == config.image_token_id] = 1
    types[input_ids == config.video_token_id] = 2
    return types


def mrope_positions(model, input_ids: torch.Tensor, image_grid_thw=None, video_grid_thw=None,
                    second_per_grid_ts=None) -> torch.Tensor:
    """``int64[3, T]``: the (temporal, height, width) rope positions of one whole prompt.

    ``input_ids`` is ``[T]`` (or ``[1, T]``); grids as the processor returns them, for this
    request's images and videos only. Calls the model's own ``get_rope_index`` with the
    ``mm_token_type_ids`` that transformers 5.x requires (derived from the image and video
    token ids: without it Qwen3-VL raises and Qwen2.5-VL silently falls back to 1-D positions).
    Runs on the host side of the pipeline (HF's loop reads the ids); give host tensors.
    For a chunk of the prompt, slice the columns of the whole prompt's positions.
    """
    fam = family_of(model, "mrope_positions")
    if not fam.is_vlm:
        raise TypeError(f"slabstage.hf.mrope_positions: {type(model).__name__} ({fam.name}) uses 1-D positions")
    ids = input_ids.reshape(1, -1) if input_ids.dim() == 1 else input_ids
    if ids.shape[0] != 1:
        raise ValueError(f"slabstage.hf.mrope_positions takes one request, got input_ids of shape "
                         f"{tuple(input_ids.shape)}")
    kwargs = dict(image_grid_thw=image_grid_thw, video_grid_thw=video_grid_thw)
    if fam.name == "qwen2_5_vl":
        kwargs["second_per_grid_ts"] = second_per_grid_ts
    elif second_per_grid_ts is not None:
        raise ValueError(f"slabstage.hf.mrope_positions: {fam.name} takes no second_per_grid_ts")
    if video_grid_thw is not None:  # Qwen3-VL rewrites the grid in place (one row per frame)
        kwargs["video_grid_thw"] = video_grid_thw.clone()
    positions, _ = fam.base.get_rope_index(ids, mm_token_type_ids=mm_token_type_ids(model, ids), **kwargs)
    if positions.dim() != 3 or positions.shape[0] != 3:
        raise RuntimeError(f"slabstage.hf.mrope_positions: get_rope_index returned shape {tuple(positions.shape)}, "
                           f"expected [3, 1, T]; this transformers version is not supported (checked with 5.x)")
    return positions[:, 0].to(torch.int64)
