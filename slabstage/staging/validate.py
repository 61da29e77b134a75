"""The one validation of a staging batch, for every path (graph, eager, the ops, the custom ops): the width rules,
the media checks and the batch checks (docs/design.md, "One validation" and "Media items").

:func:`configuration` reads a batch's tensors and checks what its configuration fixes once, keeping a
:class:`Config`; :func:`check_batch` checks the rest on every batch and returns the :class:`Checked` batch the
parameter record and the reference are built from. ``media`` is one 2-D tensor, a sequence of items (each a 2-D
tensor or a tuple of column blocks with equal rows) or a list of :class:`~slabstage.cache.Entry` handles of one
:class:`~slabstage.cache.EncoderCache`; :func:`describe_media` checks items and returns their :class:`MediaPlan`.
Every check runs before anything is written; each error names what was wrong and what was expected.
"""

from __future__ import annotations

import math
from functools import reduce
from itertools import accumulate, chain, repeat
from operator import add, attrgetter, itemgetter, mul, or_, sub
from types import SimpleNamespace
from typing import NamedTuple

import torch

from ..checks import (F32_MAX, FLOAT_DTYPES, INT32_MAX, INT_DTYPES, check_bool, check_choice, check_float32,
                      check_int, check_real, check_tensor, check_values, vocab_bounds)
from ..entry import Entry
from ..kernels.layout import FLOAT_BYTES, MAX_ITEM_WORDS, REQUESTS, ROWS, SEGMENT_WORDS
from .destinations import INT_BITS, Destinations
from .mrope import check_layouts, mrope_segments
from .slots import SOURCE_SLOTS
from .width import WidthContractError

__all__ = ["Checked", "Config", "Inputs", "MediaPlan", "check_batch", "check_media_width", "check_source_width",
           "check_sources", "describe_media", "DEFAULTS", "LAYOUT_SLOT", "ELEM"]

SOURCES = tuple(spec.name for spec in SOURCE_SLOTS)
# a batch's fields (PrefillBatch's), and the defaults of those a caller may leave out
DEFAULTS = dict.fromkeys(SOURCES) | dict(table=None, media=None, media_index=None, expand="zeros", text_scale=None,
                                         vocab_range=None, vocab_size=None, media_owner=True)
FIELDS = tuple(DEFAULTS)
TABLE, MEDIA, INDEX, EXPAND, SCALE, VOCAB_RANGE, VOCAB_SIZE, OWNER = range(len(SOURCES), len(FIELDS))
LAYOUT_SLOT = SOURCES.index("mrope_positions")  # the slot whose source may be layouts (slabstage.MropeLayout)
_fields = attrgetter(*FIELDS)
_T = torch.Tensor
_dtype, _device, _size, _stride, _ptr = attrgetter("dtype"), _T.get_device, _T.size, _T.stride, _T.data_ptr
ELEM = {torch.int32: 4, torch.int64: 8, torch.float16: 2, torch.bfloat16: 2, torch.float32: 4}
_UNREADABLE = (RuntimeError, TypeError, AttributeError, NotImplementedError, ValueError)  # sparse, nested, ...


class Inputs:
    """A batch as keyword arguments, named as :class:`~slabstage.PrefillBatch` names its fields (a field not
    given takes PrefillBatch's default)."""

    def __init__(self, **fields) -> None:
        self.__dict__.update(fields)


for _name, _default in DEFAULTS.items():  # (class attributes: what a field not given reads)
    setattr(Inputs, _name, _default)


class Config:
    """What one configuration fixes, checked once: what the per-batch checks and the stager's writer read.

    ``sources``: per integer source given that a slot takes, ``(read position, slot, kind, rows, name, element
    bytes, whether it travels in the record)``; ``narrow``: ``(read position, name, the slot's dtype)`` of each
    host source whose values the slot's narrower dtype must be checked to hold;
    ``table``, ``media``, ``index``: read positions (None: absent, or media as a list of items); ``host_ids``
    and ``host_index``: those travel in the parameter record; ``template``: the words of a parameter record it
    fixes (made by the stager on first use).
    """

    __slots__ = ("sources", "narrow", "table", "media", "index", "host_ids", "host_index", "template")

    def __init__(self, dst, at: dict, devices: tuple, dtypes: tuple) -> None:
        host = dst.host
        given = [(k, spec) for k, spec in enumerate(SOURCE_SLOTS) if k in at and dst.slots[k] is not None]
        self.sources = tuple((at[k], k, spec.kind, spec.rows, spec.name, ELEM[dtypes[at[k]]],
                              host and devices[at[k]] < 0) for k, spec in given)
        self.narrow = tuple((at[k], spec.name, dst.slots[k].dtype) for k, spec in given
                            if devices[at[k]] < 0 and dst.bits[k] < INT_BITS[dtypes[at[k]]])
        self.table, self.media, self.index = at.get(TABLE), at.get(MEDIA), at.get(INDEX)
        self.host_ids = host and devices[0] < 0
        self.host_index = self.index is not None and host and devices[self.index] < 0
        self.template = None  # the words of a parameter record this configuration fixes (Stager._template)


