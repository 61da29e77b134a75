"""The one validation of a staging batch, for every path (graph, eager, the ops, the custom ops).

Three parts, checked in this order:

- :class:`~slabstage.kernels.destinations.Destinations` checks what a stager writes (the slab, every integer
  slot, the error word) once per set of destinations;
- :func:`~slabstage.kernels.configuration.configuration` reads a batch's tensors and checks what its
  configuration fixes (kinds, dtypes, devices, ranks, widths, switches) the first time it is seen;
- :func:`check_batch` checks what can change from batch to batch (lengths, strides, ``pad_to``, bounds,
  ``text_scale``, the media items, the mrope layouts, storage overlap with the destinations) on every batch.

Every check runs before anything is written; each error names what was wrong and what was expected,
through :mod:`slabstage.checks` (a compare that fails hands the input to the helper that names the problem).
"""

from __future__ import annotations

import math
from itertools import chain
from typing import NamedTuple

from ..checks import F32_MAX, INT32_MAX, check_float32, check_int, check_tensor, check_values, vocab_bounds
from ..staging.slots import REQUESTS, ROWS
from .configuration import (ELEM, EXPAND, INDEX, LAYOUT_SLOT, MEDIA, OWNER, SCALE, SOURCES, TABLE, VOCAB_RANGE,
                            VOCAB_SIZE, Config, configuration, fields_of)
from .destinations import Destinations
from .media import MediaPlan, describe_media, one_tensor_plan
from .mrope import SEGMENT_WORDS, check_layouts, mrope_segments
from .params import MAX_ITEM_WORDS

__all__ = ["Checked", "check_batch", "check_sources"]


class Checked(NamedTuple):
    """A batch that passed :func:`check_batch`: what the parameter block and the reference are built from.

    ``fields``: the batch's fields in :data:`FIELDS` order (layouts taken out); ``reads``: ``(tensors,
    dtypes, device indices, shapes, strides, addresses)`` of its tensors (``config`` says which is which);
    ``scale``: ``text_scale`` as a float; ``media``: the media's plan; ``segments``: the mrope layouts'
    segment list.
    """

    config: Config
    n: int
    b: int
    pad_to: int
    fields: tuple
    reads: tuple
    bounds: tuple | None = None
    scale: float | None = None
    media: MediaPlan | None = None
    segments: list | None = None

    ids = property(lambda self: self.fields[0])
    table = property(lambda self: self.fields[TABLE])
    media_index = property(lambda self: self.fields[INDEX])
    expand = property(lambda self: self.fields[EXPAND])
    media_owner = property(lambda self: self.fields[OWNER])

    @property
    def sources(self) -> list:
        """Per :data:`~slabstage.staging.slots.SOURCE_SLOTS` row the tensor to copy (None: not given, or a slot
        the stager does not write)."""
        out = [None] * len(SOURCES)
        for s in self.config.sources:
            out[s[1]] = self.fields[s[1]]
        return out


def check_batch(dst: Destinations, src, pad_to, configs: dict) -> Checked:
    """Check the batch ``src`` (an object with :class:`~slabstage.PrefillBatch`'s fields; a field it lacks takes
    the default in :data:`DEFAULTS`) against ``dst``; raise before anything is written. ``configs``: the
    configurations checked so far for ``dst``'s stager (kept by the caller)."""
    embed = dst.slab is not None
    vals, layouts = fields_of(src)  # (the layouts are values: checked below, every batch)
    config, reads = configuration(dst, vals, configs, embed)
    _, dtypes, devices, shapes, strides, ptrs = reads
    n = shapes[0][0]
    spans = []  # name, first byte, end byte of every source read in place (checked against dst at the end)
    b = _check_lengths(config.sources, reads, n, spans)
    if b > dst.batch_cap and dst.batch_cap:
        raise ValueError(f"{b} requests exceed max_batch_size={dst.batch_cap}")
    if n > dst.capacity:
        if not any(s is not None for s in dst.slots):
            raise ValueError(f"{n} tokens exceed the slab's {dst.capacity} rows")
        # (the runner's batches and stage_token_inputs' calls say it in their own words)
        said = f"batch of {n} tokens exceeds" if hasattr(src, "num_tokens") else f"{n} tokens exceed"
        raise ValueError(f"{said} the buffers' capacity of {dst.capacity} tokens")
    if type(pad_to) is not int or not n <= pad_to <= dst.capacity:
        if pad_to is None and not any(s is not None for s in dst.slots):
            pad_to = n  # (stage_embeddings' default)
        pad_to = check_int("pad_to", pad_to, lo=n, hi=dst.capacity)
    if not config.sources or config.sources[0][1]:  # embeddings alone: the ids are read all the same
        if n > 1 and strides[0][0] != 1:
            check_tensor("input_ids", vals[0], dims=1)  # "... must be contiguous along its last axis"
        if n and not config.host_ids:
            spans += ("input_ids", ptrs[0], ptrs[0] + n * ELEM[dtypes[0]])
    segments = None
    if layouts is not None:
        if dst.slots[LAYOUT_SLOT] is None:
            if any(t is not None for t in dst.slots):
                raise ValueError("mrope_positions given but the buffers were allocated without mrope=True")
        else:
            segments = mrope_segments(layouts, n, dst.slots[LAYOUT_SLOT].dtype)
    if not embed:
        _check_room(None, segments)
        _clear(dst, spans)
        return Checked(config, n, b, pad_to, vals, reads, segments=segments)

    t = config.table
    rows, tw = shapes[t]
    if tw > 1 and strides[t][1] != 1:
        check_tensor("table", vals[TABLE], dims=2)  # "... must be contiguous along its last axis"
    m, media = config.media, vals[MEDIA]
    if m is not None:
        plan = one_tensor_plan(media, shapes[m], strides[m], ptrs[m], dtypes[m])
    else:
        plan = describe_media(media, dst.device, dst.slab.shape[1], tw, vals[EXPAND])
    i = config.index
    if i is not None:
        _check_index(vals, reads, i, n)
        if n and not config.host_index:  # (a host index travels in the block)
            spans += ("media_index", ptrs[i], ptrs[i] + n * ELEM[dtypes[i]])
    elif plan is not None:
        raise ValueError("media was given without media_index: say which rows are media rows")
    scale = vals[SCALE]
    if scale is not None and not (type(scale) is float and math.isfinite(scale) and abs(scale) <= F32_MAX):
        scale = check_float32("text_scale", scale)
    if vals[VOCAB_RANGE] is None and vals[VOCAB_SIZE] is None and rows <= INT32_MAX:
        bounds = (0, rows, rows)
    else:
        bounds = vocab_bounds(vals[VOCAB_RANGE], vals[VOCAB_SIZE], rows)
    _check_room(plan, segments)
    if rows and tw:
        spans += ("table", ptrs[t], ptrs[t] + ((rows - 1) * strides[t][0] + tw) * ELEM[dtypes[t]])
    _clear(dst, spans, plan)
    return Checked(config, n, b, pad_to, vals, reads, bounds, scale, plan, segments)


