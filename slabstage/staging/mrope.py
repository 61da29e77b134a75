"""mrope positions from a compact layout: what the staging launch needs to compute them on the device.

A Qwen-VL prompt's rope positions ``[3, L]`` (temporal, height, width) follow from
where its media items sit and their grids, by the rule of Hugging Face's
``get_rope_index`` (transformers >= 5.6):

- text tokens count on from the position before them, the same on all three rows;
- an item's tokens, with ``(t, h, w)`` its grid and ``m`` the spatial merge, are
  ``t x (h/m) x (w/m)`` positions ``(p + floor(i * interval), p + y, p + x)`` for
  frame ``i``, row ``y``, column ``x``, where ``p`` is the position the item starts
  at; the text after the item starts at ``p + max(h, w) / m``.

A request says this with a :class:`MropeLayout` (a few numbers an item), and
:func:`mrope_segments` turns a batch of them into the segment list the kernel reads: the
batch's rows cut into runs that are each text (``position = row + base``) or one
item's piece (``base + offsets``). Building it costs the host a few operations an
item, nothing per token. :func:`~slabstage.staging.reference.mrope_from_segments` is its PyTorch
reference.
"""

from __future__ import annotations

import math
import struct
from typing import NamedTuple, Sequence

import numpy as np
import torch

from ..checks import INT64_MAX, check_float32, check_int, is_int
from ..kernels.layout import (INTERVAL_F32, INTERVAL_F64, INTERVAL_INT, SEGMENT_WORDS)

__all__ = ["MropeLayout", "check_layouts", "float_word", "mrope_segments", "SEGMENT_WORDS"]

_FLOAT_CODE = {torch.float32: INTERVAL_F32, torch.float64: INTERVAL_F64}


class MropeLayout(NamedTuple):
    """One request's multimodal layout in a batch, from which the staging launch computes its mrope positions.

    ``tokens``: the request's rows in this batch (requests lie back to back, in order, from row 0).
    ``starts``: the prompt index of each media item's first placeholder token, ascending; ``grids``:
    each item's ``(t, h, w)`` in patches, before the spatial ``merge`` (as the processor's
    ``image_grid_thw`` gives them), so an item spans ``t * h * w // merge**2`` tokens. A video whose
    frames are parted in the prompt (Qwen3-VL's timestamps) is one item per frame, each ``(1, h, w)``.
    ``intervals``: each item's temporal step (default 1): the frame ``i`` of an item sits
    ``floor(i * interval)`` after its start (Qwen2.5-VL's videos: ``tokens_per_second *
    second_per_grid_t``). An int is exact; a Python float or a float32 tensor is multiplied in
    float32, a float64 tensor in float64, as ``torch.arange(t) * interval`` does.
    ``offset``: the prompt index of the request's first row in this batch (a chunk after the first).
    """

    tokens: int
    starts: Sequence[int] = ()
    grids: Sequence[Sequence[int]] | torch.Tensor = ()
    merge: int = 1
    intervals: Sequence | torch.Tensor | None = None
    offset: int = 0

    def position_delta(self, prompt_length: int) -> int:
        """What the positions after the prompt add to a token's index: ``max(position) + 1 - prompt_length``
        over the whole prompt of ``prompt_length`` tokens (Hugging Face's ``mrope_position_deltas``)."""
        where = "MropeLayout.position_delta:"
        length = check_int(f"{where} prompt_length", prompt_length, lo=1)
        items, _ = _items(self, where)
        top, delta, end = -1, 0, 0
        for start, stop, lh, lw, t, code, value in items:
            if stop > length:
                raise ValueError(f"{where} an item spans tokens [{start}, {stop}), past the prompt's {length}")
            if start > end:
                top = max(top, start - 1 + delta)  # the text before the item
            base = start + delta
            top = max(top, base + max(_temporal(t - 1, code, value), lh - 1, lw - 1))
            delta, end = base + max(lh, lw) - stop, stop
        if length > end:
            top = max(top, length - 1 + delta)
        return top + 1 - length


def _as_list(values, what: str) -> list:
    if isinstance(values, torch.Tensor):
        return values.tolist()
    try:
        return list(values)
    except TypeError:
        raise TypeError(f"{what} must be a sequence or a tensor, got {type(values).__name__}") from None