class _Form:
    """Which fields of a batch hold tensors, from their types alone: the positions of their reads."""

    __slots__ = ("pick", "at", "table", "media", "configs")

    def __init__(self, types: tuple, embed: bool) -> None:
        tensors = [j for j in range(len(SOURCES) + 3) if issubclass(types[j], _T) and (embed or j < len(SOURCES))]
        self.at = {j: p for p, j in enumerate(tensors)}
        picked = itemgetter(*tensors) if tensors else (lambda vals: ())
        self.pick = picked if len(tensors) != 1 else (lambda vals: (picked(vals),))
        self.table, self.media = self.at.get(TABLE), self.at.get(MEDIA)  # (their widths are configuration)
        self.configs: dict = {}


def fields_of(src) -> tuple[tuple, object]:
    """``(fields, layouts)``: the batch's fields in :data:`FIELDS` order (a field it lacks: the default), with
    mrope layouts (:class:`~slabstage.MropeLayout` values, not a tensor) taken out of them, or None."""
    vals = _fields(src)
    layouts = vals[LAYOUT_SLOT]
    if layouts is None or type(layouts) is _T:
        return vals, None
    return (*vals[:LAYOUT_SLOT], None, *vals[LAYOUT_SLOT + 1:]), layouts


def configuration(dst: Destinations | None, vals: tuple, forms: dict, embed: bool):
    """``(Config, reads)`` of the batch ``vals`` (:func:`fields_of`): its tensors read, its configuration looked
    up in ``forms`` (the caller's: one a stager), or checked and kept there; raises when it is refused.
    ``dst`` None: the checks that need no destinations (:func:`~slabstage.staging.validate.check_sources`).
    ``reads``: ``(tensors, dtypes, device indices, shapes, strides, addresses)``."""
    types = tuple(map(type, vals))
    form = forms.get(types)
    if form is None:
        form = forms[types] = _Form(types, embed)
    try:
        ts = form.pick(vals)  # (read a column at a time)
        reads = (ts, tuple(map(_dtype, ts)), tuple(map(_device, ts)), tuple(map(_size, ts)), tuple(map(_stride, ts)),
                 tuple(map(_ptr, ts)))
        shapes = reads[3]
        key = (*reads[1], *reads[2], *map(len, shapes), form.table is not None and shapes[form.table][-1:],
               form.media is not None and shapes[form.media][-1:], vals[EXPAND], vals[OWNER])
        config = form.configs.get(key)
        if config is not None and 0 not in reads[5]:
            return config, reads
    except _UNREADABLE:  # not a tensor one can read, or an unhashable look-alike of a switch
        key = reads = None
    check_configuration(dst, vals, embed)  # (raises for anything refused)
    if reads is None:  # pragma: no cover - the check above names whatever could not be read
        raise TypeError("slabstage: an input could not be read but no rule names why")
    config = Config(dst if dst is not None else _ANYWHERE, form.at, reads[2], reads[1])
    if key is not None and 0 not in reads[5]:  # (a tensor with no data is looked at every time: meta, empty)
        if len(form.configs) >= 64:
            form.configs.clear()
        form.configs[key] = config
    return config, reads


# what check_sources checks a batch against: every slot, no host inputs in a parameter record, no narrowing
_ANYWHERE = SimpleNamespace(host=False, slots=(SimpleNamespace(dtype=torch.int64),) * len(SOURCES),
                            bits=(64,) * len(SOURCES))


