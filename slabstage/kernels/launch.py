"""The one staging path: check a batch, write its parameter block, launch the kernel over it.

A :class:`Stager` serves one set of destinations (:class:`~slabstage.kernels.destinations.Destinations`):
the runner's buffers, a ``stage_token_inputs`` call's buffers, a ``stage_embeddings``
call's slab. :meth:`Stager.prepare` checks a batch (nothing is written when that
raises) and writes its parameter block into the next slot of the pinned ring
(:class:`~slabstage.kernels.block.BlockWriter`).
Then either :meth:`Stager.launch` moves the block into the stager's device block
and queues the staging kernel, or a graph recorded by :meth:`Stager.record` is
replayed: it begins with the fetch kernel, which copies the block itself, so a
replayed step costs the host no copy call. On a CPU device without Triton's
interpreter the PyTorch reference stages the checked batch instead.
"""

from __future__ import annotations

import struct
import threading
from ctypes import c_char

import numpy as np
import torch

from ..staging.registry import slot_signature
from ..staging.slots import REQUESTS, SLOTS, SOURCE_SLOTS
from .block import MAX_ITEM_WORDS, BlockWriter
from .destinations import Destinations
from .params import DEST_WORDS, HEADER_WORDS, INT_CODE, SOURCE_WORDS, PinnedRing
from .reference import stage_reference
from .runtime import launch_lock, next_pow2, use_triton
from .stage_kernel import FETCH_CHUNK, TOK_BLOCK, fetch_kernel, launch_settings, stage_kernel
from .configuration import DEFAULTS
from .validate import Checked, check_batch

__all__ = ["Stager", "Inputs", "MAX_ITEM_WORDS", "stage_batch", "capture_stream"]

_SHARED: dict = {}  # destinations' layout -> the Stager the ops share
_LOCK = threading.Lock()
_LAST_SLAB: list = [None]  # (slab, errors, layout, Destinations, Stager) of the last stage_embeddings call
_REQUIRED = ("input_ids", "positions", "num_tokens_non_padded")
_MAX_GRAPHS = 64  # graphs a stager keeps for the ops' calls (an engine stages into a few destinations)
_STREAMS: dict = {}  # (device, who) -> the side stream its captures run on


def capture_stream(device: torch.device, who: str) -> torch.cuda.Stream:
    """The side stream ``who`` (``"runner"``, ``"ops"``: apart, so that two threads never capture on one)
    captures on, one per device: cuBLAS keeps a workspace per stream it has run on (32 MiB on Hopper), so a
    fresh stream per capture would cost one more each time."""
    stream = _STREAMS.get((device, who))
    if stream is None:
        stream = _STREAMS[device, who] = torch.cuda.Stream(device)
    return stream


def _layout(slab, errors):
    """What a slab's and an error word's checks depend on, or None for anything but two tensors."""
    if type(slab) is not torch.Tensor or type(errors) is not torch.Tensor:
        return None
    return slot_signature(slab), slot_signature(errors)


