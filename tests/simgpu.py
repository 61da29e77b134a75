"""A simulated GPU for the encoder cache's tests: streams run their queued operations only when a test lets
them, an event completes when its stream has run past it, a ``non_blocking`` copy is queued on the current
stream. Under :func:`simulated_gpu` the cache's bookkeeping runs as on CUDA, on CPU tensors."""

from __future__ import annotations

import contextlib

import torch

from slabstage.cache import EncoderCache, reads as reads_mod

_copy, _zero = torch._C.TensorBase.copy_, torch._C.TensorBase.zero_


class SimStream:
    """A stream: its raw handle, its queued operations (callables, or events it waits for), how many ran."""

    def __init__(self, handle: int) -> None:
        self.cuda_stream, self.ops, self.ran = handle, [], 0

    def enqueue(self, op) -> None:
        self.ops.append(op)

    def record_event(self):
        event = SimEvent()
        event.record(self)
        return event

    def wait_event(self, event) -> None:
        self.enqueue(event)

    def run(self, upto: int | None = None) -> bool:
        """Run queued operations (up to index ``upto``); a wait for an event of another stream runs that stream
        as far as the event first. False if blocked."""
        upto = len(self.ops) if upto is None else upto
        while self.ran < upto:
            op = self.ops[self.ran]
            if type(op) is SimEvent:
                if not op.query() and not op.stream.run(op.pos):
                    return False
            else:
                op()
            self.ran += 1
        return True


class SimEvent:
    """An event: done once its stream ran past the point it was recorded at; ``syncs`` counts host waits."""

    syncs = 0

    def __init__(self, *args, **kwargs) -> None:
        self.stream, self.pos = None, 0

    def record(self, stream=None) -> None:
        self.stream = stream if stream is not None else SIM["now"]
        self.pos = len(self.stream.ops)

    def query(self) -> bool:
        return self.stream is None or self.stream.ran >= self.pos

    def synchronize(self) -> None:
        SimEvent.syncs += 1
        assert self.stream.run(self.pos)


SIM: dict = {}  # "A", "B": two streams; "now": the current one


@contextlib.contextmanager
def simulated_gpu():
    """Two streams (``SIM["A"]``, ``SIM["B"]``; ``SIM["now"]`` current): torch's events, current stream and
    ``non_blocking`` copies simulated while the block runs."""
    SIM.clear()
    SIM["A"], SIM["B"] = SimStream(1), SimStream(2)
    SIM["now"] = SIM["A"]
    SimEvent.syncs = 0

    def copy_(dst, src, non_blocking=False):  # a non_blocking copy runs when its stream reaches it
        if not non_blocking:
            return _copy(dst, src)
        SIM["now"].enqueue(lambda: _copy(dst, src))
        return dst

    def zero_(t):  # as a kernel: queued on the current stream
        SIM["now"].enqueue(lambda: _zero(t))
        return t

    saved = (reads_mod.torch.cuda.Event, torch.cuda.current_stream, torch.cuda.is_current_stream_capturing,
             torch.Tensor.copy_, torch.Tensor.zero_)
    reads_mod.torch.cuda.Event = SimEvent
    torch.cuda.current_stream = lambda device=None: SIM["now"]
    torch.cuda.is_current_stream_capturing = lambda: False
    torch.Tensor.copy_, torch.Tensor.zero_ = copy_, zero_
    try:
        yield SIM
    finally:
        (reads_mod.torch.cuda.Event, torch.cuda.current_stream, torch.cuda.is_current_stream_capturing,
         torch.Tensor.copy_, torch.Tensor.zero_) = saved


def cuda_like(rows: int, host_rows: int, width: int = 4) -> EncoderCache:
    """A host EncoderCache of ``rows`` device and ``host_rows`` host-tier rows whose bookkeeping runs as on CUDA."""
    cache = EncoderCache(width, torch.float32, "cpu", rows * width * 4, host_budget_bytes=host_rows * width * 4)
    cache.reads.cuda = cache.writes.cuda = True
    return cache


def partitioned(cache: EncoderCache) -> None:
    """Each tier's rows are its live entries' and its free runs', each row once: budgets hold, nothing leaks."""
    for tier, arena in enumerate(cache.arenas):
        runs = sorted([(cache.ats[s], cache.lens[s]) for s, t in enumerate(cache.tiers)
                       if t == tier and cache.keys[s] is not None]
                      + [(start, length) for start, length, _ in cache.free[tier].free])
        starts = [0] + [a + n for a, n in runs[:-1]]
        assert [a for a, _ in runs] == (starts if runs else []) and sum(n for _, n in runs) == arena.shape[0], \
            (tier, runs)
