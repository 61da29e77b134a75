"""The staging ops' one validation layer, and the kernel arguments it yields.

Every staging entry point (:func:`stage_embeddings`, :func:`stage_token_inputs`,
:func:`plan_stage_batch`, the runner's :class:`BatchStager`, the custom ops)
checks its inputs here, through :mod:`slabstage.checks`, before anything is
written, on the Triton path and the reference path alike. The checks come in
two halves so that the runner can keep its host-time budget:

- *static*: what is fixed by a batch's configuration (the dtype, device and
  rank of each input, widths, ``expand``, which inputs are given) and by the
  buffers (every destination slot: dtype, device, shape);
- *dynamic*: what can differ between batches of one configuration (lengths,
  ``pad_to``, batch size, vocabulary bounds, ``text_scale``'s value, storage
  overlap, the media items).

The result is a dict of kernel arguments by name (see
:mod:`slabstage.kernels.stage_kernel`) and a dict of constexprs.
"""

from __future__ import annotations

from array import array
from ctypes import memmove
from functools import reduce
from itertools import accumulate
from operator import or_

import torch

from ..checks import (FLOAT_DTYPES, INT32_MAX, INT_DTYPES, byte_span, check_choice, check_int, check_no_overlap,
                      check_real, check_fill, check_tensor)
from ..staging.width import WidthContractError, check_media_width, check_source_width
from .runtime import next_pow2, row_launch_config
from .stage_kernel import MEDIA_ITEMS, MEDIA_NONE, MEDIA_TENSOR

__all__ = ["SLOTS", "REQUEST_SLOTS", "SLOT_ARGS", "MediaPlan", "Destinations", "check_destinations",
           "check_token_sources", "check_host_values", "check_slab", "check_media", "check_embed",
           "check_sources_apart", "embed_args", "ELEM_BYTES", "INT_BITS", "row_settings", "token_args",
           "pack_host_inputs", "pack_to_device", "vocab_bounds", "ItemTables", "ITEM_TABLES", "item_records"]

SLOTS = ("input_ids", "positions", "out_cache_loc", "mrope_positions", "seq_lens", "extend_start_loc")
REQUEST_SLOTS = ("seq_lens", "extend_start_loc")
# each integer slot's kernel arguments: source, destination, fill, pad switch, presence switch
SLOT_ARGS = {
    "input_ids": ("ids_ptr", "ids_dst_ptr", "ids_fill", "PAD_IDS", None),
    "positions": ("pos_ptr", "pos_dst_ptr", "pos_fill", "PAD_POS", None),
    "out_cache_loc": ("loc_ptr", "loc_dst_ptr", "loc_fill", "PAD_LOC", "HAS_LOC"),
    "mrope_positions": ("mrope_ptr", "mrope_dst_ptr", "mrope_fill", "PAD_MROPE", "HAS_MROPE"),
    "seq_lens": ("seq_ptr", "seq_dst_ptr", "seq_fill", "PAD_SEQ", "HAS_SEQ"),
    "extend_start_loc": ("ext_ptr", "ext_dst_ptr", "ext_fill", "PAD_EXT", "HAS_EXT"),
}
_REQUIRED = ("input_ids", "positions", "num_tokens_non_padded")


# -- destinations ------------------------------------------------------------------------
class Destinations:
    """Every integer slot the kernel may write, checked; read once per registry signature.

    ``args``: destination pointers (tensors), fills, ``batch_cap``, ``stride_mrope_dst``;
    ``pads``: slot -> whether its tail is padded; ``dtypes``: slot -> dtype.
    """

    __slots__ = ("args", "pads", "dtypes", "batch_cap", "has_mrope", "spans")

    def __init__(self, args, pads, dtypes, batch_cap, has_mrope, spans):
        self.args, self.pads, self.dtypes = args, pads, dtypes
        self.batch_cap, self.has_mrope, self.spans = batch_cap, has_mrope, spans


