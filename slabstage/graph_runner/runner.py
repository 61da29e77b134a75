"""PrefillGraphRunner: capture staging and the prefill forward per bucket, and replay them.

Each bucket's graph begins with the staging launch, which reads everything a batch
changes from the stager's device parameter block. ``run()`` is: check the batch,
write its block into pinned memory, one host-to-device copy, one replay.
"""

from __future__ import annotations

import bisect
import logging
import numbers
import time
from typing import Any, Callable

import torch

from ..checks import check_choice, check_real
from ..kernels.launch import Stager
from ..staging.buffers import StagingBuffers
from .batch import PrefillBatch
from .buckets import default_token_buckets
from .nvtx import nvtx_range, range_pop, range_push

__all__ = ["PrefillGraphRunner", "CaptureError"]

log = logging.getLogger("slabstage")

Forward = Callable[[dict], Any]


class CaptureError(RuntimeError):
    """``forward`` raised while a bucket was being captured; nothing was kept."""


def _rows(out: Any, n: int, clone: bool) -> Any:
    """``out`` (a tensor, or a tuple/list/dict of them) cut to its first ``n`` rows."""
    if isinstance(out, torch.Tensor):
        return out[:n].clone() if clone else out[:n]
    if isinstance(out, dict):
        return {k: _rows(v, n, clone) for k, v in out.items()}
    if isinstance(out, (tuple, list)):
        return type(out)(_rows(v, n, clone) for v in out)
    raise TypeError(f"forward must return a tensor, or a tuple/list/dict of tensors; got {type(out).__name__}")


def _into_static(out: Any, static: Any) -> Any:
    """Copy ``out`` into the first rows of ``static`` (same structure) and return those views.

    Inside a capture this adds one copy per output to the graph and lets the
    graph's own output tensors go back to the pool, so the whole ladder takes
    about the memory of its largest bucket. Outputs that do not line up with the
    static ones (another structure, dtype or row shape) are kept as they are.
    """
    if isinstance(out, torch.Tensor):
        if (isinstance(static, torch.Tensor) and out.dtype == static.dtype and out.dim() >= 1
                and out.shape[1:] == static.shape[1:] and out.shape[0] <= static.shape[0]):
            dst = static[:out.shape[0]]
            if dst.data_ptr() != out.data_ptr():
                dst.copy_(out)
            return dst
        return out
    if isinstance(out, dict) and isinstance(static, dict) and out.keys() == static.keys():
        return {k: _into_static(v, static[k]) for k, v in out.items()}
    if isinstance(out, (tuple, list)) and isinstance(static, (tuple, list)) and len(out) == len(static):
        return type(out)(_into_static(v, w) for v, w in zip(out, static))
    return out


_CAPTURE_STREAMS: dict = {}


def _capture_stream(device: torch.device) -> torch.cuda.Stream:
    """One side stream per device for every capture: cuBLAS keeps a workspace per stream it
    has run on (32 MiB on Hopper), so a fresh stream per capture() would cost one more each time."""
    stream = _CAPTURE_STREAMS.get(device)
    if stream is None:
        stream = _CAPTURE_STREAMS[device] = torch.cuda.Stream(device)
    return stream


def _is_rank0(group) -> bool:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return True
    return dist.get_rank(group) == 0


def _progress(total: int, enabled: bool):
    if not enabled:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:  # tqdm is optional (extra "progress")
        return None
    return tqdm(total=total, desc="slabstage capture", unit="graph", leave=False)


def _probe(buffers: StagingBuffers, n: int) -> PrefillBatch:
    """The batch staged while capturing: ``n`` text rows of a small random table, one sequence, positions
    ``0..n-1``; what warm-up, capture and the check after it run on."""
    slab = buffers.input_embeds
    g = torch.Generator(device="cpu").manual_seed(n)
    host = torch.device("cpu")  # (named: a caller's default device has no say)
    positions = torch.arange(n, device=host)
    return PrefillBatch(input_ids=torch.randint(0, 16, (n,), generator=g, device=host), positions=positions,
                        table=torch.randn(16, slab.shape[1], generator=g, device=host).to(buffers.device, slab.dtype),
                        mrope_positions=positions.expand(3, n) if buffers.mrope_positions is not None else None,
                        seq_lens=torch.tensor([n], dtype=torch.int32, device=host),
                        extend_start_loc=torch.zeros(1, dtype=torch.int32, device=host))


