"""EncoderCache: encoder outputs kept in the slab's format, staged by handle (docs/encoder_cache.md).

An entry is a run of rows of the device arena (or of the pinned host tier it is demoted to) found by its key.
Its handle (:class:`Entry`) carries its generation, which every eviction or overwrite bumps: an older handle is
refused, never read. Rows that queued work still reads are reused only after that work completes.
"""

from __future__ import annotations

import struct
from collections import OrderedDict, deque
from itertools import accumulate
from operator import add, itemgetter, le

import torch

from ..checks import FLOAT_DTYPES, byte_span, check_int, check_tensor
from ..entry import Entry
from .reads import Reads
from .rows import Rows

_SLOT = itemgetter(1)  # (an Entry's slot)
_QUAD = struct.Struct("<4q")  # (a slot's item fields as the parameter record holds them: four int64 words)

__all__ = ["EncoderCache", "Entry", "StaleEntryError", "CacheFullError"]

DEVICE, HOST = 0, 1  # tiers
_FREE = -1


class StaleEntryError(LookupError):
    """A handle to an entry that was evicted or overwritten since it was taken."""


class CacheFullError(ValueError):
    """An entry larger than the device budget, or items the budget cannot hold at once."""


_KEY_TYPES = frozenset((bytes, str, int))
_new = tuple.__new__  # (an Entry without NamedTuple's Python-level __new__: a hit costs the host less)


def _check_key(key):
    if type(key) not in _KEY_TYPES:
        raise TypeError(f"key must be bytes, str or int (compared whole), got {type(key).__name__}")
    return key