def check_destinations(buffers) -> Destinations:
    """Check every integer slot of ``buffers`` (given or not): dtype, device, shape, pad value."""
    reg, device, batch_cap = buffers.registry, buffers.device, buffers.max_batch_size
    args, pads, dtypes, spans = {}, {}, {}, []
    for name in (*SLOTS, "num_tokens_non_padded"):
        if name not in reg:
            if name in _REQUIRED:
                raise ValueError(f"the buffers have no {name!r} slot")
            continue
        t = reg[name]
        what = f"slot {name!r}"
        check_tensor(what, t, dtypes=INT_DTYPES, device=device)
        if name == "mrope_positions":
            check_tensor(what, t, dims=2, shape=(3, None))
            if t.shape[1] > 1 and t.stride(1) != 1:
                raise ValueError(f"{what} must have contiguous rows, got stride {t.stride()}")
        else:
            check_tensor(what, t, dims=1)
            need = batch_cap if name in REQUEST_SLOTS else (1 if name == "num_tokens_non_padded" else 0)
            if t.shape[0] < need:
                raise ValueError(f"{what} holds {t.shape[0]} entries, needs at least {need}")
        fill = reg.slot(name).fill_value
        if fill is not None:
            fill = check_fill(f"{what} pad", fill, t.dtype)
        dtypes[name] = t.dtype
        spans.append((name, t))
        if name == "num_tokens_non_padded":
            args["ntok_dst_ptr"] = t
            continue
        src, dst, fill_arg, _, _ = SLOT_ARGS[name]
        args[dst] = t
        args[fill_arg] = int(fill or 0)
        pads[name] = fill is not None
    args["batch_cap"] = batch_cap
    args["stride_mrope_dst"] = reg["mrope_positions"].stride(0) if "mrope_positions" in reg else 0
    return Destinations(args, pads, dtypes, batch_cap, "mrope_positions" in reg, spans)


# -- integer sources ---------------------------------------------------------------------
def check_token_sources(device, *, input_ids, positions, out_cache_loc=None, mrope_positions=None, seq_lens=None,
                        extend_start_loc=None, batch_cap: int | None = None) -> tuple[dict, int, int]:
    """Check the integer inputs (on ``device`` or the host; ``device=None``: anywhere) and return
    ``(given slots, n, b)``."""
    host_ok = device is not None
    ids = check_tensor("input_ids", input_ids, dtypes=INT_DTYPES, device=device, host_ok=host_ok, dims=1)
    n = ids.shape[0]
    given = {"input_ids": ids}
    for name, t in (("positions", positions), ("out_cache_loc", out_cache_loc)):
        if t is not None or name == "positions":
            given[name] = check_tensor(name, t, dtypes=INT_DTYPES, device=device, host_ok=host_ok, shape=(n,))
    if mrope_positions is not None:
        t = mrope_positions
        if isinstance(t, torch.Tensor) and t.dim() == 3 and t.shape[0] == 3 and t.shape[1] == 1:
            raise ValueError(f"mrope_positions must be [3, n] for one packed batch, got {tuple(t.shape)} (the "
                             f"[3, batch, n] form of Hugging Face's get_rope_index): take [:, 0] of each request "
                             f"or use slabstage.hf.mrope_positions")
        given["mrope_positions"] = check_tensor("mrope_positions", t, dtypes=INT_DTYPES, device=device,
                                                host_ok=host_ok, shape=(3, n))
    b = 0
    for name, t in (("seq_lens", seq_lens), ("extend_start_loc", extend_start_loc)):
        if t is not None:
            check_tensor(name, t, dtypes=INT_DTYPES, device=device, host_ok=host_ok, dims=1)
            if "seq_lens" in given and t.shape[0] != b:
                raise ValueError(f"extend_start_loc has {t.shape[0]} entries but seq_lens has {b}: one per request")
            b = t.shape[0]
            given[name] = t
    if batch_cap is not None and b > batch_cap:
        raise ValueError(f"{b} requests exceed max_batch_size={batch_cap}")
    return given, n, b


INT_BITS = {torch.int32: 32, torch.int64: 64}


def check_host_values(given: dict, dtypes: dict) -> None:
    """Host inputs whose values their slot's dtype cannot hold are refused (device ones are flagged
    on the device): a narrowing copy is never silent."""
    for name, t in given.items():
        dst = dtypes.get(name)
        if dst is None or INT_BITS.get(dst, 64) >= INT_BITS.get(t.dtype, 0) or t.device.type != "cpu" or t.numel() == 0:
            continue
        info = torch.iinfo(dst)
        values = t.numpy()  # a host tensor: numpy's min and max cost a fraction of torch's
        lo, hi = int(values.min()), int(values.max())
        if lo < info.min or hi > info.max:
            raise ValueError(f"{name} holds {lo if lo < info.min else hi}, which its {dst} slot cannot hold")


