"""Media descriptors: what the staging kernel needs to read a batch's media rows where they are.

``media`` is one 2-D tensor or a sequence of items laid end to end, each a 2-D
tensor or a tuple of column blocks with equal rows (DeepStack: block 0 the
embeddings, block ``i`` level ``i - 1``). :func:`describe_media` checks them
against the width contract and returns a :class:`MediaPlan`: each item's first
media row and, per column block, ``(address, row stride, first column, end
column)``; the kernel finds a row's item from them, so nothing is concatenated.
Items may sit in pinned host memory when the slab is on a CUDA device (the
kernel reads them through their mapped address); an empty item is never read.
``media`` may instead be a list of :class:`~slabstage.cache.Entry` handles of one
:class:`~slabstage.cache.EncoderCache`: each is an item of one block, the cache's
full width, at its arena address (no tensor is read).
"""

from __future__ import annotations

from functools import reduce
from itertools import accumulate, chain, repeat
from operator import add, attrgetter, mul, or_, sub

from typing import NamedTuple

import torch

from ..cache.encoder_cache import Entry
from ..checks import FLOAT_DTYPES, check_tensor
from ..staging.width import WidthContractError, check_media_width
from .params import FLOAT_BYTES

__all__ = ["MediaPlan", "describe_media", "one_tensor_plan"]

_T = torch.Tensor
_data_ptr, _stride, _size, _device, _is_cpu = _T.data_ptr, _T.stride, _T.size, _T.get_device, _T.is_cpu.__get__
_dense = _T.is_contiguous
_dtype = attrgetter("dtype")


class MediaPlan(NamedTuple):
    """Media checked and laid out for the kernel (see the module docstring)."""

    media: tuple | list  # the items as given: tensors, or tuples of column blocks
    rows: int
    width: int
    dtype: torch.dtype
    starts: list  # first media row of each item
    fields: list  # (address, row stride, first column, end column) per item and block
    column_blocks: int  # column blocks per item in ``fields`` (an item with fewer is padded)
    vec: bool  # every address, row stride and block column in whole 16-byte vectors
    lows: list  # the bytes every block read spans (a block with rows and columns): first,
    highs: list  # and end
    entries: tuple | None = None  # media of cache entries: (the EncoderCache, the slots read)

    @property
    def items(self) -> tuple:
        """Each item as a tuple of its column blocks."""
        return _items(self.media)

    def spans(self):
        """``(name, first byte, end byte)`` of every block read, named as the errors name them."""
        if self.entries is not None:
            yield from self.entries[0].spans()
            return
        k = 0
        for i, blocks in enumerate(self.items):
            for j, t in enumerate(blocks):
                if t.shape[0] and t.shape[1]:
                    yield f"media item {i}" + (f" block {j}" if len(blocks) > 1 else ""), self.lows[k], self.highs[k]
                    k += 1


def describe_media(media, device: torch.device, slab_width: int, text_width: int, expand: str) -> MediaPlan | None:
    """Check ``media`` (None, one 2-D tensor, or a sequence of items) and lay it out for the kernel.

    Raises ``TypeError``/``ValueError`` naming the item and block that breaks a rule, and
    :class:`WidthContractError` for widths (see :func:`check_media_width`).
    """
    if media is None:
        return None
    if isinstance(media, torch.Tensor):
        check_tensor("media", media, dtypes=FLOAT_DTYPES, device=device, dims=2)
        check_media_width("media", media.shape[1], slab_width, text_width, expand)
        return _plan((media,), [media], None, device, slab_width, text_width)
    if type(media) not in (list, tuple):
        raise TypeError(f"media must be a 2-D tensor or a list of items (tensors or tuples of column blocks), "
                        f"got {type(media).__name__}")
    if not media:
        raise ValueError("media is an empty list: pass None when the batch has no media")
    kinds = set(map(type, media))
    if Entry in kinds:
        return _entries_plan(media, kinds, device, slab_width, text_width, expand)
    if kinds == {torch.Tensor}:  # items of one block each
        blocks, lens = media, None
    elif kinds == {tuple}:  # items of column blocks
        blocks, lens = list(chain.from_iterable(media)), list(map(len, media))
    else:
        items = _items(media)
        blocks, lens = [t for item in items for t in item], list(map(len, items))
    plan = _plan(media, blocks, lens, device, slab_width, text_width)
    check_media_width("media item 0", plan.width, slab_width, text_width, expand)
    return plan


