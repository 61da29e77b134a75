"""mrope positions ``[3, T]`` for one request of a Qwen-VL model."""

from __future__ import annotations

import functools
import inspect

import numpy as np
import torch

from ..staging.mrope import MropeLayout
from ._checks import as_prompt_ids, check_grid_rows, check_placeholders, check_seconds, placeholder_runs
from ._family import family_of

__all__ = ["mrope_positions", "mm_token_type_ids", "rope_layout", "layout_of_rows", "layout_rule", "layout_takes"]

# the get_rope_index rules slabstage follows without calling it: transformers 5.6 grouped the prompt by token
# type (text counts on from p + max(h, w) / merge after an item); 5.18 multiplies a Qwen2.5-VL video's frame
# index by tokens_per_second * second_per_grid_t as given (earlier: by its int())
LAYOUT_MIN_TRANSFORMERS = (5, 6)
FLOAT_INTERVALS_FROM = (5, 18)


def mm_token_type_ids(model, input_ids: torch.Tensor) -> torch.Tensor:
    """``int32`` like ``input_ids``: 0 text, 1 image placeholder, 2 video placeholder (from the config's token ids)."""
    config = model.config
    types = torch.zeros_like(input_ids, dtype=torch.int32)
    types[input_ids == config.image_token_id] = 1
    types[input_ids == config.video_token_id] = 2
    return types


def check_vlm_grids(fam, image_grid_thw, video_grid_thw, second_per_grid_ts, where: str):
    """``(image grid rows, video grid rows)`` (lists of ``[t, h, w]``, or None) once the grids and
    ``second_per_grid_ts`` are right on their own; raises ``TypeError``/``ValueError`` naming what is not."""
    merge = fam.merge
    images = check_grid_rows(image_grid_thw, "image_grid_thw", where, merge)
    videos = check_grid_rows(video_grid_thw, "video_grid_thw", where, merge)
    if second_per_grid_ts is not None and fam.name != "qwen2_5_vl":
        raise ValueError(f"{where} {fam.name} takes no second_per_grid_ts (it is Qwen2.5-VL's)")
    check_seconds(second_per_grid_ts, videos, where)
    return images, videos


def check_vlm_prompt(fam, ids: torch.Tensor, image_grid_thw, video_grid_thw, second_per_grid_ts, where: str):
    """``(image grid, video grid, runs)`` once the grids, ``second_per_grid_ts`` and the placeholders of the
    host prompt ``ids`` agree: the grids as host ``int64[N, 3]`` (or None), ``runs`` as
    :func:`check_placeholders` returns them; raises ``TypeError``/``ValueError`` naming what does not."""
    images, videos = check_vlm_grids(fam, image_grid_thw, video_grid_thw, second_per_grid_ts, where)
    found, = placeholder_runs(ids.numpy(), fam.placeholder_ids, [0])
    runs = check_placeholders(found, images, videos, where, fam.merge, frames=fam.has_deepstack)
    return grid_tensor(images), grid_tensor(videos), runs


def grid_tensor(rows: list | None) -> torch.Tensor | None:
    """Checked grid rows (:func:`check_vlm_grids`) as the host ``int64[N, 3]`` HF takes (None stays None)."""
    return None if rows is None else torch.tensor(rows, dtype=torch.int64, device="cpu").reshape(-1, 3)


@functools.lru_cache(maxsize=None)
def layout_rule(version: str) -> str | None:
    """Which ``get_rope_index`` rule the installed transformers follows: ``"int"`` (5.6 to 5.17: a
    Qwen2.5-VL video's interval is ``tokens_per_second * int(second_per_grid_t)``), ``"float"`` (5.18 on: as
    given), or None for a version whose rule :func:`rope_layout` does not reproduce (before 5.6)."""
    try:
        major, minor = (int(part) for part in version.split(".")[:2])
    except ValueError:
        return None
    if (major, minor) < LAYOUT_MIN_TRANSFORMERS:
        return None
    return "float" if (major, minor) >= FLOAT_INTERVALS_FROM else "int"