# -- slab, table, media ------------------------------------------------------------------
def check_slab(slab) -> torch.Tensor:
    check_tensor("slab", slab, dtypes=FLOAT_DTYPES, dims=2)
    rows, width = slab.shape
    if slab.stride() != (width, 1):
        raise ValueError(f"slab rows must be contiguous with stride ({width}, 1), got {slab.stride()}")
    return slab


def vocab_bounds(vocab_range, vocab_size, table_rows: int) -> tuple[int, int, int]:
    """``(vocab_start, vocab_end, vocab_size)`` checked against a table of ``table_rows`` rows."""
    if vocab_range is None:
        vocab_start, vocab_end = 0, table_rows
    else:
        if not isinstance(vocab_range, (tuple, list)) or len(vocab_range) != 2:
            raise TypeError(f"vocab_range must be a (start, end) pair of ints, got {vocab_range!r}")
        vocab_start = check_int("vocab_range start", vocab_range[0], lo=0, hi=INT32_MAX)
        vocab_end = check_int("vocab_range end", vocab_range[1], lo=vocab_start, hi=INT32_MAX)
        if vocab_end - vocab_start > table_rows:
            raise ValueError(f"vocab_range {tuple(vocab_range)!r} spans {vocab_end - vocab_start} ids but the "
                             f"table has {table_rows} rows")
    if table_rows > INT32_MAX:
        raise ValueError(f"the table has {table_rows} rows; at most {INT32_MAX} are supported")
    vocab_size = vocab_end if vocab_size is None else check_int("vocab_size", vocab_size, lo=vocab_end,
                                                                  hi=INT32_MAX)
    return vocab_start, vocab_end, vocab_size


class MediaPlan:
    """Media checked and laid out for the kernel: one tensor, or items and their table.

    For items, ``spans`` holds the bytes of every block the kernel reads, for the
    overlap checks.
    """

    __slots__ = ("mode", "tensor", "rows", "width", "dtype", "media", "table", "blocks", "vec", "unit", "spans",
                 "records", "_items")

    def __init__(self, mode, tensor, rows, width, dtype, media=(), table=(), blocks=1, vec=1, unit=0):
        self.mode, self.tensor, self.rows, self.width, self.dtype = mode, tensor, rows, width, dtype
        self.media, self.table, self.blocks, self.vec = media, table, blocks, vec
        self.unit = unit  # the largest power of two dividing every read column block's width (0: no items)
        self.spans = None  # items: (starts, ends), the bytes of every block read, for the overlap checks
        self.records = None  # items read from their records (item_records) and all on the slab's device
        self._items = None

    @property
    def num_items(self) -> int:
        return len(self.media)

    @property
    def items(self) -> tuple:
        """Each item as a tuple of its column blocks (empty for one tensor)."""
        if self._items is None:
            self._items = tuple(m if type(m) is tuple else (m,) for m in self.media)
        return self._items

    def named_sources(self) -> list:
        """``(name, tensor)`` of every tensor the media is read from, named as the errors name them."""
        if not self.media:
            return [("media", self.tensor)]
        return [(f"media item {i}" + (f" block {j}" if len(blocks) > 1 else ""), t)
                for i, blocks in enumerate(self.items) for j, t in enumerate(blocks)]

    @property
    def sources(self) -> tuple:
        """Every tensor the media is read from."""
        return (self.tensor,) if not self.media else tuple(t for blocks in self.items for t in blocks)


def _item_device_ok(t: torch.Tensor, device) -> bool:
    if t.device == device or (t.numel() == 0 and t.device.type == "cpu"):  # an empty item is never read
        return True
    return device.type == "cuda" and t.device.type == "cpu" and t.is_pinned()


_ANCHORS: dict = {}


def _dtype_anchor(device, dev: int, dtype) -> torch.Tensor:
    """A small tensor on ``device`` (index ``dev``) that tells the kernel the items' dtype (it reads nothing
    from it)."""
    t = _ANCHORS.get((dev, dtype))
    if t is None:
        with torch.inference_mode(False):
            t = _ANCHORS[(dev, dtype)] = torch.zeros(8, dtype=dtype, device=device)
    return t


