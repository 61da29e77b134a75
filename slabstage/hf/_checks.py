"""Checks on what a caller hands the VLM adapters: prompt ids, grids, and how a prompt's placeholders
line up with its grids and media items (docs/hf.md, "A request's items, in order").

They run before anything is computed, so a bad request fails here with a ``TypeError`` (wrong kind of
value) or ``ValueError`` (right kind, wrong value) that names it, never later inside HF or the kernels.
"""

from __future__ import annotations

import functools
import operator
from typing import Sequence

import numpy as np
import torch

from ..cache.encoder_cache import Entry

__all__ = ["as_prompt_ids", "check_grid", "check_grid_rows", "check_chunk", "check_items", "check_mrope",
           "check_placeholders", "check_pixels", "check_seconds", "grid_rows", "placeholder_runs"]


@functools.lru_cache(maxsize=None)
def _is_integer(dtype: torch.dtype) -> bool:
    return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)


def as_prompt_ids(input_ids, where: str, name: str = "input_ids") -> torch.Tensor:
    """``int64[L]`` on the host: one prompt's ids, given as an integer ``[L]`` or ``[1, L]`` tensor, L >= 1."""
    if not isinstance(input_ids, torch.Tensor):
        raise TypeError(f"{where} {name} must be a torch.Tensor of token ids, got {type(input_ids).__name__}")
    dtype = input_ids.dtype
    if dtype is not torch.int64 and not _is_integer(dtype):
        raise TypeError(f"{where} {name} must hold integer token ids, got dtype {dtype}")
    shape = input_ids.shape
    if not (len(shape) == 1 or (len(shape) == 2 and shape[0] == 1)):
        raise ValueError(f"{where} {name} must be one prompt, [L] or [1, L], got shape {tuple(shape)} "
                         f"(give each prompt as its own request)")
    if not shape[-1]:
        raise ValueError(f"{where} {name} is empty")
    if input_ids.is_meta:
        raise ValueError(f"{where} {name} is a meta tensor: it holds no ids")
    if len(shape) == 2:
        input_ids = input_ids[0]
    # (a host int64 prompt, the usual one, as it is: each torch call costs the host a microsecond)
    return input_ids if dtype is torch.int64 and input_ids.is_cpu else input_ids.to("cpu", torch.int64)


def check_grid_rows(grid, name: str, where: str, merge: int) -> list[list[int]] | None:
    """The ``(t, h, w)`` rows of ``grid`` as lists (None stays None), read once: an integer ``[N, 3]`` tensor
    whose rows are each at least 1, ``h`` and ``w`` multiples of the vision tower's spatial ``merge`` size."""
    if grid is None:
        return None
    _check_grid_kind(grid, name, where)
    return _check_grid_values(grid.tolist(), name, where, merge)


def check_grid(grid, name: str, where: str, merge: int) -> torch.Tensor | None:
    """``grid`` as ``int64[N, 3]`` on the host (None stays None), checked as :func:`check_grid_rows` does."""
    if grid is None:
        return None
    _check_grid_kind(grid, name, where)
    host = grid.to("cpu", torch.int64)
    _check_grid_values(host.tolist(), name, where, merge)
    return host


def _check_grid_kind(grid, name: str, where: str) -> None:
    if not isinstance(grid, torch.Tensor):
        raise TypeError(f"{where} {name} must be a torch.Tensor [N, 3] of (t, h, w), got {type(grid).__name__}")
    if not _is_integer(grid.dtype):
        raise TypeError(f"{where} {name} must be an integer tensor [N, 3] of (t, h, w), got dtype {grid.dtype}")
    shape = grid.shape
    if len(shape) != 2 or shape[1] != 3:
        raise ValueError(f"{where} {name} must be [N, 3] (one (t, h, w) row per item), got shape "
                         f"{tuple(shape)}")


