"""Checks on what a caller hands the VLM adapters: prompt ids, grids, and how a prompt's placeholders
line up with its grids and media items.

They run before anything is computed (rope index, packing), so a bad request fails here with a
``TypeError`` (wrong kind of value) or ``ValueError`` (right kind, wrong value) that names it,
never later inside HF or the staging kernels.

What HF means by the grids (``get_rope_index``, ``get_placeholder_mask`` and the masked scatter
of its forward): the image placeholder tokens of a prompt, in prompt order, take the rows of the
images in ``image_grid_thw`` order, one maximal run of placeholders per image; the video
placeholders likewise take the videos in ``video_grid_thw`` order, one run per video (Qwen3-VL:
one run per frame, the frames parted by their timestamps). So a request's items are its images in
``image_grid_thw`` order, then its videos in ``video_grid_thw`` order, item ``j`` holding
``t * h * w // merge**2`` rows of its own grid row ``(t, h, w)``.
"""

from __future__ import annotations

import operator
from typing import Sequence

import numpy as np
import torch

__all__ = ["as_prompt_ids", "check_grid", "check_chunk", "check_items", "check_mrope", "check_placeholders",
           "check_pixels", "check_seconds", "grid_rows"]


def _is_integer(dtype: torch.dtype) -> bool:
    return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)


def as_prompt_ids(input_ids, where: str, name: str = "input_ids") -> torch.Tensor:
    """``int64[L]`` on the host: one prompt's ids, given as an integer ``[L]`` or ``[1, L]`` tensor, L >= 1."""
    if not isinstance(input_ids, torch.Tensor):
        raise TypeError(f"{where} {name} must be a torch.Tensor of token ids, got {type(input_ids).__name__}")
    if not _is_integer(input_ids.dtype):
        raise TypeError(f"{where} {name} must hold integer token ids, got dtype {input_ids.dtype}")
    shape = tuple(input_ids.shape)
    if not (len(shape) == 1 or (len(shape) == 2 and shape[0] == 1)):
        raise ValueError(f"{where} {name} must be one prompt, [L] or [1, L], got shape {shape} "
                         f"(give each prompt as its own request)")
    if input_ids.numel() == 0:
        raise ValueError(f"{where} {name} is empty")
    return input_ids.reshape(-1).to("cpu", torch.int64)


def check_grid(grid, name: str, where: str, merge: int) -> torch.Tensor | None:
    """``grid`` as ``int64[N, 3]`` on the host (None stays None): integer ``(t, h, w)`` rows, each at least 1,
    ``h`` and ``w`` multiples of the vision tower's spatial ``merge`` size."""
    if grid is None:
        return None
    if not isinstance(grid, torch.Tensor):
        raise TypeError(f"{where} {name} must be a torch.Tensor [N, 3] of (t, h, w), got {type(grid).__name__}")
    if not _is_integer(grid.dtype):
        raise TypeError(f"{where} {name} must be an integer tensor [N, 3] of (t, h, w), got dtype {grid.dtype}")
    if grid.dim() != 2 or grid.shape[1] != 3:
        raise ValueError(f"{where} {name} must be [N, 3] (one (t, h, w) row per item), got shape "
                         f"{tuple(grid.shape)}")
    host = grid.to("cpu", torch.int64)
    for j, (t, h, w) in enumerate(host.tolist()):
        if min(t, h, w) < 1 or h % merge or w % merge:
            raise ValueError(f"{where} {name}[{j}] = {(t, h, w)}: t, h, w must be at least 1 and h, w multiples "
                             f"of the spatial merge size {merge}")
    return host


