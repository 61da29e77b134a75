"""The one staging path: check a batch, write its parameter record, launch the kernel over it.

A :class:`Stager` serves one set of destinations and owns what it stages through (its pinned ring, device
parameter records and checked configurations); see docs/design.md, "One kernel, one parameter record".
:meth:`Stager.prepare` checks a batch (nothing is written when that raises) and writes its parameter record into
the next ring slot; :meth:`Stager.launch` copies it into the device record and queues the kernel, or
:meth:`Stager.replay` copies it into the graphs' device record on a side stream and replays a graph made with
:meth:`Stager.record`. On a CPU device without Triton's
interpreter the PyTorch reference stages the checked batch instead. Launches of one stager are totally ordered,
whatever their streams (:meth:`Stager._order`).
"""

from __future__ import annotations

import struct
import threading
import weakref
from ctypes import c_char, memmove

import numpy as np
import torch

from ..kernels.layout import (DEST_WORDS, F_MEDIA, F_MEDIA_TILED, F_MEDIA_VEC, F_MEDIA_WRAP, F_SCALE, F_TEXT_TILED,
                              F_TEXT_VEC, F_TEXT_WRAP, FLOAT_CODE, H_B, H_DONE, H_FLAGS, H_IDS, H_IDS_DTYPE, H_INDEX,
                              H_INDEX_DTYPE, H_ITEMS, H_LIVE, H_N, H_NUM_MEDIA, H_PAD_TO, H_SCALE, H_STEP, H_TABLE,
                              H_TABLE_DTYPE, H_TABLE_STRIDE, H_TABLE_WIDTH, H_TICKET, H_VOCAB_START, H_WORDS,
                              HEADER_WORDS, INT_CODE, LAYOUT_CODE, MAX_ITEM_WORDS, REQUESTS, ROWS, S_ADDR, S_DTYPE,
                              S_STRIDE, SEGMENT_WORDS, SOURCE_WORDS)
from ..kernels.runtime import next_pow2
from ..kernels.stage_kernel import grid_size, launch_settings, stage_kernel
from . import driver
from .destinations import Destinations
from .launch import DirectLaunch, launch_context, use_pdl, use_triton
from .mrope import float_word
from .reference import stage_reference
from .ring import PinnedRing
from .slots import NEEDED_SLOTS, SLOTS, SOURCE_SLOTS
from .validate import ELEM, LAYOUT_SLOT, Checked, Config, Inputs, check_batch

__all__ = ["Stager", "Inputs", "MAX_ITEM_WORDS", "stage_batch", "capture_stream", "live_stagers"]

_STREAMS: dict = {}  # (device, use) -> a side stream (capture_stream)
_LIVE: "weakref.WeakSet" = weakref.WeakSet()  # every stager not yet collected
_RETIRED: list = []  # [event or None, stream, held]: what a collected stager held, until its device work ends
_RETIRED_LOCK = threading.Lock()
_CAPTURED: list = []  # what collected stagers held whose launches a caller's graph captured (replays read it)
try:  # the current stream's handle, as an int (cheaper than a Stream object)
    from torch._C import _cuda_getCurrentRawStream as _raw_stream
except ImportError:  # pragma: no cover - a torch without CUDA
    _raw_stream = None


def capture_stream(device: torch.device, use: str = "capture") -> torch.cuda.Stream:
    """A side stream of ``device``, one per use: ``"capture"``, the one the runner captures on (cuBLAS keeps a
    workspace per stream it has run on, 32 MiB on Hopper, so a fresh stream per capture would cost one more each
    time); ``"branch"``, a graph's branch beside its forward (used while capturing only)."""
    stream = _STREAMS.get((device, use))
    if stream is None:
        stream = _STREAMS[(device, use)] = torch.cuda.Stream(device)
    return stream


def live_stagers() -> int:
    """Stagers alive, and collected ones whose pinned ring and device parameter record still wait for device work."""
    _sweep()
    return len(_LIVE) + len(_RETIRED)


