"""The one validation of a staging batch, for every path (graph, eager, the ops, the custom ops).

Two halves:

- :class:`~slabstage.kernels.destinations.Destinations` checks what a stager writes (the slab, every integer
  slot, the error word) once per set of destinations;
- :func:`check_batch` checks a batch against them. What a *configuration* fixes (which fields hold
  tensors, each one's dtype, device and rank, the table's and the media tensor's width, ``expand``,
  ``media_owner``; values compared by type and value, so ``1`` is not ``True``) is checked the first time
  the configuration is seen and kept as a :class:`Config`; what can change (lengths, strides, ``pad_to``,
  bounds, ``text_scale``, the media items, the mrope layouts, addresses and storage overlap) on every batch.

Each tensor is read once a batch, a column of the batch at a time (every dtype, then every device, ...):
the reads are most of a batch's host time. Every check runs before anything is written; each error names
what was wrong and what was expected, through :mod:`slabstage.checks` (a compare that fails hands the
input to the helper that names the problem).
"""

from __future__ import annotations

import math
from itertools import chain
from operator import attrgetter, itemgetter
from types import SimpleNamespace
from typing import NamedTuple

import torch

from ..checks import (FLOAT_DTYPES, INT32_MAX, INT_DTYPES, check_bool, check_choice, check_int, check_real,
                      check_tensor, check_values, vocab_bounds)
from ..staging.slots import REQUESTS, ROWS, SOURCE_SLOTS
from ..staging.width import check_source_width
from .destinations import INT_BITS, Destinations
from .media import MediaPlan, describe_media, one_tensor_plan
from .mrope import check_layouts, mrope_segments

__all__ = ["Checked", "Config", "check_batch", "check_sources", "FIELDS", "DEFAULTS", "LAYOUT_SLOT"]

SOURCES = tuple(spec.name for spec in SOURCE_SLOTS)
# a batch's fields (PrefillBatch's), and the defaults of those a caller may leave out
DEFAULTS = dict.fromkeys(SOURCES) | dict(table=None, media=None, media_index=None, expand="zeros", text_scale=None,
                                         vocab_range=None, vocab_size=None, media_owner=True)
FIELDS = tuple(DEFAULTS)
TABLE, MEDIA, INDEX, EXPAND, SCALE, RANGE, SIZE, OWNER = range(len(SOURCES), len(FIELDS))
LAYOUT_SLOT = SOURCES.index("mrope_positions")  # the slot whose source may be layouts (slabstage.MropeLayout)
_fields = attrgetter(*FIELDS)
_T = torch.Tensor
_dtype, _device, _size, _stride, _ptr = attrgetter("dtype"), _T.get_device, _T.size, _T.stride, _T.data_ptr
_ELEM = {torch.int32: 4, torch.int64: 8, torch.float16: 2, torch.bfloat16: 2, torch.float32: 4}
_UNREADABLE = (RuntimeError, TypeError, AttributeError, NotImplementedError, ValueError)  # sparse, nested, ...


class Config:
    """What one configuration fixes, checked once: what the per-batch checks and the block writer read.

    ``sources``: per integer source given that a slot takes, ``(read position, slot, kind, rows, name, element
    bytes, whether it travels in the block, the slot's dtype when its host values must be checked)``;
    ``table``, ``media``, ``index``: read positions (None: absent, or media as a list of items); ``host_ids``
    and ``host_index``: those travel in the block; ``block``: the block writer's template (made on first use).
    """

    __slots__ = ("sources", "table", "media", "index", "host_ids", "host_index", "block")

    def __init__(self, dst, at: dict, devices: tuple, dtypes: tuple) -> None:
        host = dst.host
        self.sources = tuple(
            (at[k], k, spec.kind, spec.rows, spec.name, _ELEM[dtypes[at[k]]], host and devices[at[k]] < 0,
             dst.slots[k].dtype if devices[at[k]] < 0 and dst.bits[k] < INT_BITS[dtypes[at[k]]] else None)
            for k, spec in enumerate(SOURCE_SLOTS) if k in at and dst.slots[k] is not None)
        self.table, self.media, self.index = at.get(TABLE), at.get(MEDIA), at.get(INDEX)
        self.host_ids = host and devices[0] < 0
        self.host_index = self.index is not None and host and devices[self.index] < 0
        self.block = None


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


def _read(ts: tuple) -> tuple:
    """``(tensors, dtypes, devices, shapes, strides, addresses)``, a column at a time."""
    return (ts, tuple(map(_dtype, ts)), tuple(map(_device, ts)), tuple(map(_size, ts)), tuple(map(_stride, ts)),
            tuple(map(_ptr, ts)))


def _config_of(dst: Destinations | None, vals: tuple, forms: dict, embed: bool):
    """``(Config or None, reads)`` for the batch ``vals``: its configuration looked up, or checked and kept
    (``dst`` None: the checks that need no destinations, :func:`check_sources`); raises when it is refused."""
    types = tuple(map(type, vals))
    form = forms.get(types)
    if form is None:
        form = forms[types] = _Form(types, embed)
    try:
        reads = _read(form.pick(vals))
        shapes = reads[3]
        key = (*reads[1], *reads[2], *map(len, shapes), form.table is not None and shapes[form.table][-1:],
               form.media is not None and shapes[form.media][-1:], vals[EXPAND], vals[OWNER])
        config = form.configs.get(key)
        if config is not None and 0 not in reads[5]:
            return config, reads
    except _UNREADABLE:  # not a tensor one can read, or an unhashable look-alike of a switch
        key = reads = None
    _check_configuration(dst, vals, embed)  # (raises for anything refused)
    if reads is None:  # pragma: no cover - the check above names whatever could not be read
        raise TypeError("slabstage: an input could not be read but no rule names why")
    config = Config(dst if dst is not None else _ANYWHERE, form.at, reads[2], reads[1])
    if key is not None and 0 not in reads[5]:  # (a tensor with no data is looked at every time: meta, empty)
        if len(form.configs) >= 64:
            form.configs.clear()
        form.configs[key] = config
    return config, reads