def check_media(media, device, slab_width: int, text_width: int, expand: str, records=None) -> MediaPlan | None:
    """Check ``media`` (None, one 2-D tensor, or a sequence of items) against the width contract.

    ``records``: :func:`item_records` of ``media``, when the caller read them already.
    """
    if media is None:
        return None
    if isinstance(media, torch.Tensor):
        check_tensor("media", media, dtypes=FLOAT_DTYPES, device=device, dims=2)
        check_media_width("media", media.shape[1], slab_width, text_width, expand)
        return MediaPlan(MEDIA_TENSOR, media, media.shape[0], media.shape[1], media.dtype)
    if not isinstance(media, (list, tuple)):
        raise TypeError(f"media must be a 2-D tensor or a list of items (tensors or tuples of column blocks), "
                        f"got {type(media).__name__}")
    plan = _scan_items(media, device, slab_width, text_width, records)
    if plan is None:  # something is off: the item-by-item check names it
        _check_items(media, device, slab_width, text_width, expand)
        raise AssertionError("slabstage: the fast item scan refused items the full check accepts")  # pragma: no cover
    check_media_width("media item 0", plan.width, slab_width, text_width, expand)
    return plan


def item_records(media) -> list | None:
    """``(dtype, shape, contiguous, device index, address)`` of each item, or None unless every item is one
    tensor: all that the items' plan depends on, read in one pass. Two batches whose records are equal
    (compared in one C-level pass) have the same plan, whatever the tensor objects."""
    try:
        return [(t.dtype, t.shape, t.is_contiguous(), t.get_device(), t.data_ptr()) for t in media]
    except (AttributeError, TypeError):  # a tuple of column blocks; not a sequence of tensors
        return None


def _scan_records(records: list, dev: int, on_cuda: bool, media):
    """What the loop of :func:`_scan_items` yields, from the items' records: for contiguous 2-D items of one
    dtype and width, none empty, all on the slab's device; else None (the loop decides)."""
    dtypes, shapes, contiguous, devices, ptrs = zip(*records)
    dtype, n = dtypes[0], len(records)
    elem = ELEM_BYTES.get(dtype)
    if elem is None or dtypes.count(dtype) != n or devices.count(dev) != n or not all(contiguous):
        return None  # (dtypes are singletons)
    if set(map(len, shapes)) != {2} or not (on_cuda or all(t.is_cpu for t in media)):  # (-1 is meta too)
        return None
    item_rows, widths = zip(*shapes)
    width = widths[0]
    if widths.count(width) != n or 0 in item_rows:
        return None
    fields = [0, width, 0, width] * n  # (address, row stride, first column, end column) per item
    fields[0::4] = ptrs
    row_bytes = width * elem
    highs = [p + r * row_bytes for p, r in zip(ptrs, item_rows)]
    return dtype, elem, list(item_rows), fields, list(ptrs), highs, width, reduce(or_, ptrs), 0, 0, 1, False


def _scan_items(media, device, slab_width: int, text_width: int, records=None) -> MediaPlan | None:
    """The items' plan in one pass of cheap reads, or None when anything is off (the item-by-item check
    then names it). Runs per batch on the runner's cached path: about five attribute reads a block, each
    a fraction of a microsecond, are most of its cost, so each is made once."""
    dev = -1 if device.type == "cpu" else device.index
    if dev is None:  # "cuda": the current device
        dev = torch.cuda.current_device() if device.type == "cuda" else -1
    on_cuda = dev >= 0
    if records is None:
        records = item_records(media)
    scan = _scan_records(records, dev, on_cuda, media) if records else None
    if scan is None:
        scan = _scan_blocks(media, dev, on_cuda, slab_width > text_width, text_width)
        if scan is None:
            return None
        records = None
    dtype, elem, item_rows, fields, lows, highs, width, align, ealign, grain, blocks, uneven = scan
    k = max(blocks, 1)
    if k > 1 and (uneven or k & (k - 1)):  # pad every item to a power of two of blocks
        fields = _pad_fields(fields, [len(m) if type(m) is tuple else 1 for m in media], next_pow2(k), width)
        k = next_pow2(k)  # (fewer compiled variants)
    vec = 16 // elem  # 16-byte loads need addresses (bytes), row strides and block columns (elements) to allow them
    aligned = not (align & 15) and not ((ealign | width) & (vec - 1))
    grain |= width  # its lowest set bit divides every block boundary
    starts = list(accumulate(item_rows, initial=0))
    rows = starts.pop()
    starts += fields
    plan = MediaPlan(MEDIA_ITEMS, _dtype_anchor(device, dev, dtype), rows, width, dtype, media=media,
                     table=tuple(starts), blocks=k, vec=vec if aligned else 1, unit=grain & -grain)
    plan.spans = lows, highs
    plan.records = records
    return plan