class Stager(BlockWriter):
    """Stages batches into ``dst`` through the one kernel; see the module docstring.

    The piece of a slab row one program writes comes from the slab's width and dtype
    (one helper, :func:`launch_settings`). Launches of one stager are ordered on the
    stream that queues them, as every write of its destinations is.
    """

    def __init__(self, dst: Destinations) -> None:
        device, slab = dst.device, dst.slab
        self.triton = use_triton(device)
        self.num_slots = len(SLOTS) if any(t is not None for t in dst.slots) else 0
        req = max([t.shape[0] for spec, t in zip(SLOTS, dst.slots) if t is not None and spec.kind == REQUESTS],
                  default=1)
        self.constexprs, self.num_warps = launch_settings(None if slab is None else slab.shape[1],
                                                          None if slab is None else slab.element_size(),
                                                          self.num_slots, req)
        self.block, self.cols = self.constexprs["BLOCK"], self.constexprs["COL_BLOCKS"]
        self.width = 0 if slab is None else slab.shape[1]  # (the slab's width: every slab a stager serves has it)
        self._items_at = HEADER_WORDS + (SOURCE_WORDS + DEST_WORDS) * self.num_slots
        # words of host integer inputs in a block (dst.host: they travel in it): per token, and fixed
        self._host_per_token = sum(spec.rows for spec, t in zip(SOURCE_SLOTS, dst.slots) if t is not None
                                   and spec.kind != REQUESTS) + 1 if dst.host else 0  # (+1: media_index)
        self._host_fixed = 2 * len(SLOTS) + 2 * dst.batch_cap if dst.host else 0  # requests, 16-byte alignment
        words = self.words_for(dst.capacity)
        self.ring = PinnedRing(8 * words, pinned=device.type == "cuda", k=8 if device.type == "cuda" else 1)
        with torch.inference_mode(False):  # normal tensors, usable in and outside inference mode
            self.params = torch.zeros(self.ring.slot_words, dtype=torch.int64, device=device)
            self.counter = torch.zeros(4, dtype=torch.int64, device=device)  # [0]: last step staged; [2]: spare
        self._base = self.params.data_ptr()
        self._counter_addr, self._spare_addr = self.counter.data_ptr(), self.counter.data_ptr() + 16
        self._mv = memoryview((c_char * (8 * self.ring.words.size)).from_address(self.ring.base)).cast("B")
        self._dynamic = struct.Struct(f"<{HEADER_WORDS + SOURCE_WORDS * self.num_slots}q")  # what a batch writes
        self._copies: dict = {}  # (slot, words) -> (ring view, device view)
        self.configs: dict = {}  # the configurations check_batch has passed for these destinations
        self._kept: list = []  # (host block, device block) of launches captured in a caller's graph
        self._graphs: dict = {}  # (slab, error word, rows) -> launches so far, then a graph of them (ops' calls)
        self._fetch_loaded = False
        self._now = self.params  # the device block the next launch reads
        self._pending = (0, 0, 0)  # (step, slot offset, words) of the last prepared block
        self._reads = None  # (EncoderCache, slots) the prepared batch's media reads, if cache entries
        self.lock = threading.Lock()
        self.dst = None
        self._bind(dst)

    def words_for(self, tokens: int) -> int:
        """The most words a block of a batch of ``tokens`` tokens takes."""
        return self._items_at + MAX_ITEM_WORDS + self._host_per_token * tokens + self._host_fixed

    # -- a batch ------------------------------------------------------------------------------
    def prepare(self, src, pad_to, *, own_block: bool = False) -> Checked:
        """Check ``src`` and write its parameter block into the ring (on the reference path: nothing but the
        check). Raises before anything is written. ``own_block``: a block of its own, kept for good (a caller
        capturing the launch in its own graph: each replay copies this block again)."""
        c = check_batch(self.dst, src, pad_to, self.configs)
        reads = c.media.entries if c.media is not None else None
        if reads is not None and own_block:
            raise ValueError("media of EncoderCache entries cannot be staged inside a graph the caller captures "
                             "(its replays would read entries the cache may have evicted): stage tensors there")
        if self.triton:
            self._write(c, own_block)
        self._reads = reads
        return c

    def _note_reads(self) -> None:
        """The launch or replay just queued reads the prepared batch's cache entries: tell their cache."""
        reads, self._reads = self._reads, None
        if reads is not None:
            reads[0].reads.note(reads[1])

    def launch(self, c: Checked, pad_to: int) -> None:
        """Move the prepared block into the device block and queue the kernel for ``pad_to`` rows; on the
        reference path stage ``c`` in PyTorch."""
        if not self.triton:
            stage_reference(self.dst, c)
            return
        grid = self._grid(pad_to)
        if not grid:
            return
        step, at, words = self._pending
        if self._now is not self.params:  # a block of its own: its copy was queued with it
            self._kernel(grid, self._now)
            return
        if self.dst.device.type == "cuda":
            size = min(max(1024, next_pow2(words)), self.ring.slot_words)
            pair = self._copies.get((at, size))
            if pair is None:
                pair = self._copies[(at, size)] = (self.ring.tensor[at:at + size], self.params[:size])
            pair[1].copy_(pair[0], non_blocking=True)
        else:
            self._fetch(-(-words // FETCH_CHUNK))
        self._kernel(grid, self.params)
        self.ring.commit(step)
        self._note_reads()

    def record(self, pad_to: int) -> None:
        """Queue, or record into the graph being captured, the fetch of the next prepared block and the kernel
        over it for ``pad_to`` rows. A replay of that graph stages whatever :meth:`prepare` wrote last; call
        :meth:`replayed` after it."""
        self._fetch(-(-self.words_for(pad_to) // FETCH_CHUNK))
        self._kernel(max(self._grid(pad_to), 1), self.params)

    def replayed(self) -> None:
        """A graph made by :meth:`record` staged the last prepared block."""
        self.ring.commit(self._pending[0])
        self._note_reads()

    def _grid(self, pad_to: int) -> int:
        grid = pad_to * self.cols if self.dst.slab is not None else -(-pad_to // TOK_BLOCK)
        return max(grid, 1) if self.num_slots else grid  # program 0 writes the token count, the requests

    def _kernel(self, grid: int, params: torch.Tensor) -> None:
        dst = self.dst
        slab = dst.slab if dst.slab is not None else dst.errors
        with launch_lock(dst.device):
            stage_kernel[(grid,)](params, dst.errors, slab, **self.constexprs, num_warps=self.num_warps)

    def _fetch(self, grid: int) -> None:
        args = (self.ring.tensor, self.counter, self.params, self.ring.slot_words, self.ring.k)
        with launch_lock(self.dst.device):
            fetch_kernel[(grid,)](*args, CHUNK=FETCH_CHUNK, num_warps=4)

    # -- destinations --------------------------------------------------------------------------
    def _bind(self, dst: Destinations) -> None:
        """Stage into ``dst`` from now on: the destinations' half of every block, written into every slot."""
        if dst is self.dst:
            return
        self.dst = dst
        dest = np.zeros(DEST_WORDS * self.num_slots, dtype=np.int64)
        for s, (spec, t, fill) in enumerate(zip(SLOTS[:self.num_slots], dst.slots, dst.fills)):
            if t is not None:
                dest[DEST_WORDS * s:DEST_WORDS * (s + 1)] = (
                    t.data_ptr(), INT_CODE[t.dtype], t.stride(0) if t.dim() == 2 else 0, int(fill or 0),
                    fill is not None, spec.kind, spec.rows, t.shape[-1])
        at = HEADER_WORDS + SOURCE_WORDS * self.num_slots
        for k in range(self.ring.k):  # (a slot a queued copy still reads is rewritten with what it holds)
            start = k * self.ring.slot_words + at
            if not np.array_equal(self.ring.words[start:start + dest.size], dest):
                self.ring.words[start:start + dest.size] = dest
        self._dest = dest

    def stage_into(self, dst: Destinations, src, pad_to) -> Checked:
        """:meth:`stage` into ``dst``, destinations laid out like this stager's (a shared stager)."""
        with self.lock:
            self._bind(dst)
            cuda = dst.device.type == "cuda"
            own = cuda and torch.cuda.is_current_stream_capturing()
            c = self.prepare(src, pad_to, own_block=own)
            if cuda and not own and self._grid(c.pad_to):
                self._replay_or_launch(c)
            else:
                self.launch(c, c.pad_to)
            return c

    def _replay_or_launch(self, c: Checked) -> None:
        """Stage the prepared block ``c`` through this stager's graph of the fetch and the kernel for these
        destinations and ``c.pad_to``'s power-of-two bucket of rows (the block says ``pad_to``: programs past
        it write nothing): a replay costs the host a fraction of the block's copy and a Triton launch. The
        first two calls of a bucket :meth:`launch`; the second then captures the graph (no host sync)."""
        dst = self.dst
        rows = min(next_pow2(c.pad_to), dst.capacity)
        key = (0 if dst.slab is None else dst.slab.data_ptr(), dst.errors.data_ptr(), rows)
        entry = self._graphs.get(key, 0)  # the bucket's launches so far, or its graph
        if not isinstance(entry, int):
            entry.replay()
            self.replayed()
            return
        self.launch(c, c.pad_to)
        if not entry and len(self._graphs) >= _MAX_GRAPHS:
            self._graphs.clear()
        graph = self._capture(rows) if entry == 1 else None  # (a destination staged once is never captured)
        self._graphs[key] = graph if graph is not None else entry + 1

    def _capture(self, rows: int):
        """A graph of :meth:`record` for ``rows`` rows, captured on a side stream; None if capture fails."""
        device = self.dst.device
        stream, current = capture_stream(device, "ops"), torch.cuda.current_stream(device)
        if not self._fetch_loaded:  # (its module loads outside the capture; the block it copies goes unused)
            self._fetch(1)
            self._fetch_loaded = True
        stream.wait_stream(current)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.stream(stream):
                graph.capture_begin(capture_error_mode="thread_local")
                try:
                    self.record(rows)
                finally:
                    graph.capture_end()
        except RuntimeError:  # (the launch path serves the bucket)
            return None
        current.wait_stream(stream)
        return graph

    @classmethod
    def shared(cls, dst: Destinations) -> "Stager":
        """The stager the ops share for destinations laid out like ``dst`` (device, slab dtype and width, which
        slots and their dtypes): its ring, device block and checked configurations."""
        slab = dst.slab
        key = (dst.device, dst.host_ok, dst.capacity, dst.batch_cap,
               None if slab is None else (slab.dtype, slab.shape[1]),
               tuple(None if t is None else (t.dtype, t.dim()) for t in dst.slots))
        st = _SHARED.get(key)
        if st is None:
            with _LOCK:
                st = _SHARED.get(key) or cls(dst)
                _SHARED[key] = st
        return st

    @classmethod
    def for_slab(cls, slab, errors) -> tuple[Destinations, "Stager"]:
        """The checked destinations of a ``stage_embeddings`` call into ``slab`` and the stager they share.

        The last call's are kept (nothing a stager does not already hold) and reused while ``slab`` and
        ``errors`` are the same objects with the same storage, shape, strides, dtype and device: what
        :class:`Destinations` checks is a function of those alone."""
        layout = _layout(slab, errors)
        last = _LAST_SLAB[0]
        if layout is not None and last is not None and last[0] is slab and last[1] is errors and last[2] == layout:
            return last[3], last[4]
        dst = Destinations(slab=slab, errors=errors, host_ok=False)
        st = cls.shared(dst)
        if layout is not None:
            _LAST_SLAB[0] = (slab, errors, layout, dst, st)
        return dst, st

    @classmethod
    def for_buffers(cls, buffers, embed: bool) -> "Stager":
        """The stager of ``buffers`` (with the slab when ``embed``), made again when a slot or the error word
        changed since it was made."""
        reg, errors = buffers.registry, buffers.errors
        kept = buffers._stagers.get(embed)
        if kept is not None and kept[2] is errors and kept[3] == errors.data_ptr() and reg.matches(kept[1]):
            return kept[0]
        missing = [name for name in _REQUIRED if name not in reg]
        if missing:
            raise ValueError(f"the buffers have no {missing[0]!r} slot")
        slots = [reg[spec.name] if spec.name in reg else None for spec in SLOTS]
        fills = [reg.slot(spec.name).fill_value if spec.name in reg else None for spec in SLOTS]
        dst = Destinations(slab=reg["input_embeds"] if embed else None, slots=slots, fills=fills, errors=errors,
                           host_ok=True, device=buffers.device, batch_cap=buffers.max_batch_size)
        st = cls(dst)
        buffers._stagers[embed] = (st, reg.signature(), errors, errors.data_ptr())
        return st

class Inputs:
    """A batch as keyword arguments, named as :class:`~slabstage.PrefillBatch` names its fields (a field not
    given takes PrefillBatch's default)."""

    def __init__(self, **fields) -> None:
        self.__dict__.update(fields)


for _name, _default in DEFAULTS.items():  # (class attributes: what a field not given reads)
    setattr(Inputs, _name, _default)


def stage_batch(buffers, *, pad_to, **inputs) -> None:
    """A whole batch (integer slots and embeddings, ``PrefillBatch``'s fields as keywords) into ``buffers`` in one
    launch: what the runner stages, outside it (for tests and tools)."""
    st = Stager.for_buffers(buffers, embed=True)
    st.stage_into(st.dst, Inputs(**inputs), pad_to)
