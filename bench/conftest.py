"""pytest-benchmark set up for GPU work, shared by every suite in bench/.

- ``device_bench``: the ``benchmark`` fixture with its timer swapped for a
  CUDA-event timer (:class:`harness.CudaEventTimer`) and its precision
  pinned; ``device_bench(fn)`` runs ``benchmark.pedantic(fn, setup=between_rounds,
  rounds=R, warmup_rounds=W, iterations=1)``.
- ``between_rounds``: the untimed setup of each round: overwrite a 256 MiB scratch
  buffer (L2 holds nothing of the inputs), then queue a short device sleep so that
  the host has queued all of ``fn`` before its start event runs. The time measured
  is then the device span of ``fn`` alone, not host launch gaps (which
  ``host_bench`` measures apart). A function that syncs inside (vLLM's boolean
  index_put does) still pays for its sync: the gap it opens is inside the span.
- ``host_bench``: the same on the host clock; between rounds (untimed) the device
  drains its queue, so no call waits on a full launch queue.
- ``copy_ceiling``: the device-to-device copy bandwidth, measured once a session;
  ``device_bench.record_bandwidth(bytes, **info)`` fills ``extra_info`` with
  bytes, GB/s, the floor and the fraction of that ceiling.
- ``pytest_benchmark_update_machine_info``: GPU name, SMs, driver and CUDA, torch
  and triton versions, the measured ceiling.

Without CUDA, every device-time benchmark skips; the checks and the host-time
benchmarks run at small sizes (through the Triton interpreter, as in tests/,
unless TRITON_INTERPRET=0 picks the PyTorch reference path).
"""

import os

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:  # before slabstage is imported: the kernels read it when they are defined
    os.environ.setdefault("TRITON_INTERPRET", "1")

import fnmatch  # noqa: E402
import importlib.metadata  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from harness import TIMER_PRECISION_S, CudaEventTimer, sleep_cycles_per_us  # noqa: E402

BENCH_DIR = Path(__file__).resolve().parent
DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")
_CEILING = None  # the session's CopyCeiling, once measured (read by the machine-info hook)


# -- collection ----------------------------------------------------------------------
def pytest_addoption(parser):
    group = parser.getgroup("slabstage bench")
    group.addoption("--bench-rounds", type=int, default=100, help="timed rounds per device benchmark")
    group.addoption("--bench-warmup", type=int, default=10, help="untimed rounds before them")
    group.addoption("--bench-host-rounds", type=int, default=1000, help="timed calls per host-time benchmark")
    group.addoption("--bench-flush-mib", type=int, default=256,
                    help="scratch written between rounds to flush L2 (0: no flush)")
    group.addoption("--bench-head-start-us", type=float, default=2000.0,
                    help="device sleep queued before each timed round so that host launch gaps stay "
                         "out of device time (0: none)")


def _opt(config, name, default):
    return config.getoption(name, default=default)  # the default serves when bench/ is not an initial conftest


def pytest_collect_file(file_path, parent):
    """Collect ``bench_*.py`` here (setup.cfg's python_files only names test files)."""
    if file_path.suffix != ".py" or not file_path.name.startswith("bench_"):
        return None
    patterns = parent.config.getini("python_files")
    if parent.session.isinitpath(file_path) or any(fnmatch.fnmatch(file_path.name, p) for p in patterns):
        return None  # the python plugin collects it already
    return pytest.Module.from_parent(parent, path=file_path)


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="device-time benchmark: needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords and not HAS_CUDA and BENCH_DIR in Path(str(item.fspath)).parents:
            item.add_marker(skip)


def pytest_sessionstart(session):
    # --benchmark-timer harness.cuda_event_timer: pin its precision too (the
    # benchmark session exists by now: pytest-benchmark makes it in a trylast configure)
    bench_session = getattr(session.config, "_benchmarksession", None)
    timer = getattr(getattr(bench_session, "options", {}).get("timer"), "target", None)
    if isinstance(timer, CudaEventTimer):
        _pin_precision(timer)


# -- timers ------------------------------------------------------------------------
def _pin_precision(timer, precision=TIMER_PRECISION_S):
    """Tell pytest-benchmark the timer's precision so it never measures it.

    Measuring calls the timer out of start/stop pairs, which an event timer cannot
    answer. pytest-benchmark 3.x-5.x cache precisions in the class dict
    ``BenchmarkFixture._precisions``, keyed by the timer.
    """
    from pytest_benchmark.fixture import BenchmarkFixture

    cache = getattr(BenchmarkFixture, "_precisions", None)
    if isinstance(cache, dict):
        cache[timer] = precision