def grid_rows(grid: torch.Tensor | None, merge: int) -> list[int]:
    """Media rows of each grid row: ``t * h * w // merge**2``, as HF splits the tower's output."""
    return [] if grid is None else (grid.prod(-1) // merge ** 2).tolist()


def check_chunk(chunk, length: int, where: str) -> tuple[int, int]:
    """``(start, end)`` of ``chunk`` (None: the whole prompt), two ints with ``0 <= start < end <= length``."""
    if chunk is None:
        return 0, length
    try:
        start, end = chunk
        if isinstance(start, bool) or isinstance(end, bool):
            raise TypeError
        start, end = operator.index(start), operator.index(end)
    except (TypeError, ValueError):
        raise TypeError(f"{where} chunk must be two ints (start, end), got {chunk!r}") from None
    if not 0 <= start < end <= length:
        raise ValueError(f"{where} chunk {chunk} is not inside its {length} tokens (need 0 <= start < end <= "
                         f"{length})")
    return start, end


def _runs(mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Maximal runs of True in ``mask`` as ``(starts, ends)``, as HF groups placeholder tokens."""
    at = np.flatnonzero(mask)
    if not at.size:
        return at, at
    gaps = np.flatnonzero(at[1:] != at[:-1] + 1)
    return at[np.concatenate(([0], gaps + 1))], at[np.concatenate((gaps, [at.size - 1]))] + 1


def check_placeholders(ids: torch.Tensor, tokens: tuple[int, int], image_grid, video_grid, where: str, merge: int,
                       frames: bool) -> list[tuple[int, int, int, int, int]]:
    """Each maximal run of image (video) placeholder tokens in ``ids`` holds the rows of the next grid row,
    in order, and every grid row has its run (``tokens``: the image and video placeholder ids). ``frames``: a
    video's run is one frame (Qwen3-VL), so a video ``(t, h, w)`` takes ``t`` runs of ``h * w // merge**2``;
    else one run of ``t * h * w // merge**2``.

    Returns the runs in prompt order as ``(start, tokens, kind, grid row, frame)``: kind 1 an image and 2 a
    video, ``frame`` the run's frame in its video when ``frames`` (else 0). Vectorised: the host touches each
    token in a few numpy passes, no Python loop."""
    values = ids.numpy()
    runs_out = []
    for kind, token, grid, name, what in ((1, tokens[0], image_grid, "image_grid_thw", "image"),
                                          (2, tokens[1], video_grid, "video_grid_thw", "video")):
        starts, ends = _runs(values == token)
        if grid is None:
            if len(starts):
                count = int((ends - starts).sum())
                raise ValueError(f"{where} input_ids hold {count} {what} placeholder tokens ({len(starts)} "
                                 f"{what}{'s' if len(starts) > 1 else ''}) but {name} is None: give the grid")
            continue
        want = []  # (grid row, rows of its run, frame)
        for j, (t, h, w) in enumerate(grid.tolist()):
            if what == "video" and frames:
                want += [(j, h * w // merge ** 2, f) for f in range(t)]
            else:
                want.append((j, t * h * w // merge ** 2, 0))
        unit = "frame runs" if what == "video" and frames else "runs"
        if len(starts) != len(want):
            raise ValueError(f"{where} input_ids hold {len(starts)} runs of {what} placeholder tokens but {name} "
                             f"({grid.shape[0]} rows) needs {len(want)} {unit}")
        lengths = (ends - starts).tolist()
        starts = starts.tolist()
        for s, length, (j, rows, frame) in zip(starts, lengths, want):
            if length != rows:
                raise ValueError(f"{where} the {what} placeholder run at tokens [{s}, {s + length}) holds {length} "
                                 f"tokens but {name}[{j}] = {tuple(grid[j].tolist())} gives {rows} rows")
            runs_out.append((s, length, kind, j, frame))
    runs_out.sort()
    return runs_out


def _item_rows(item, where: str, j: int) -> int:
    main = item[0] if isinstance(item, (tuple, list)) and len(item) else item
    if not isinstance(main, torch.Tensor) or main.dim() != 2:
        raise TypeError(f"{where} media item {j} must be a 2-D tensor or a tuple of 2-D column blocks "
                        f"(as slabstage.hf.media_items returns), got {type(item).__name__}")
    return main.shape[0]


def check_items(media, image_grid, video_grid, where: str, merge: int) -> list[int]:
    """Rows of each item in ``media``, checked against its own grid row: items are the images in
    ``image_grid_thw`` order, then the videos in ``video_grid_thw`` order."""
    if isinstance(media, torch.Tensor) or not isinstance(media, Sequence):
        raise TypeError(f"{where} media must be a list of items (one per image, then one per video), got "
                        f"{type(media).__name__}")
    slots = [("image", "image_grid_thw", j, g) for j, g in enumerate(image_grid.tolist() if image_grid is not None
                                                                      else [])]
    slots += [("video", "video_grid_thw", j, g) for j, g in enumerate(video_grid.tolist() if video_grid is not None
                                                                       else [])]
    if len(media) != len(slots):
        images, videos = (0 if g is None else g.shape[0] for g in (image_grid, video_grid))
        raise ValueError(f"{where} {len(media)} media items were given for {images} images and {videos} videos "
                         f"(grids and placeholders): give one item per image (image_grid_thw order), then one "
                         f"per video (video_grid_thw order)")
    rows = []
    for i, (item, (what, name, j, (t, h, w))) in enumerate(zip(media, slots)):
        n = _item_rows(item, where, i)
        want = t * h * w // merge ** 2
        if n != want:
            raise ValueError(f"{where} media item {i} holds {n} rows but it is {what} {j}, {name}[{j}] = "
                             f"{(t, h, w)} gives {want}: items are the images in image_grid_thw order, then the "
                             f"videos in video_grid_thw order")
        rows.append(n)
    return rows


def check_mrope(mrope, length: int, where: str) -> None:
    """A request's own ``mrope_positions``: an integer ``[3, L]`` tensor for the whole prompt."""
    if mrope is None:
        return
    if not isinstance(mrope, torch.Tensor) or not _is_integer(mrope.dtype):
        raise TypeError(f"{where} mrope_positions must be an integer tensor [3, L], got "
                        f"{getattr(mrope, 'dtype', type(mrope).__name__)}")
    if tuple(mrope.shape) != (3, length):
        raise ValueError(f"{where} mrope_positions must be the whole prompt's [3, {length}], got shape "
                         f"{tuple(mrope.shape)}")


def check_seconds(seconds, video_grid, where: str) -> None:
    """Qwen2.5-VL's ``second_per_grid_ts``: one number per video."""
    if seconds is None:
        return
    if video_grid is None:
        raise ValueError(f"{where} second_per_grid_ts was given without video_grid_thw (it holds one number "
                         f"per video)")
    try:
        count = len(seconds)
    except TypeError:
        raise TypeError(f"{where} second_per_grid_ts must be a tensor or list of one number per video, got "
                        f"{type(seconds).__name__}") from None
    if count != video_grid.shape[0]:
        raise ValueError(f"{where} second_per_grid_ts has {count} entries but video_grid_thw lists "
                         f"{video_grid.shape[0]} videos")


def check_pixels(pixels, grid: torch.Tensor, pixels_name: str, grid_name: str, where: str) -> None:
    """The tower reads one pixel row per patch: ``sum(t * h * w)`` rows for the grid."""
    if not isinstance(pixels, torch.Tensor):
        raise TypeError(f"{where} {pixels_name} must be a torch.Tensor, got {type(pixels).__name__}")
    patches = int(grid.prod(-1).sum())
    if pixels.dim() != 2 or pixels.shape[0] != patches:
        raise ValueError(f"{where} {pixels_name} has shape {tuple(pixels.shape)} but {grid_name} gives {patches} "
                         f"patches: expected [{patches}, patch features]")
