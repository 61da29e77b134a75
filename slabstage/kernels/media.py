"""Media descriptors: what the staging kernel needs to read a batch's media rows where they are.

``media`` is one 2-D tensor or a sequence of items laid end to end, each a 2-D
tensor or a tuple of column blocks with equal rows (DeepStack: block 0 the
embeddings, block ``i`` level ``i - 1``). :func:`describe_media` checks them
against the width contract and returns a :class:`MediaPlan`: each item's first
media row and, per column block, ``(address, row stride, first column, end
column)``; the kernel finds a row's item from them, so nothing is concatenated.
Items may sit in pinned host memory when the slab is on a CUDA device (the
kernel reads them through their mapped address); an empty item is never read.
"""

from __future__ import annotations

import torch

from ..checks import FLOAT_DTYPES, check_tensor
from ..staging.width import WidthContractError, check_media_width
from .params import FLOAT_BYTES

__all__ = ["MediaPlan", "describe_media"]

_data_ptr, _stride, _size = torch.Tensor.data_ptr, torch.Tensor.stride, torch.Tensor.size


class MediaPlan:
    """Media checked and laid out for the kernel (see the module docstring)."""

    __slots__ = ("items", "rows", "width", "dtype", "starts", "fields", "blocks", "vec", "lows", "highs")

    def __init__(self, items, rows, width, dtype, starts, fields, blocks, vec, lows, highs):
        self.items = items  # each item as a tuple of its column blocks
        self.rows, self.width, self.dtype = rows, width, dtype
        self.starts = starts  # first media row of each item
        self.fields = fields  # (address, row stride, first column, end column) per item and block
        self.blocks = blocks  # column blocks per item in ``fields`` (an item with fewer is padded)
        self.vec = vec  # every address, row stride and block column in whole 16-byte vectors
        self.lows, self.highs = lows, highs  # the bytes every block read spans, for the overlap checks

    def spans(self):
        """``(name, first byte, end byte)`` of every block read, named as the errors name them."""
        k = 0
        for i, blocks in enumerate(self.items):
            for j, t in enumerate(blocks):
                if t.shape[0]:
                    yield f"media item {i}" + (f" block {j}" if len(blocks) > 1 else ""), self.lows[k], self.highs[k]
                    k += 1


def describe_media(media, device: torch.device, slab_width: int, text_width: int, expand: str,
                   read=None) -> MediaPlan | None:
    """Check ``media`` (None, one 2-D tensor, or a sequence of items) and lay it out for the kernel.

    ``read``: for one tensor whose configuration (kind, dtype, device, rank, width) was checked, what
    :func:`~slabstage.kernels.validate.check_batch` read of it. Raises ``TypeError``/``ValueError``
    naming the item and block that breaks a rule, and :class:`WidthContractError` for widths (see
    :func:`check_media_width`).
    """
    if media is None:
        return None
    if read is not None:  # one tensor: the per-batch part of its checks, from what was read
        (rows, width), (s0, s1), ptr = read[4], read[5], read[6]
        if s1 != 1 and width > 1 and rows:
            check_tensor("media", media, dims=2)  # "... must be contiguous along its last axis"
        elem = FLOAT_BYTES[read[1]]
        vec = not (ptr & 15) and not ((width | (s0 if rows > 1 else 0)) & 7)
        lows, highs = ([ptr], [ptr + ((rows - 1) * s0 + width) * elem]) if rows else ([], [])
        return MediaPlan(((media,),), rows, width, read[1], [0], [ptr if rows else 0, s0, 0, width], 1, vec,
                         lows, highs)
    if isinstance(media, torch.Tensor):
        check_tensor("media", media, dtypes=FLOAT_DTYPES, device=device, dims=2)
        check_media_width("media", media.shape[1], slab_width, text_width, expand)
        return _plan(((media,),), [media], device, slab_width, text_width)
    if type(media) not in (list, tuple):
        raise TypeError(f"media must be a 2-D tensor or a list of items (tensors or tuples of column blocks), "
                        f"got {type(media).__name__}")
    if not media:
        raise ValueError("media is an empty list: pass None when the batch has no media")
    items = tuple(m if type(m) is tuple else (m,) for m in media)
    blocks = [t for item in items for t in item]
    if set(map(type, blocks)) != {torch.Tensor}:  # parameters, subclasses, non-tensors: each one looked at
        for i, item in enumerate(items):
            for j, t in enumerate(item):
                _check_block(_name(i, item, j), t)
    plan = _plan(items, blocks, device, slab_width, text_width)
    check_media_width("media item 0", plan.width, slab_width, text_width, expand)
    return plan


def _name(i: int, item: tuple, j: int) -> str:
    return f"media item {i}" + (f" block {j}" if len(item) > 1 else "")


def _check_block(name: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    check_tensor(name, t, dtypes=FLOAT_DTYPES, dims=2)


def _plan(items: tuple, blocks: list, device: torch.device, slab_width: int, text_width: int) -> MediaPlan:
    """The plan from one read of every block; any rule broken: the item-by-item check names it."""
    def explain():
        _explain(items, device, slab_width, text_width)

    try:
        dtype = blocks[0].dtype
        shapes = list(map(_size, blocks))
        strides = list(map(_stride, blocks))
        ptrs = list(map(_data_ptr, blocks))
        ok = all(t.dtype is dtype for t in blocks) and all(len(s) == 2 for s in shapes)
    except (RuntimeError, TypeError, AttributeError):  # sparse, mkldnn, nested tensors have no strides or data
        ok = False
    if not ok:
        explain()
    elem = FLOAT_BYTES.get(dtype)
    if elem is None:
        explain()
    wide = slab_width > text_width
    dev = device.index if device.type == "cuda" else -1
    if dev is None:
        dev = torch.cuda.current_device()
    on_cuda = device.type == "cuda"
    k = max(map(len, items))
    starts, fields, lows, highs = [], [], [], []
    rows = width = 0
    align = ealign = 0
    at = 0
    for item in items:
        item_rows, c = shapes[at][0], 0
        for _ in item:
            r, w = shapes[at]
            s0, s1 = strides[at]
            ptr = ptrs[at]
            if r != item_rows or (w > 1 and s1 != 1 and r):
                explain()
            if r:
                t = blocks[at]
                if t.get_device() != dev or not (on_cuda or t.is_cpu):  # (-1 is meta too: ask is_cpu)
                    if not (on_cuda and t.is_cpu and t.is_pinned()):  # a pinned host item, read in place
                        explain()
                align |= ptr
                ealign |= w | (s0 if r > 1 else 0)
                lows.append(ptr)
                highs.append(ptr + ((r - 1) * s0 + w) * elem)
            fields += (ptr if r else 0, s0, c, c + w)
            c += w
            at += 1
        if wide and len(item) > 1 and shapes[at - len(item)][1] != text_width:
            explain()  # block 0 holds the embeddings
        fields += (0, 0, c, c) * (k - len(item))  # padded with empty blocks
        if not starts:
            width = c
        elif c != width:
            explain()
        starts.append(rows)
        rows += item_rows
    vec = not (align & 15) and not ((ealign | width) & 7)  # (8 elements: 16 bytes at 2 bytes an element)
    return MediaPlan(items, rows, width, dtype, starts, fields, k, vec, lows, highs)


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

