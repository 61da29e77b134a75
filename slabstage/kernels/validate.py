"""The one validation of a staging batch, for every path (graph, eager, the ops, the custom ops).

Two halves, one function each:

- :class:`~slabstage.kernels.destinations.Destinations` checks what a stager writes (the slab, every integer slot,
  the error word) once per set of destinations;
- :func:`check_batch` checks a batch against them. What a *configuration* fixes
  (each input's kind, dtype, device and rank, the table's and the media tensor's
  width, ``expand``, ``media_owner``, which inputs are given; values compared by
  type and value, so ``1`` is not ``True``) is checked the first time the
  configuration is seen and remembered; what can change (lengths, ``pad_to``,
  bounds, ``text_scale``, the media items, addresses and storage overlap) on
  every batch.

Every check runs before anything is written; each error names what was wrong and
what was expected, through :mod:`slabstage.checks`.
"""

from __future__ import annotations

import math
from itertools import chain
from operator import itemgetter

import torch

from ..checks import (FLOAT_DTYPES, INT32_MAX, INT_DTYPES, check_bool, check_choice, check_int, check_real,
                      check_tensor, check_values, vocab_bounds)
from ..staging.slots import REQUESTS, ROWS, SOURCE_SLOTS
from ..staging.width import check_source_width
from .destinations import INT_BITS, Destinations
from .media import MediaPlan, describe_media
from .mrope import check_layouts, mrope_segments

__all__ = ["Checked", "check_batch", "check_sources", "vocab_bounds", "LAYOUT_SLOT"]

class Checked:
    """A batch that passed :func:`check_batch`: what the parameter block and the reference are built from.

    ``sources``: per :data:`~slabstage.staging.slots.SOURCE_SLOTS` row, the tensor to copy (None: not
    given, or a slot the stager does not write); ``reads``: per source, ``(dtype, address, row stride,
    bytes per row, rows)`` as read once for the checks.
    """

    __slots__ = ("n", "b", "pad_to", "ids", "sources", "reads", "table", "bounds", "scale", "media", "index",
                 "expand", "media_owner", "ids_read", "index_read", "table_read", "segments")

    def __init__(self, n, b, pad_to, ids, sources, reads, table=None, bounds=None, scale=None, media=None,
                 index=None, expand="zeros", media_owner=True, reads3=(None, None, None), segments=None):
        self.n, self.b, self.pad_to, self.ids, self.sources, self.reads = n, b, pad_to, ids, sources, reads
        self.table, self.bounds, self.scale = table, bounds, scale
        self.media: MediaPlan | None = media
        self.index, self.expand, self.media_owner = index, expand, media_owner
        self.ids_read, self.index_read, self.table_read = reads3  # what check_batch read of each
        self.segments = segments  # mrope positions given as layouts: their segment list (the source None)


_NAMES = tuple(spec.name for spec in SOURCE_SLOTS)
LAYOUT_SLOT = _NAMES.index("mrope_positions")  # the slot whose source may be layouts (slabstage.MropeLayout)
_KINDS = tuple((spec.kind, spec.rows) for spec in SOURCE_SLOTS)
_ELEM = {torch.int32: 4, torch.int64: 8, torch.float16: 2, torch.bfloat16: 2, torch.float32: 4}
_NONE = (None,) * 7
_CONF = itemgetter(0, 1, 2, 3)  # of a read: what a configuration fixes (kind, dtype, device, rank)


def _read(t):
    """One read of what the checks and the parameter block need of an input: ``(type, dtype, device index
    (-1: the host; -2: no data, the meta device), rank, shape, stride, address)``."""
    if t is None:
        return _NONE
    shape, ptr, device = t.shape, t.data_ptr(), t.get_device()
    if device < 0 and not ptr and 0 not in shape:
        device = -2
    return type(t), t.dtype, device, len(shape), shape, t.stride(), ptr


