"""A fake CUDA for the runner's bookkeeping on the CPU: a graph records, while it captures, what a replay
re-runs (the forward's outputs recomputed, the copies into the largest bucket's outputs); events time 0;
streams, synchronisation and the memory counters do nothing. ``install(monkeypatch)`` puts it in place."""

import contextlib

import torch

import slabstage.graph_runner.capture as capture
import slabstage.kernels.runtime as runtime
import slabstage.graph_runner.outputs as outputs

CAPTURING = [None]  # the graph being captured, or None


class Graph:
    def __init__(self):
        self.ops, self.replays, self._pool = [], 0, None

    def capture_begin(self, pool=None):
        self._pool = pool if pool is not None else object()
        CAPTURING[0] = self

    def capture_end(self):
        CAPTURING[0] = None

    def pool(self):
        return self._pool

    def replay(self):
        self.replays += 1
        for op in self.ops:
            op()


class Event:
    def __init__(self, *args, **kwargs):
        pass

    def record(self, *args):
        pass

    def synchronize(self):
        pass

    def elapsed_time(self, other):
        return 0.0


class Stream:
    def wait_stream(self, other):
        pass


def _into_static(out, static, _into=outputs.into_static):
    """``into_static``, and while a graph captures, the copies it makes recorded for the replays."""
    result = _into(out, static)
    graph = CAPTURING[0]
    if graph is not None and isinstance(out, torch.Tensor) and out.data_ptr() != result.data_ptr():
        graph.ops.append(lambda: result.copy_(out))
    return result


def install(monkeypatch):
    cuda = torch.cuda
    monkeypatch.setattr(cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(cuda, "Event", Event)
    monkeypatch.setattr(cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(cuda, "empty_cache", lambda *a, **k: None)
    monkeypatch.setattr(cuda, "memory_reserved", lambda *a, **k: 0)
    monkeypatch.setattr(cuda, "current_stream", lambda *a, **k: Stream())
    monkeypatch.setattr(cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(capture, "capture_stream", lambda device: Stream())
    monkeypatch.setattr(capture, "into_static", _into_static)
    monkeypatch.setattr(capture, "_reset_capture_state", lambda device: None)
    monkeypatch.setattr(runtime, "INTERPRET", False)  # (a fake graph re-runs the interpreter's kernels: it captures)


def forward_that_fails_capturing(buckets=()):
    """A forward (``input_embeds * 2 + 1``) that a fake graph records, and that raises while a graph of one of
    ``buckets`` captures."""

    def forward(views):
        x = views["input_embeds"]
        graph = CAPTURING[0]
        if graph is not None and x.shape[0] in buckets:
            raise RuntimeError(f"cannot capture {x.shape[0]}")
        out = x * 2 + 1
        if graph is not None:
            graph.ops.append(lambda: out.copy_(x * 2 + 1))
        return out
    return forward