def _scan_blocks(media, dev: int, on_cuda: bool, wide: bool, text_width: int):
    """Every item (a tensor, taken as one block, or a tuple of column blocks) read once: ``(dtype, element
    bytes, rows per item, fields, block starts, block ends, width, or of addresses, or of row strides and
    widths, or of widths, most blocks of an item, whether block counts differ)``, or None."""
    try:
        first = media[0]
        dtype = (first[0] if type(first) is tuple else first).dtype
        elem = ELEM_BYTES[dtype]
    except (IndexError, TypeError, AttributeError, KeyError):
        return None
    item_rows, fields, lows, highs = [], [], [], []
    add_rows, add_low, add_high = item_rows.append, lows.append, highs.append  # (bound once: the loop is hot)
    width, align, ealign, grain = None, 0, 0, 0
    blocks, uneven = 0, False  # the most blocks of an item; whether block counts differ
    try:
        for item in media:
            if type(item) is not tuple:  # one tensor: an item of one block
                item = (item,)
            rows, c = -1, 0
            for t in item:
                if t.dtype is not dtype:  # dtypes are singletons; a non-tensor has no dtype
                    return None
                r, w = t.shape  # not 2-D: ValueError
                s0, s1 = (w, 1) if t.is_contiguous() else t.stride()  # (the cheaper read first)
                if rows < 0:
                    rows = r
                elif r != rows:
                    return None
                if wide and c == 0 and len(item) > 1 and w != text_width:
                    return None
                if r:
                    if w > 1 and s1 != 1:
                        return None
                    if t.get_device() != dev or not (on_cuda or t.is_cpu):  # -1 is meta too: ask is_cpu
                        if not (on_cuda and t.is_cpu and t.is_pinned()):  # a pinned host item, read in place
                            return None
                    ptr = t.data_ptr()
                    # the kernel's 16-byte loads take addresses, row strides and block columns in whole vectors
                    align |= ptr
                    ealign |= w | (s0 if r > 1 else 0)
                    grain |= w
                    add_low(ptr)
                    add_high(ptr + ((r - 1) * s0 + w) * elem)
                else:
                    ptr = 0
                fields += (ptr, s0, c, c + w)
                c += w
            if rows < 0 or (width is not None and c != width):
                return None
            width = c
            add_rows(rows)
            if len(item) != blocks:
                uneven = uneven or blocks > 0
                blocks = max(blocks, len(item))
    except (TypeError, ValueError, AttributeError):
        return None
    if width is None:
        return None
    return dtype, elem, item_rows, fields, lows, highs, width, align, ealign, grain, blocks, uneven


def _pad_fields(fields: list, counts, k: int, width: int) -> list:
    """Item fields of ``counts[i]`` blocks each, padded to ``k`` blocks an item with empty blocks."""
    out, at = [], 0
    for c in counts:
        out += fields[at:at + 4 * c] + [0, 0, width, width] * (k - c)
        at += 4 * c
    return out


ELEM_BYTES = {torch.float16: 2, torch.bfloat16: 2, torch.float32: 4}  # of each embedding dtype


