"""What a staging batch's configuration fixes, checked once per configuration and kept.

A batch's *configuration* is which of its fields hold tensors, each tensor's dtype, device and rank, the
table's and the media tensor's width, ``expand`` and ``media_owner`` (values compared by type and value, so
``1`` is not ``True``). :func:`configuration` reads the batch's tensors (once, a column at a time: every
dtype, then every device, ...; the reads are most of a batch's host time), looks the configuration up, and
checks it the first time it is seen (:func:`check_configuration`), keeping a :class:`Config`: where each
input's reads are and what the block writer needs of them. What a batch's values decide is checked by
:func:`~slabstage.kernels.validate.check_batch`, every batch.
"""

from __future__ import annotations

from operator import attrgetter, itemgetter
from types import SimpleNamespace

import torch

from ..checks import FLOAT_DTYPES, INT_DTYPES, check_bool, check_choice, check_real, check_tensor
from ..staging.slots import ROWS, SOURCE_SLOTS
from ..staging.width import check_source_width
from .destinations import INT_BITS, Destinations
from .media import describe_media

__all__ = ["Config", "configuration", "check_configuration", "FIELDS", "DEFAULTS", "SOURCES", "LAYOUT_SLOT",
           "TABLE", "MEDIA", "INDEX", "EXPAND", "SCALE", "VOCAB_RANGE", "VOCAB_SIZE", "OWNER", "ELEM", "fields_of"]

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


class Config:
    """What one configuration fixes, checked once: what the per-batch checks and the block writer read.

    ``sources``: per integer source given that a slot takes, ``(read position, slot, kind, rows, name, element
    bytes, whether it travels in the block, the slot's dtype when its host values must be checked)``;
    ``table``, ``media``, ``index``: read positions (None: absent, or media as a list of items); ``host_ids``
    and ``host_index``: those travel in the block; ``block``: the block writer's template (made on first use).
    """

    __slots__ = ("sources", "table", "media", "index", "host_ids", "host_index", "template")

    def __init__(self, dst, at: dict, devices: tuple, dtypes: tuple) -> None:
        host = dst.host
        self.sources = tuple(
            (at[k], k, spec.kind, spec.rows, spec.name, ELEM[dtypes[at[k]]], host and devices[at[k]] < 0,
             dst.slots[k].dtype if devices[at[k]] < 0 and dst.bits[k] < INT_BITS[dtypes[at[k]]] else None)
            for k, spec in enumerate(SOURCE_SLOTS) if k in at and dst.slots[k] is not None)
        self.table, self.media, self.index = at.get(TABLE), at.get(MEDIA), at.get(INDEX)
        self.host_ids = host and devices[0] < 0
        self.host_index = self.index is not None and host and devices[self.index] < 0
        self.template = None  # the words of a parameter block this configuration fixes (ParamsWriter)


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


def _read(ts: tuple) -> tuple:
    """``(tensors, dtypes, devices, shapes, strides, addresses)``, a column at a time."""
    return (ts, tuple(map(_dtype, ts)), tuple(map(_device, ts)), tuple(map(_size, ts)), tuple(map(_stride, ts)),
            tuple(map(_ptr, ts)))


def configuration(dst: Destinations | None, vals: tuple, forms: dict, embed: bool):
    """``(Config, reads)`` of the batch ``vals`` (:func:`fields_of`): its tensors read, its configuration looked
    up in ``forms`` (the caller's: one a stager), or checked and kept there; raises when it is refused.
    ``dst`` None: the checks that need no destinations (:func:`~slabstage.kernels.validate.check_sources`).
    ``reads``: ``(tensors, dtypes, device indices, shapes, strides, addresses)``."""
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
    check_configuration(dst, vals, embed)  # (raises for anything refused)
    if reads is None:  # pragma: no cover - the check above names whatever could not be read
        raise TypeError("slabstage: an input could not be read but no rule names why")
    config = Config(dst if dst is not None else _ANYWHERE, form.at, reads[2], reads[1])
    if key is not None and 0 not in reads[5]:  # (a tensor with no data is looked at every time: meta, empty)
        if len(form.configs) >= 64:
            form.configs.clear()
        form.configs[key] = config
    return config, reads


# what check_sources checks a batch against: every slot, no host block, no narrowing
_ANYWHERE = SimpleNamespace(host=False, slots=(SimpleNamespace(dtype=torch.int64),) * len(SOURCES),
                            bits=(64,) * len(SOURCES))


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


def check_configuration(dst: Destinations | None, vals: tuple, embed: bool) -> None:
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
