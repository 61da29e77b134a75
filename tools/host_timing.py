"""The host-time loop the tools/ profilers share (imported from the script's own folder)."""
import statistics
import time

import torch


def host_us(f, reps: int = 300, rounds: int = 9) -> tuple[float, float]:
    """``(min, median)`` µs per ``f()`` call, over ``rounds`` rounds of ``reps`` back-to-back calls, the device
    drained between rounds (after ``reps`` warm-up calls)."""
    for _ in range(reps):
        f()
    torch.cuda.synchronize()
    out = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(reps):
            f()
        out.append((time.perf_counter() - start) / reps * 1e6)
        torch.cuda.synchronize()
    return round(min(out), 2), round(statistics.median(out), 2)


def host_us_after_sync(f, samples: int = 300) -> tuple[float, float]:
    """``(min, median)`` µs of one ``f()`` call right after a device sync, as
    ``bench_graph_runner.py::test_run_host_time`` times ``run`` (after 20 warm-up calls)."""
    for _ in range(20):
        f()
    out = []
    for _ in range(samples):
        torch.cuda.synchronize()
        start = time.perf_counter()
        f()
        out.append((time.perf_counter() - start) * 1e6)
    torch.cuda.synchronize()
    return round(min(out), 2), round(statistics.median(out), 2)