# why a run() ran eagerly (runner.last_fallback; runner.stats()["eager"])
NO_CUDA, ENFORCE_EAGER, NOT_CAPTURED = "no_cuda", "enforce_eager", "not_captured"
ABOVE_LARGEST, PADDING = "above_largest_bucket", "padding_ratio"
REPLAY_DIFFERS, REPLAY_SLOWER = "replay_differs", "replay_slower"  # the capture check dropped the bucket
CAPTURING = "capturing"  # capture(lazy=True): the batch ran eagerly, then its bucket was captured
VERIFY = ("warn", "strict", "off")


class PrefillGraphRunner:
    """Capture staging and ``forward`` around :class:`StagingBuffers` for a ladder of token buckets; replay it.

    ``forward(views)`` takes ``buffers.registry.views(bucket)`` (every slot cut to
    the bucket on its token axis) and returns a tensor, or a tuple/list/dict of
    tensors, whose first axis is the token axis. Rows past the batch hold padding
    (zero embeddings, zero ids and positions); ``forward`` must keep them from
    changing real rows (causal attention within each sequence does).

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

    def __init__(self, forward: Forward, buffers: StagingBuffers, *, buckets=None, max_padding_ratio: float = 2.0,
                 enforce_eager: bool = False, pool=None, after_stage: Callable[[int], None] | None = None,
                 progress: bool = True, process_group=None, verify: str = "warn") -> None:
        if not callable(forward):
            raise TypeError(f"forward must be callable, got {type(forward).__name__}")
        if not isinstance(buffers, StagingBuffers):
            raise TypeError(f"buffers must be StagingBuffers, got {type(buffers).__name__}")
        capacity = buffers.registry.capacity
        buckets = default_token_buckets(capacity) if buckets is None else buckets
        sizes = sorted(set(buckets))
        if not sizes or any(isinstance(b, bool) or not isinstance(b, numbers.Integral) or b < 1 for b in sizes):
            raise ValueError(f"buckets must be positive ints, got {buckets!r}")
        if sizes[-1] > capacity:
            raise ValueError(f"bucket {sizes[-1]} exceeds the buffers' capacity of {capacity} tokens")
        try:
            ratio = check_real("max_padding_ratio", max_padding_ratio)
        except (TypeError, ValueError):
            ratio = None
        if ratio is None or ratio < 1:
            raise ValueError(f"max_padding_ratio must be a number >= 1, got {max_padding_ratio!r}")
        check_choice("verify", verify, VERIFY)
        self.forward = forward
        self.buffers = buffers
        self.registry = buffers.registry
        self.buckets = [int(b) for b in sizes]
        self._ratio = ratio
        self.after_stage = after_stage
        self.process_group = process_group
        self.is_rank0 = _is_rank0(process_group)
        self.progress = progress and self.is_rank0
        self.verify = verify
        self._user_pool = pool
        self.pool = pool
        self.enforce_eager = bool(enforce_eager)
        self.eager = self.enforce_eager or buffers.device.type != "cuda"
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, Any]] = {}
        self._dropped: dict[int, str] = {}  # bucket -> why the capture check dropped it
        self._pending: set[int] = set()  # capture(lazy=True): the buckets not captured yet
        self._views: dict[int, Any] = {}  # n -> the first n rows of its bucket's outputs
        self._route: list = []  # n -> its bucket, or why it runs eagerly (a str)
        self._stager = None  # the stager the graphs were captured with
        self._signature = None
        self._said: set = set()  # the fallbacks already logged
        self._replays: dict[int, int] = {}
        self._eager: dict[str, int] = {}
        self._padded = 0
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
        ratio = check_real("max_padding_ratio", value)
        if ratio < 1:
            raise ValueError(f"max_padding_ratio must be a number >= 1, got {value!r}")
        self._ratio = ratio
        if self._graphs or self._pending:
            self._routes()

    # -- capture ----------------------------------------------------------------------
    @property
    def captured(self) -> bool:
        return bool(self._graphs)

    @property
    def graphs(self) -> dict:
        """bucket -> ``(torch.cuda.CUDAGraph, its static outputs)``; empty before :meth:`capture`."""
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
        call synchronises with the device; every later one replays.
        """
        if self.eager:
            self._say(ENFORCE_EAGER if self.enforce_eager else NO_CUDA)
            return self
        if self._graphs or self._pending:
            raise RuntimeError("already captured: call reset() before capturing again")
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
        runner's pool; on an error keep none of them and put every buffer back."""
        device = self.buffers.device
        stager = Stager.for_buffers(self.buffers, embed=True)
        torch.cuda.synchronize(device)
        kept = {name: self.registry[name].to("cpu", copy=True) for name in self.registry}  # put back after
        torch.cuda.empty_cache()  # what the caching allocator holds unused would blur the memory measure
        reserved0 = torch.cuda.memory_reserved(device)
        start = time.perf_counter()
        graphs: dict[int, tuple[torch.cuda.CUDAGraph, Any]] = {}
        pool = self.pool
        bar = _progress(len(buckets), self.progress)
        stream = _capture_stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        bucket = None
        largest = self._graphs.get(self.buckets[-1])
        static = None if largest is None else largest[1]  # every smaller graph copies its rows into these
        checks, dropped = {}, {}
        try:
            with torch.cuda.stream(stream), nvtx_range("slabstage.capture"):
                for bucket in buckets:
                    graph, out, probe, eager_out, eager_us = self._capture_one(stager, bucket, pool, static)
                    pool = graph.pool() if pool is None else pool
                    graphs[bucket] = (graph, out)
                    if static is None:
                        static = out
                    if self.verify != "off":
                        checks[bucket] = self._check_one(stager, bucket, graph, out, probe, eager_out, eager_us)
                        why = checks[bucket]["dropped"]
                        if why is not None:
                            if self.verify == "strict":
                                raise CaptureError(f"the {bucket}-token bucket's replay {_WORDS[why]} the eager "
                                                   f"forward ({checks[bucket]['detail']})")
                            dropped[bucket] = why
                    if bar is not None:
                        bar.update(1)
        except Exception as e:
            graphs.clear()
            torch.cuda.current_stream(device).wait_stream(stream)
            torch.cuda.synchronize(device)
            self._restore(kept)
            if isinstance(e, CaptureError):
                raise
            raise CaptureError(f"forward raised while capturing the {bucket}-token bucket: {e!r}; "
                               f"no graph was kept, capture() can be called again") from e
        finally:
            if bar is not None:
                bar.close()
        torch.cuda.current_stream(device).wait_stream(stream)
        torch.cuda.synchronize(device)
        self._restore(kept)
        torch.cuda.empty_cache()  # warm-up blocks go back; what stays reserved is the graphs' pool
        seconds, grown = time.perf_counter() - start, torch.cuda.memory_reserved(device) - reserved0
        self.capture_seconds += seconds
        self.capture_bytes += grown
        self._graphs.update(graphs)
        self.pool, self._stager = pool, stager
        self._dropped.update(dropped)
        self.checks.update(checks)
        self._pending.difference_update(graphs)
        self._routes()
        (log.info if self.is_rank0 else log.debug)(
            "slabstage: captured %d prefill graphs (%d..%d tokens) in %.2f s (%.3f s a bucket), %.1f MiB of GPU "
            "memory", len(graphs), min(graphs), max(graphs), seconds, seconds / len(graphs), grown / 2**20)
        for b, why in sorted(dropped.items()):
            (log.warning if self.is_rank0 else log.debug)(
                "slabstage: the %d-token bucket runs eagerly: its replay %s the eager forward (%s)", b, _WORDS[why],
                checks[b]["detail"])

    def _capture_one(self, stager: Stager, bucket: int, pool, static):
        """Warm up, then capture one bucket: ``(graph, its outputs, probe, eager outputs, eager µs)``, the last
        two from a timed eager run after the warm-up (None without ``verify``)."""
        views = self.registry.views(bucket)
        probe = _probe(self.buffers, bucket)
        eager_out = eager_us = None
        for timed in (False, True) if self.verify != "off" else (False,):
            checked = stager.prepare(probe, bucket)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            stager.launch(checked, bucket)
            out = self.forward(views)  # the warm-up: lazy set-up and autotuning stay out of the graph
            end.record()
            if timed:
                end.synchronize()
                eager_out, eager_us = _rows(out, bucket, True), start.elapsed_time(end) * 1e3
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(pool=pool)
        try:
            if self.after_stage is None:  # (else staging runs before the graph, after_stage between them)
                stager.record(bucket)
            out = self.forward(views)
            if static is not None:  # smaller buckets write into the largest one's output storage
                out = _into_static(out, static)
        except BaseException:
            try:  # end the capture, but report forward's error, not capture_end's echo of it
                graph.capture_end()
            except Exception:
                _reset_capture_state(self.buffers.device)
            raise
        graph.capture_end()
        _rows(out, 0, False)  # the output's structure is checked now, not at replay
        return graph, out, probe, eager_out, eager_us

    def _check_one(self, stager: Stager, bucket: int, graph, out, probe, eager_out, eager_us: float) -> dict:
        """Replay ``graph`` on the capture's inputs: equal bit for bit to the eager outputs, and no slower
        (a second replay is timed when the first looks slower: it may have paid for uploading the graph)."""
        best = float("inf")
        for _ in range(2):
            checked = stager.prepare(probe, bucket)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            if self.after_stage is not None:
                stager.launch(checked, bucket)
            graph.replay()
            if self.after_stage is None:
                stager.replayed()
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) * 1e3)
            if best <= eager_us:
                break
        same, diff = _same(_rows(out, bucket, False), eager_out)
        slower = best > eager_us * 1.02 + 2.0  # (2% and 2 µs: the timers' own spread)
        dropped = REPLAY_DIFFERS if not same else (REPLAY_SLOWER if slower else None)
        detail = (f"max |replay - eager| = {diff:.3g}" if not same else
                  f"replay {best:.1f} µs, eager {eager_us:.1f} µs")
        return dict(equal=same, max_abs_diff=diff, replay_us=best, eager_us=eager_us, dropped=dropped,
                    detail=detail)

    def _restore(self, kept: dict) -> None:
        for name, t in kept.items():
            self.registry[name].copy_(t)

    def reset(self) -> None:
        """Drop the graphs and unfreeze the registry (slots may then be replaced)."""
        self._graphs.clear()
        self._views.clear()
        self._dropped.clear()
        self._pending.clear()
        self.checks, self.capture_seconds, self.capture_bytes = {}, 0.0, 0
        self._route = []
        self._signature = None
        self._stager = None
        self.pool = self._user_pool
        self.registry.unfreeze()

    def _say(self, why: str) -> None:
        """Log once why the runner runs eagerly, the first time each reason comes up."""
        if why in self._said or why not in (NO_CUDA, ENFORCE_EAGER, NOT_CAPTURED):
            return
        self._said.add(why)
        words = {NO_CUDA: "no CUDA device" if not torch.cuda.is_available() else f"buffers on {self.buffers.device}",
                 ENFORCE_EAGER: "enforce_eager=True",
                 NOT_CAPTURED: "no graphs captured: capture() was not called or failed"}[why]
        (log.warning if self.is_rank0 else log.debug)(
            "slabstage: running prefill eagerly (%s): no CUDA graphs are captured", words)

    # -- run --------------------------------------------------------------------------
    def bucket_for(self, n: int) -> int | None:
        """The bucket a batch of ``n`` tokens replays in, or None when it runs eagerly."""
        route = self._route_of(n)
        return route if type(route) is int else None

    def _route_of(self, n: int):
        """``n``'s bucket, or why a batch of ``n`` tokens runs eagerly (a reason code)."""
        if not self._graphs and not self._pending:
            return ENFORCE_EAGER if self.enforce_eager else (NO_CUDA if self.eager else NOT_CAPTURED)
        if len(self._route) != self.buckets[-1] + 1:
            self._routes()
        return self._route[n] if 0 < n < len(self._route) else ABOVE_LARGEST

    def _routes(self) -> None:
        """The route of every token count up to the largest bucket, looked up in O(1) on the hot path."""
        route = [ABOVE_LARGEST]
        for n in range(1, self.buckets[-1] + 1):
            b = self.buckets[bisect.bisect_left(self.buckets, n)]
            route.append(PADDING if b > n * self._ratio else
                         CAPTURING if b in self._pending else self._dropped.get(b, b))
        self._route = route
        self._views.clear()  # a view belongs to the bucket its n replayed in

    def stats(self) -> dict:
        """``{"replays": {bucket: runs}, "eager": {reason: runs}, "padded_rows": rows}`` since capture."""
        return {"replays": dict(self._replays), "eager": dict(self._eager), "padded_rows": self._padded}

    def run(self, batch: PrefillBatch, *, clone: bool = False) -> Any:
        """Stage ``batch``, replay its bucket's graph (or run eagerly) and return the outputs.

        The outputs are the first ``n`` rows of static graph memory: the next
        ``run`` overwrites them. Pass ``clone=True`` (or copy them) to keep them.
        On the graph path, runs of the same ``n`` return the very same tensor views
        (a slice costs more host time than the replay launch); a dict or list output
        is a new container each time. ``last_bucket`` and ``last_fallback`` say how it
        ran. Every check happens before anything is written; a bad batch leaves the
        buffers as they were. No host synchronisation on the graph path.
        """
        if not isinstance(batch, PrefillBatch):
            raise TypeError(f"run() takes a PrefillBatch, got {type(batch).__name__}")
        ids = batch.input_ids
        n = ids.shape[0] if isinstance(ids, torch.Tensor) and ids.dim() == 1 else 0
        route = self._route[n] if 0 < n < len(self._route) else self._route_of(n)
        if type(route) is int:
            self.registry.check(self._signature)
            stager = self._stager
            pad_to = route
        else:
            self._say(route)
            stager = Stager.for_buffers(self.buffers, embed=True)
            pad_to = n
        range_push("slabstage.stage")
        try:
            checked = stager.prepare(batch, pad_to)
            if type(route) is not int or self.after_stage is not None:
                stager.launch(checked, pad_to)
        finally:
            range_pop()
        if self.after_stage is not None:
            self.after_stage(pad_to)
        if type(route) is not int:
            self.last_bucket, self.last_fallback = None, route
            self._eager[route] = self._eager.get(route, 0) + 1
            with nvtx_range("slabstage.eager"):
                out = self.forward(self.registry.views(n))
            if route == CAPTURING:  # (the capture's warm-up may write where the forward's outputs live)
                out = _rows(out, n, True)
                need = self.buckets[bisect.bisect_left(self.buckets, n)]
                self._capture_buckets(sorted({self.buckets[-1], need} & self._pending, reverse=True))
                return out
            return _rows(out, n, clone)
        self.last_bucket, self.last_fallback = route, None
        self._replays[route] = self._replays.get(route, 0) + 1
        self._padded += route - n
        graph, out = self._graphs[route]
        range_push("slabstage.replay")
        try:
            graph.replay()
            if self.after_stage is None:
                stager.replayed()
        finally:
            range_pop()
        if clone:
            return _rows(out, n, True)
        views = self._views.get(n)  # the same views every time: slicing costs more than the replay launch
        if views is None:
            views = _rows(out, n, False)
            if isinstance(out, torch.Tensor) or (isinstance(out, tuple)  # a dict or list could be changed
                                                 and all(isinstance(v, torch.Tensor) for v in out)):
                self._views[n] = views
        return views