def _sweep() -> None:
    """Free what collected stagers held once the work they queued has finished (an event query, no host
    sync). Nothing is done while the current stream captures a graph (a query there would break the capture)."""
    if not _RETIRED or _capturing_now():
        return
    if not _RETIRED_LOCK.acquire(blocking=False):  # (a sweep under way: on another thread, or this one when the
        return  # collector ran a stager's finalizer inside it)
    try:
        n = len(_RETIRED)
        keep = []
        for entry in _RETIRED[:n]:
            if entry[0] is None:  # (collected while a graph was being captured: recorded now)
                entry[0] = torch.cuda.Event()
                entry[0].record(entry[1])
            if not entry[0].query():
                keep.append(entry)
        _RETIRED[:n] = keep  # (entries a finalizer appended meanwhile stay)
    finally:
        _RETIRED_LOCK.release()


def _capturing_now() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


def _retire(held: tuple, where: list) -> None:
    """A stager was collected: keep ``held`` (its ring, device parameter records, kept ones, events) until the device
    work it queued on its last stream (``where[1]``) has finished; for good if a caller's graph captured one
    of its launches (a replay reads that launch's parameter record and reports into the ring's spare words)."""
    stream = where[1]
    if held[3]:
        _CAPTURED.append(held)
    elif stream is not None:
        _RETIRED.append([None, stream, held])  # (no lock: the collector may run this inside a sweep)
    _sweep()