def _check_kinds(vals: tuple, device, host_ok: bool, slots: bool, embed: bool, switches: bool = True) -> None:
    """Each input's kind, dtype, device and rank (``device=None``: any device). ``slots``: the integer
    slots are written (their required sources must be given; the ids always are); ``embed``: the slab;
    ``switches``: ``media_owner`` and ``text_scale`` too."""
    for spec, t in zip(SOURCE_SLOTS, vals):
        if t is None and not (spec.required and (slots or spec.name == "input_ids")):
            continue
        if spec.kind == ROWS:
            if isinstance(t, _T) and t.dim() == 3 and t.shape[0] == spec.rows and t.shape[1] == 1:
                raise ValueError(f"{spec.name} must be [{spec.rows}, n] for one packed batch, got {tuple(t.shape)} "
                                 f"(the [3, batch, n] form of Hugging Face's get_rope_index): take [:, 0] of each "
                                 f"request or use slabstage.hf.mrope_positions")
            check_tensor(spec.name, t, dtypes=INT_DTYPES, device=device, host_ok=host_ok)
        else:
            check_tensor(spec.name, t, dtypes=INT_DTYPES, device=device, host_ok=host_ok, dims=1)
    if not embed:
        return
    check_tensor("table", vals[TABLE], dtypes=FLOAT_DTYPES, device=device, dims=2)
    if isinstance(vals[MEDIA], _T):
        check_tensor("media", vals[MEDIA], dtypes=FLOAT_DTYPES, device=device, dims=2)
    if vals[INDEX] is not None:
        check_tensor("media_index", vals[INDEX], dtypes=INT_DTYPES, device=device, host_ok=host_ok, dims=1)
    check_choice("expand", vals[EXPAND], ("zeros", "repeat"))
    if not switches:
        return
    check_bool("media_owner", vals[OWNER])
    if vals[SCALE] is not None:
        check_real("text_scale", vals[SCALE])


def check_configuration(dst: Destinations | None, vals: tuple, embed: bool) -> None:
    """The checks a configuration decides: kinds, dtypes, devices, ranks and switches (through
    :mod:`slabstage.checks`), then the slots the destinations have and the widths."""
    if dst is None:  # (no destinations: any device, host inputs allowed, the slots' sources required)
        _check_kinds(vals, None, True, True, True, switches=False)
        return
    has_slots = any(s is not None for s in dst.slots)
    _check_kinds(vals, dst.device, dst.host_ok, has_slots, embed)
    for spec, t, slot in zip(SOURCE_SLOTS, vals, dst.slots):
        if t is not None and slot is None and has_slots:
            if spec.switch is not None:
                raise ValueError(f"{spec.name} given but the buffers were allocated without {spec.switch}=True")
            raise ValueError(f"{spec.name} given but the buffers have no {spec.name!r} slot")
    if not embed:
        return
    width, table, media = dst.slab.shape[1], vals[TABLE], vals[MEDIA]
    if table.shape[1] != width:
        check_source_width("table", table.shape[1], width, vals[EXPAND])
    if isinstance(media, _T):  # (a list of items is checked every batch)
        check_media_width("media", media.shape[1], width, table.shape[1], vals[EXPAND])


# -- every batch ------------------------------------------------------------------------------------------
class Checked(NamedTuple):
    """A batch that passed :func:`check_batch`: what the parameter record and the reference are built from.

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
    configurations checked so far for ``dst``'s stager (kept by the caller). A tensor or media block that breaks a
    rule of :func:`~slabstage.checks.check_tensor` (``misfit``) is named after the batch's own rules are decided.
    """
    embed = dst.slab is not None
    vals, layouts = fields_of(src)  # (the layouts are values: checked below, every batch)
    config, reads = configuration(dst, vals, configs, embed)
    n, spans = reads[3][0][0], []  # spans: name, first byte, end byte of every source read in place
    b, misfit = _sizes(dst, src, config, reads, n, spans)
    segments = plan = None
    if misfit is None and layouts is not None:
        segments = _segments(dst, layouts, n)
    if misfit is None and embed:
        plan, misfit = _embeddings(dst, config, vals, reads, n, spans)
    if misfit is None:
        _check_room(plan, segments)
        _clear(dst, spans, plan)
    return _named(dst, config, vals, reads, n, b, pad_to, plan, segments, misfit)


def _sizes(dst: Destinations, src, config: Config, reads: tuple, n: int, spans: list) -> tuple:
    """``(b, misfit)``: the request count, after the request and token counts are checked against ``dst``, and
    the first input whose shape or stride is refused (``(name, tensor, the rules it breaks)``), or None."""
    b, misfit = _lengths(config.sources, reads, n, spans)
    if misfit is not None:
        return b, misfit
    if b > dst.batch_cap and dst.batch_cap:
        raise ValueError(f"{b} requests exceed max_batch_size={dst.batch_cap}")
    if n > dst.capacity:
        if not any(s is not None for s in dst.slots):
            raise ValueError(f"{n} tokens exceed the slab's {dst.capacity} rows")
        # (the runner's batches and stage_token_inputs' calls say it in their own words)
        said = f"batch of {n} tokens exceeds" if hasattr(src, "num_tokens") else f"{n} tokens exceed"
        raise ValueError(f"{said} the buffers' capacity of {dst.capacity} tokens")
    _, dtypes, _, _, strides, ptrs = reads
    if not config.sources or config.sources[0][1]:  # embeddings alone: the ids are read all the same
        if n > 1 and strides[0][0] != 1:
            return b, ("input_ids", reads[0][0], {"shape": (n,)})  # "... must be contiguous along its last axis"
        if n and not config.host_ids:
            spans += ("input_ids", ptrs[0], ptrs[0] + n * ELEM[dtypes[0]])
    return b, None