def _take_layouts(given: list):
    """The mrope layouts among the sources ``given`` (None: none), taken out of them: the tensor checks pass
    them by, :func:`~slabstage.kernels.mrope.mrope_segments` checks them."""
    layouts = given[LAYOUT_SLOT]
    if layouts is None or isinstance(layouts, torch.Tensor):
        return None
    given[LAYOUT_SLOT] = None
    return layouts


def _configuration(reads, tread, iread, media, mread, expand, owner, scale) -> tuple:
    """What a batch's configuration is, from what was read of its inputs (the key of the checks it decides)."""
    return (tuple(map(_CONF, reads)), _CONF(tread), tread[4] and tread[4][-1:], _CONF(iread), type(media),
            _CONF(mread), mread[4] and mread[4][-1:], type(expand), expand if type(expand) is str else id(expand),
            type(owner), owner if type(owner) is bool else id(owner), type(scale))


def _reads(given: list, table, index, media) -> tuple:
    """``(reads, table read, index read, media read)``: one :func:`_read` of each input."""
    reads = [_read(t) if t is not None else _NONE for t in given]
    return reads, _read(table), _read(index), _read(media) if type(media) is torch.Tensor else _NONE


_SOURCE_CONFIGS: dict = {}  # configurations check_sources has passed (a few per engine)


def check_sources(src, what: str = "PrefillBatch") -> None:
    """What a batch must satisfy on its own, with no destinations to check it against (a
    :class:`~slabstage.PrefillBatch` when it is made): the checks of :func:`check_batch` that need none
    (what a configuration decides once per configuration, as there)."""
    given = [getattr(src, name, None) for name in _NAMES]
    layouts = _take_layouts(given)
    media, expand = src.media, src.expand
    try:
        reads, tread, iread, mread = _reads(given, src.table, src.media_index, media)
        key = _configuration(reads, tread, iread, media, mread, expand, True, None)
        known = key in _SOURCE_CONFIGS
    except (AttributeError, TypeError, RuntimeError, IndexError):  # not a tensor, or one with no data or shape
        key, known = None, False
    if not known:
        _check_kinds(given, None, True, True, True, src.table, media, src.media_index, expand)
        reads = _reads(given, None, None, None)[0]
        if key is not None:
            if len(_SOURCE_CONFIGS) >= 256:
                _SOURCE_CONFIGS.clear()
            _SOURCE_CONFIGS[key] = True
    _check_lengths(given, reads, (True,) * len(given), reads[0][4][0])
    if layouts is not None:
        check_layouts(layouts)  # (their values are checked where they are staged, with the rest of the batch)
    _check_index(src.media, src.media_index, reads[0][4][0], f"{what}.media was given without media_index")