def layout_takes(second_per_grid_ts, rule: str | None) -> bool:
    """Whether a :class:`~slabstage.MropeLayout` holds the intervals ``get_rope_index`` makes of
    ``second_per_grid_ts`` under ``rule``: not where it multiplies the frame indices in float16 or bfloat16 (a
    half-precision tensor, or a list of 0-d ones, as a processor's output moved with ``.to(device, dtype)``
    holds); such a request's positions come from ``get_rope_index`` itself."""
    if rule is None:
        return False
    if rule == "int" or second_per_grid_ts is None:
        return True
    values = second_per_grid_ts if isinstance(second_per_grid_ts, torch.Tensor) else list(second_per_grid_ts)
    if isinstance(values, torch.Tensor):
        return values.dtype not in (torch.float16, torch.bfloat16)
    return not any(isinstance(v, torch.Tensor) and v.dtype in (torch.float16, torch.bfloat16) for v in values)


def rope_layout(fam, runs, images, videos, second_per_grid_ts, start: int, end: int, rule: str) -> MropeLayout:
    """The :class:`~slabstage.MropeLayout` of the chunk ``[start, end)`` of one checked prompt: its placeholder
    ``runs`` and grids (host tensors, from :func:`check_vlm_prompt`), as :func:`layout_of_rows` makes it."""
    rows = (lambda grid: None if grid is None else grid.tolist())
    return layout_of_rows(fam, runs, rows(images), rows(videos), second_per_grid_ts, start, end, rule)


def layout_of_rows(fam, runs, images, videos, second_per_grid_ts, start: int, end: int, rule: str) -> MropeLayout:
    """The :class:`~slabstage.MropeLayout` of the chunk ``[start, end)`` of one checked prompt: its placeholder
    ``runs`` (:func:`check_placeholders`) with their grids' rows ``images``, ``videos`` (:func:`check_vlm_grids`),
    computed as ``get_rope_index`` would under ``rule`` (:func:`layout_rule`), a few operations an item."""
    frames = fam.has_deepstack
    tps = fam.tokens_per_second
    starts, grids, intervals = [], [], []
    for s, _, kind, j, _ in runs:
        starts.append(s)
        if kind == 1:
            grids.append(images[j])
            intervals.append(1)
            continue
        t, h, w = videos[j]
        grids.append((1, h, w) if frames else (t, h, w))
        if tps is None:
            intervals.append(1)
        elif second_per_grid_ts is None:
            intervals.append(tps * 1)
        elif rule == "int":
            intervals.append(tps * int(second_per_grid_ts[j]))
        else:  # (a tensor's element stays a tensor of its dtype; a numpy one is a Python number to torch)
            interval = tps * second_per_grid_ts[j]
            intervals.append(interval.item() if isinstance(interval, np.generic) else interval)
    return MropeLayout(end - start, starts, grids, fam.merge, intervals, start)


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
    (integer ``[N, 3]`` of ``(t, h, w)``), for this request's images and videos only (docs/hf.md,
    "A request's items, in order"). ``second_per_grid_ts`` (one number per video) is Qwen2.5-VL's
    only. Calls the model's own ``get_rope_index`` (with ``mm_token_type_ids`` where it takes
    them) on the host: give host tensors. For a chunk, slice the whole prompt's columns.

    Raises ``TypeError`` for a text-only model, non-integer ids or grids, and ``ValueError``
    for ids that are not one prompt, or grids that disagree with the placeholders.
    """
    fam = family_of(model, "mrope_positions")
    if not fam.is_vlm:
        raise TypeError(f"slabstage.hf.mrope_positions: {type(model).__name__} ({fam.name}) uses 1-D positions")
    where = "slabstage.hf.mrope_positions:"
    ids = as_prompt_ids(input_ids, where)
    images, videos, _ = check_vlm_prompt(fam, ids, image_grid_thw, video_grid_thw, second_per_grid_ts, where)
    return rope_index(fam, ids, images, videos, second_per_grid_ts)