def _segments(dst: Destinations, layouts, n: int) -> list | None:
    """The mrope layouts' segment list (None: the destinations have no mrope slot, nor any other)."""
    if dst.slots[LAYOUT_SLOT] is not None:
        return mrope_segments(layouts, n, dst.slots[LAYOUT_SLOT].dtype)
    if any(t is not None for t in dst.slots):
        raise ValueError("mrope_positions given but the buffers were allocated without mrope=True")
    return None


def _embeddings(dst: Destinations, config: Config, vals: tuple, reads: tuple, n: int, spans: list) -> tuple:
    """``(plan, misfit)`` of the table, the media and ``media_index``."""
    _, dtypes, _, shapes, strides, ptrs = reads
    t, m, i = config.table, config.media, config.index
    rows, tw = shapes[t]
    if tw > 1 and strides[t][1] != 1:
        return None, ("table", vals[TABLE], {})  # "... must be contiguous along its last axis"
    if m is not None:
        plan = one_tensor_plan(vals[MEDIA], shapes[m], strides[m], ptrs[m], dtypes[m])
        if plan is None:
            return None, ("media", vals[MEDIA], {})  # "... must be contiguous along its last axis"
    else:
        plan, misfit = _media_plan(vals[MEDIA], dst.device, dst.slab.shape[1], tw, vals[EXPAND])
        if misfit is not None:
            return None, misfit
    if i is not None:
        if shapes[i] != (n,) or (n > 1 and strides[i][0] != 1):
            return plan, ("media_index", vals[INDEX], {"shape": (n,)})
        if n and not config.host_index:  # (a host index travels in the parameter record)
            spans += ("media_index", ptrs[i], ptrs[i] + n * ELEM[dtypes[i]])
    elif plan is not None:
        raise ValueError("media was given without media_index: say which rows are media rows")
    if rows and tw:
        spans += ("table", ptrs[t], ptrs[t] + ((rows - 1) * strides[t][0] + tw) * ELEM[dtypes[t]])
    return plan, None


def _named(dst: Destinations, config: Config, vals: tuple, reads: tuple, n: int, b: int, pad_to, plan, segments,
           misfit) -> Checked:
    """The end of :func:`check_batch`: a refused tensor or block named; host values a narrower slot cannot hold
    refused; ``pad_to``, ``text_scale`` and the vocabulary bounds checked; the :class:`Checked` batch."""
    if misfit is not None:
        _refuse(misfit)
    for at, name, narrow in config.narrow:
        check_values(name, reads[0][at], narrow)
    if type(pad_to) is not int or not n <= pad_to <= dst.capacity:
        if pad_to is None and not any(s is not None for s in dst.slots):
            pad_to = n  # (stage_embeddings' default)
        pad_to = check_int("pad_to", pad_to, lo=n, hi=dst.capacity)
    if dst.slab is None:
        return Checked(config, n, b, pad_to, vals, reads, segments=segments)
    scale, rows = vals[SCALE], reads[3][config.table][0]
    if scale is not None and not (type(scale) is float and math.isfinite(scale) and abs(scale) <= F32_MAX):
        scale = check_float32("text_scale", scale)
    if vals[VOCAB_RANGE] is None and vals[VOCAB_SIZE] is None and rows <= INT32_MAX:
        bounds = (0, rows, rows)
    else:
        bounds = vocab_bounds(vals[VOCAB_RANGE], vals[VOCAB_SIZE], rows)
    return Checked(config, n, b, pad_to, vals, reads, bounds, scale, plan, segments)


def _lengths(sources: tuple, reads: tuple, n: int, spans: list | None) -> tuple:
    """``(b, misfit)``: the request count, and the first integer source (``sources``, a :class:`Config`'s) whose
    shape or stride does not fit ``n`` and ``b`` (``(name, tensor, {"shape": ...})``, or None); the bytes of each
    read in place go to ``spans`` (checked against every destination)."""
    ts, _, _, shapes, strides, ptrs = reads
    b = -1
    for at, _, kind, rows, name, elem, in_record in sources:
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
            return max(b, 0), (name, ts[at], {"shape": want})
        if spans is None or in_record:
            continue
        elems = want[0] if kind != ROWS else ((rows - 1) * strides[at][0] + n if n else 0)
        if elems:
            spans += (name, ptrs[at], ptrs[at] + elems * elem)
    return max(b, 0), None