def _check_lengths(sources: tuple, reads: tuple, n: int, spans: list | None) -> int:
    """The request count ``b``, after checking each integer source (``sources``, a :class:`Config`'s) against
    ``n`` and ``b``; the bytes of each read in place go to ``spans`` (checked against every destination), and
    host values a narrower slot cannot hold are refused."""
    ts, dtypes, _, shapes, strides, ptrs = reads
    b = -1
    for at, _, kind, rows, name, elem, in_block, narrow in sources:
        shape = shapes[at]
        if kind == REQUESTS:
            if b < 0:
                b = shape[0] if len(shape) == 1 else 0
            elif shape[0] != b:
                raise ValueError(f"{name} has {shape[0]} entries but seq_lens has {b}: one per request")
            want = (b,)
        else:
            want = (rows, n) if kind == ROWS else (n,)
        if shape != want or (want[-1] > 1 and strides[at][-1] != 1):
            check_tensor(name, ts[at], shape=want)  # names what is wrong
        if spans is None:
            continue
        if narrow is not None:
            check_values(name, ts[at], narrow)
        if in_block:
            continue
        elems = want[0] if kind != ROWS else ((rows - 1) * strides[at][0] + n if n else 0)
        if elems:
            spans += (name, ptrs[at], ptrs[at] + elems * elem)
    return max(b, 0)


def _check_index(vals: tuple, reads: tuple, i: int, n: int) -> None:
    """``media_index`` (read at position ``i``) is ``[n]`` and contiguous."""
    if reads[3][i] != (n,) or (n > 1 and reads[4][i][0] != 1):
        check_tensor("media_index", vals[INDEX], shape=(n,))  # names what is wrong


def _check_room(plan: MediaPlan | None, segments: list | None) -> None:
    """The media items' and the mrope segments' lists fit the parameter block's room for them (on every path:
    the reference has no block, and answers as the kernel does)."""
    item_words = 0 if plan is None else len(plan.starts) + len(plan.fields)
    seg_words = 0 if segments is None else len(segments)
    if item_words + seg_words > MAX_ITEM_WORDS:
        what = f"media has {len(plan.starts)} items of {plan.column_blocks} column blocks" if plan is not None else ""
        if seg_words:
            what += (" and " if what else "") + f"the mrope layouts make {seg_words // SEGMENT_WORDS} segments"
        raise ValueError(f"{what}: their lists take {item_words + seg_words} words, at most {MAX_ITEM_WORDS} "
                         f"fit the parameter block")


def _clear(dst: Destinations, spans: list, plan: MediaPlan | None = None) -> None:
    """Every source's bytes (``spans``: name, first byte, end byte of each; then the media blocks') miss every
    destination: one pass over them all, errors named in that order."""
    lows, highs = spans[1::3], spans[2::3]
    if plan is not None and plan.lows:
        lows += plan.lows
        highs += plan.highs
    dst.clear_of_all(lows, highs, lambda: chain(zip(spans[0::3], lows, highs), () if plan is None else plan.spans()))


_SOURCE_FORMS: dict = {}  # the configurations check_sources has passed (a few per engine)


def check_sources(src, what: str = "PrefillBatch") -> None:
    """What a batch must satisfy on its own, with no destinations to check it against (a
    :class:`~slabstage.PrefillBatch` when it is made): the checks of :func:`check_batch` that need none."""
    vals, layouts = fields_of(src)
    if layouts is not None:
        check_layouts(layouts)  # (their values are checked where they are staged, with the rest of the batch)
    config, reads = configuration(None, vals, _SOURCE_FORMS, True)
    n = reads[3][0][0]
    _check_lengths(config.sources, reads, n, None)
    if config.index is not None:
        _check_index(vals, reads, config.index, n)
    elif vals[MEDIA] is not None:
        raise ValueError(f"{what}.media was given without media_index")


