"""Benchmark tooling: the device-time timer pytest-benchmark uses, and where suites live.

``python -m slabstage.bench run`` runs the suites in ``bench/`` and saves their JSON;
``python -m slabstage.bench report`` turns the JSON into markdown tables and plots.
The suites are not part of the installed package: they live in ``bench/`` of a
source checkout, found beside the package (an editable install) or through
``--bench-dir``; from a plain install ``run`` says so and exits 2.
The timer below is importable by dotted name, so it also plugs in as
``pytest --benchmark-timer slabstage.bench.cuda_event_timer``.
"""

from __future__ import annotations

from pathlib import Path

import torch

__all__ = ["CudaEventTimer", "cuda_event_timer", "TIMER_PRECISION_S", "bench_dir", "default_results_dir",
           "find_bench_dir", "NO_CHECKOUT"]

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


NO_CHECKOUT = ("the benchmark suites live in bench/ of a slabstage source checkout, not in the installed package: "
               "run this from an editable install of a checkout (pip install -e .), or pass --bench-dir "
               "CHECKOUT/bench")


def bench_dir() -> Path:
    """Where the repository's ``bench/`` folder is when this package sits in a checkout (it may not exist)."""
    return Path(__file__).resolve().parents[2] / "bench"


def find_bench_dir(given: Path | None = None) -> Path | None:
    """``given``, else the checkout's ``bench/``, when it holds the suites (``conftest.py``); else None."""
    path = bench_dir() if given is None else Path(given).resolve()
    return path if (path / "conftest.py").is_file() else None


def default_results_dir() -> Path:
    return bench_dir() / "results"


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