def _refuse(misfit: tuple) -> None:
    """Raise what :func:`~slabstage.checks.check_tensor` says of ``misfit``: ``(name, tensor, the rules it
    breaks)``."""
    name, t, rules = misfit
    check_tensor(name, t, **rules)
    raise TypeError(f"{name} could not be read as a tensor")  # pragma: no cover - a look-alike it accepts


def _check_room(plan: MediaPlan | None, segments: list | None) -> None:
    """The media items' and the mrope segments' lists fit the parameter record's room for them (on every path:
    the reference has no parameter record, and answers as the kernel does)."""
    item_words = 0 if plan is None else len(plan.starts) + plan.field_words
    seg_words = 0 if segments is None else len(segments)
    if item_words + seg_words > MAX_ITEM_WORDS:
        what = f"media has {len(plan.starts)} items of {plan.column_blocks} column blocks" if plan is not None else ""
        if seg_words:
            what += (" and " if what else "") + f"the mrope layouts make {seg_words // SEGMENT_WORDS} segments"
        raise ValueError(f"{what}: their lists take {item_words + seg_words} words, at most {MAX_ITEM_WORDS} "
                         f"fit the parameter record")


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
    n, i = reads[3][0][0], config.index
    misfit = _lengths(config.sources, reads, n, None)[1]
    if misfit is None and i is not None and (reads[3][i] != (n,) or (n > 1 and reads[4][i][0] != 1)):
        misfit = ("media_index", vals[INDEX], {"shape": (n,)})
    if misfit is not None:
        _refuse(misfit)
    if i is None and vals[MEDIA] is not None:
        raise ValueError(f"{what}.media was given without media_index")


# -- media ------------------------------------------------------------------------------------------------
_data_ptr, _is_cpu, _dense = _T.data_ptr, _T.is_cpu.__get__, _T.is_contiguous


class MediaPlan(NamedTuple):
    """Media checked and laid out for the kernel (see the module docstring)."""

    media: tuple | list  # the items as given: tensors, or tuples of column blocks
    rows: int
    width: int
    dtype: torch.dtype
    starts: list  # first media row of each item
    fields: list | bytes  # (address, row stride, first column, end column) per item and block: for cache entries,
    # packed as the parameter record holds them
    column_blocks: int  # column blocks per item in ``fields`` (an item with fewer is padded)
    vec: bool  # every address, row stride and block column in whole 16-byte vectors
    lows: list  # the bytes every block read spans (a block with rows and columns): first,
    highs: list  # and end
    entries: tuple | None = None  # media of cache entries: (the EncoderCache, the slots read)

    @property
    def field_words(self) -> int:
        """The words of ``fields`` in a parameter record."""
        return len(self.fields) >> 3 if type(self.fields) is bytes else len(self.fields)

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
    """Check ``media`` (None, or a sequence of items) and lay it out for the kernel.

    Each rule is decided for all the items at once; only when one refuses them is the first item and block that
    breaks it looked for, and named: ``TypeError``/``ValueError``, and :class:`WidthContractError` for widths (see
    :func:`check_media_width`).
    """
    plan, misfit = _media_plan(media, device, slab_width, text_width, expand)
    if misfit is not None:
        _refuse(misfit)
    return plan


def _media_plan(media, device: torch.device, slab_width: int, text_width: int, expand: str) -> tuple:
    """``(plan, misfit)``: :func:`describe_media`'s plan, or None and the first block that a rule of
    :func:`~slabstage.checks.check_tensor` refuses (``(name, block, the rules)``: :func:`_refuse` names it)."""
    if media is None:
        return None, None
    if type(media) not in (list, tuple):
        raise TypeError(f"media must be a 2-D tensor or a list of items (tensors, tuples of column blocks or "
                        f"EncoderCache entries), got {type(media).__name__}")
    if not media:
        raise ValueError("media is an empty list: pass None when the batch has no media")
    if type(media[0]) is Entry:
        return _entries_plan(media, device, slab_width, text_width, expand), None
    kinds = set(map(type, media))
    if Entry in kinds:
        return _entries_plan(media, device, slab_width, text_width, expand), None
    if kinds == {torch.Tensor}:  # items of one block each
        blocks, lens = media, None
    elif kinds == {tuple}:  # items of column blocks
        blocks, lens = list(chain.from_iterable(media)), list(map(len, media))
    else:
        items = _items(media)
        blocks, lens = [t for item in items for t in item], list(map(len, items))
    plan, misfit = _plan(media, blocks, lens, device, slab_width, text_width)
    if plan is not None:
        check_media_width("media item 0", plan.width, slab_width, text_width, expand)
    return plan, misfit