def check_batch(dst: Destinations, src, pad_to, configs: dict) -> Checked:
    """Check the batch ``src`` (an object with :class:`~slabstage.PrefillBatch`'s fields; the fields
    ``dst`` does not write may be absent) against ``dst``; raise before anything is written.
    ``configs``: the configurations checked so far for destinations like ``dst`` (kept by the caller).

    Runs on every batch: each input is read once (:func:`_read`) and everything else is worked out from
    what was read, so each check is a compare or two."""
    embed = dst.slab is not None
    fields = src.__dict__.get
    given = list(map(fields, _NAMES))
    layouts = _take_layouts(given)  # (checked below, every batch: they are values)
    if embed:
        table, media, index = fields("table"), fields("media"), fields("media_index")
        expand, owner, scale = fields("expand", "zeros"), fields("media_owner", True), fields("text_scale")
    else:
        table = media = index = scale = None
        expand, owner = "zeros", True
    try:
        reads, tread, iread, mread = _reads(given, table, index, media)
        key = _configuration(reads, tread, iread, media, mread, expand, owner, scale)
        present = configs.get(key)  # (what a configuration fixes: which sources the stager takes)
    except (AttributeError, TypeError, RuntimeError, IndexError):  # not a tensor, or one with no data or shape
        key = present = None
    if present is None:
        _check_configuration(dst, given, table, media, index, expand, owner, scale)
        present = tuple(k for k, t in enumerate(given) if t is not None and dst.slots[k] is not None)
        configs[key] = present

    ids = given[0]
    n = reads[0][4][0]
    spans = []  # (name, first byte, end byte) of every source read in place, checked against dst at the end
    sources, b = _check_lengths(given, reads, dst.slots, n, spans, dst, present)
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
    if sources[0] is None:  # embeddings alone: the ids are read all the same
        r = reads[0]
        if len(r[4]) != 1 or (n > 1 and r[5][0] != 1):
            check_tensor("input_ids", ids, dims=1)  # names what is wrong
        if n:
            spans.append(("input_ids", r[6], r[6] + n * _ELEM[r[1]]))
    segments = None
    if layouts is not None:
        if dst.slots[LAYOUT_SLOT] is None:
            if any(t is not None for t in dst.slots):
                raise ValueError("mrope_positions given but the buffers were allocated without mrope=True")
        else:
            segments = mrope_segments(layouts, n)
    if not embed:
        _clear(dst, spans)
        return Checked(n, b, pad_to, ids, sources, reads, reads3=(reads[0], None, None), segments=segments)

    width = dst.slab.shape[1]
    rows, tw = tread[4]
    if tread[5][1] != 1 and tw > 1:
        check_tensor("table", table, dims=2)  # "... must be contiguous along its last axis"
    plan = describe_media(media, dst.device, width, tw, expand, mread if mread[0] is not None else None)
    if index is not None:
        if iread[4] != (n,) or (n > 1 and iread[5][0] != 1):
            check_tensor("media_index", index, shape=(n,))  # names what is wrong
        if n and not (dst.host and iread[2] < 0):  # (a host index is copied into the block)
            spans.append(("media_index", iread[6], iread[6] + n * _ELEM[iread[1]]))
    elif plan is not None:
        raise ValueError("media was given without media_index: say which rows are media rows")
    if scale is not None and not (type(scale) is float and math.isfinite(scale)):
        scale = check_real("text_scale", scale)
    vocab_range, vocab_size = fields("vocab_range"), fields("vocab_size")
    if vocab_range is None and vocab_size is None and rows <= INT32_MAX:
        bounds = (0, rows, rows)
    else:
        bounds = vocab_bounds(vocab_range, vocab_size, rows)
    if rows:
        spans.append(("table", tread[6], tread[6] + ((rows - 1) * tread[5][0] + tw) * _ELEM[tread[1]]))
    _clear(dst, spans, plan)
    return Checked(n, b, pad_to, ids, sources, reads, table, bounds, scale, plan, index, expand, owner,
                   (reads[0], iread, tread), segments)


def _check_kinds(given, device, host_ok: bool, slots: bool, embed: bool, table, media, index, expand) -> None:
    """Each input's kind, dtype, device and rank (``device=None``: any device). ``slots``: the integer
    slots are written (their required sources must be given; the ids always are); ``embed``: the slab."""
    for spec, t in zip(SOURCE_SLOTS, given):
        if t is None and not (spec.required and (slots or spec.name == "input_ids")):
            continue
        if spec.kind == ROWS:
            if isinstance(t, torch.Tensor) and t.dim() == 3 and t.shape[0] == spec.rows and t.shape[1] == 1:
                raise ValueError(f"{spec.name} must be [{spec.rows}, n] for one packed batch, got {tuple(t.shape)} "
                                 f"(the [3, batch, n] form of Hugging Face's get_rope_index): take [:, 0] of each "
                                 f"request or use slabstage.hf.mrope_positions")
            check_tensor(spec.name, t, dtypes=INT_DTYPES, device=device, host_ok=host_ok)
        else:
            check_tensor(spec.name, t, dtypes=INT_DTYPES, device=device, host_ok=host_ok, dims=1)
    if not embed:
        return
    check_tensor("table", table, dtypes=FLOAT_DTYPES, device=device, dims=2)
    if isinstance(media, torch.Tensor):
        check_tensor("media", media, dtypes=FLOAT_DTYPES, device=device, dims=2)
    if index is not None:
        check_tensor("media_index", index, dtypes=INT_DTYPES, device=device, host_ok=host_ok, dims=1)
    check_choice("expand", expand, ("zeros", "repeat"))


