"""The benchmark harness: the device-time timer pytest-benchmark uses, the runner and the report.

``python bench/run.py`` runs the suites in ``bench/`` and saves their JSON;
``python bench/report.py`` turns the JSON into markdown tables and plots.
It lives beside the suites in a source checkout, not in the installed package.
The timer below is importable by dotted name where ``bench/`` is on the path (pytest
puts it there for the suites), so it also plugs in as
``pytest --benchmark-timer harness.cuda_event_timer``.
"""

from __future__ import annotations

from pathlib import Path

import torch

__all__ = ["CudaEventTimer", "cuda_event_timer", "TIMER_PRECISION_S", "BENCH_DIR", "RESULTS_DIR", "synced_us",
           "sleep_cycles_per_us"]

# What a pair of CUDA events resolves (about half a microsecond); pinned as the
# timer's precision so pytest-benchmark never probes it by calling the timer out of pairs.
TIMER_PRECISION_S = 1e-6


class CudaEventTimer:
    """A pytest-benchmark timer whose differences are device time.

    pytest-benchmark calls its timer twice around the timed function (``start =
    timer(); fn(); end = timer()``) and records ``end - start``. This timer keeps a
    running total: the first call of a pair records a start event on the current
    stream and returns the total; the second records an end event, waits for it,
    adds the elapsed device seconds to the total and returns it. So ``end - start``
    is the device time between the two events, whatever the host did meanwhile.

    Work queued before the start call (an L2 flush, say) is not counted: the start
    event runs after it in stream order.
    """

    __name__ = "cuda_event_timer"  # pytest-benchmark names the timer in its JSON by this

    def __init__(self) -> None:
        self.total = 0.0
        self._start = None

    def reset(self) -> None:
        """Forget an unfinished pair (a timed function that raised between the calls)."""
        self._start = None

    def __call__(self) -> float:
        if self._start is None:
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()
            return self.total
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        end.synchronize()
        self.total += self._start.elapsed_time(end) / 1e3  # elapsed_time is in ms
        self._start = None
        return self.total

    def __repr__(self) -> str:
        return f"CudaEventTimer(total={self.total:.6f}s)"


cuda_event_timer = CudaEventTimer()


BENCH_DIR = Path(__file__).resolve().parents[1]  # the checkout's bench/: the suites and their conftest
RESULTS_DIR = BENCH_DIR / "results"


def synced_us(fn) -> float:
    """Wall µs of one ``fn()`` between two device syncs: its latency, host and device together."""
    import time

    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e6


def sleep_cycles_per_us() -> float:
    """How many ``torch.cuda._sleep`` cycles make a microsecond on this GPU (measured).

    Used to give the host a head start before a timed region, so that host
    launch gaps stay out of device time.
    """
    import torch

    cycles = 1_000_000
    torch.cuda._sleep(cycles)  # first launch
    best = float("inf")
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3)
    return cycles / max(best, 1e-3)