def _check_items(media, device, slab_width: int, text_width: int, expand: str) -> None:
    """Check media items one by one; raise naming the first item and block that breaks a rule."""
    width = dtype = None
    for i, item in enumerate(media):
        blocks = item if isinstance(item, tuple) else (item,)
        if not blocks:
            raise ValueError(f"media item {i} is an empty tuple: give at least one column block")
        item_rows, cols = None, 0
        for j, t in enumerate(blocks):
            name = f"media item {i}" + (f" block {j}" if isinstance(item, tuple) else "")
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if dtype is None:
                dtype = t.dtype
                check_tensor(name, t, dtypes=FLOAT_DTYPES)
            elif t.dtype != dtype:
                raise TypeError(f"{name} is {t.dtype} but media item 0 is {dtype}: items share one dtype")
            if not _item_device_ok(t, device):
                if t.device.type == "cpu" and device.type == "cuda":
                    raise ValueError(f"{name} is in pageable host memory: the kernel reads host items through "
                                     f"their device-mapped address, so pin it (tensor.pin_memory())")
                raise ValueError(f"{name} is on {t.device}; expected {device}")
            check_tensor(name, t, dims=2)
            if item_rows is None:
                item_rows = t.shape[0]
            elif t.shape[0] != item_rows:
                raise ValueError(f"{name} has {t.shape[0]} rows but block 0 of media item {i} has {item_rows}: "
                                 f"the column blocks of an item share their rows")
            if j == 0 and len(blocks) > 1 and slab_width > text_width and t.shape[1] != text_width:
                raise WidthContractError(
                    f"{name} is {t.shape[1]} wide: block 0 holds the embeddings, so it must be the text width "
                    f"{text_width} when the slab ({slab_width}) is wider")
            cols += t.shape[1]
        if width is None:
            width = cols
            check_media_width(f"media item {i}", width, slab_width, text_width, expand)
        elif cols != width:
            raise WidthContractError(f"media item {i} is {cols} wide but media item 0 is {width}: items share one "
                                     f"row width (the column blocks of an item add up to it)")
    if width is None:
        raise ValueError("media is an empty list: pass None when the batch has no media")


def check_embed(slab, table, n: int, *, media=None, media_index=None, pad_to=None, expand="zeros", text_scale=None,
                vocab_range=None, vocab_size=None, media_owner=True, index_host_ok=False):
    """Check the embedding half; return ``(pad_to, media plan, (vocab_start, vocab_end, vocab_size), scale)``."""
    rows, width = slab.shape
    device = slab.device
    check_tensor("table", table, dtypes=FLOAT_DTYPES, device=device, dims=2)
    check_choice("expand", expand, ("zeros", "repeat"))
    if table.shape[1] != width:
        check_source_width("table", table.shape[1], width, expand)
    plan = check_media(media, device, width, table.shape[1], expand)
    if media_index is not None:
        check_tensor("media_index", media_index, dtypes=INT_DTYPES, device=device, host_ok=index_host_ok,
                     shape=(n,))
    elif plan is not None:
        raise ValueError("media was given without media_index: say which rows are media rows")
    if not isinstance(media_owner, bool):
        raise TypeError(f"media_owner must be a bool, got {media_owner!r}")
    if n > rows:
        raise ValueError(f"{n} tokens exceed the slab's {rows} rows")
    pad_to = n if pad_to is None else check_int("pad_to", pad_to, lo=n, hi=rows)
    scale = None if text_scale is None else check_real("text_scale", text_scale)
    bounds = vocab_bounds(vocab_range, vocab_size, table.shape[0])
    check_no_overlap("the slab", slab, "table", table)
    if plan is not None:
        if plan.spans is not None and slab.numel():  # items: every span in one loop; names only on a hit
            start, end = byte_span(slab)
            sources = plan.named_sources() if any(lo < end and hi > start for lo, hi in zip(*plan.spans)) else ()
        else:
            sources = plan.named_sources()
        for name, src in sources:
            check_no_overlap("the slab", slab, name, src)
    return pad_to, plan, bounds, scale


_WHOLE_MIN_BYTES = 1024  # ITEM_WHOLE only where the column blocks allow row pieces of at least this
# items: row pieces of at most 4 KiB. Twice the programs of a one-tensor launch at 4096 bf16 columns, so
# more of them are in flight while each finds its item; measured on an H200 (the item table copied each
# call): 16 items 1.05x of one tensor at 8192x4096 against 1.08x with 8 KiB pieces
_ITEM_MAX_BYTES = 4096