def one_tensor_plan(media: torch.Tensor, shape, stride, ptr: int, dtype: torch.dtype) -> MediaPlan:
    """The plan of one media tensor whose configuration (kind, dtype, device, rank, width) was checked, from
    what :func:`~slabstage.kernels.validate.check_batch` read of it."""
    (rows, width), (s0, s1) = shape, stride
    if s1 != 1 and width > 1 and rows:
        check_tensor("media", media, dims=2)  # "... must be contiguous along its last axis"
    vec = not (ptr & 15) and not ((width | (s0 if rows > 1 else 0)) & 7)
    lows, highs = ([ptr], [ptr + ((rows - 1) * s0 + width) * FLOAT_BYTES[dtype]]) if rows and width else ([], [])
    return MediaPlan((media,), rows, width, dtype, [0], [ptr if rows else 0, s0, 0, width], 1, vec, lows, highs)


def _entries_plan(media, kinds: set, device: torch.device, slab_width: int, text_width: int,
                  expand: str) -> MediaPlan:
    """The plan of cache handles ``media``: integers from the cache's tables, no tensor read."""
    if len(kinds) > 1:
        i = next(i for i, m in enumerate(media) if type(m) is not Entry)
        raise TypeError(f"media item {i} is a {type(media[i]).__name__} but media item 0 is a cache Entry: "
                        f"give cache entries or tensors, not both")
    cache = media[0].cache
    if cache.device != device and not (device.type == cache.device.type == "cuda" and device.index is None):
        raise ValueError(f"media item 0 is an entry of an EncoderCache on {cache.device}; expected {device}")
    starts, fields, rows, slots = cache.locate(media)
    check_media_width("media (cache entries)", cache.width, slab_width, text_width, expand)
    spans = cache.spans()
    return MediaPlan(media, rows, cache.width, cache.dtype, starts, fields, 1, cache.vec, [s[1] for s in spans],
                     [s[2] for s in spans], (cache, slots))


def _items(media) -> tuple:
    return tuple(m if type(m) is tuple else (m,) for m in media)


def _name(i: int, item: tuple, j: int) -> str:
    return f"media item {i}" + (f" block {j}" if len(item) > 1 else "")


