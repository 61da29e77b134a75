"""PrefillGraphRunner: capture staging and the prefill forward per bucket, and replay them (docs/graphs.md).

Each bucket's graph begins with the staging launch, which reads the batch from the stager's device parameter
record: ``run()`` checks the batch, writes its parameter record and replays.
"""

from __future__ import annotations

import bisect
import logging
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..checks import check_bool, check_choice, check_int, check_real
from ..kernels import runtime
from ..staging.stager import Stager
from ..staging.buffers import StagingBuffers
from .batch import PrefillBatch
from .buckets import default_token_buckets
from .capture import VERIFY, CaptureError, capture_buckets
from .nvtx import nvtx_range, range_pop, range_push
from .outputs import first_rows
from .routes import (ABOVE_LARGEST, CAPTURING, EAGER, ENFORCE_EAGER, NO_CUDA, NOT_CAPTURED, Route, eager_words,
                     routes_by_size)

__all__ = ["PrefillGraphRunner", "CaptureError"]

log = logging.getLogger("slabstage")


class PrefillGraphRunner:
    """Capture staging and ``forward`` around :class:`StagingBuffers` for a ladder of token buckets; replay it.

    ``forward(views)`` takes ``buffers.registry.views(bucket)`` (every slot cut to
    the bucket on its token axis) and returns a tensor, or a tuple/list/dict of
    tensors, whose first axis is the token axis. Rows past the batch hold padding
    (zero embeddings, zero ids and positions); ``forward`` must keep them from
    changing real rows (causal attention within each sequence does). A forward with a
    ``needs`` attribute (names of ``PrefillBatch`` fields: ``prefill_forward(model,
    cache=...)`` names its KV cache's slots) gets only batches that give them.

    Args:
        buckets: token counts to capture (default :func:`default_token_buckets`).
        max_padding_ratio: a batch whose bucket exceeds ``n * max_padding_ratio``
            runs eagerly instead of padding that far.
        enforce_eager: never capture. Without a CUDA device the runner is eager too.
        pool: a graph memory pool (``torch.cuda.graph_pool_handle()``) to capture
            into, shared with the engine's other graphs; default: a private pool.
        after_stage: called with ``pad_to`` after staging, before replay or eager
            forward (the tensor-parallel all-reduce of the slab goes here); the
            graphs then hold the forward alone and staging is launched before them.
        progress: show a progress bar while capturing (tqdm, when installed).
        process_group: under tensor parallelism, the group this rank belongs to;
            the progress bar and the capture log line then appear on rank 0 only.
        verify: after capturing a bucket, replay it on the capture's inputs and compare
            with the eager forward bit for bit, and time both: ``"warn"`` (default) drops
            a bucket whose replay differs or is slower (it runs eagerly from then on)
            and says so once; ``"strict"`` raises :class:`CaptureError`; ``"off"`` skips it.
    """

    def __init__(self, forward: Callable[[dict], Any], buffers: StagingBuffers, *, buckets=None,
                 max_padding_ratio: float = 2.0, enforce_eager: bool = False, pool=None,
                 after_stage: Callable[[int], None] | None = None, progress: bool = True, process_group=None,
                 verify: str = "warn") -> None:
        if not callable(forward):
            raise TypeError(f"forward must be callable, got {type(forward).__name__}")
        if not isinstance(buffers, StagingBuffers):
            raise TypeError(f"buffers must be StagingBuffers, got {type(buffers).__name__}")
        capacity = buffers.registry.capacity
        buckets = default_token_buckets(capacity) if buckets is None else buckets
        if isinstance(buckets, (str, bytes)) or not hasattr(buckets, "__iter__"):
            raise TypeError(f"buckets must be a sequence of token counts (ints), got {buckets!r} "
                            f"({type(buckets).__name__})")
        sizes = sorted({check_int(f"buckets[{i}]", b, lo=1) for i, b in enumerate(buckets)})
        if not sizes:
            raise ValueError(f"buckets must hold at least one token count, got {buckets!r}")
        if sizes[-1] > capacity:
            raise ValueError(f"bucket {sizes[-1]} exceeds the buffers' capacity of {capacity} tokens")
        ratio = check_real("max_padding_ratio", max_padding_ratio, lo=1)
        check_choice("verify", verify, VERIFY)
        self.forward = forward
        self._needs = tuple(getattr(forward, "needs", ()))  # batch fields the forward reads (a cache's slots, say)
        self.buffers = buffers
        self.registry = buffers.registry
        self.buckets = sizes
        self._ratio = ratio
        self.after_stage = after_stage
        self.process_group = process_group
        self.is_rank0 = not (dist.is_available() and dist.is_initialized()) or dist.get_rank(process_group) == 0
        self.progress = progress and self.is_rank0
        self.verify = verify
        self.pool = self._user_pool = pool
        self.enforce_eager = check_bool("enforce_eager", enforce_eager)
        self.eager = self.enforce_eager or buffers.device.type != "cuda"
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, Any]] = {}
        self._dropped: dict[int, str] = {}  # bucket -> why the capture check dropped it
        self._pending: set[int] = set()  # capture(lazy=True): the buckets not captured yet
        self._views: dict[int, Any] = {}  # n -> the first n rows of its bucket's outputs
        self._route: list[Route] = []  # n -> where a batch of n tokens runs
        self._stager = None  # the stager the graphs were captured with
        self._signature = None
        self._said: set = set()  # the fallbacks already logged
        self._clear_stats()  # replays by bucket, eager runs by reason code, padded rows
        self.last_bucket: int | None = None  # bucket of the last run, None when it ran eagerly
        self.last_fallback: str | None = None  # why the last run ran eagerly (None: it replayed)
        self.capture_seconds = 0.0
        self.capture_bytes = 0
        self.checks: dict[int, dict] = {}  # bucket -> what the capture check measured

    @property
    def max_padding_ratio(self) -> float:
        return self._ratio

    @max_padding_ratio.setter
    def max_padding_ratio(self, value: float) -> None:
        self._ratio = check_real("max_padding_ratio", value, lo=1)
        if self._graphs or self._pending:
            self._routes()

    # -- capture ----------------------------------------------------------------------
    @property
    def captured(self) -> bool:
        return bool(self._graphs)

    @property
    def graphs(self) -> dict:
        """bucket -> ``(torch.cuda.CUDAGraph, its static outputs)``; empty before :meth:`capture`. A bare
        ``replay()`` of one (no batch prepared for it by :meth:`run`) stages nothing: its forward runs again on the
        buffers as the last step left them, queued before a :meth:`run` or between two (no sync needed): a run's
        record is copied in once the graph queued before it has read the last one."""
        return dict(self._graphs)

    @property
    def signature(self):
        """The registry signature recorded at capture (checked before every replay), or None."""
        return self._signature

    @property
    def stager(self) -> Stager:
        """The stager of this runner's buffers (slab and integer slots, one launch)."""
        return self._stager if self._stager is not None else Stager.for_buffers(self.buffers, embed=True)

    def capture(self, lazy: bool = False) -> "PrefillGraphRunner":
        """Capture every bucket, largest first, into one pool; check each (``verify``); freeze the registry.

        Capture stages a batch of its own (text rows of a random table, one sequence); every
        buffer is as it was when capture returns or raises. ``lazy=True`` captures nothing now
        (the registry is frozen at once): the first batch that needs a bucket runs eagerly
        (``last_fallback == "capturing"``), and then that bucket (with the largest first, whose
        outputs every graph writes into) is captured and checked before ``run`` returns. That
        call synchronises with the device; every later one replays. With ``TRITON_INTERPRET`` set (the
        interpreter runs the kernels on the host) it raises :class:`CaptureError` on CUDA and captures nothing.
        """
        if self._graphs or self._pending:
            raise RuntimeError("already captured: call reset() before capturing again")
        self._clear_stats()
        if self.eager:
            self._say(ENFORCE_EAGER if self.enforce_eager else NO_CUDA)
            return self
        if runtime.INTERPRET:
            raise CaptureError("TRITON_INTERPRET is set: Triton's interpreter runs the staging kernel on the host, "
                               "which a CUDA graph cannot capture; unset it on a GPU, or pass enforce_eager=True")
        if lazy:
            self._pending = set(self.buckets)
            self._routes()
        else:
            self._capture_buckets(list(reversed(self.buckets)))
        self._signature = self.registry.signature()
        self.registry.freeze()
        return self

    def _capture_buckets(self, buckets: list) -> None:
        """Capture and check ``buckets`` (the largest bucket among them first, or captured already) into the
        runner's pool and keep them; on an error keep none of them (every buffer is put back)."""
        largest = self._graphs.get(self.buckets[-1])
        done = capture_buckets(self.forward, self.buffers, buckets, pool=self.pool,
                               static=None if largest is None else largest[1], verify=self.verify,
                               after_stage=self.after_stage, progress=self.progress, rank0=self.is_rank0,
                               group=self.process_group)
        self.capture_seconds += done.seconds
        self.capture_bytes += done.bytes
        self._graphs.update(done.graphs)
        self.pool, self._stager = done.pool, done.stager
        self._dropped.update(done.dropped)
        self.checks.update(done.checks)
        self._pending.difference_update(done.graphs)
        self._routes()

    def _captured(self, buckets: list) -> bool:
        """:meth:`_capture_buckets`, False where it raised :class:`CaptureError`."""
        try:
            self._capture_buckets(buckets)
        except CaptureError:
            return False
        return True

    def reset(self) -> None:
        """Drop the graphs and unfreeze the registry (slots may then be replaced)."""
        self._graphs.clear()
        self._views.clear()
        self._dropped.clear()
        self._pending.clear()
        self.checks, self.capture_seconds, self.capture_bytes = {}, 0.0, 0
        self._route, self._signature, self._stager, self.pool = [], None, None, self._user_pool
        self._clear_stats()
        self.registry.unfreeze()

    def _clear_stats(self) -> None:
        """What :meth:`stats` counts starts again (at :meth:`capture` and :meth:`reset`)."""
        self._replays, self._eager, self._padded = {}, {}, 0

    def _say(self, why: str) -> None:
        """Log once why the runner runs eagerly, the first time each reason comes up."""
        if why in self._said:
            return
        self._said.add(why)
        words = eager_words(why, self.buffers.device)
        if words is not None:  # (a reason of one batch, such as padding, is not logged)
            (log.warning if self.is_rank0 else log.debug)(
                "slabstage: running prefill eagerly (%s): no CUDA graphs are captured", words)

    # -- run --------------------------------------------------------------------------
    def bucket_for(self, n: int) -> int | None:
        """The bucket a batch of ``n`` tokens replays in, or None when it runs eagerly."""
        return self._route_of(n).bucket

    def _route_of(self, n: int) -> Route:
        """Where a batch of ``n`` tokens runs: its bucket, or why it runs eagerly (a reason code)."""
        if not self._graphs and not self._pending:
            return EAGER[ENFORCE_EAGER if self.enforce_eager else (NO_CUDA if self.eager else NOT_CAPTURED)]
        if len(self._route) != self.buckets[-1] + 1:
            self._routes()
        return self._route[n] if 0 < n < len(self._route) else EAGER[ABOVE_LARGEST]

    def _routes(self) -> None:
        """The route of every token count up to the largest bucket, looked up in O(1) on the hot path."""
        self._route = routes_by_size(self.buckets, self._ratio, self._pending, self._dropped)
        self._views.clear()  # a view belongs to the bucket its n replayed in

    def stats(self) -> dict:
        """``{"replays": {bucket: runs}, "eager": {reason: runs}, "padded_rows": rows}`` since the last
        :meth:`capture` or :meth:`reset` (since the runner was made, before either)."""
        return {"replays": dict(self._replays), "eager": dict(self._eager), "padded_rows": self._padded}

    def run(self, batch: PrefillBatch, *, clone: bool = False) -> Any:
        """Stage ``batch``, replay its bucket's graph (or run eagerly) and return the outputs.

        The outputs are the first ``n`` rows of static graph memory: the next
        ``run`` overwrites them. Pass ``clone=True`` (or copy them) to keep them.
        On the graph path, runs of the same ``n`` return the very same tensor views
        (a slice costs more host time than the replay launch: do not change their shape
        in place, ``unsqueeze_`` or ``t_``, which later runs would return); a dict or
        list output is a new container each time. ``last_bucket`` and ``last_fallback`` say how it
        ran. Every check happens before anything is written; a bad batch leaves the
        buffers as they were. No host synchronisation on the graph path. An eager run
        captured in a graph of the caller's stages from a parameter record of its own:
        that graph's replays stage the captured batch again.
        """
        if not isinstance(batch, PrefillBatch):
            raise TypeError(f"run() takes a PrefillBatch, got {type(batch).__name__}")
        ids = batch.input_ids
        shape = ids.shape if isinstance(ids, torch.Tensor) else ()
        n = shape[0] if len(shape) == 1 else 0  # (a bad input_ids runs eagerly: staging's checks name it)
        bucket, why = self._route[n] if n < len(self._route) else self._route_of(n)  # (routes[0]: above largest)
        if bucket is None:  # eager: staged by the whole buffers' stager, launched at once
            self._say(why)
            stager, pad_to, launch = Stager.for_buffers(self.buffers, embed=True), n, True
        else:  # replay: the bucket's graph begins with the staging launch (after_stage given: launched before it)
            self.registry.check(self._signature)
            stager, pad_to, launch = self._stager, bucket, self.after_stage is not None
        self._stage(stager, batch, pad_to, launch)
        if bucket is None:
            return self._run_eager(n, why, clone)
        return self._replay(n, bucket, clone)

    def _replay(self, n: int, bucket: int, clone: bool) -> Any:
        """Replay the graph of ``bucket`` over the batch staged for it (``n`` rows of it real)."""
        stager, after = self._stager, self.after_stage
        self.last_bucket, self.last_fallback = bucket, None
        self._replays[bucket] = self._replays.get(bucket, 0) + 1
        self._padded += bucket - n
        graph, out = self._graphs[bucket]
        range_push("slabstage.replay")
        try:
            if after is None:
                stager.replay(graph)  # (ordered after the stager's other launches, whatever their stream)
            else:
                graph.replay()
        finally:
            range_pop()
        if clone:
            return first_rows(out, n, True)
        views = self._views.get(n)  # the same views every time: slicing costs more than the replay launch
        if views is None:
            views = first_rows(out, n, False)
            if isinstance(out, torch.Tensor) or (isinstance(out, tuple) and all(isinstance(v, torch.Tensor)
                                                                                for v in out)):
                self._views[n] = views  # (not a dict or a list: a caller could change those)
        return views

    def _run_eager(self, n: int, why: str, clone: bool) -> Any:
        """Run ``forward`` eagerly over the staged batch of ``n`` rows (``why``: the reason code); for
        ``CAPTURING``, then capture the bucket ``n`` needs (and the largest, when it is not captured yet)."""
        self.last_bucket, self.last_fallback = None, why
        self._eager[why] = self._eager.get(why, 0) + 1
        with nvtx_range("slabstage.eager"):
            out = self.forward(self.registry.views(n))
        if why != CAPTURING:
            return first_rows(out, n, clone)
        out = first_rows(out, n, True)  # (the capture's warm-up may write where the forward's outputs live)
        need = self.buckets[bisect.bisect_left(self.buckets, n)]
        largest = self.buckets[-1]
        try:
            self._capture_buckets(sorted({largest, need} & self._pending, reverse=True))
        except CaptureError as e:  # that bucket runs eagerly from now on, every bucket if the largest failed (the
            # others write into its outputs), as a failed capture() leaves the runner: raised once under
            # verify="strict", else logged once
            failed = {need}  # (a failed capture keeps none of its graphs: the largest again, alone)
            if largest not in self._graphs and (need == largest or not self._captured([largest])):
                failed = set(self._pending)
            self._pending.difference_update(failed)
            self._dropped.update(dict.fromkeys(failed, NOT_CAPTURED))
            self._routes()
            if self.verify == "strict":
                raise
            (log.warning if self.is_rank0 else log.debug)(
                "slabstage: capture(lazy=True): %s; the %s run eagerly", e,
                "buckets" if len(failed) > 1 else f"{need}-token bucket's batches")
        return out

    def _stage(self, stager: Stager, batch: PrefillBatch, pad_to: int, launch: bool) -> None:
        """Check ``batch`` and write its parameter record (and launch staging when ``launch``), then call
        ``after_stage``. Raises before anything is written."""
        for name in self._needs:  # (a slot the batch does not give keeps the last batch's values)
            if getattr(batch, name, None) is None:
                raise ValueError(f"run(): the forward reads {name}, which this batch does not give (a KV cache's "
                                 f"slots: pack_requests(..., cache=) gives them)")
        # staging launched here while the caller captures a graph of its own (an eager run, or staging before the
        # graph under after_stage): a parameter record of its own, which that graph's replays copy (a ring slot
        # holds other steps by then)
        own = (launch and stager.triton and self.buffers.device.type == "cuda"
               and torch.cuda.is_current_stream_capturing())
        range_push("slabstage.stage")
        try:
            checked = stager.prepare(batch, pad_to, own_params=own, replay=not launch)
            if launch:
                stager.launch(checked, pad_to)
        finally:
            range_pop()
        if self.after_stage is not None:
            self.after_stage(pad_to)