def row_settings(slab, text_width: int, plan: MediaPlan | None, expand: str) -> tuple[int, int, bool]:
    """(BLOCK, num_warps, ITEM_WHOLE) of the embedding half.

    A tiled ("repeat") source needs whole pieces. Items: pieces of at most 4 KiB
    (see ``_ITEM_MAX_BYTES``). Items in column blocks: where a
    power of two of at least ``_WHOLE_MIN_BYTES`` divides every block width, BLOCK
    is capped at it, so that each program's columns lie in one block of every item
    and the kernel loads them once (ITEM_WHOLE); otherwise it loads every block
    under a column mask.
    """
    width, elem = slab.shape[1], slab.element_size()
    media_width = plan.width if plan is not None else None
    tiled = tuple(w for w in (text_width, media_width) if w is not None and expand == "repeat" and w < width)
    max_bytes, whole = 8192, False
    if plan is not None and plan.mode == MEDIA_ITEMS:
        max_bytes = _ITEM_MAX_BYTES
        whole = plan.blocks > 1 and plan.unit * elem >= _WHOLE_MIN_BYTES
        if whole:
            max_bytes = min(max_bytes, plan.unit * elem)
    block, num_warps = row_launch_config(width, elem, divides=tiled, max_block_bytes=max_bytes)
    return block, num_warps, whole


def embed_args(slab, table, plan: MediaPlan | None, bounds, scale, *, expand, media_owner, has_index: bool):
    """``(args, constexprs, cols, num_warps)`` of the embedding half (``ids_ptr``, ``media_index_ptr`` and
    ``items_ptr`` are the caller's: they may travel in the packed host copy)."""
    width, text_width = slab.shape[1], table.shape[1]
    media_width = plan.width if plan is not None else width
    text_tiled = expand == "repeat" and text_width < width
    media_tiled = plan is not None and expand == "repeat" and media_width < width
    block, num_warps, whole = row_settings(slab, text_width, plan, expand)
    cols = (width + block - 1) // block
    # an index without media still marks media rows: each is then past the (zero) media rows, and flagged
    mode = MEDIA_NONE if not has_index else (plan.mode if plan is not None else MEDIA_TENSOR)
    args = dict(slab_ptr=slab, table_ptr=table, vocab_start=bounds[0], vocab_end=bounds[1], vocab_size=bounds[2],
                text_scale=1.0 if scale is None else scale, stride_slab=width, stride_table=table.stride(0))
    if plan is not None:
        args.update(media_ptr=plan.tensor, num_media=plan.rows, num_items=plan.num_items,
                    stride_media=plan.tensor.stride(0) if plan.mode == MEDIA_TENSOR else 0)
    constexprs = dict(WIDTH=width, TEXT_WIDTH=text_width, MEDIA_WIDTH=media_width, BLOCK=block, COL_BLOCKS=cols,
                      TEXT_TILED=text_tiled, MEDIA_TILED=media_tiled, MEDIA_MODE=mode,
                      ITEM_BLOCKS=plan.blocks if plan is not None else 1,
                      ITEM_VEC=plan.vec if plan is not None and block % max(plan.vec, 1) == 0 else 1,
                      ITEM_WHOLE=whole,
                      MEDIA_OWNER=media_owner and plan is not None, HAS_SCALE=scale is not None)
    return args, constexprs, cols, num_warps


def token_args(dst: Destinations, given: dict, b: int, stride_mrope: int):
    """``(args, constexprs)`` of the integer half for sources ``given`` (tensors, on the device)."""
    args = dict(dst.args)
    constexprs = {}
    for name, (src, _, _, pad, has) in SLOT_ARGS.items():
        on = name in given
        if on:
            args[src] = given[name]
        if has is not None:
            constexprs[has] = on
        constexprs[pad] = on and dst.pads.get(name, False)
    args["b"] = b
    args["stride_mrope"] = stride_mrope
    constexprs["REQ_BLOCK"] = next_pow2(dst.batch_cap)
    return args, constexprs


def check_sources_apart(dst: Destinations, given: dict, slab=None) -> None:
    """A source sharing storage with a destination would read this launch's own writes."""
    for name, t in given.items():
        for slot, d in dst.spans:
            if not (slot == name and t.data_ptr() == d.data_ptr()):  # a slot staged from itself is harmless
                check_no_overlap(f"slot {slot!r}", d, name, t)
        if slab is not None:
            check_no_overlap("the slab", slab, name, t)