_WORDS = {REPLAY_DIFFERS: "differs from", REPLAY_SLOWER: "is slower than"}


def _same(a: Any, b: Any) -> tuple[bool, float]:
    """Whether two outputs (tensors or containers of them) are equal bit for bit, and their largest difference."""
    if isinstance(a, torch.Tensor):
        if a.shape != b.shape or a.dtype != b.dtype:
            return False, float("inf")
        same = torch.equal(_bits(a), _bits(b))  # (NaN equals NaN, -0.0 differs from 0.0: bit for bit)
        diff = 0.0 if same else (a.double() - b.double()).abs().nan_to_num(float("inf")).max().item()
        return same, diff
    pairs = zip(a.values(), b.values()) if isinstance(a, dict) else zip(a, b)
    results = [_same(x, y) for x, y in pairs]
    return all(r[0] for r in results), max([r[1] for r in results], default=0.0)


def _bits(t: torch.Tensor) -> torch.Tensor:
    if not t.dtype.is_floating_point or not t.dim():
        return t
    return t.contiguous().view(torch.uint8)


def _reset_capture_state(device: torch.device) -> None:
    """After a capture that could not end cleanly, capture and drop an empty graph: the CUDA random
    generators then leave capture mode (otherwise the next random op outside a graph fails)."""
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=_capture_stream(device)):
            pass
        del graph
    except Exception:  # noqa: BLE001 - nothing more to do; the error that got here is reported
        pass