def _clear(dst: Destinations, spans: list, plan: MediaPlan | None = None) -> None:
    """Every source's bytes (``spans``, then the media blocks') miss every destination: one pass over them all,
    errors named in that order."""
    names, lows, highs = zip(*spans) if spans else ((), (), ())
    if plan is not None and plan.lows:
        lows, highs = (*lows, *plan.lows), (*highs, *plan.highs)
    dst.clear_of_all(lows, highs, lambda: chain(spans, plan.spans() if plan is not None else ()))


def _check_lengths(given, reads, slots, n: int, spans=None, dst: Destinations | None = None,
                   present=None) -> tuple[list, int]:
    """``(sources, b)``: the integer sources that ``slots`` take, each checked against the batch's ``n`` and
    its request count ``b`` (from ``reads``, what was read of them); with ``dst``, also their values
    (host ones), and each device one's bytes are added to ``spans`` (checked against every destination).
    ``present``: the indices of the sources given that a slot takes, when known."""
    b = -1
    sources = [None] * len(given)
    for k in range(len(reads)) if present is None else present:
        r = reads[k]
        if r[0] is None or slots[k] is None:
            continue
        shape = r[4]
        kind, rows = _KINDS[k]
        if kind == REQUESTS:
            if b < 0:
                b = shape[0] if len(shape) == 1 else 0
            elif shape[0] != b:
                raise ValueError(f"extend_start_loc has {shape[0]} entries but seq_lens has {b}: one per request")
            want = (b,)
        else:
            want = (rows, n) if kind == ROWS else (n,)
        if shape != want or (want[-1] > 1 and r[5][-1] != 1):
            check_tensor(_NAMES[k], given[k], shape=want)  # names what is wrong
        sources[k] = given[k]
        if dst is None:
            continue
        if r[2] < 0:  # a host input: its values must fit its slot (a device one is flagged on the device)
            if dst.bits[k] < INT_BITS[r[1]]:
                check_values(_NAMES[k], given[k], slots[k].dtype)
            if dst.host:
                continue  # copied into the block: apart from every destination
        elems = shape[0] if len(shape) == 1 else (shape[0] - 1) * r[5][0] + shape[1]
        if elems:
            spans.append((_NAMES[k], r[6], r[6] + elems * _ELEM[r[1]]))
    return sources, max(b, 0)


def _check_index(media, index, n: int, missing: str) -> None:
    if index is not None:
        if index.shape != (n,) or (n > 1 and index.stride(0) != 1):
            check_tensor("media_index", index, shape=(n,))  # names what is wrong
    elif media is not None:
        raise ValueError(missing)


def _check_configuration(dst: Destinations, given, table, media, index, expand, owner, scale) -> None:
    """The checks a configuration decides: kinds, dtypes, devices, ranks, widths, switches."""
    device = dst.device
    has_slots = any(s is not None for s in dst.slots)
    _check_kinds(given, device, dst.host_ok, has_slots, dst.slab is not None, table, media, index, expand)
    for spec, t, slot in zip(SOURCE_SLOTS, given, dst.slots):
        if t is not None and slot is None and has_slots:
            if spec.switch is not None:
                raise ValueError(f"{spec.name} given but the buffers were allocated without {spec.switch}=True")
            raise ValueError(f"{spec.name} given but the buffers have no {spec.name!r} slot")
    if dst.slab is None:
        return
    width = dst.slab.shape[1]
    if table.shape[1] != width:
        check_source_width("table", table.shape[1], width, expand)
    check_bool("media_owner", owner)
    if scale is not None:
        check_real("text_scale", scale)
    if isinstance(media, torch.Tensor):
        describe_media(media, device, width, table.shape[1], expand)