def _check_block(name: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    check_tensor(name, t, dtypes=FLOAT_DTYPES, dims=2)


def _plan(media, blocks, lens: list | None, device: torch.device, slab_width: int, text_width: int) -> MediaPlan:
    """The plan of items ``media`` (``blocks``: their column blocks in order; ``lens``: each item's blocks, None
    when each is one tensor) from one read of every block, worked out a column of the batch at a time in
    C-level loops (the host time of many new items is their reads); any rule broken: the item-by-item check
    names it."""
    def explain():
        _explain(_items(media), device, slab_width, text_width)

    try:  # (a contiguous block's row stride is its width: its strides are read only when it is not)
        ptrs, shapes, dense = list(map(_data_ptr, blocks)), list(map(_size, blocks)), list(map(_dense, blocks))
        dtypes, devices = set(map(_dtype, blocks)), set(map(_device, blocks))
    except (RuntimeError, TypeError, AttributeError):  # sparse, mkldnn, nested tensors have no strides or data
        explain()
    if len(dtypes) != 1 or set(map(len, shapes)) != {2}:
        explain()
    dtype = dtypes.pop()
    elem = FLOAT_BYTES.get(dtype)
    if elem is None:
        explain()
    rs, ws = zip(*shapes)
    if False in dense:
        s0s, s1s = zip(*map(_stride, blocks))
        if any(s1 != 1 and w > 1 and r for r, w, s1 in zip(rs, ws, s1s)):
            explain()  # rows must be contiguous
    else:
        s0s = ws
    on_cuda = device.type == "cuda"
    dev = (device.index if device.index is not None else torch.cuda.current_device()) if on_cuda else -1
    if devices != {dev} or (not on_cuda and 0 in ptrs and not all(map(_is_cpu, blocks))):  # (-1 is meta too)
        for t, r in zip(blocks, rs):  # an empty block is never read; a pinned host item is read in place
            if r and (t.get_device() != dev or not (on_cuda or t.is_cpu)) and not (on_cuda and t.is_cpu and
                                                                                  t.is_pinned()):
                explain()
    n, k = len(media), 1 if lens is None else max(lens)
    if k > 1 or (lens is not None and 0 in lens):
        if 0 in lens:
            explain()  # an item with no block
        if lens.count(k) != n:  # items of fewer blocks: padded with empty ones
            rs, ws, s0s, ptrs = _pad(lens, rs, ws, s0s, ptrs, k, text_width if slab_width > text_width else None,
                                     explain)
        elif slab_width > text_width and ws[0::k].count(text_width) != n:
            explain()  # block 0 holds the embeddings
    item_rows = rs[0::k] if k > 1 else rs
    for j in range(1, k):
        if rs[j::k] != item_rows:
            explain()  # the blocks of an item share their rows
    if k == 1:
        width, ends = ws[0], ws
        if ws.count(width) != n:
            explain()  # items share one row width
    elif ws == ws[:k] * n:  # every item of the same blocks: their columns once
        ends = list(accumulate(ws[:k]))
        width, ends = ends[-1], ends * n
    else:  # an item's columns: its blocks side by side, each item's from 0
        ends = list(accumulate(ws))
        width = ends[k - 1]
        if ends[k - 1::k] != list(range(width, width * (n + 1), width)):
            explain()  # items share one row width
        ends = [e - width * (i // k) for i, e in enumerate(ends)]
    if 0 in rs:
        ptrs = [p if r else 0 for p, r in zip(ptrs, rs)]
    fields = [0] * (4 * len(ptrs))
    fields[0::4], fields[1::4], fields[2::4], fields[3::4] = ptrs, s0s, list(map(sub, ends, ws)), ends
    if 0 in rs or 0 in ws:  # the bytes each block with rows and columns reads, for the overlap checks
        spans = [(p, p + ((r - 1) * s + w) * elem) for p, r, w, s in zip(ptrs, rs, ws, s0s) if r and w]
        lows, highs = (list(x) for x in zip(*spans)) if spans else ([], [])
    elif s0s is ws and ws.count(ws[0]) == len(ws):  # contiguous blocks of one width: rows x width bytes
        lows, highs = ptrs, list(map(add, ptrs, map(mul, rs, repeat(ws[0] * elem))))
    else:
        lows, highs = ptrs, list(map(add, ptrs, map(mul, map(add, map(mul, map(sub, rs, repeat(1)), s0s), ws),
                                                    repeat(elem))))
    starts = list(accumulate(item_rows, initial=0))
    rows = starts.pop()
    align = reduce(or_, ptrs, 0) & 15 or (reduce(or_, ws, width) if k > 1 else width) & 7
    if not align and s0s is not ws:  # (the row stride of an item of one row is never used)
        align = reduce(or_, s0s if min(rs) > 1 else (s for s, r in zip(s0s, rs) if r > 1), 0) & 7
    return MediaPlan(media, rows, width, dtype, starts, fields, k, not align, lows, highs)


def _pad(lens: list, rs, ws, s0s, ptrs, k: int, text_width: int | None, explain):
    """Rows, widths, row strides and addresses with every item (``lens``: its blocks) padded to ``k`` blocks by
    empty ones (no address, no columns, the item's rows); with ``text_width``, block 0 of an item of several
    must be that wide (it holds the embeddings)."""
    out = [], [], [], []
    at = 0
    for m in lens:
        if text_width is not None and m > 1 and ws[at] != text_width:
            explain()
        for col, given, fill in zip(out, (rs, ws, s0s, ptrs), (rs[at], 0, 0, 0)):
            col.extend(given[at:at + m])
            col.extend([fill] * (k - m))
        at += m
    return out


def _explain(items: tuple, device: torch.device, slab_width: int, text_width: int):
    """Check media items one by one; raise naming the first item and block that breaks a rule."""
    width = dtype = None
    for i, item in enumerate(items):
        if not item:
            raise ValueError(f"media item {i} is an empty tuple: give at least one column block")
        item_rows, cols = None, 0
        for j, t in enumerate(item):
            name = _name(i, item, j)
            _check_block(name, t)
            if dtype is None:
                dtype = t.dtype
            elif t.dtype != dtype:
                raise TypeError(f"{name} is {t.dtype} but media item 0 is {dtype}: items share one dtype")
            if not (t.device == device or (t.numel() == 0 and t.device.type == "cpu")):
                if t.device.type == "cpu" and device.type == "cuda":
                    if not t.is_pinned():
                        raise ValueError(f"{name} is in pageable host memory: the kernel reads host items "
                                         f"through their device-mapped address, so pin it (tensor.pin_memory())")
                else:
                    raise ValueError(f"{name} is on {t.device}; expected {device}")
            if item_rows is None:
                item_rows = t.shape[0]
            elif t.shape[0] != item_rows:
                raise ValueError(f"{name} has {t.shape[0]} rows but block 0 of media item {i} has {item_rows}: "
                                 f"the column blocks of an item share their rows")
            if j == 0 and len(item) > 1 and slab_width > text_width and t.shape[1] != text_width:
                raise WidthContractError(
                    f"{name} is {t.shape[1]} wide: block 0 holds the embeddings, so it must be the text width "
                    f"{text_width} when the slab ({slab_width}) is wider")
            cols += t.shape[1]
        if width is None:
            width = cols
        elif cols != width:
            raise WidthContractError(f"media item {i} is {cols} wide but media item 0 is {width}: items share one "
                                     f"row width (the column blocks of an item add up to it)")
    raise AssertionError("slabstage: media items were refused but no rule names why")  # pragma: no cover