def _intervals(intervals, count: int, where: str) -> list[tuple[int, int]]:
    """``(code, value word)`` per item: an int interval as itself, a float one as its float32 or float64 bits."""
    if intervals is None:
        return [(INTERVAL_INT, 1)] * count
    if isinstance(intervals, torch.Tensor):
        if intervals.dim() != 1 or intervals.shape[0] != count:
            raise ValueError(f"{where} intervals has shape {tuple(intervals.shape)}, expected [{count}] (one per item)")
        if intervals.dtype not in _FLOAT_CODE and _not_int(intervals.dtype):
            raise TypeError(f"{where} intervals must be an integer, float32 or float64 tensor, got {intervals.dtype}")
        code = _FLOAT_CODE.get(intervals.dtype, INTERVAL_INT)
        return [_word(code, v, f"{where} intervals[{j}]", None) for j, v in enumerate(intervals.tolist())]
    values = _as_list(intervals, f"{where} intervals")
    if len(values) != count:
        raise ValueError(f"{where} intervals has {len(values)} entries for {count} items")
    out = []
    for j, v in enumerate(values):
        if isinstance(v, torch.Tensor) and v.dim() == 0:
            if v.dtype not in _FLOAT_CODE and _not_int(v.dtype):
                raise TypeError(f"{where} intervals[{j}] is a {v.dtype} tensor: give an int, float32 or float64")
            code, v = _FLOAT_CODE.get(v.dtype, INTERVAL_INT), v.item()
        elif is_int(v):
            code = INTERVAL_INT
        elif isinstance(v, float):
            code = INTERVAL_F32  # a Python float: torch multiplies an int64 arange by it in float32
        else:
            raise TypeError(f"{where} intervals[{j}] must be an int or a float, got {v!r} ({type(v).__name__})")
        out.append(_word(code, v, f"{where} intervals[{j}]"))
    return out