def use_timer(benchmark, timer):
    """Make ``benchmark`` (the pytest-benchmark fixture) time with ``timer``."""
    if not hasattr(benchmark, "_timer"):
        raise RuntimeError("this pytest-benchmark keeps its timer elsewhere than BenchmarkFixture._timer; "
                           "pass --benchmark-timer harness.cuda_event_timer instead")
    benchmark._timer = timer
    _pin_precision(timer)
    if not isinstance(getattr(benchmark, "_precisions", None), dict) and hasattr(benchmark, "_get_precision"):
        benchmark._get_precision = lambda _timer: TIMER_PRECISION_S  # a release without the class cache
    return benchmark


class TimedBench:
    """A ``benchmark`` fixture set up for one kind of timing; call it with the function to time.

    ``bench(fn)`` runs ``benchmark.pedantic(fn, setup=..., rounds=..., warmup_rounds=...,
    iterations=1)`` and returns what ``fn`` returned; ``bench.record_*`` then fill
    ``extra_info``. ``bench.benchmark`` is the pytest-benchmark fixture itself.
    """

    def __init__(self, benchmark, *, rounds: int, warmup_rounds: int, setup, ceiling=None) -> None:
        self.benchmark = benchmark
        self.rounds = rounds
        self.warmup_rounds = warmup_rounds
        self.setup = setup
        self.ceiling = ceiling

    @property
    def extra_info(self) -> dict:
        return self.benchmark.extra_info

    def __call__(self, fn):
        return self.benchmark.pedantic(fn, setup=self.setup, rounds=self.rounds,
                                       warmup_rounds=self.warmup_rounds, iterations=1)

    def record_bandwidth(self, bytes_moved: int, **info) -> None:
        record_bandwidth(self.benchmark, bytes_moved, self.ceiling, **info)

    def record_host_time(self, **info) -> None:
        record_host_time(self.benchmark, **info)


@pytest.fixture
def device_bench(benchmark, request, between_rounds, copy_ceiling):
    """Device time: CUDA-event timer, L2 flush and head start between rounds."""
    if not HAS_CUDA:
        pytest.skip("device-time benchmark: needs a CUDA device")
    timer = CudaEventTimer()
    use_timer(benchmark, timer)
    benchmark.extra_info.update(metric="device", timer="cuda_event")
    yield TimedBench(benchmark, rounds=max(1, _opt(request.config, "--bench-rounds", 100)),
                     warmup_rounds=max(0, _opt(request.config, "--bench-warmup", 10)),
                     setup=between_rounds, ceiling=copy_ceiling)
    timer.reset()


