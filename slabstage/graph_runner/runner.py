"""PrefillGraphRunner: capture the prefill forward around the slab, per bucket, and replay it."""

from __future__ import annotations

import bisect
import logging
import numbers
import time
from typing import Any, Callable

import torch

from ..kernels.stage_batch import BatchStager
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
    if type(out) is torch.Tensor and not clone:
        return out[:n]
    if isinstance(out, torch.Tensor):
        return out[:n].clone() if clone else out[:n]
    if isinstance(out, dict):
        return {k: _rows(v, n, clone) for k, v in out.items()}
    if isinstance(out, (tuple, list)):
        return type(out)(_rows(v, n, clone) for v in out)
    raise TypeError(f"forward must return a tensor, or a tuple/list/dict of tensors; got {type(out).__name__}")


def _into_static(out: Any, static: Any, n: int) -> Any:
    """Copy ``out`` into the first ``n`` rows of ``static`` (same structure) and return those views.

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
        return {k: _into_static(v, static[k], n) for k, v in out.items()}
    if isinstance(out, (tuple, list)) and isinstance(static, (tuple, list)) and len(out) == len(static):
        return type(out)(_into_static(v, w, n) for v, w in zip(out, static))
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


class PrefillGraphRunner:
    """Capture ``forward`` around :class:`StagingBuffers` for a ladder of token buckets; replay it.

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
            forward (the tensor-parallel all-reduce of the slab goes here).
        progress: show a progress bar while capturing (tqdm, when installed).
        process_group: under tensor parallelism, the group this rank belongs to;
            the progress bar and the capture log line then appear on rank 0 only.
    """

    def __init__(self, forward: Forward, buffers: StagingBuffers, *, buckets=None, max_padding_ratio: float = 2.0,
                 enforce_eager: bool = False, pool=None, after_stage: Callable[[int], None] | None = None,
                 progress: bool = True, process_group=None) -> None:
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
        if isinstance(max_padding_ratio, bool) or not isinstance(max_padding_ratio, numbers.Real) \
                or max_padding_ratio < 1:
            raise ValueError(f"max_padding_ratio must be a number >= 1, got {max_padding_ratio!r}")
        self.forward = forward
        self.buffers = buffers
        self.registry = buffers.registry
        self.buckets = [int(b) for b in sizes]
        self.max_padding_ratio = float(max_padding_ratio)
        self.after_stage = after_stage
        self.process_group = process_group
        self.is_rank0 = _is_rank0(process_group)
        self.progress = progress and self.is_rank0
        self._user_pool = pool
        self.pool = pool
        self.enforce_eager = bool(enforce_eager)
        self.eager = self.enforce_eager or buffers.device.type != "cuda"
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, Any]] = {}
        self._views: dict[int, Any] = {}  # n -> the first n rows of its bucket's outputs
        self._bucket_of: list = []  # n -> bucket_for(n), up to the largest bucket
        self._bucket_ratio = None  # the max_padding_ratio _bucket_of was built for
        self.stager = BatchStager(buffers)
        self._signature = None
        self._said_eager = False
        self.last_bucket: int | None = None  # bucket of the last run, None when it ran eagerly
        self.capture_seconds = 0.0
        self.capture_bytes = 0

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

    def capture(self) -> "PrefillGraphRunner":
        """Capture every bucket, largest first, into one pool; freeze the registry."""
        if self.eager:
            self._say_eager()
            return self
        if self._graphs:
            raise RuntimeError("already captured: call reset() before capturing again")
        device = self.buffers.device
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()  # what the caching allocator holds unused would blur the memory measure
        reserved0 = torch.cuda.memory_reserved(device)
        start = time.perf_counter()
        graphs: dict[int, tuple[torch.cuda.CUDAGraph, Any]] = {}
        pool = self._user_pool
        bar = _progress(len(self.buckets), self.progress)
        stream = _capture_stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        bucket = None
        static = None  # the largest bucket's outputs: every smaller graph copies its rows into them
        try:
            with torch.cuda.stream(stream), nvtx_range("slabstage.capture"):
                for bucket in reversed(self.buckets):
                    views = self.registry.views(bucket)
                    self.forward(views)  # warm-up: lazy init and autotuning stay out of the graph
                    graph = torch.cuda.CUDAGraph()
                    graph.capture_begin(pool=pool)
                    try:
                        out = self.forward(views)
                        if static is not None:  # smaller buckets write into the largest one's output storage
                            out = _into_static(out, static, bucket)
                    except BaseException:
                        try:  # end the capture, but report forward's error, not capture_end's echo of it
                            graph.capture_end()
                        except Exception:
                            pass
                        raise
                    graph.capture_end()
                    _rows(out, 0, False)  # the output's structure is checked now, not at replay
                    pool = graph.pool() if pool is None else pool
                    graphs[bucket] = (graph, out)
                    if static is None:
                        static = out
                    if bar is not None:
                        bar.update(1)
        except Exception as e:
            graphs.clear()
            torch.cuda.current_stream(device).wait_stream(stream)
            torch.cuda.synchronize(device)
            raise CaptureError(f"forward raised while capturing the {bucket}-token bucket: {e!r}; "
                               f"no graph was kept, capture() can be called again") from e
        finally:
            if bar is not None:
                bar.close()
        torch.cuda.current_stream(device).wait_stream(stream)
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()  # warm-up blocks go back; what stays reserved is the graphs' pool
        self.capture_seconds = time.perf_counter() - start
        self.capture_bytes = torch.cuda.memory_reserved(device) - reserved0
        self._graphs, self.pool = graphs, pool
        self._bucket_table()
        self._signature = self.registry.signature()
        self.registry.freeze()
        (log.info if self.is_rank0 else log.debug)(
            "slabstage: captured %d prefill graphs (%d..%d tokens) in %.2f s, %.1f MiB of GPU memory",
                 len(graphs), self.buckets[0], self.buckets[-1], self.capture_seconds, self.capture_bytes / 2**20)
        return self

    def reset(self) -> None:
        """Drop the graphs and unfreeze the registry (slots may then be replaced)."""
        self._graphs.clear()
        self._views.clear()
        self._signature = None
        self.pool = self._user_pool
        self.registry.unfreeze()

    def _say_eager(self) -> None:
        if not self._said_eager:
            if self.buffers.device.type != "cuda":
                why = "no CUDA device" if not torch.cuda.is_available() else f"buffers on {self.buffers.device}"
            elif self.enforce_eager:
                why = "enforce_eager=True"
            else:
                why = "no graphs captured: capture() was not called or failed"
            (log.warning if self.is_rank0 else log.debug)(
                "slabstage: running prefill eagerly (%s): no CUDA graphs are captured", why)
            self._said_eager = True

    # -- run --------------------------------------------------------------------------
    def bucket_for(self, n: int) -> int | None:
        """The bucket a batch of ``n`` tokens replays in, or None when it runs eagerly."""
        if not self._graphs:
            return None
        table = self._bucket_of
        if self._bucket_ratio != self.max_padding_ratio:
            table = self._bucket_table()
        return table[n] if 0 <= n < len(table) else None

    def _bucket_table(self) -> list:
        """``bucket_for`` of every token count up to the largest bucket, looked up in O(1) on the hot path."""
        table = []
        for n in range(self.buckets[-1] + 1):
            i = bisect.bisect_left(self.buckets, n)
            fits = n > 0 and self.buckets[i] <= n * self.max_padding_ratio
            table.append(self.buckets[i] if fits else None)
        self._bucket_of, self._bucket_ratio = table, self.max_padding_ratio
        self._views.clear()  # a view belongs to the bucket its n replayed in
        return table

    def run(self, batch: PrefillBatch, *, clone: bool = False) -> Any:
        """Stage ``batch``, replay its bucket's graph (or run eagerly) and return the outputs.

        The outputs are the first ``n`` rows of static graph memory: the next
        ``run`` overwrites them. Pass ``clone=True`` (or copy them) to keep them.
        On the graph path, runs of the same ``n`` return the very same tensor views
        (a slice costs more host time than the replay launch); a dict or list output
        is a new container each time.
        Every check happens before anything is written; a bad batch leaves the
        buffers as they were. No host synchronisation on the graph path.
        """
        if type(batch) is not PrefillBatch and not isinstance(batch, PrefillBatch):
            raise TypeError(f"run() takes a PrefillBatch, got {type(batch).__name__}")
        n = batch.input_ids.shape[0]
        bucket = self.bucket_for(n)
        if bucket is not None:
            signature = self._signature
            self.registry.check(signature)
        else:
            signature = None
            if self.eager or not self._graphs:
                self._say_eager()
            if n > self.registry.capacity:
                raise ValueError(f"batch of {n} tokens exceeds the buffers' capacity of "
                                 f"{self.registry.capacity} tokens")
        range_push("slabstage.stage")
        try:
            self.stager(batch, bucket or n, signature)
        finally:
            range_pop()
        if self.after_stage is not None:
            self.after_stage(bucket or n)
        self.last_bucket = bucket
        if bucket is None:
            with nvtx_range("slabstage.eager"):
                out = self.forward(self.registry.views(n))
            return _rows(out, n, clone)
        graph, out = self._graphs[bucket]
        range_push("slabstage.replay")
        try:
            graph.replay()
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