def _check_grid_values(rows: list, name: str, where: str, merge: int) -> list:
    for j, (t, h, w) in enumerate(rows):
        if t < 1 or h < 1 or w < 1 or h % merge or w % merge:
            raise ValueError(f"{where} {name}[{j}] = {(t, h, w)}: t, h, w must be at least 1 and h, w multiples "
                             f"of the spatial merge size {merge}")
    return rows


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


def placeholder_runs(values: np.ndarray, tokens: tuple[int, int], firsts: list[int]) -> list[tuple[list, list]]:
    """The maximal runs of image and video placeholder tokens (``tokens``: their ids) of prompts laid end to
    end in ``values``, prompt ``k`` from ``firsts[k]`` (``firsts[0] == 0``), as HF groups them: a run ends
    where its kind of token or its prompt does. Per prompt ``(image runs, video runs)``, each a list of
    ``(start in the prompt, tokens)`` in prompt order.

    One numpy compare a kind over all the prompts at once, then byte scans (``bytes.find``, a ``memchr``) from
    run to run: nothing in Python a token, a few operations a run."""
    ends = firsts[1:] + [values.shape[0]]
    found = [([], []) for _ in firsts]
    for kind, token in enumerate(tokens):
        mask = (values == token).tobytes()  # a byte a token: 1 a placeholder, 0 not
        k = 0
        start = mask.find(1)
        while start >= 0:
            while start >= ends[k]:  # (the prompt the run starts in)
                k += 1
            hi = ends[k]
            end = mask.find(0, start, hi)
            if end < 0:
                end = hi
            found[k][kind].append((start - firsts[k], end - start))
            start = mask.find(1, end)
    return found