@pytest.fixture
def host_bench(benchmark, request):
    """Host time per call: ``time.perf_counter`` around the call, no sync inside it.

    Between rounds (untimed) the device drains its queue, so no call blocks on a
    full launch queue. Without CUDA the rounds are capped at 200 (CPU runs the
    whole computation inside the call).
    """
    benchmark._timer = time.perf_counter  # whatever --benchmark-timer says
    benchmark.extra_info.update(metric="host", timer="perf_counter")
    rounds = max(1, _opt(request.config, "--bench-host-rounds", 1000))
    rounds = rounds if HAS_CUDA else min(rounds, 200)
    return TimedBench(benchmark, rounds=rounds, warmup_rounds=max(1, rounds // 10), setup=host_setup)


def host_setup():
    if HAS_CUDA:
        torch.cuda.synchronize()


class BetweenRounds:
    """Setup of each device-timed round: flush L2, then give the host a head start."""

    def __init__(self, flush_mib: int, head_start_us: float) -> None:
        self.scratch = torch.empty(flush_mib * 2**20, dtype=torch.uint8, device=DEVICE) if flush_mib else None
        self.sleep_cycles = 0
        if head_start_us > 0 and HAS_CUDA and hasattr(torch.cuda, "_sleep"):
            self.sleep_cycles = int(head_start_us * sleep_cycles_per_us())

    def __call__(self) -> None:
        if self.scratch is not None:
            self.scratch.fill_(1)  # a write pass: evicts every line the previous round left in L2
        if self.sleep_cycles:
            torch.cuda._sleep(self.sleep_cycles)


@pytest.fixture(scope="session")
def between_rounds(request):
    if not HAS_CUDA:
        return lambda: None
    return BetweenRounds(_opt(request.config, "--bench-flush-mib", 256),
                         _opt(request.config, "--bench-head-start-us", 2000.0))


# -- the copy ceiling ----------------------------------------------------------------
@dataclass(frozen=True)
class CopyCeiling:
    """Device-to-device copy bandwidth, counting bytes read plus bytes written."""

    bytes_per_s: float
    copy_bytes: int  # bytes of one copy's source (it moves twice that)
    median_s: float

    @property
    def gbps(self) -> float:
        return self.bytes_per_s / 1e9


def measure_copy_ceiling(nbytes: int = 1 << 30, rounds: int = 30, warmup: int = 5) -> CopyCeiling:
    """Median CUDA-event time of ``dst.copy_(src)`` over ``nbytes`` (1 GiB: far past L2)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").fill_(7)
    dst = torch.empty_like(src)
    for _ in range(warmup):
        dst.copy_(src)
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    median = statistics.median(times)
    del src, dst
    torch.cuda.empty_cache()
    return CopyCeiling(bytes_per_s=2 * nbytes / median, copy_bytes=nbytes, median_s=median)


@pytest.fixture(scope="session")
def copy_ceiling():
    """The session's :class:`CopyCeiling` (None without CUDA)."""
    global _CEILING
    if not HAS_CUDA:
        return None
    if _CEILING is None:
        _CEILING = measure_copy_ceiling()
    return _CEILING


def median_seconds(benchmark):
    """The median of the rounds just timed, or None (benchmarks disabled)."""
    stats = getattr(benchmark, "stats", None)
    stats = getattr(stats, "stats", stats)  # Metadata wraps Stats in pytest-benchmark 3.x-5.x
    try:
        return float(stats.median)
    except (AttributeError, TypeError, statistics.StatisticsError):
        return None


def record_bandwidth(benchmark, bytes_moved: int, ceiling: CopyCeiling | None, **info) -> None:
    """Fill ``benchmark.extra_info``: ``info``, bytes, median, GB/s, floor and fraction of ``ceiling``.

    Call after the timed run. ``bytes_moved`` counts bytes read plus bytes written,
    like the ceiling, so ``fraction_of_ceiling`` is the bandwidth share reached and
    ``floor_us`` the time the bytes need at the ceiling.
    """
    extra = benchmark.extra_info
    extra.update(info)
    extra["bytes"] = int(bytes_moved)
    median = median_seconds(benchmark)
    if median is not None:
        extra["median_us"] = median * 1e6
    if ceiling is not None:
        extra["ceiling_gbps"] = ceiling.gbps
        extra["floor_us"] = bytes_moved / ceiling.bytes_per_s * 1e6
    if median:
        extra["gbps"] = bytes_moved / median / 1e9
        if ceiling is not None:
            extra["fraction_of_ceiling"] = extra["gbps"] / ceiling.gbps


def record_host_time(benchmark, **info) -> None:
    """Fill ``benchmark.extra_info`` for a host-time benchmark: ``info`` and ``host_us``."""
    benchmark.extra_info.update(info)
    median = median_seconds(benchmark)
    if median is not None:
        benchmark.extra_info["host_us"] = median * 1e6


# -- machine info --------------------------------------------------------------------
def _nvidia_smi(field: str):
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    first = out.strip().splitlines()
    return first[0].strip() if first else None


def _cuda_driver_api():
    """cuDriverGetVersion (e.g. 12080 for 12.8), or None."""
    try:
        import ctypes

        version = ctypes.c_int()
        if ctypes.CDLL("libcuda.so.1").cuDriverGetVersion(ctypes.byref(version)) == 0:
            return version.value
    except (OSError, AttributeError):
        pass
    return None


def _version_of(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def gpu_info() -> dict:
    """What the figures depend on: GPU, SMs, memory, driver, CUDA, torch, triton, transformers."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    info = {"torch": torch.__version__, "triton": triton_version, "device": DEVICE.type,
            "python": platform.python_version(), "transformers": _version_of("transformers")}
    if not HAS_CUDA:
        info["gpu"] = None
        return info
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    driver_api = _cuda_driver_api()
    info.update({
        "gpu": props.name,
        "gpu_count": torch.cuda.device_count(),
        "sm_count": props.multi_processor_count,
        "compute_capability": f"{props.major}.{props.minor}",
        "memory_gib": round(props.total_memory / 2**30, 1),
        "l2_cache_mib": round(getattr(props, "L2_cache_size", 0) / 2**20, 1) or None,
        "driver": _nvidia_smi("driver_version"),
        "cuda_driver_api": f"{driver_api // 1000}.{driver_api % 1000 // 10}" if driver_api else None,
        "cuda_runtime": torch.version.cuda,
    })
    return info


@pytest.hookimpl(optionalhook=True)
def pytest_benchmark_update_machine_info(config, machine_info):
    machine_info["slabstage"] = gpu_info()
    if _CEILING is not None:
        machine_info["slabstage"]["copy_ceiling_gbps"] = round(_CEILING.gbps, 1)