class EncoderCache:
    """Encoder outputs of ``width`` columns in ``dtype`` on ``device`` (docs/encoder_cache.md).

    ``device_budget_bytes`` / ``host_budget_bytes``: the arenas' sizes (whole rows of ``width`` x element
    bytes; the host tier is pinned when ``device`` is CUDA, absent when 0). Memory is allocated once, here.
    """

    def __init__(self, width: int, dtype: torch.dtype, device, device_budget_bytes: int,
                 host_budget_bytes: int = 0) -> None:
        self.width = check_int("width", width, lo=1)
        if dtype not in FLOAT_DTYPES:
            raise TypeError(f"dtype must be one of {', '.join(map(str, FLOAT_DTYPES))}, got {dtype}")
        self.dtype, self.device = dtype, torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.row_bytes = width * torch.empty((), dtype=dtype).element_size()
        check_int("device_budget_bytes", device_budget_bytes, lo=self.row_bytes)
        check_int("host_budget_bytes", host_budget_bytes, lo=0)
        cuda = self.device.type == "cuda"
        with torch.inference_mode(False):
            self.arena = torch.zeros(device_budget_bytes // self.row_bytes, width, dtype=dtype, device=self.device)
            self.host = torch.zeros(host_budget_bytes // self.row_bytes, width, dtype=dtype, pin_memory=cuda)
        self.arenas = (self.arena, self.host)
        self.bases = (self.arena.data_ptr(), self.host.data_ptr())
        self.free = (Rows(self.arena.shape[0]), Rows(self.host.shape[0]))
        self.lru = (OrderedDict(), OrderedDict())  # per tier: slot -> None, least recently used first
        self.reads = Reads(self.device)  # the stagings and replays that read each entry
        self.writes = Reads(self.device)  # the cache's own copies (and puts') into each entry's rows
        self._slot_of: dict = {}  # key -> slot
        self.keys: list = []  # per slot: its key (None: a free slot)
        self.gens: list = []  # per slot: its generation (bumped when its entry goes)
        self.tiers: list = []  # per slot: DEVICE, HOST or _FREE
        self.ats: list = []  # per slot: its first row in its tier's arena
        self.lens: list = []  # per slot: its rows
        self.quads: list = []  # per slot: its item fields in a parameter record (first row's address, row stride, 0,
        # width), packed as the record's words (_QUAD): a batch's are joined, not unpacked
        self.fits = None  # (device, slab width, text width, expand): the last destinations staging checked it for
        self.handles: list = []  # per slot: the handle of its whole entry (made once a generation: a hit is a lookup)
        self._spare: list = []  # free slots
        self._written: dict = {}  # slot -> (event, raw stream) of a demotion's copy into its host rows, maybe queued
        self._held: dict = {}  # slot -> holds (hold / release): entries no put evicts or demotes
        self.vec = not (self.row_bytes & 15 or self.bases[0] & 15 or (self.host.numel() and self.bases[1] & 15))
        self._spans = [(f"the encoder cache's {name} rows", base, base + t.shape[0] * self.row_bytes)
                       for name, base, t in zip(("device", "host"), self.bases, self.arenas) if t.shape[0]]
        self.span_lows, self.span_highs = [s[1] for s in self._spans], [s[2] for s in self._spans]

    # -- filling ---------------------------------------------------------------------------
    def put(self, key, value) -> Entry:
        """Copy ``value`` (a 2-D tensor, or a tuple of column blocks with equal rows) in under ``key`` (an entry
        already there is replaced) and return its handle. The columns past ``value``'s are zero."""
        _check_key(key)
        blocks = value if type(value) is tuple else (value,)
        if not blocks:
            raise ValueError("value is an empty tuple: give a tensor or column blocks")
        cols = 0
        for j, t in enumerate(blocks):
            name = "value" if len(blocks) == 1 else f"value block {j}"
            check_tensor(name, t, dtypes=FLOAT_DTYPES, dims=2)
            if t.shape[0] != blocks[0].shape[0]:
                raise ValueError(f"{name} has {t.shape[0]} rows but block 0 has {blocks[0].shape[0]}: the column "
                                 f"blocks of an item share their rows")
            cols += t.shape[1]
        if cols > self.width:
            raise ValueError(f"value is {cols} columns wide; the cache's rows are {self.width}")
        blocks = tuple(self._source(t, "value" if len(blocks) == 1 else f"value block {j}")
                       for j, t in enumerate(blocks))
        entry = self._place(key, blocks[0].shape[0])
        view = self._view(entry.slot)
        at = 0
        try:
            for t in blocks:
                view[:, at:at + t.shape[1]].copy_(t, non_blocking=True)
                at += t.shape[1]
            if at < self.width:
                view[:, at:].zero_()
        except BaseException:  # (no entry of rows never written stays under the key)
            self._drop(entry.slot)
            raise
        return entry

    def _source(self, t: torch.Tensor, name: str) -> torch.Tensor:
        """A block ``put`` copies in: detached (the arena records no autograd), on the cache's device or the host,
        and a copy of its own where it lies in the cache's rows (the entry it is put as may take them)."""
        if t.device != self.device and t.device.type != "cpu":
            raise ValueError(f"{name} is on {t.device}; the cache's rows are on {self.device} (a host tensor is "
                             f"copied in)")
        t = t.detach()
        if t.numel():
            lo, hi = byte_span(t)
            if any(lo < high and low < hi for low, high in zip(self.span_lows, self.span_highs)):
                t = t.clone()
        return t

    def reserve(self, key, rows: int) -> torch.Tensor:
        """A writable ``[rows, width]`` view of a new entry under ``key`` (an encoder writes its output in place,
        on the current stream: work queued there before may still read these rows; take the handle with
        :meth:`get`). Its rows hold whatever was there before."""
        _check_key(key)
        check_int("rows", rows, lo=0)
        return self._view(self._place(key, rows).slot)

    # -- reading ---------------------------------------------------------------------------
    def get(self, key, rows: int | None = None) -> Entry | None:
        """The handle of ``key``'s entry (it becomes the most recently used), or None on a miss. ``rows``: the
        rows the caller expects (its placeholder count); an entry of other rows raises ``ValueError``."""
        if type(key) not in _KEY_TYPES:  # (1.0 and True would find the key 1)
            _check_key(key)
        slot = self._slot_of.get(key)
        if slot is None:
            return None
        n = self.lens[slot]
        if rows is not None and (rows != n or type(rows) is not int):
            check_int("EncoderCache.get: rows", rows, lo=0)  # (a bool, a float, a tensor: named as such)
            raise ValueError(f"the cache entry of key {key!r} holds {n} rows but {rows} were expected: "
                             f"the item's placeholders and its encoder output disagree")
        self.lru[self.tiers[slot]].move_to_end(slot)
        return self.handles[slot]

    def get_many(self, keys, rows=None) -> list:
        """:meth:`get` of each key in ``keys`` (``rows``: None, or the rows each one expects), in one call: the
        handles (None for a miss)."""
        if rows is not None and len(rows) != len(keys):
            raise ValueError(f"get_many: {len(keys)} keys but {len(rows)} row counts")
        slots = list(map(self._slot_of.get, keys)) if set(map(type, keys)) <= _KEY_TYPES else [None]
        ns = None if None in slots else list(map(self.lens.__getitem__, slots))
        if ns is None or (rows is not None and ns != list(rows)):  # a miss, a wrong count or key: one by one
            return [self.get(k, None if rows is None else rows[i]) for i, k in enumerate(keys)]
        tiers, lru = self.tiers, self.lru
        if lru[HOST]:
            for slot in slots:
                lru[tiers[slot]].move_to_end(slot)
        else:  # (every entry on the device)
            deque(map(lru[DEVICE].move_to_end, slots), 0)
        return list(map(self.handles.__getitem__, slots))

    def __contains__(self, key) -> bool:
        return key in self._slot_of

    def __len__(self) -> int:
        return len(self._slot_of)

    def tier(self, entry: Entry) -> str:
        """``"device"`` or ``"host"``: where ``entry``'s rows are now."""
        self._check_live(entry)
        return ("device", "host")[self.tiers[entry.slot]]

    def rows_of(self, entry: Entry) -> torch.Tensor:
        """A view of ``entry``'s rows (all columns) where they lie."""
        self._check_live(entry)
        return self._view(entry.slot)[entry.first:entry.first + entry.rows]

    def hold(self, entry: Entry) -> None:
        """Keep ``entry``'s entry where it is until :meth:`release`: no put or reserve evicts or demotes it (one that
        finds no other room raises :class:`CacheFullError`); :meth:`evict` and a put under its key still replace
        it. Holds count: each needs its release."""
        self._check_live(entry)
        self._held[entry.slot] = self._held.get(entry.slot, 0) + 1

    def release(self, entry: Entry) -> None:
        """Undo one :meth:`hold` of ``entry`` (nothing if its entry has gone since)."""
        slot = entry.slot
        if type(entry) is Entry and entry.cache is self and slot < len(self.gens) and self.gens[slot] == entry.gen:
            n = self._held.pop(slot, 0) - 1
            if n > 0:
                self._held[slot] = n

    def evict_unheld(self) -> None:
        """Evict every entry that no :meth:`hold` keeps."""
        for slot, key in enumerate(self.keys):
            if key is not None and slot not in self._held:
                self._drop(slot)

    def evict(self, key) -> None:
        """Drop ``key``'s entry (its handles are refused from now on)."""
        slot = self._slot_of.get(_check_key(key))
        if slot is not None:
            self._drop(slot)

    def _check_handles(self, entries, slots, gens, firsts, rows) -> None:
        """Each of ``entries`` (their fields: ``slots`` ...) names rows of a live entry of this cache:
        :class:`StaleEntryError` for the first whose entry went, ``ValueError`` for one no call of this cache made
        (a slot it does not have, rows past its entry's: an edited handle; :meth:`Entry.part` makes parts)."""
        try:  # (all at once; one by one only to name the handle that fails)
            if (min(slots) >= 0 and list(map(self.gens.__getitem__, slots)) == list(gens) and min(firsts) >= 0
                    and min(rows) >= 0 and type(sum(firsts) + sum(rows)) is int
                    and all(map(le, map(add, firsts, rows), map(self.lens.__getitem__, slots)))):
                return
        except (TypeError, IndexError):
            pass
        for i, e in enumerate(entries):
            slot, first, rows = e.slot, e.first, e.rows
            if not (type(slot) is int and 0 <= slot < len(self.gens)):
                raise ValueError(f"media item {i} is not a handle this EncoderCache made (slot {slot!r})")
            if self.gens[slot] != e.gen:
                self._check_live(e)
            if not (type(first) is int and type(rows) is int and first >= 0 and rows >= 0
                    and first + rows <= self.lens[slot]):
                raise ValueError(f"media item {i} names rows [{first!r}, {first!r} + {rows!r}) of an entry of "
                                 f"{self.lens[slot]} rows: take handles from put/get and parts from Entry.part")

    # -- staging ---------------------------------------------------------------------------
    def locate(self, entries) -> tuple:
        """``(starts, fields, rows, slots)`` of ``entries``, a list or tuple of :class:`Entry` (nothing else), for the
        parameter record's item list: each item's first media row, per item ``(address, row stride, 0, width)``
        packed as the record's int64 words, the rows in all, the entries read. Raises :class:`StaleEntryError` for
        a handle whose entry is gone, ``ValueError`` for one of another cache."""
        try:  # (each the handle put/get hand out for its slot now, whole and live: nothing more to check; a list
            # of handles compares them by identity first, then as tuples)
            slots = list(map(_SLOT, entries))
            listed = entries if type(entries) is list else list(entries)  # (a tuple of handles: the same check)
            current = list(map(self.handles.__getitem__, slots)) == listed
        except (TypeError, IndexError):
            current = False
        firsts = None
        if current:
            rows = map(self.lens.__getitem__, slots)
        else:  # parts of entries, or stale or edited handles
            caches, slots, gens, firsts, rows = zip(*entries)
            if caches.count(self) != len(caches):
                i = next(i for i, c in enumerate(caches) if c is not self)
                raise ValueError(f"media item {i} is an entry of another EncoderCache: a batch's entries come from "
                                 f"one")
            self._check_handles(entries, slots, gens, firsts, rows)
            slots = list(slots)
        if self._written:
            self._after_writes(slots)
        quads = map(self.quads.__getitem__, slots)
        if firsts is None or firsts.count(0) == len(firsts):
            fields = b"".join(quads)
        else:  # parts of entries: their first rows
            rb = self.row_bytes
            fields = b"".join(_QUAD.pack(a + f * rb, stride, c0, c1)
                              for (a, stride, c0, c1), f in zip(map(_QUAD.unpack, quads), firsts))
        starts = list(accumulate(rows, initial=0))
        return starts, fields, starts.pop(), slots

    def spans(self) -> list:
        """``(name, first byte, end byte)`` of the arenas (what a staging call checks its destinations against;
        ``span_lows`` and ``span_highs`` hold their first and end bytes)."""
        return self._spans

    def _after_writes(self, slots) -> None:
        """The current stream waits for the copies into the host rows of ``slots`` that a demotion queued on
        another stream (one CUDA call while one may be queued; none once it is done, or on the same stream). Not
        while capturing: entries are refused there."""
        if torch.cuda.is_current_stream_capturing():
            return
        written, stream = self._written, torch.cuda.current_stream(self.device)
        for slot in set(slots).intersection(written):
            event, raw = written[slot]
            if event.query():
                del written[slot]
            elif raw != stream.cuda_stream:
                stream.wait_event(event)

    # -- entries ---------------------------------------------------------------------------
    def _view(self, slot: int) -> torch.Tensor:
        at = self.ats[slot]
        return self.arenas[self.tiers[slot]][at:at + self.lens[slot]]

    def _check_live(self, entry: Entry) -> None:
        if type(entry) is not Entry or entry.cache is not self:
            raise ValueError("not a handle of this EncoderCache")
        if entry.slot >= len(self.gens) or self.gens[entry.slot] != entry.gen:
            raise StaleEntryError(f"the cache entry this handle names (slot {entry.slot}, generation {entry.gen}) "
                                  f"was evicted or overwritten: get() it again, or encode the item again")

    def _place(self, key, rows: int) -> Entry:
        """A new device entry of ``rows`` rows under ``key`` (replacing one there), evicting as needed."""
        if rows > self.arena.shape[0]:
            raise CacheFullError(f"an entry of {rows} rows exceeds the cache's device budget of "
                                 f"{self.arena.shape[0]} rows ({self.row_bytes} bytes a row)")
        old = self._slot_of.get(key)  # (replaced: its rows count as free, held or not)
        if self._held and rows > self._widest(DEVICE, old):
            raise CacheFullError(f"an entry of {rows} rows: the cache's device rows beside the entries kept by "
                                 f"hold() have no run that long ({self._widest(DEVICE, old)} rows at most)")
        if self.reads.cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("EncoderCache: a put or reserve while the current stream captures a graph (every replay "
                               "would write the rows this capture chose, whatever the cache holds there by then): put "
                               "outside the capture; the runner's graphs stage entries put before each run()")
        if old is not None:
            self._drop(old)
        at = self._room(DEVICE, rows)
        slot = self._spare.pop() if self._spare else len(self.gens)
        if slot == len(self.gens):
            for col, v in ((self.keys, None), (self.gens, 0), (self.tiers, _FREE), (self.ats, 0), (self.lens, 0),
                           (self.quads, None), (self.handles, None)):
                col.append(v)
            self.reads.grow(slot + 1)
            self.writes.grow(slot + 1)
        self.keys[slot], self.tiers[slot], self.ats[slot], self.lens[slot] = key, DEVICE, at, rows
        self.quads[slot] = _QUAD.pack(self.bases[DEVICE] + at * self.row_bytes, self.width, 0, self.width)
        self.gens[slot] += 1
        self._slot_of[key] = slot
        self.lru[DEVICE][slot] = None
        entry = self.handles[slot] = _new(Entry, (self, slot, self.gens[slot], 0, rows))
        self.writes.note((slot,))  # the write into them (a put's copy, an encoder's) is queued on this stream
        return entry

    def _room(self, tier: int, rows: int) -> int:
        """The first row of ``rows`` free rows of ``tier``, evicting least recently used entries for them. Rows that
        queued work still uses are taken as they are when that work is on the current stream (the write queued
        next runs after it); for work on another stream the current one queues a wait: the host never waits."""
        free, lru = self.free[tier], self.lru[tier]
        here = torch.cuda.current_stream(self.device).cuda_stream if self.reads.cuda else None
        while True:
            got = free.take(rows, here) if rows else (0, ())
            if got is not None:
                self._after(got[1])
                return got[0]
            held = self._held
            victim = next((s for s in lru if s not in held), None) if held else next(iter(lru), None)
            if victim is None:  # (checked before: with every entry but the held ones gone, there is a run)
                raise RuntimeError(f"slabstage: the encoder cache has no run of {rows} free rows "
                                   f"({free.free_rows()} free in all)")
            if tier == DEVICE and self.host.shape[0] and self.lens[victim] <= (
                    self._widest(HOST) if held else self.host.shape[0]):
                self._demote(victim)
            else:
                self._drop(victim)

    def _after(self, events) -> None:
        """Order what the current stream queues next after ``events`` recorded on other streams (a
        ``cudaStreamWaitEvent`` each; none for the current stream's own, which run first anyway)."""
        if events and self.reads.cuda:  # (on the CPU a launch has finished when it returns)
            stream = torch.cuda.current_stream(self.device)
            here = stream.cuda_stream
            for e in events:
                if getattr(e, "on", None) != here:
                    stream.wait_event(e)

    def _widest(self, tier: int, but=None) -> int:
        """The longest run of ``tier``'s rows that no held entry (but slot ``but``) lies in: what evicting every
        other entry frees."""
        spans = sorted((self.ats[s], self.lens[s]) for s in self._held if self.tiers[s] == tier and s != but)
        widest, end = 0, 0
        for at, rows in spans:
            widest, end = max(widest, at - end), max(end, at + rows)
        return max(widest, self.arenas[tier].shape[0] - end)

    def _demote(self, slot: int) -> None:
        """Move a device entry to the host tier (a queued copy), keeping its key and generation."""
        rows = self.lens[slot]
        at = self._room(HOST, rows)
        del self.lru[DEVICE][slot]
        src = self._view(slot)
        self._after(self.writes.pending(slot))  # (a put's write into them may be queued on another stream)
        self.arenas[HOST][at:at + rows].copy_(src, non_blocking=True)
        self.writes.note((slot,))  # the copy reads the device rows: they are free after it
        self.free[DEVICE].give(self.ats[slot], rows, self.reads.take(slot) + self.writes.take(slot))
        self.writes.note((slot,))  # and writes the host rows: they are freed after it too
        if self.reads.cuda:  # and a staging on another stream reads them after it
            stream = torch.cuda.current_stream(self.device)
            self._written[slot] = (stream.record_event(), stream.cuda_stream)
        self.tiers[slot], self.ats[slot] = HOST, at
        self.quads[slot] = _QUAD.pack(self.bases[HOST] + at * self.row_bytes, self.width, 0, self.width)
        self.lru[HOST][slot] = None

    def _drop(self, slot: int) -> None:
        tier = self.tiers[slot]
        del self.lru[tier][slot]
        self.free[tier].give(self.ats[slot], self.lens[slot], self.reads.take(slot) + self.writes.take(slot))
        self._written.pop(slot, None)
        self._held.pop(slot, None)
        del self._slot_of[self.keys[slot]]
        self.keys[slot], self.tiers[slot], self.lens[slot], self.handles[slot] = None, _FREE, 0, None
        self.gens[slot] += 1
        self._spare.append(slot)