def _not_int(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point or dtype.is_complex or dtype == torch.bool


def _word(code: int, v, name: str, lo: int | None = -INT64_MAX - 1) -> tuple[int, int]:
    """``(code, value word)`` of one interval ``v`` of kind ``code``, checked (an int: not below ``lo``)."""
    if code == INTERVAL_INT:
        return code, check_int(name, v, lo=lo)
    if not math.isfinite(v):
        raise ValueError(f"{name} is {v}: must be finite")
    if code == INTERVAL_F32:
        check_float32(name, v)
    return code, float_word(v, code)


def float_word(v: float, code: int = INTERVAL_F32) -> int:
    """The bits of ``v`` as float32 (``code`` INTERVAL_F32) or float64, as an int word of the parameter record."""
    if code == INTERVAL_F32:
        return struct.unpack("<i", struct.pack("<f", v))[0]
    return struct.unpack("<q", struct.pack("<d", v))[0]


def _value(code: int, word: int) -> float:
    if code == INTERVAL_F32:
        return struct.unpack("<f", struct.pack("<i", word))[0]
    return struct.unpack("<d", struct.pack("<q", word))[0]


def _temporal(i: int, code: int, word: int) -> int:
    """``floor(i * interval)`` computed as the kernel computes it (truncation of a float32 or float64 product)."""
    if code == INTERVAL_INT:
        return i * word
    if code == INTERVAL_F32:
        with np.errstate(over="ignore"):
            f = float(np.float32(i) * np.float32(_value(code, word)))
    else:
        f = float(i) * _value(code, word)
    return int(f) if math.isfinite(f) else int(math.copysign(2**64, f))  # (past int64 either way: refused)


def _items(layout, where: str) -> tuple[list, int]:
    """``([(start, end, h/m, w/m, t, code, interval word)], offset)`` of a checked layout."""
    merge = check_int(f"{where} merge", layout.merge, lo=1)
    offset = check_int(f"{where} offset", layout.offset, lo=0)
    starts = _as_list(layout.starts, f"{where} starts")
    grids = _as_list(layout.grids, f"{where} grids")
    if len(starts) != len(grids):
        raise ValueError(f"{where} {len(starts)} starts but {len(grids)} grids: one (t, h, w) per item")
    codes = _intervals(layout.intervals, len(starts), where)
    items, end = [], 0
    for j, (start, grid, (code, word)) in enumerate(zip(starts, grids, codes)):
        if not is_int(start) or not end <= start <= INT64_MAX:
            raise ValueError(f"{where} starts[{j}] = {start!r}: items start at ints, ascending, each after the end "
                             f"of the one before ({end})")
        try:
            t, h, w = grid
            ok = is_int(t) and is_int(h) and is_int(w) and min(t, h, w) >= 1 and not (h % merge or w % merge)
        except (TypeError, ValueError):
            ok = False
        if not ok:
            raise ValueError(f"{where} grids[{j}] = {grid!r}: (t, h, w) must be ints >= 1 with h and w multiples "
                             f"of merge={merge}")
        lh, lw = h // merge, w // merge
        end = start + t * lh * lw
        if end > INT64_MAX:
            raise ValueError(f"{where} grids[{j}] = {grid!r}: the item's tokens end at {end}, past int64")
        items.append((int(start), end, lh, lw, t, code, word))
    return items, offset


def check_layouts(layouts) -> tuple:
    """``layouts`` as a tuple of :class:`MropeLayout`: one, or a non-empty list or tuple of them."""
    if isinstance(layouts, MropeLayout):
        return (layouts,)
    if type(layouts) not in (list, tuple):
        raise TypeError(f"mrope_positions must be a [3, n] tensor, a slabstage.MropeLayout or a list of them (one "
                        f"per request), got {type(layouts).__name__}")
    if not layouts:
        raise ValueError("mrope_positions is an empty list of layouts: give one MropeLayout per request")
    for r, layout in enumerate(layouts):
        if not isinstance(layout, MropeLayout):
            raise TypeError(f"mrope_positions[{r}]: expected a slabstage.MropeLayout, got {type(layout).__name__}")
    return tuple(layouts)


def mrope_segments(layouts, n: int, dtype: torch.dtype = torch.int64) -> list[int]:
    """The segment list of a batch of ``n`` rows (``SEGMENT_WORDS`` ints a segment, rows ascending from 0).

    ``layouts``: a :class:`MropeLayout` (one request) or a sequence of them, one per request in row order,
    their ``tokens`` adding up to ``n``; ``dtype``: the slot the positions go to (int32 or int64). Raises
    ``TypeError``/``ValueError`` naming the request and field, or the request whose positions ``dtype``
    cannot hold."""
    layouts = check_layouts(layouts)
    info = torch.iinfo(dtype)
    words: list[int] = []
    row = 0
    for r, layout in enumerate(layouts):
        where = f"mrope_positions[{r}]:" if len(layouts) > 1 else "mrope_positions:"
        items, offset = _items(layout, where)
        tokens = check_int(f"{where} tokens", layout.tokens, lo=1)
        low, high = _request(words, items, row, offset, tokens)
        if low < info.min or high > info.max:
            raise ValueError(f"{where} its positions reach {low if low < info.min else high} (offset={offset}, "
                             f"tokens={tokens}), past what the {dtype} mrope_positions slot holds "
                             f"([{info.min}, {info.max}])")
        row += tokens
    if row != n:
        raise ValueError(f"mrope_positions: the layouts' tokens add up to {row} but the batch has {n} rows")
    return words


def _request(words: list, items: list, row0: int, offset: int, tokens: int) -> tuple[int, int]:
    """Append the segments of one request's rows ``[row0, row0 + tokens)``, prompt tokens from ``offset``;
    return the least and the greatest position they hold (bounds: a piece of an item counts its whole rows
    and columns)."""
    lo, hi = offset, offset + tokens  # the chunk, in prompt tokens
    delta, prev = 0, 0  # text position = prompt index + delta; prev: where the text run starts
    shift = row0 - offset  # batch row = prompt index + shift
    low, high = None, None
    for start, end, lh, lw, _, code, word in items:
        if start >= hi:
            break
        a, b = max(prev, lo), min(start, hi)  # the text before the item
        if a < b:
            words += (a + shift, delta - shift, 0, 1, 0, INTERVAL_INT, 0, 0)
            low, high = _span(low, high, a + delta, b - 1 + delta)
        base = start + delta
        a, b = max(start, lo), min(end, hi)
        if a < b:
            words += (a + shift, base, lh * lw, lw, a - start, code, word, 0)
            first, last = _temporal((a - start) // (lh * lw), code, word), _temporal((b - 1 - start) // (lh * lw),
                                                                                      code, word)
            low, high = _span(low, high, base + min(first, last, 0), base + max(first, last, lh - 1, lw - 1))
        delta, prev = base + max(lh, lw) - end, end
    a = max(prev, lo)
    if a < hi:
        words += (a + shift, delta - shift, 0, 1, 0, INTERVAL_INT, 0, 0)
        low, high = _span(low, high, a + delta, hi - 1 + delta)
    return low, high


def _span(low, high, a: int, b: int) -> tuple[int, int]:
    return (a, b) if low is None else (min(low, a), max(high, b))