def check_placeholders(found: tuple[list, list], images: list | None, videos: list | None, where: str, merge: int,
                       frames: bool) -> list[tuple[int, int, int, int, int]]:
    """Each maximal run of image (video) placeholder tokens of a prompt holds the rows of the next grid row,
    in order, and every grid row has its run. ``found``: the prompt's image runs and video runs, each
    ``(start, tokens)`` in prompt order (:func:`placeholder_runs`); ``images``, ``videos``: the grids' rows
    (:func:`check_grid_rows`). ``frames``: a video's run is one frame (Qwen3-VL), so a video ``(t, h, w)``
    takes ``t`` runs of ``h * w // merge**2``; else one run of ``t * h * w // merge**2``.

    Returns the runs in prompt order as ``(start, tokens, kind, grid row, media row)``: kind 1 an image and 2
    a video, ``media row`` the run's first row among the prompt's items laid end to end (the images', then the
    videos'; a frame's run starts inside its video's item). A few operations a run."""
    runs_out = []
    area = merge ** 2
    row = 0  # media rows of the runs so far: the runs of a kind take their grid rows' items in order
    for kind, mine, grid, name, what in ((1, found[0], images, "image_grid_thw", "image"),
                                         (2, found[1], videos, "video_grid_thw", "video")):
        if grid is None:
            if mine:
                count = sum(length for _, length in mine)
                raise ValueError(f"{where} input_ids hold {count} {what} placeholder tokens ({len(mine)} "
                                 f"{what}{'s' if len(mine) > 1 else ''}) but {name} is None: give the grid")
            continue
        split = frames and kind == 2
        if split:  # (grid row, rows of its run) of each run
            want = [(j, h * w // area) for j, (t, h, w) in enumerate(grid) for _ in range(t)]
        else:
            want = [(j, t * h * w // area) for j, (t, h, w) in enumerate(grid)]
        if len(mine) != len(want):
            raise ValueError(f"{where} input_ids hold {len(mine)} runs of {what} placeholder tokens but {name} "
                             f"({len(grid)} rows) needs {len(want)} {'frame runs' if split else 'runs'}")
        for (s, length), (j, rows) in zip(mine, want):
            if length != rows:
                raise ValueError(f"{where} the {what} placeholder run at tokens [{s}, {s + length}) holds {length} "
                                 f"tokens but {name}[{j}] = {tuple(grid[j])} gives {rows} rows")
            runs_out.append((s, length, kind, j, row))
            row += length
    if found[0] and found[1]:  # (one kind alone is in prompt order already)
        runs_out.sort()
    return runs_out


def check_items(media, images: list | None, videos: list | None, where: str, merge: int) -> list[int]:
    """Rows of each item in ``media``, checked against its own grid row: items are the images in
    ``image_grid_thw`` order, then the videos in ``video_grid_thw`` order (``images``, ``videos``: the grids'
    rows, :func:`check_grid_rows`)."""
    # (a list or tuple passes without the Sequence ABC's isinstance, which costs the host a microsecond)
    if type(media) not in (list, tuple) and (isinstance(media, torch.Tensor) or not isinstance(media, Sequence)):
        raise TypeError(f"{where} media must be a list of items (one per image, then one per video), got "
                        f"{type(media).__name__}")
    grids = (images or []) + (videos or [])
    if len(media) != len(grids):
        raise ValueError(f"{where} {len(media)} media items were given for {len(images or ())} images and "
                         f"{len(videos or ())} videos (grids and placeholders): give one item per image "
                         f"(image_grid_thw order), then one per video (video_grid_thw order)")
    rows, bad = [], None  # (a wrong kind of item is named before wrong rows, wherever it is)
    area = merge ** 2
    for i, (item, (t, h, w)) in enumerate(zip(media, grids)):
        if type(item) is Entry:  # an encoder-cache handle: its rows, no tensor
            shape = (item.rows, 0)
        else:
            main = item[0] if isinstance(item, (tuple, list)) and item else item
            shape = main.shape if isinstance(main, torch.Tensor) else ()
        if len(shape) != 2:
            raise TypeError(f"{where} media item {i} must be a 2-D tensor, a tuple of 2-D column blocks or an "
                            f"EncoderCache entry (as slabstage.hf.media_items returns), got {type(item).__name__}")
        rows.append(shape[0])
        if shape[0] != t * h * w // area and bad is None:
            bad = i
    if bad is not None:
        num_images = len(images or ())
        what, name, j = ("image", "image_grid_thw", bad) if bad < num_images else \
            ("video", "video_grid_thw", bad - num_images)
        t, h, w = grids[bad]
        raise ValueError(f"{where} media item {bad} holds {rows[bad]} rows but it is {what} {j}, {name}[{j}] = "
                         f"{(t, h, w)} gives {t * h * w // area}: items are the images in image_grid_thw order, "
                         f"then the videos in video_grid_thw order")
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


def check_seconds(seconds, videos: list | None, where: str) -> None:
    """Qwen2.5-VL's ``second_per_grid_ts``: one number per video (``videos``: the video grid's rows)."""
    if seconds is None:
        return
    if videos is None:
        raise ValueError(f"{where} second_per_grid_ts was given without video_grid_thw (it holds one number "
                         f"per video)")
    try:
        count = len(seconds)
    except TypeError:
        raise TypeError(f"{where} second_per_grid_ts must be a tensor or list of one number per video, got "
                        f"{type(seconds).__name__}") from None
    if count != len(videos):
        raise ValueError(f"{where} second_per_grid_ts has {count} entries but video_grid_thw lists "
                         f"{len(videos)} videos")


def check_pixels(pixels, grid: torch.Tensor, pixels_name: str, grid_name: str, where: str) -> None:
    """The tower reads one pixel row per patch: ``sum(t * h * w)`` rows for the grid."""
    if not isinstance(pixels, torch.Tensor):
        raise TypeError(f"{where} {pixels_name} must be a torch.Tensor, got {type(pixels).__name__}")
    patches = int(grid.prod(-1).sum())
    if pixels.dim() != 2 or pixels.shape[0] != patches:
        raise ValueError(f"{where} {pixels_name} has shape {tuple(pixels.shape)} but {grid_name} gives {patches} "
                         f"patches: expected [{patches}, patch features]")
