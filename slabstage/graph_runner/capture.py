"""Capture buckets into one graph pool, and check each replay against the eager forward (``verify``).

:func:`capture_buckets` is what :meth:`PrefillGraphRunner.capture` (and, with ``lazy=True``, the first batch
that needs a bucket) runs; the runner keeps the :class:`Captured` it returns.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..staging.stager import Stager, capture_stream
from ..staging.buffers import StagingBuffers
from ..staging.slots import ROWS, SOURCE_SLOTS, TOKENS
from .batch import PrefillBatch
from .nvtx import nvtx_range
from .outputs import bit_equal, first_rows, into_static
from .routes import DROPPED_WORDS, REPLAY_DIFFERS, REPLAY_SLOWER

__all__ = ["CaptureError", "Captured", "VERIFY", "capture_buckets"]

log = logging.getLogger("slabstage")

VERIFY = ("warn", "strict", "off")


class CaptureError(RuntimeError):
    """``forward`` raised while a bucket was being captured; nothing was kept."""


@dataclass
class Captured:
    """What one :func:`capture_buckets` call made.

    ``graphs``: bucket -> ``(torch.cuda.CUDAGraph, its static outputs)``; ``checks``: bucket -> what the
    check measured (empty with ``verify="off"``); ``dropped``: bucket -> the reason code of a bucket the
    check dropped; ``pool``: the pool the graphs live in; ``stager``: the stager they were captured with
    (its device parameter record is what a replay reads); ``seconds`` and ``bytes``: the capture's wall
    time and the growth of the device's reserved memory over it.
    """

    graphs: dict[int, tuple[torch.cuda.CUDAGraph, Any]]
    checks: dict[int, dict]
    dropped: dict[int, str]
    pool: Any
    stager: Stager
    seconds: float
    bytes: int


def _progress(buckets: list, enabled: bool):
    """``buckets``, behind a progress bar when ``enabled`` and tqdm (extra "progress") is installed."""
    if not enabled:
        return buckets
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return buckets
    return tqdm(buckets, desc="slabstage capture", unit="graph", leave=False)


def _probe(buffers: StagingBuffers, n: int) -> PrefillBatch:
    """The batch staged while capturing: ``n`` text rows of a small random table, one sequence; each slot the
    buffers have gets what its :data:`~slabstage.staging.slots.SLOTS` row's ``probe`` says (positions
    ``0..n-1``, ``seq_lens`` ``[n]``); what warm-up, capture and the check after it run on."""
    slab = buffers.input_embeds
    g = torch.Generator(device="cpu").manual_seed(n)
    host = torch.device("cpu")  # (named: a caller's default device has no say)
    table = torch.randn(16, slab.shape[1], generator=g, device=host).to(buffers.device, slab.dtype)
    ids = torch.randint(0, 16, (n,), generator=g, device=host)
    values = {"ids": ids, "positions": torch.arange(n, device=host), "count": n}
    slots = {}
    for spec in SOURCE_SLOTS:
        if spec.probe is None or spec.name not in buffers.registry:
            continue
        shape = (spec.rows, n) if spec.kind == ROWS else (n,) if spec.kind == TOKENS else (1,)
        value = values.get(spec.probe, spec.probe)
        slots[spec.name] = (value.to(spec.dtype).expand(shape) if isinstance(value, torch.Tensor)
                            else torch.full(shape, value, dtype=spec.dtype, device=host))
    return PrefillBatch(table=table, **slots)


def _dropped(bucket: int, check: dict, verify: str) -> str:
    """Why the check dropped ``bucket`` (its ``check``); under ``verify="strict"`` a :class:`CaptureError`."""
    if verify == "strict":
        raise CaptureError(f"the {bucket}-token bucket's replay {DROPPED_WORDS[check['dropped']]} "
                           f"the eager forward ({check['detail']})")
    return check["dropped"]


def capture_buckets(forward: Callable[[dict], Any], buffers: StagingBuffers, buckets: list, *, pool, static,
                    verify: str, after_stage, progress: bool, rank0: bool, group=None) -> Captured:
    """Capture and check ``buckets`` (the largest bucket among them first, or captured already) into ``pool``.

    ``pool`` is None for a new private pool (the first graph's); ``static`` is the largest bucket's outputs
    when that bucket is captured already (the graphs of smaller buckets copy their rows into them), else None.
    ``verify``, ``after_stage`` and ``group`` (its ``process_group``) as :class:`PrefillGraphRunner` takes them:
    under a group of several ranks every rank replays each bucket as often and drops the buckets any rank's check
    dropped (one collective a bucket), so all take the same path. Every buffer is as it was when
    this returns or raises; on an error no graph is kept and :class:`CaptureError` is raised. Logs the capture
    (at info on rank 0, ``rank0``) and each bucket the check dropped (a warning on rank 0).
    """
    device = buffers.device
    stager = Stager.for_buffers(buffers, embed=True)
    torch.cuda.synchronize(device)
    kept = {name: buffers.registry[name].to("cpu", copy=True) for name in buffers.registry}  # put back after
    torch.cuda.empty_cache()  # what the caching allocator holds unused would blur the memory measure
    reserved0, start = torch.cuda.memory_reserved(device), time.perf_counter()
    graphs, checks, dropped = {}, {}, {}
    stream = capture_stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    bucket = None
    try:
        with torch.cuda.stream(stream), nvtx_range("slabstage.capture"):
            for bucket in _progress(buckets, progress):
                graph, out, probe, eager_out, eager_us = _capture_one(forward, buffers, stager, bucket, pool, static,
                                                                      verify, after_stage)
                pool = graph.pool() if pool is None else pool
                static = out if static is None else static  # every smaller graph copies its rows into these
                graphs[bucket] = (graph, out)
                if verify != "off":
                    check = checks[bucket] = _check_one(stager, bucket, graph, out, probe, eager_out, eager_us,
                                                        after_stage, group)
                    if check["dropped"] is not None:
                        dropped[bucket] = _dropped(bucket, check, verify)
    except Exception as e:
        graphs.clear()
        _rejoin(buffers, stream, kept)
        if isinstance(e, CaptureError):
            raise
        raise CaptureError(f"forward raised while capturing the {bucket}-token bucket: {e!r}; "
                           f"no graph was kept, capture() can be called again") from e
    _rejoin(buffers, stream, kept)
    torch.cuda.empty_cache()  # warm-up blocks go back; what stays reserved is the graphs' pool
    seconds, grown = time.perf_counter() - start, torch.cuda.memory_reserved(device) - reserved0
    _log_capture(graphs, checks, dropped, seconds, grown, rank0)
    return Captured(graphs=graphs, checks=checks, dropped=dropped, pool=pool, stager=stager, seconds=seconds,
                    bytes=grown)


def _log_capture(graphs: dict, checks: dict, dropped: dict, seconds: float, grown: int, rank0: bool) -> None:
    """The capture at info, each bucket the check dropped as a warning (on rank 0; at debug elsewhere)."""
    (log.info if rank0 else log.debug)(
        "slabstage: captured %d prefill graphs (%d..%d tokens) in %.2f s (%.3f s a bucket), %.1f MiB of GPU "
        "memory", len(graphs), min(graphs), max(graphs), seconds, seconds / len(graphs), grown / 2**20)
    for b, why in sorted(dropped.items()):
        (log.warning if rank0 else log.debug)(
            "slabstage: the %d-token bucket runs eagerly: its replay %s the eager forward (%s)", b,
            DROPPED_WORDS[why], checks[b]["detail"])


def _capture_one(forward, buffers: StagingBuffers, stager: Stager, bucket: int, pool, static, verify: str,
                 after_stage):
    """Warm up, then capture one bucket: ``(graph, its outputs, probe, eager outputs, eager µs)``, the last
    two from a timed eager run after the warm-up (None without ``verify``)."""
    views = buffers.registry.views(bucket)
    probe = _probe(buffers, bucket)
    eager_out = eager_us = None
    for timed in (False, True) if verify != "off" else (False,):
        checked = stager.prepare(probe, bucket)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        stager.launch(checked, bucket)
        out = forward(views)  # the warm-up: lazy set-up and autotuning stay out of the graph
        end.record()
        if timed:
            end.synchronize()
            eager_out, eager_us = first_rows(out, bucket, True), start.elapsed_time(end) * 1e3
    graph = torch.cuda.CUDAGraph()
    graph.capture_begin(pool=pool)
    recorded = False
    try:
        if after_stage is None:  # (else staging runs before the graph, after_stage between them)
            recorded = True
            stager.record(bucket)
        out = forward(views)
        if static is not None:  # smaller buckets write into the largest one's output storage
            out = into_static(out, static)
    except BaseException:
        # end the capture, but report forward's error, not the echoes of it: after an illegal call (a sync, an
        # .item()) the capture is invalidated, the branch's join fails, and capture_end must still run, or the
        # stream stays capturing
        if recorded:
            try:
                stager.end_record()
            except Exception:  # noqa: BLE001 - (an invalidated capture: capture_end below ends it all the same)
                pass
        try:
            graph.capture_end()
        except Exception:
            _reset_capture_state(buffers.device)
        raise
    if recorded:
        stager.end_record()
    graph.capture_end()
    first_rows(out, 0, False)  # the output's structure is checked now, not at replay
    return graph, out, probe, eager_out, eager_us


def _check_one(stager: Stager, bucket: int, graph, out, probe, eager_out, eager_us: float, after_stage,
               group=None) -> dict:
    """Replay ``graph`` on the capture's inputs: equal bit for bit to the eager outputs, and no slower
    (a second replay is timed when the first looks slower: it may have paid for uploading the graph). Under a
    ``group`` of several ranks: two replays on every rank (a graph may hold a collective), and the verdict
    every rank's (an all-reduce of the flags)."""
    ranks = dist.get_world_size(group) if group is not None and dist.is_available() and dist.is_initialized() else 1
    best = float("inf")
    for _ in range(2):
        checked = stager.prepare(probe, bucket, replay=after_stage is None)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        if after_stage is None:
            stager.replay(graph)
        else:
            stager.launch(checked, bucket)
            graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3)
        if best <= eager_us and ranks == 1:
            break
    same, diff = bit_equal(first_rows(out, bucket, False), eager_out)
    slower = best > eager_us * 1.02 + 2.0  # (2% and 2 µs: the timers' own spread)
    detail = (f"max |replay - eager| = {diff:.3g}" if not same else
              f"replay {best:.1f} µs, eager {eager_us:.1f} µs")
    if ranks > 1:  # (a rank that dropped a bucket another kept would run other collectives than it)
        on = stager.params.device if dist.get_backend(group) == "nccl" else torch.device("cpu")
        flags = torch.tensor([int(not same), int(slower)], dtype=torch.int32, device=on)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
        different, slower_somewhere = (bool(f) for f in flags.tolist())
        if (different and same) or (slower_somewhere and not slower):
            detail += "; another rank's check dropped it"
        same, slower = same and not different, slower_somewhere
    dropped = REPLAY_DIFFERS if not same else (REPLAY_SLOWER if slower else None)
    return dict(equal=same, max_abs_diff=diff, replay_us=best, eager_us=eager_us, dropped=dropped,
                detail=detail)


def _rejoin(buffers: StagingBuffers, stream, kept: dict) -> None:
    """The current stream waits for the capture stream's work, and every buffer gets back what it held."""
    torch.cuda.current_stream(buffers.device).wait_stream(stream)
    torch.cuda.synchronize(buffers.device)
    for name, t in kept.items():
        buffers.registry[name].copy_(t)


def _reset_capture_state(device: torch.device) -> None:
    """After a capture that could not end cleanly, capture and drop an empty graph: the CUDA random
    generators then leave capture mode (otherwise the next random op outside a graph fails)."""
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=capture_stream(device)):
            pass
        del graph
    except Exception:  # noqa: BLE001 - nothing more to do; the error that got here is reported
        pass