def one_tensor_plan(media: torch.Tensor, shape, stride, ptr: int, dtype: torch.dtype) -> MediaPlan | None:
    """The plan of one media tensor whose configuration (kind, dtype, device, rank, width) was checked, from
    what :func:`check_batch` read of it; None when its rows are not contiguous."""
    (rows, width), (s0, s1) = shape, stride
    if s1 != 1 and width > 1 and rows:
        return None
    vec = not (ptr & 15) and not ((width | (s0 if rows > 1 else 0)) & 7)
    lows, highs = ([ptr], [ptr + ((rows - 1) * s0 + width) * FLOAT_BYTES[dtype]]) if rows and width else ([], [])
    return MediaPlan((media,), rows, width, dtype, [0], [ptr if rows else 0, s0, 0, width], 1, vec, lows, highs)


def _entries_plan(media, device: torch.device, slab_width: int, text_width: int, expand: str) -> MediaPlan:
    """The plan of cache handles ``media``: integers from the cache's tables, no tensor read. What the cache and
    the destinations fix is checked once for each set of them (the cache keeps the last one that passed)."""
    kinds = set(map(type, media))
    if len(kinds) > 1:
        i = next(i for i, m in enumerate(media) if type(m) is not type(media[0]))
        raise TypeError(f"media item {i} is a {type(media[i]).__name__} but media item 0 is a "
                        f"{'cache Entry' if type(media[0]) is Entry else type(media[0]).__name__}: give cache "
                        f"entries or tensors, not both")
    cache = media[0].cache
    fits = (device, slab_width, text_width, expand)
    if cache.fits != fits:
        if cache.device != device and not (device.type == cache.device.type == "cuda" and device.index is None):
            raise ValueError(f"media item 0 is an entry of an EncoderCache on {cache.device}; expected {device}")
        check_media_width("media (cache entries)", cache.width, slab_width, text_width, expand)
    starts, fields, rows, slots = cache.locate(media)
    cache.fits = fits
    return MediaPlan(media, rows, cache.width, cache.dtype, starts, fields, 1, cache.vec, cache.span_lows,
                     cache.span_highs, (cache, slots))


def _items(media) -> tuple:
    return tuple(m if type(m) is tuple else (m,) for m in media)


def _plan(media, blocks, lens: list | None, device: torch.device, slab_width: int, text_width: int) -> tuple:
    """``(plan, misfit)`` of items ``media`` (``blocks``: their column blocks in order; ``lens``: each item's
    blocks, None when each is one tensor) from one read of every block, worked out a column of the batch at a
    time in C-level loops (the host time of many new items is their reads); raises naming the first item that
    breaks a rule, but for a block's own rules (``misfit``, see :func:`_read_blocks`)."""
    if lens is not None and 0 in lens:
        raise ValueError(f"media item {lens.index(0)} is an empty tuple: give at least one column block")
    read, misfit = _read_blocks(blocks, lens, device)
    if misfit is not None:
        return None, misfit
    ptrs, rs, ws, s0s, dtype = read
    n, k = len(media), 1 if lens is None else max(lens)
    if k > 1:  # (block 0 of an item of several holds the embeddings: the text width when the slab is wider)
        wide = text_width if slab_width > text_width else None
        if lens.count(k) != n:  # items of fewer blocks: padded with empty ones
            rs, ws, s0s, ptrs = _pad(lens, rs, ws, s0s, ptrs, k, wide, slab_width)
        elif wide is not None and ws[0::k].count(wide) != n:
            i = next(i for i, w in enumerate(ws[0::k]) if w != wide)
            _refuse_block_0(i, ws[i * k], wide, slab_width)
    item_rows = rs[0::k] if k > 1 else rs
    ends = _columns(rs, ws, item_rows, n, k)
    width = ends[k - 1]
    if 0 in rs:
        ptrs = [p if r else 0 for p, r in zip(ptrs, rs)]
    fields = [0] * (4 * len(ptrs))
    fields[0::4], fields[1::4], fields[2::4], fields[3::4] = ptrs, s0s, list(map(sub, ends, ws)), ends
    lows, highs = _block_spans(ptrs, rs, ws, s0s, FLOAT_BYTES[dtype])
    starts = list(accumulate(item_rows, initial=0))
    rows = starts.pop()
    align = reduce(or_, ptrs, 0) & 15 or (reduce(or_, ws, width) if k > 1 else width) & 7
    if not align and s0s is not ws:  # (the row stride of an item of one row is never used)
        align = reduce(or_, s0s if min(rs) > 1 else (s for s, r in zip(s0s, rs) if r > 1), 0) & 7
    return MediaPlan(media, rows, width, dtype, starts, fields, k, not align, lows, highs), None