# -- host inputs -------------------------------------------------------------------------
def pack_to_device(device: torch.device, parts: list, scratch=None) -> tuple[torch.Tensor, list]:
    """Host tensors (and int sequences) ``parts`` in one device buffer of bytes, through one pinned buffer
    and one non-blocking copy; ``(device bytes, each part's byte offset in it)``.

    Each part keeps its dtype (an int sequence becomes int64), its elements laid out
    contiguously, and starts 16-byte aligned. The parts are copied into the pinned
    buffer with one ``memmove`` each: a torch op costs a few microseconds of host time
    (a ``torch.cat`` that casts int32 parts, 10-15), a memmove a fraction of one.
    ``scratch(nbytes)``, when given, supplies the device buffer (reused: the copy and the
    launch that reads it are ordered on the current stream); else a new one is allocated.
    """
    spans, offsets, at = [], [], 0  # (address, bytes) of each part
    held = []  # what must live until the memmoves are done
    for v in parts:
        if isinstance(v, torch.Tensor):
            if not v.is_cpu:
                raise ValueError(f"pack_to_device: a part is on {v.device}, not on the host")
            if not v.is_contiguous():
                v = v.contiguous()
            held.append(v)
            spans.append((v.data_ptr(), v.numel() * v.element_size()))
        else:
            v = array("q", v)
            held.append(v)
            spans.append((v.buffer_info()[0], len(v) * 8))
        offsets.append(at)
        at += (spans[-1][1] + 15) & ~15  # the next part starts 16-byte aligned
    pinned = torch.empty(at, dtype=torch.uint8, pin_memory=device.type == "cuda")
    base = pinned.data_ptr()
    for (addr, nbytes), offset in zip(spans, offsets):
        if nbytes:
            memmove(base + offset, addr, nbytes)
    dev = scratch(at) if scratch is not None else torch.empty(at, dtype=torch.uint8, device=device)
    dev.copy_(pinned, non_blocking=True)
    return dev, offsets


def pack_host_inputs(device: torch.device, parts: dict, scratch=None) -> dict:
    """``parts`` with every host tensor (and int sequence) replaced by its view of one device buffer, made
    by :func:`pack_to_device` (same dtype and shape, contiguous); device tensors pass through."""
    on_cuda = device.type == "cuda"  # (inputs on another device were refused before this)
    host = [k for k, v in parts.items() if not isinstance(v, torch.Tensor) or (on_cuda and v.is_cpu)]
    if not host:
        return parts
    dev, offsets = pack_to_device(device, [parts[k] for k in host], scratch)
    out = dict(parts)
    for k, start in zip(host, offsets):
        v = parts[k]
        if isinstance(v, torch.Tensor):
            out[k] = dev[start:start + v.numel() * v.element_size()].view(v.dtype).view(v.shape)
        else:
            out[k] = dev[start:start + 8 * len(v)].view(torch.int64)
    return out


class ItemTables:
    """Item tables on the device, kept per content: a batch whose items have not moved (a chunked image, an
    encoder cache's entries staged again, a benchmark) reuses its table and skips the host-to-device copy.

    That copy is small but sits on the stream before the launch: measured on an H200, it put 2.3 µs (16
    items, 640 bytes) to 7.4 µs (16 items of 4 column blocks, 2 KiB) of latency before a staging kernel of
    35-110 µs. ``get(device, table, stream)``: the device copy of ``table`` (a tuple of ints, as int64)
    for launches on ``stream``, a key: a table is reused only on the stream whose copy wrote it, so that
    no launch can read it before the copy is done. ``clear()`` forgets them all (a benchmark of items
    staged for the first time calls it before each call).
    """

    KEPT = 64  # tables kept, each a few hundred bytes to a few KiB of device memory

    def __init__(self) -> None:
        self._tables: dict = {}

    def get(self, device: torch.device, table: tuple, stream=None) -> torch.Tensor:
        key = (stream, table)
        dev = self._tables.get(key)
        if dev is None:
            if len(self._tables) >= self.KEPT:
                self.clear()  # (a launch queued with one of them holds it through its arguments)
            dev = self._tables[key] = pack_to_device(device, [table])[0].view(torch.int64)
        return dev

    def clear(self) -> None:
        self._tables.clear()


ITEM_TABLES = ItemTables()  # stage_embeddings' tables (the runner keeps its own)