class Stager:
    """Stages batches into ``dst`` through the one kernel (see the module docstring); the piece of a slab row one
    program writes comes from the slab's width and dtype (:func:`launch_settings`)."""

    def __init__(self, dst: Destinations, where: list | None = None) -> None:
        """``where``: the ``[raw handle, Stream]`` of the last launch into these destinations, shared with the
        other stagers that write them (a buffers' two stagers; a slab's stager and the one made after it was
        let go), so that a launch on another stream waits for theirs too."""
        _sweep()
        device, slab = dst.device, dst.slab
        self.triton = use_triton(device)
        self.num_slots = len(SLOTS) if any(t is not None for t in dst.slots) else 0
        req = max([t.shape[0] for spec, t in zip(SLOTS, dst.slots) if t is not None and spec.kind == REQUESTS],
                  default=1)
        self.constexprs, self.num_warps = launch_settings(None if slab is None else slab.shape[1],
                                                          None if slab is None else slab.element_size(),
                                                          self.num_slots, req)
        self.pdl = self.constexprs["PDL"] = bool(self.triton and use_pdl(device))
        pdl = {"launch_pdl": True} if self.pdl else {}  # (a launch option older Tritons do not know)
        self._launch = DirectLaunch(stage_kernel, self.constexprs, num_warps=self.num_warps, **pdl) \
            if self.triton else None
        self.program_cols, self.row_programs = self.constexprs["BLOCK"], self.constexprs["ROW_PROGRAMS"]
        self.width = 0 if slab is None else slab.shape[1]  # (the slab's width: every slab a stager serves has it)
        self._items_at = HEADER_WORDS + (SOURCE_WORDS + DEST_WORDS) * self.num_slots
        # words of host integer inputs in a parameter record (dst.host: they travel in it): per token, and fixed
        self._host_per_token = sum(spec.rows for spec, t in zip(SOURCE_SLOTS, dst.slots) if t is not None
                                   and spec.kind != REQUESTS) + 1 if dst.host else 0  # (+1: media_index)
        self._host_fixed = 2 * len(SLOTS) + 2 * dst.batch_cap if dst.host else 0  # requests, 16-byte alignment
        self._allocate(device, self.words_for(dst.capacity))
        self._dynamic = struct.Struct(f"<{HEADER_WORDS + SOURCE_WORDS * self.num_slots}q")  # what a batch writes
        self._copies: dict = {}  # (slot, words) -> (ring view, device view)
        self.configs: dict = {}  # the configurations check_batch has passed for these destinations
        self._kept: list = []  # (host, device) parameter records of launches captured in a caller's graph
        self._now = self.params  # the device parameter record the next launch reads
        self._pending = (0, 0, 0, False)  # (step, slot offset, words, for a replay) of the last prepared record
        self._events = None  # (read, copied): driver events of the graphs' record (made by the first record())
        self._reads = None  # (EncoderCache, slots) the prepared batch's media reads, if cache entries
        self.lock = threading.Lock()
        self.dst = dst
        self._where = [None, None] if where is None else where  # (raw handle, Stream) of the last launch
        self._index = device.index if device.index is not None or device.type != "cuda" else torch.cuda.current_device()
        self._dest = self._dest_words(dst)
        at = HEADER_WORDS + SOURCE_WORDS * self.num_slots
        for k in range(self.ring.k):  # the destinations' half of every parameter record: written once, never again
            start = k * self.ring.slot_words + at
            self.ring.words[start:start + self._dest.size] = self._dest
        _LIVE.add(self)
        if device.type == "cuda":  # (what the device may still read or write outlives the stager a while)
            done = weakref.finalize(self, _retire, (self.ring, self.params, self.graph_params, self._kept,
                                                    self._held_events), self._where)
            done.atexit = False  # (at exit the process frees it all)

    def _allocate(self, device: torch.device, words: int) -> None:
        """The pinned ring of parameter records of ``words`` words, the device records (launches', graphs'), their
        addresses."""
        self.ring = PinnedRing(8 * words, pinned=device.type == "cuda", k=8 if device.type == "cuda" else 1)
        with torch.inference_mode(False):  # normal tensors, usable in and outside inference mode
            self.params = torch.zeros(self.ring.slot_words, dtype=torch.int64, device=device)
            self.graph_params = torch.zeros(self.ring.slot_words + 8, dtype=torch.int64, device=device)  # (+ ticket)
        self._base, self._graph_base = self.params.data_ptr(), self.graph_params.data_ptr()
        self._ticket = self._graph_base + 8 * self.ring.slot_words  # (H_TICKET of a replay's record)
        self._held_events = []  # (the graphs' events, freed with what the device may still use)
        self._mv = memoryview((c_char * (8 * self.ring.words.size)).from_address(self.ring.base)).cast("B")

    def words_for(self, tokens: int) -> int:
        """The most words a parameter record of a batch of ``tokens`` tokens takes."""
        return self._items_at + MAX_ITEM_WORDS + self._host_per_token * tokens + self._host_fixed

    def _dest_words(self, dst: Destinations) -> np.ndarray:
        """The destinations' half of a parameter record: per slot its address, dtype, stride, pad value and shape."""
        dest = np.zeros(DEST_WORDS * self.num_slots, dtype=np.int64)
        for s, (spec, t, fill) in enumerate(zip(SLOTS[:self.num_slots], dst.slots, dst.fills)):
            if t is not None:
                dest[DEST_WORDS * s:DEST_WORDS * (s + 1)] = (
                    t.data_ptr(), INT_CODE[t.dtype], t.stride(0) if t.dim() == 2 else 0, int(fill or 0),
                    fill is not None, spec.kind, spec.rows, t.shape[-1])
        return dest

    # -- a parameter record -----------------------------------------------------------------------
    def _template(self, config: Config, c: Checked) -> tuple:
        """``(words, sources read in place, sources copied into the parameter record)``: the words that
        ``config`` fixes, and where each integer source's words go (``(read position, word, is rows)``;
        ``(read position, word, element bytes)``)."""
        values = [0] * (HEADER_WORDS + SOURCE_WORDS * self.num_slots)
        values[H_DONE], values[H_LIVE] = self.ring.done_addr, 1
        dtypes, shapes = c.reads[1], c.reads[3]
        in_place, in_record = [], []
        for at, k, kind, _, _, elem, host in config.sources:
            w = HEADER_WORDS + SOURCE_WORDS * k
            values[w + S_DTYPE] = INT_CODE[dtypes[at]]
            (in_record if host else in_place).append((at, w, elem) if host else (at, w, kind == ROWS))
        if self.dst.slab is not None:
            width, tw = self.width, shapes[config.table][1]
            flags = F_SCALE if c.scale is not None else 0
            if tw < width and c.expand == "repeat":
                flags |= F_TEXT_TILED if tw % self.program_cols == 0 else F_TEXT_WRAP
            values[H_FLAGS], values[H_ITEMS] = flags, self._items_at
            values[H_TABLE_WIDTH], values[H_TABLE_DTYPE] = tw, FLOAT_CODE[dtypes[config.table]]
            values[H_IDS_DTYPE] = INT_CODE[dtypes[0]]
            if config.index is not None:
                values[H_INDEX_DTYPE] = INT_CODE[dtypes[config.index]]
        config.template = values, tuple(in_place), tuple(in_record)
        return config.template

    def _write(self, c: Checked, own_params: bool, replay: bool) -> None:
        config, plan, segments = c.config, c.media, c.segments
        item_words = 0 if plan is None else len(plan.starts) + plan.field_words
        seg_words = 0 if segments is None else len(segments)  # (their room was checked with the batch)
        base = self._graph_base if replay else self._base  # (host inputs in the record: read where it is copied)
        if own_params:  # a device parameter record of its own (in the capturing graph's pool), kept with its host one
            with torch.inference_mode(False):
                own = torch.zeros(self.words_for(c.n), dtype=torch.int64, device=self.dst.device)
            base = own.data_ptr()
        template, in_place, in_record = config.template or self._template(config, c)
        values = template.copy()
        end = 8 * (self._items_at + item_words + seg_words)  # bytes: host inputs follow the item and segment lists
        parts = []  # (byte offset in the record, address, bytes per row, rows, row stride in bytes)
        _, dtypes, _, shapes, strides, ptrs = c.reads
        for at, w, rows in in_place:
            values[w + S_ADDR] = ptrs[at]
            if rows:
                values[w + S_STRIDE] = strides[at][0]
        for at, w, elem in in_record:
            addr, stride, end = _into_record(shapes[at], strides[at], ptrs[at], elem, parts, base, end)
            values[w + S_ADDR], values[w + S_STRIDE] = addr, stride
        if seg_words:  # the mrope slot's source: the segment list after the item list
            w = HEADER_WORDS + SOURCE_WORDS * LAYOUT_SLOT
            values[w + S_ADDR] = base + 8 * (self._items_at + item_words)
            values[w + S_DTYPE], values[w + S_STRIDE] = LAYOUT_CODE, seg_words // SEGMENT_WORDS  # (the count)
        if self.dst.slab is not None:
            end = self._embed_header(values, c, parts, base, end)
        words = -(-end // 8)
        if replay:
            values[H_TICKET] = self._ticket
        if own_params:
            step, at = 0, 0
            values[H_DONE] = self.ring.spare_done_addr
            record, mv, start = self._own_host_record(words, own)
        else:
            step, at = self.ring.take()
            mv, start = self._mv, self.ring.base + 8 * at
        values[H_STEP], values[H_WORDS], values[H_N], values[H_B], values[H_PAD_TO] = step, words, c.n, c.b, c.pad_to
        self._dynamic.pack_into(mv, 8 * at, *values)
        if plan is not None:
            o, fields = 8 * (at + self._items_at), plan.fields
            if type(fields) is bytes:  # (cache entries: their fields packed already)
                _words(len(plan.starts)).pack_into(mv, o, *plan.starts)
                o += 8 * len(plan.starts)
                mv[o:o + len(fields)] = fields
            else:
                _words(item_words).pack_into(mv, o, *plan.starts, *fields)
        if seg_words:
            _words(seg_words).pack_into(mv, 8 * (at + self._items_at + item_words), *segments)
        for off, addr, row, rows, stride in parts:  # host inputs, row by row (mrope rows may lie apart)
            for r in range(rows):
                memmove(start + off + r * row, addr + r * stride, row)
        if own_params:
            own[:words].copy_(record, non_blocking=True)
            self._now = own
        else:
            self._now = self.params
            self._pending = (step, at, words, replay)

    def _own_host_record(self, words: int, own: torch.Tensor) -> tuple:
        """``(record, its bytes, its address)``: a pinned host parameter record of ``words`` words, the destinations'
        half written, kept for good with ``own``, the device record it is copied into."""
        record = torch.zeros(words, dtype=torch.int64, device="cpu", pin_memory=True)
        self._kept.append((record, own))
        record.numpy()[HEADER_WORDS + SOURCE_WORDS * self.num_slots:self._items_at] = self._dest
        return record, memoryview((c_char * (8 * words)).from_address(record.data_ptr())).cast("B"), record.data_ptr()

    def _embed_header(self, values: list, c: Checked, parts: list, base: int, end: int) -> int:
        config, plan = c.config, c.media
        _, dtypes, _, shapes, strides, ptrs = c.reads
        t = config.table
        tptr, s0, tw = ptrs[t], strides[t][0], shapes[t][1]
        flags = values[H_FLAGS]
        if not (tptr & 15 or (s0 | tw) & 7 or flags & F_TEXT_WRAP):
            flags |= F_TEXT_VEC
        if self.num_slots:  # the embeddings read the ids where the integer half reads them
            ids_addr = values[HEADER_WORDS]
        elif config.host_ids:
            ids_addr, _, end = _into_record(shapes[0], strides[0], ptrs[0], ELEM[dtypes[0]], parts, base, end)
        else:
            ids_addr = ptrs[0]
        i = config.index
        if i is not None:
            if config.host_index:
                values[H_INDEX], _, end = _into_record(shapes[i], strides[i], ptrs[i], ELEM[dtypes[i]], parts, base,
                                                       end)
            else:
                values[H_INDEX] = ptrs[i]
        values[H_VOCAB_START:H_SCALE] = c.bounds
        if c.scale is not None:
            values[H_SCALE] = float_word(c.scale)
        values[H_TABLE], values[H_TABLE_STRIDE], values[H_IDS] = tptr, s0, ids_addr
        if plan is not None:
            if c.media_owner:
                flags |= F_MEDIA
            mw = plan.width
            if mw < self.width and c.expand == "repeat":
                flags |= F_MEDIA_TILED if mw % self.program_cols == 0 else F_MEDIA_WRAP
            if plan.vec and not flags & F_MEDIA_WRAP:
                flags |= F_MEDIA_VEC
            values[H_NUM_MEDIA:H_ITEMS] = (plan.rows, len(plan.starts), plan.column_blocks, FLOAT_CODE[plan.dtype], mw)
        values[H_FLAGS] = flags
        return end

    # -- a batch ------------------------------------------------------------------------------
    def prepare(self, src, pad_to, *, own_params: bool = False, replay: bool = False) -> Checked:
        """Check ``src`` and write its parameter record into the ring (on the reference path: nothing but the
        check). Raises before anything is written. ``own_params``: a parameter record of its own, kept for good (a
        caller capturing the launch in its own graph: each replay copies it again). ``replay``: for
        :meth:`replay` (the graphs' device record), not :meth:`launch`."""
        if replay and own_params:
            raise ValueError("a parameter record of its own is launched, not replayed")
        c = check_batch(self.dst, src, pad_to, self.configs)
        reads = c.media.entries if c.media is not None else None
        if reads is not None and own_params:
            raise ValueError("media of EncoderCache entries cannot be staged inside a graph the caller captures "
                             "(its replays would read entries the cache may have evicted): stage tensors there")
        if self.triton:
            self._write(c, own_params, replay)
        self._reads = reads
        return c

    def _note_reads(self, where=True) -> None:
        """The launch or replay just queued reads the prepared batch's cache entries: tell their cache. ``where``:
        the stream it was queued on (default: the one ``_order`` found, no CUDA call; None: the current one)."""
        reads, self._reads = self._reads, None
        if reads is not None:
            reads[0].reads.note(reads[1], stream=self._where if where is True else where)

    def launch(self, c: Checked, pad_to: int) -> None:
        """Move the prepared parameter record into the device one and queue the kernel for ``pad_to`` rows; on the
        reference path stage ``c`` in PyTorch."""
        if not self.triton:
            stage_reference(self.dst, c)  # (queued on the current stream: on CUDA without Triton, it reads entries)
            self._note_reads(None)
            return
        grid = self._grid(pad_to)
        if not grid:
            return
        step, at, words, replay = self._pending
        if self._now is not self.params:  # a parameter record of its own: its copy was queued with it
            self._kernel(grid, self._now)
            return
        if replay:
            raise RuntimeError("Stager.launch(): the prepared parameter record is a replay's (prepare(replay=True))")
        size = min(max(1024, next_pow2(words)), self.ring.slot_words)
        pair = self._copies.get((at, size))
        if pair is None:
            pair = self._copies[(at, size)] = (self.ring.tensor[at:at + size], self.params[:size])
        if self.dst.device.type == "cuda":
            self._order()
        pair[1].copy_(pair[0], non_blocking=True)
        self._kernel(grid, self.params)
        self.ring.commit(step)
        self._note_reads()

    def record(self, pad_to: int) -> None:
        """Record into the graph being captured the kernel over the graphs' device parameter record for ``pad_to``
        rows, then, on a branch beside what the caller records next, an event the next replay's copy waits for
        (the kernel's last program has cleared the record's ``H_LIVE`` word by then). Call :meth:`end_record`
        before the capture ends (it joins the branch). A replay of the graph stages the record :meth:`prepare`
        wrote for it (replay it with :meth:`replay`); a replay with none copied in (a second one, a bare
        ``graph.replay()``) writes nothing."""
        if self._events is None:
            self._events = (driver.Event(self._index), driver.Event(self._index))
            self._held_events.extend(self._events)
            # (a copy stream for each stager, from torch's pool, which hands its 32 streams out in turn: one side
            # stream for the device would make one runner's copy wait for another's graphs)
            self._copy_stream = torch.cuda.Stream(self.dst.device)
            self._copy_raw = self._copy_stream.cuda_stream
        self._kernel(max(self._grid(pad_to), 1), self.graph_params)
        branch = capture_stream(self.dst.device, "branch")
        branch.wait_stream(torch.cuda.current_stream(self._index))
        r = driver.calls().record_external(self._events[0].handle, branch.cuda_stream)
        if r:
            driver.fail(r, "recording a graph's branch", self._index)

    def end_record(self) -> None:
        """Join the branch :meth:`record` forked into the stream being captured (before the capture ends)."""
        torch.cuda.current_stream(self._index).wait_stream(capture_stream(self.dst.device, "branch"))

    def replay(self, graph) -> None:
        """Replay ``graph`` (made with :meth:`record`) on the current stream over the parameter record prepared for
        it (``prepare(replay=True)``), ordered after every earlier launch of this stager. The record is copied into
        the graphs' device record on a side stream once the last graph's kernel has read it (the previous step's
        forward may still run), and the replay waits for the copy: four driver calls, no kernel."""
        step, at, words, replay = self._pending
        if not replay:
            raise RuntimeError("Stager.replay(): prepare the batch with replay=True")
        self._order()
        read, copied = self._events
        copy, lib = self._copy_raw, driver.calls()
        for retry in (False, True):  # (a retry once this thread has a current context: driver.fail)
            r = (lib.wait(copy, read.handle) | lib.copy_in(self._graph_base, self.ring.base + 8 * at, 8 * words, copy)
                 | lib.record(copied.handle, copy) | lib.wait(self._where[0], copied.handle))
            if not r or not driver.fail(r, "copying a replay's parameter record", self._index, retry):
                break
        graph.replay()
        self.ring.commit(step)
        self._pending = (0, 0, 0, False)  # (a second replay() needs a record of its own)
        self._note_reads()

    def _order(self) -> None:
        """Launches of this stager on one stream are ordered by it; a launch on another stream than the last
        one's first waits for that stream (no host sync). Not while capturing: a captured launch reads a
        parameter record of its own."""
        where = self._where
        raw = _raw_stream(self._index)
        if raw != where[0]:
            stream = torch.cuda.current_stream(self._index)
            if where[1] is not None:
                stream.wait_stream(where[1])
            where[0], where[1] = raw, stream

    @property
    def stream(self):
        """The stream of this stager's last launch or replay (None before the first on CUDA): what reads the
        sources of that launch, and what a later launch on another stream waits for."""
        return self._where[1]

    def _grid(self, pad_to: int) -> int:
        return grid_size(pad_to, self.num_slots, self.row_programs if self.dst.slab is not None else 0)

    def _kernel(self, grid: int, params: torch.Tensor) -> None:
        dst = self.dst
        slab = dst.slab if dst.slab is not None else dst.errors
        with launch_context(dst.device):
            self._launch(grid, _raw_stream(self._index) if dst.device.type == "cuda" else 0, params, dst.errors, slab)

    # -- one call -------------------------------------------------------------------------------
    def stage(self, src, pad_to) -> Checked:
        """Check and stage one batch: a launch of its own (a parameter record of its own when the current stream is
        capturing a graph)."""
        with self.lock:
            return self._stage(src, pad_to)

    def stage_into(self, dst: Destinations, src, pad_to) -> Checked:
        """:meth:`stage` into ``dst``, then forget it (a stager an op keeps holds no reference to what it
        writes). ``dst``: the destinations this stager was made for, or for a stager of a slab alone, any slab
        of its device, dtype and width (views of one slab share a stager)."""
        with self.lock:
            self.dst = dst
            try:
                return self._stage(src, pad_to)
            finally:
                self.dst = None

    def _stage(self, src, pad_to) -> Checked:
        capturing = self.triton and self.dst.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        c = self.prepare(src, pad_to, own_params=capturing)
        self.launch(c, c.pad_to)
        return c

    @classmethod
    def for_buffers(cls, buffers, embed: bool) -> "Stager":
        """The stager of ``buffers`` (with the slab when ``embed``), made again when a slot or the error word
        changed since it was made."""
        reg, errors = buffers.registry, buffers.errors
        kept = buffers._stagers.get(embed)
        if kept is not None and kept[2] is errors and kept[3] == errors.data_ptr() and reg.matches(kept[1]):
            return kept[0]
        missing = [name for name in NEEDED_SLOTS if name not in reg]
        if missing:
            raise ValueError(f"the buffers have no {missing[0]!r} slot")
        slots, fills = buffers.slots_and_fills()
        dst = Destinations(slab=reg["input_embeds"] if embed else None, slots=slots, fills=fills, errors=errors,
                           host_ok=True, device=buffers.device, batch_cap=buffers.max_batch_size)
        st = cls(dst, buffers._stagers.setdefault("where", [None, None]))  # (one order for both)
        buffers._stagers[embed] = (st, reg.signature(), errors, errors.data_ptr())
        return st


def stage_batch(buffers, *, pad_to, **inputs) -> None:
    """A whole batch (integer slots and embeddings, ``PrefillBatch``'s fields as keywords) into ``buffers`` in one
    launch: what the runner stages, outside it (for tests and tools)."""
    Stager.for_buffers(buffers, embed=True).stage(Inputs(**inputs), pad_to)


_STRUCTS: dict = {}


def _words(count: int) -> struct.Struct:
    """The packer of ``count`` int64 words (one a length: item lists come in few lengths)."""
    packer = _STRUCTS.get(count)
    if packer is None:
        packer = _STRUCTS[count] = struct.Struct(f"<{count}q")
    return packer


def _into_record(shape, stride, ptr: int, elem: int, parts: list, base: int, end: int) -> tuple[int, int, int]:
    """``(device address, row stride, new end)`` of a host integer input copied into the parameter record at byte
    ``end`` (rows end to end, 16-byte aligned)."""
    at = (end + 15) & ~15
    row = shape[-1] * elem
    rows = shape[0] if len(shape) == 2 else 1
    parts.append((at, ptr, row, rows, (stride[0] if len(shape) == 2 else 0) * elem))
    return base + at, shape[-1], at + rows * row