def _read_blocks(blocks, lens: list | None, device: torch.device) -> tuple:
    """``(read, misfit)``: ``(addresses, rows, widths, row strides, dtype)`` of every block, read a column at a
    time; or None and the first block that is not a 2-D float tensor with contiguous rows that the kernel can
    read on ``device`` (``(name, block, the rules of check_tensor it breaks)``). Raises for a block of another
    dtype than item 0's and for a pageable host block on a CUDA device."""
    try:  # (a contiguous block's row stride is its width: its strides are read only when it is not)
        ptrs, shapes, dense = list(map(_data_ptr, blocks)), list(map(_size, blocks)), list(map(_dense, blocks))
        dtypes, devices = set(map(_dtype, blocks)), set(map(_device, blocks))
    except (RuntimeError, TypeError, AttributeError):  # not a tensor; sparse, mkldnn, nested ones have no data
        at = next(at for at, t in enumerate(blocks) if _unreadable(t))
        return None, (_block_name(lens, at), blocks[at], {})
    dtype = blocks[0].dtype
    if len(dtypes) != 1 or dtype not in FLOAT_BYTES:
        at = next(at for at, t in enumerate(blocks) if t.dtype != dtype or dtype not in FLOAT_BYTES)
        name = _block_name(lens, at)
        if blocks[at].dtype not in FLOAT_BYTES:
            return None, (name, blocks[at], {"dtypes": FLOAT_DTYPES})
        raise TypeError(f"{name} is {blocks[at].dtype} but media item 0 is {dtype}: items share one dtype")
    if set(map(len, shapes)) != {2}:
        at = next(at for at, shape in enumerate(shapes) if len(shape) != 2)
        return None, (_block_name(lens, at), blocks[at], {"dims": 2})
    rs, ws = zip(*shapes)
    s0s = ws
    if False in dense:
        s0s, s1s = zip(*map(_stride, blocks))
        for at, (r, w, s1) in enumerate(zip(rs, ws, s1s)):
            if s1 != 1 and w > 1 and r:  # rows must be contiguous
                return None, (_block_name(lens, at), blocks[at], {})
    on_cuda = device.type == "cuda"
    dev = (device.index if device.index is not None else torch.cuda.current_device()) if on_cuda else -1
    if devices != {dev} or (not on_cuda and 0 in ptrs and not all(map(_is_cpu, blocks))):  # (-1 is meta too)
        for at, (t, r) in enumerate(zip(blocks, rs)):  # an empty block is never read; a pinned host one in place
            if r and (t.get_device() != dev or not (on_cuda or t.is_cpu)) and not (on_cuda and t.is_cpu and
                                                                                  t.is_pinned()):
                name = _block_name(lens, at)
                if on_cuda and t.is_cpu:
                    raise ValueError(f"{name} is in pageable host memory: the kernel reads host items "
                                     f"through their device-mapped address, so pin it (tensor.pin_memory())")
                return None, (name, t, {"device": device})
    return (ptrs, rs, ws, s0s, dtype), None


def _unreadable(t) -> bool:
    """Whether ``t`` is not a tensor whose data, shape, dtype and device :func:`_read_blocks` can read."""
    try:
        _data_ptr(t), _size(t), _dense(t), _dtype(t), _device(t)
    except (RuntimeError, TypeError, AttributeError):
        return True
    return False


def _block_name(lens: list | None, at: int) -> str:
    """How the errors name block ``at`` of the items' blocks in order (``lens``: each item's blocks, None when
    each is one tensor)."""
    if lens is None:
        return f"media item {at}"
    for i, m in enumerate(lens):
        if at < m:
            return f"media item {i}" + (f" block {at}" if m > 1 else "")
        at -= m
    raise IndexError(at)  # pragma: no cover


