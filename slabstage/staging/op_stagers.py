"""The stagers of the standalone ops: at most :data:`MAX_STAGERS`, each owned by the destinations it writes.

``stage_embeddings`` keeps one per slab storage, dtype and width (views of one slab share it);
``torch.ops.slabstage.stage_token_inputs`` one per exact set of destination tensors. No entry holds a reference to
a tensor it serves: a finalizer on each owner's storage or base tensor drops it (docs/design.md).
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict, deque

import torch

from .registry import slot_signature
from .destinations import Destinations
from .stager import Stager

__all__ = ["slab_stager", "slots_destinations", "slots_stager", "MAX_STAGERS", "cached_stagers", "clear"]

MAX_STAGERS = 16  # stagers kept for the ops' destinations (an engine stages into a few)

_CACHE: OrderedDict = OrderedDict()  # key -> _Entry, least recently used first
_LOCK = threading.Lock()
# slab storage -> the [raw handle, Stream] of its stager's last launch, kept while the storage lives: a stager
# made for it after the cache let the last one go orders its launches after that one's
_SLAB_ORDER: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


class _Entry:
    """A cached stager, the finalizers that drop it, and ``checked``: its destinations as last checked, without
    their tensors, with the error word they were checked with (a weak reference and its signature)."""

    __slots__ = ("stager", "finalizers", "checked")

    def __init__(self, stager: Stager) -> None:
        self.stager, self.finalizers, self.checked = stager, [], (None, lambda: None, None)


def _base(t: torch.Tensor) -> torch.Tensor:
    return t._base if t._base is not None else t


_DROPPED: deque = deque()  # keys whose owners were collected, not yet dropped


def _drop(key) -> None:
    """An owner of ``key``'s entry was collected: drop the entry, or, while the lock is held (the collector runs
    finalizers at any allocation, also inside this module's locked code on this thread), queue its key for the
    next look into the cache."""
    if not _LOCK.acquire(blocking=False):
        _DROPPED.append(key)
        return
    try:
        entry = _CACHE.pop(key, None)
    finally:
        _LOCK.release()
    _detach(entry)


def _drain() -> None:
    """Drop the entries whose keys the finalizers queued."""
    gone = []
    with _LOCK:
        while _DROPPED:
            entry = _CACHE.pop(_DROPPED.popleft(), None)
            if entry is not None:
                gone.append(entry)
    _detach(*gone)


def _detach(*entries) -> None:
    """Dropped entries (None: none) no longer drop anything when their owners are collected."""
    for e in entries:
        if e is not None:
            for f in e.finalizers:
                f.detach()


def _keep(key, stager: Stager, owners) -> _Entry:
    """Cache ``stager`` under ``key``, dropped when any of ``owners`` (tensors or storages) is collected."""
    stager.dst = None  # (each call hands it its destinations: it keeps none)
    entry = _Entry(stager)
    seen = set()
    for base in owners:
        if id(base) not in seen:
            seen.add(id(base))
            entry.finalizers.append(weakref.finalize(base, _drop, key))
    with _LOCK:
        old = _CACHE.pop(key, None)
        _CACHE[key] = entry
        evicted = [_CACHE.popitem(last=False)[1] for _ in range(len(_CACHE) - MAX_STAGERS)]
    _detach(old, *evicted)
    return entry


def _get(key):
    if _DROPPED:
        _drain()
    entry = _CACHE.get(key)
    if entry is not None:
        try:
            _CACHE.move_to_end(key)
        except KeyError:  # (dropped by another thread meanwhile)
            pass
    return entry


def slab_stager(slab, errors) -> tuple[Destinations, Stager]:
    """The checked destinations of a ``stage_embeddings`` call into ``slab`` (reporting into ``errors``) and
    the stager of ``slab``'s storage, dtype and width. Raises as :class:`Destinations` does. A view of a
    slab already checked with the same error word is checked from its address and rows alone."""
    if not (isinstance(slab, torch.Tensor) and isinstance(errors, torch.Tensor) and slab.dim() == 2):
        Destinations(slab=slab, errors=errors, host_ok=False)  # (raises, naming the argument)
        raise TypeError(f"slab must be a 2-D tensor, got {type(slab).__name__}")  # pragma: no cover
    storage = slab.untyped_storage()  # (views share it, also those made under inference mode: no ``_base``)
    key = ("slab", id(storage), storage.data_ptr(), slab.device, slab.dtype, slab.shape[1])
    entry = _get(key)
    if entry is not None:
        checked, ref, word = entry.checked  # (one read: another thread may replace it meanwhile)
        if ref() is errors and word == slot_signature(errors):
            dst = checked.slab_view(slab, errors)
            if dst is not None:
                return dst, entry.stager
    dst = Destinations(slab=slab, errors=errors, host_ok=False)
    if entry is None:
        entry = _keep(key, Stager(dst, _SLAB_ORDER.setdefault(storage, [None, None])), (storage,))
    _remember(entry, dst, errors)
    return dst, entry.stager


def _remember(entry: _Entry, dst: Destinations, errors) -> None:
    entry.checked = (dst.holding(None, (None,) * len(dst.slots), None),  # (the checks' results, no tensor)
                     weakref.ref(errors), slot_signature(errors))


def slots_destinations(slots, fills, errors) -> tuple[Destinations, Stager]:
    """The checked destinations of a custom op's call into integer ``slots`` (one tensor or None per row of
    :data:`~slabstage.staging.slots.SLOTS`) with ``fills``, reporting into ``errors``, and the stager of exactly
    that memory (tensors are told apart by address, shape, strides, dtype and device: a new tensor object over
    the same memory finds the same stager). Raises as :class:`Destinations` does. Destinations already checked
    are not checked again."""
    try:
        key = ("slots", tuple(fills), *(None if t is None else (type(t), *slot_signature(t)) for t in slots),
               id(errors), slot_signature(errors))
    except (AttributeError, RuntimeError, TypeError):  # (not plain tensors: the checks say what is wrong)
        key = None
    entry = None if key is None else _get(key)
    if entry is not None:
        checked, ref, _ = entry.checked
        if ref() is errors:
            return checked.holding(None, tuple(slots), errors), entry.stager
    device = next((t.device for t in slots if isinstance(t, torch.Tensor)), None)
    dst = Destinations(slots=slots, fills=fills, errors=errors, host_ok=True, device=device)
    if entry is None:
        entry = _keep(key, Stager(dst), [_base(t) for t in dst.slots if t is not None] + [_base(errors)])
    _remember(entry, dst, errors)
    return dst, entry.stager


def slots_stager(dst: Destinations) -> Stager:
    """The stager of exactly ``dst``'s integer slots, fills and error word."""
    return slots_destinations(dst.slots, dst.fills, dst.errors)[1]


def cached_stagers() -> int:
    """Stagers the ops keep now."""
    _drain()
    return len(_CACHE)


def clear() -> None:
    """Drop every stager the ops keep (each frees its memory once its queued work has finished)."""
    with _LOCK:
        entries = list(_CACHE.values())
        _CACHE.clear()
    _detach(*entries)