def check_batch(dst: Destinations, src, pad_to, configs: dict) -> Checked:
    """Check the batch ``src`` (an object with :class:`~slabstage.PrefillBatch`'s fields; a field it lacks takes
    the default in :data:`DEFAULTS`) against ``dst``; raise before anything is written. ``configs``: the
    configurations checked so far for ``dst``'s stager (kept by the caller)."""
    embed = dst.slab is not None
    vals = _fields(src)
    layouts = vals[LAYOUT_SLOT]
    if layouts is not None and type(layouts) is not _T:  # mrope layouts: values, checked below every batch
        vals = (*vals[:LAYOUT_SLOT], None, *vals[LAYOUT_SLOT + 1:])
    else:
        layouts = None
    config, reads = _config_of(dst, vals, configs, embed)
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
            spans += ("input_ids", ptrs[0], ptrs[0] + n * _ELEM[dtypes[0]])
    segments = None
    if layouts is not None:
        if dst.slots[LAYOUT_SLOT] is None:
            if any(t is not None for t in dst.slots):
                raise ValueError("mrope_positions given but the buffers were allocated without mrope=True")
        else:
            segments = mrope_segments(layouts, n)
    if not embed:
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
        if shapes[i] != (n,) or (n > 1 and strides[i][0] != 1):
            check_tensor("media_index", vals[INDEX], shape=(n,))  # names what is wrong
        if n and not config.host_index:  # (a host index travels in the block)
            spans += ("media_index", ptrs[i], ptrs[i] + n * _ELEM[dtypes[i]])
    elif plan is not None:
        raise ValueError("media was given without media_index: say which rows are media rows")
    scale = vals[SCALE]
    if scale is not None and not (type(scale) is float and math.isfinite(scale)):
        scale = check_real("text_scale", scale)
    if vals[RANGE] is None and vals[SIZE] is None and rows <= INT32_MAX:
        bounds = (0, rows, rows)
    else:
        bounds = vocab_bounds(vals[RANGE], vals[SIZE], rows)
    if rows and tw:
        spans += ("table", ptrs[t], ptrs[t] + ((rows - 1) * strides[t][0] + tw) * _ELEM[dtypes[t]])
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
                raise ValueError(f"extend_start_loc has {shape[0]} entries but seq_lens has {b}: one per request")
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


def _clear(dst: Destinations, spans: list, plan: MediaPlan | None = None) -> None:
    """Every source's bytes (``spans``: name, first byte, end byte of each; then the media blocks') miss every
    destination: one pass over them all, errors named in that order."""
    lows, highs = spans[1::3], spans[2::3]
    if plan is not None and plan.lows:
        lows += plan.lows
        highs += plan.highs
    dst.clear_of_all(lows, highs, lambda: chain(zip(spans[0::3], lows, highs), () if plan is None else plan.spans()))


_SOURCE_FORMS: dict = {}  # the configurations check_sources has passed (a few per engine)
# what check_sources checks a batch against: every slot, no host block, no narrowing
_ANYWHERE = SimpleNamespace(host=False, slots=(SimpleNamespace(dtype=torch.int64),) * len(SOURCES),
                            bits=(64,) * len(SOURCES))


def check_sources(src, what: str = "PrefillBatch") -> None:
    """What a batch must satisfy on its own, with no destinations to check it against (a
    :class:`~slabstage.PrefillBatch` when it is made): the checks of :func:`check_batch` that need none."""
    vals = _fields(src)
    layouts = vals[LAYOUT_SLOT]
    if layouts is not None and type(layouts) is not _T:
        vals = (*vals[:LAYOUT_SLOT], None, *vals[LAYOUT_SLOT + 1:])
        check_layouts(layouts)  # (their values are checked where they are staged, with the rest of the batch)
    config, reads = _config_of(None, vals, _SOURCE_FORMS, True)
    n = reads[3][0][0]
    _check_lengths(config.sources, reads, n, None)
    i = config.index
    if i is not None:
        if reads[3][i] != (n,) or (n > 1 and reads[4][i][0] != 1):
            check_tensor("media_index", vals[INDEX], shape=(n,))  # names what is wrong
    elif vals[MEDIA] is not None:
        raise ValueError(f"{what}.media was given without media_index")


def _check_kinds(vals: tuple, device, host_ok: bool, slots: bool, embed: bool) -> None:
    """Each input's kind, dtype, device and rank (``device=None``: any device). ``slots``: the integer
    slots are written (their required sources must be given; the ids always are); ``embed``: the slab."""
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


def _check_configuration(dst: Destinations | None, vals: tuple, embed: bool) -> None:
    """The checks a configuration decides: kinds, dtypes, devices, ranks, widths, switches."""
    if dst is None:  # (no destinations: any device, host inputs allowed, the slots' sources required)
        _check_kinds(vals, None, True, True, True)
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
    check_bool("media_owner", vals[OWNER])
    if vals[SCALE] is not None:
        check_real("text_scale", vals[SCALE])
    if isinstance(media, _T):
        describe_media(media, dst.device, width, table.shape[1], vals[EXPAND])