def _columns(rs, ws, item_rows, n: int, k: int) -> list:
    """Each block's end column in its item (an item's blocks side by side, from 0), the last of an item its
    width; raises naming the first item whose blocks differ in rows, or whose width differs from item 0's."""
    for j in range(1, k):
        if rs[j::k] != item_rows:  # the blocks of an item share their rows
            i, j = next((i, j) for i in range(n) for j in range(1, k) if rs[i * k + j] != item_rows[i])
            raise ValueError(f"media item {i} block {j} has {rs[i * k + j]} rows but block 0 of media item {i} "
                             f"has {item_rows[i]}: the column blocks of an item share their rows")
    if k == 1:
        if ws.count(ws[0]) != n:  # items share one row width
            _refuse_width(ws, ws[0])
        return ws
    if ws == ws[:k] * n:  # every item of the same blocks: their columns once
        return list(accumulate(ws[:k])) * n
    ends = list(accumulate(ws))
    width = ends[k - 1]
    if ends[k - 1::k] != list(range(width, width * (n + 1), width)):  # items share one row width
        _refuse_width(list(map(sub, ends[k - 1::k], [0, *ends[k - 1:-1:k]])), width)
    return [e - width * (i // k) for i, e in enumerate(ends)]


def _refuse_width(widths: list, width: int) -> None:
    i = next(i for i, w in enumerate(widths) if w != width)
    raise WidthContractError(f"media item {i} is {widths[i]} wide but media item 0 is {width}: items share one "
                             f"row width (the column blocks of an item add up to it)")


def _refuse_block_0(i: int, width: int, text_width: int, slab_width: int) -> None:
    raise WidthContractError(f"media item {i} block 0 is {width} wide: block 0 holds the embeddings, so it must be "
                             f"the text width {text_width} when the slab ({slab_width}) is wider")


def _block_spans(ptrs, rs, ws, s0s, elem: int) -> tuple[list, list]:
    """The first and end byte each block with rows and columns reads, for the overlap checks."""
    if 0 in rs or 0 in ws:
        spans = [(p, p + ((r - 1) * s + w) * elem) for p, r, w, s in zip(ptrs, rs, ws, s0s) if r and w]
        return tuple(list(x) for x in zip(*spans)) if spans else ([], [])
    if s0s is ws and ws.count(ws[0]) == len(ws):  # contiguous blocks of one width: rows x width bytes
        return ptrs, list(map(add, ptrs, map(mul, rs, repeat(ws[0] * elem))))
    return ptrs, list(map(add, ptrs, map(mul, map(add, map(mul, map(sub, rs, repeat(1)), s0s), ws), repeat(elem))))


def _pad(lens: list, rs, ws, s0s, ptrs, k: int, text_width: int | None, slab_width: int) -> list:
    """Rows, widths, row strides and addresses with every item (``lens``: its blocks) padded to ``k`` blocks by
    empty ones (no address, no columns, the item's rows); with ``text_width``, block 0 of an item of several
    must be that wide (it holds the embeddings): raises naming the first that is not."""
    out = [], [], [], []
    at = 0
    for i, m in enumerate(lens):
        if text_width is not None and m > 1 and ws[at] != text_width:
            _refuse_block_0(i, ws[at], text_width, slab_width)
        for col, given, fill in zip(out, (rs, ws, s0s, ptrs), (rs[at], 0, 0, 0)):
            col.extend(given[at:at + m])
            col.extend([fill] * (k - m))
        at += m
    return out


# -- the width contract of what is written into the slab --------------------------------------------------
def check_source_width(name: str, source_width: int, slab_width: int, expand: str) -> None:
    """Check that rows ``source_width`` wide can be written into a ``slab_width`` slab.

    ``expand`` is ``"zeros"`` (columns past the source are zero) or ``"repeat"``
    (the source is tiled; the slab width must be a multiple of it). Raises
    :class:`WidthContractError` naming the source, both widths and the policy.
    """
    if source_width > slab_width:
        raise WidthContractError(f"{name} rows are {source_width} wide but the input_embeds slab is {slab_width} wide: "
                                 f"the declared input_embeds width is too narrow for this source")
    if source_width < slab_width:
        if expand == "repeat" and (source_width <= 0 or slab_width % source_width):
            raise WidthContractError(f"{name} width {source_width} does not divide the slab width {slab_width}: "
                                     f'expand="repeat" needs a whole number of copies')
        if expand not in ("zeros", "repeat"):
            raise WidthContractError(f'{name} is {source_width} wide, narrower than the slab ({slab_width}); '
                                     f'expand must be "zeros" or "repeat", got {expand!r}')


def check_media_width(name: str, media_width: int, slab_width: int, text_width: int, expand: str) -> None:
    """Check the width contract for media rows ``media_width`` wide.

    Media rows are as wide as the slab, or as wide as the text (the table's rows,
    ``text_width``) with an expand policy (``"zeros"`` or ``"repeat"``, checked as
    :func:`check_source_width` checks the table). Any other width is refused, even
    one that an expand policy could fill: media narrower than the slab must line up
    with the text rows column for column. Raises :class:`WidthContractError` naming
    the source, the widths and the policy.
    """
    if media_width == slab_width:
        return
    if media_width != text_width:
        raise WidthContractError(
            f"{name} rows are {media_width} wide, but media must be as wide as the input_embeds slab "
            f"({slab_width}) or as the text rows ({text_width}, with expand=\"zeros\" or \"repeat\"); "
            f"got expand={expand!r}"
        )
    check_source_width(name, media_width, slab_width, expand)
