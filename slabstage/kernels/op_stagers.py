"""The stagers of the standalone ops: a few, each owned by the destinations it writes, none shared.

``stage_embeddings(slab, ...)`` keeps one stager per slab *base* tensor, dtype and width: views of one slab
(``base[:n]``, the usual way an engine stages) share it, and its blocks name no destination (the slab is a
launch argument). ``torch.ops.slabstage.stage_token_inputs`` keeps one per exact set of destination tensors
(their blocks name every destination's address). The cache holds at most :data:`MAX_STAGERS` and no
reference to any tensor it serves: a finalizer on each destination's base tensor drops its entries when
that tensor is collected, and a dropped stager frees its pinned ring and device block once the device work
it queued has finished (:mod:`slabstage.kernels.launch`).
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict

import torch

from ..staging.registry import slot_signature
from .destinations import Destinations
from .launch import Stager

__all__ = ["slab_stager", "slots_stager", "MAX_STAGERS", "cached_stagers", "clear"]

MAX_STAGERS = 16  # stagers kept for the ops' destinations (an engine stages into a few)

_CACHE: OrderedDict = OrderedDict()  # key -> _Entry, least recently used first
_LOCK = threading.Lock()


class _Entry:
    """A cached stager, the finalizers that drop it, and (for a slab) the last call's checked destinations
    without their tensors, reused while the call's slab and error word are the same objects."""

    __slots__ = ("stager", "finalizers", "slab", "errors", "layout", "dst")

    def __init__(self, stager: Stager) -> None:
        self.stager, self.finalizers = stager, []
        self.slab = self.errors = self.layout = self.dst = None


def _base(t: torch.Tensor) -> torch.Tensor:
    return t._base if t._base is not None else t


def _drop(key) -> None:
    with _LOCK:
        entry = _CACHE.pop(key, None)
    if entry is not None:
        for f in entry.finalizers:
            f.detach()


def _keep(key, stager: Stager, tensors) -> _Entry:
    """Cache ``stager`` under ``key``, dropped when any of ``tensors``' base tensors is collected."""
    stager.dst = None  # (each call hands it its destinations: it keeps none)
    entry = _Entry(stager)
    seen = set()
    for t in tensors:
        base = _base(t)
        if id(base) not in seen:
            seen.add(id(base))
            entry.finalizers.append(weakref.finalize(base, _drop, key))
    with _LOCK:
        old = _CACHE.pop(key, None)
        _CACHE[key] = entry
        evicted = [_CACHE.popitem(last=False)[1] for _ in range(len(_CACHE) - MAX_STAGERS)]
    for e in [old, *evicted]:
        if e is not None:
            for f in e.finalizers:
                f.detach()
    return entry


def _get(key):
    entry = _CACHE.get(key)
    if entry is not None:
        try:
            _CACHE.move_to_end(key)
        except KeyError:  # (dropped by another thread meanwhile)
            pass
    return entry


def slab_stager(slab, errors) -> tuple[Destinations, Stager]:
    """The checked destinations of a ``stage_embeddings`` call into ``slab`` (reporting into ``errors``) and
    the stager of ``slab``'s base tensor, dtype and width. Raises as :class:`Destinations` does."""
    if not (isinstance(slab, torch.Tensor) and isinstance(errors, torch.Tensor) and slab.dim() == 2):
        Destinations(slab=slab, errors=errors, host_ok=False)  # (raises, naming the argument)
        raise TypeError(f"slab must be a 2-D tensor, got {type(slab).__name__}")  # pragma: no cover
    base = _base(slab)
    key = ("slab", id(base), base.data_ptr(), slab.device, slab.dtype, slab.shape[1])
    entry = _get(key)
    layout = slot_signature(slab), slot_signature(errors)
    if entry is not None and entry.layout == layout and entry.slab() is slab and entry.errors() is errors:
        return _with(entry.dst, slab, errors), entry.stager
    dst = Destinations(slab=slab, errors=errors, host_ok=False)
    if entry is None:
        entry = _keep(key, Stager(dst), (slab,))
    entry.slab, entry.errors, entry.layout = weakref.ref(slab), weakref.ref(errors), layout
    entry.dst = _with(dst, None, None)  # (the checks' results, no tensor: reused while slab and errors are)
    return dst, entry.stager


def _with(dst: Destinations, slab, errors) -> Destinations:
    """A shallow copy of ``dst`` holding ``slab`` and ``errors``."""
    out = object.__new__(Destinations)
    out.__dict__.update(dst.__dict__)
    out.slab, out.errors = slab, errors
    return out


def slots_stager(dst: Destinations) -> Stager:
    """The stager of exactly ``dst``'s integer slots, fills and error word (a custom op's call)."""
    key = ("slots", dst.device, dst.batch_cap, dst.fills,
           *(None if t is None else (id(t), t.data_ptr(), t.dtype, t.shape, t.stride()) for t in dst.slots),
           id(dst.errors), dst.errors.data_ptr())
    entry = _get(key)
    if entry is None:
        entry = _keep(key, Stager(dst), [t for t in dst.slots if t is not None] + [dst.errors])
    return entry.stager


def cached_stagers() -> int:
    """Stagers the ops keep now."""
    return len(_CACHE)


def clear() -> None:
    """Drop every stager the ops keep (each frees its memory once its queued work has finished)."""
    with _LOCK:
        entries = list(_CACHE.values())
        _CACHE.clear()
    for e in entries:
        for f in e.finalizers:
            f.detach()
