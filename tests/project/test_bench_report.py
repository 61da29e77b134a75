"""The bench report (python bench/report.py) renders the figures a suite's JSON holds."""

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"
RESULTS = BENCH / "results"
sys.path.insert(0, str(BENCH))  # the harness lives beside the suites, not in the package
try:
    from harness.report import markdown
finally:
    sys.path.remove(str(BENCH))


def test_capture_is_shown_as_seconds_a_bucket_not_as_a_subprocess_wall_time():
    data = json.loads((RESULTS / "graph_runner.json").read_text())
    text = markdown("graph_runner", data)
    info = next(b["extra_info"] for b in data["benchmarks"] if b["extra_info"].get("metric") == "capture")
    assert f"({info['s_per_bucket']:.3f} per bucket)" in text
    assert "| test_capture |" not in text  # the benchmark's own timing is the capture subprocess's wall time


def _replay_case(impl: str) -> dict:
    """The extra_info of one bench_replay.py case, as its worker and test fill it (figures made up)."""
    def profile(kernel_us, kernels):
        return dict(wall_us=kernel_us + 150.0, kernel_us=kernel_us, kernels=kernels, copy_us=2.5, span_us=kernel_us)

    sizes = [dict(tokens=64, bucket=64, ran_as=64, replay_min_us=1120.0, replay_median_us=1150.0, eager_min_us=5125.0,
                  eager_median_us=5300.0, ratio_min=0.219, ratio_median=0.217, equal=True, max_abs_diff=0.0,
                  profile=dict(replay=profile(1000.0, 57), eager=profile(990.0, 301)), host_overhead_us=150.0),
             dict(tokens=4080, bucket=4096, ran_as="replay_differs", replay_min_us=16900.0, replay_median_us=17000.0,
                  eager_min_us=16800.0, eager_median_us=16950.0, ratio_min=1.006, ratio_median=1.003, equal=False,
                  max_abs_diff=0.0625, profile=dict(replay={}, eager={}), host_overhead_us=None)]
    return dict(suite="replay", impl=impl, metric="replay", buckets=48, capture_s=5.2, capture_s_per_bucket=0.1083,
                capture_mib=646.0, largest_alone_mib=720.0, mib_vs_largest_alone=0.897, dropped={
                    "16": "replay_differs", "32": "replay_differs", "4096": "replay_differs", "1": "replay_slower"},
                stats=dict(replays={"64": 26}, eager={"replay_differs": 26}, padded_rows=0), sizes=sizes, rounds=20,
                profiled_steps=5)


def test_replay_suite_is_shown_per_case_and_size_not_as_a_worker_wall_time():
    data = {"machine_info": {"slabstage": {"gpu": "NVIDIA H200"}}, "benchmarks": [
        {"name": f"test_replay[{impl}]", "stats": {"median": 60.0}, "extra_info": _replay_case(impl)}
        for impl in ("qwen2_7b sdpa prefill_forward", "qwen3_vl sdpa prefill_forward")]}
    text = markdown("replay", data)
    assert "## replay" not in text  # no table of the benchmarks' own timing: the workers' wall time
    lines = text.splitlines()
    capture = next(ln for ln in lines if ln.startswith("| qwen2_7b sdpa prefill_forward | 48 |"))
    assert "5.20 (0.108)" in capture and "| 646 | 720 MiB | 0.90x |" in capture
    assert "replay_differs x3 (16, 32, 4096); replay_slower x1 (1)" in capture and "26 / replay_differs: 26" in capture
    step = next(ln for ln in lines if ln.startswith("| qwen3_vl sdpa prefill_forward | 4080 (bucket 4096) | 16,900"))
    assert "| 1.00 | no (0.0625) | eager: replay_differs |" in step
    small = [ln for ln in lines if ln.startswith("| qwen2_7b sdpa prefill_forward | 64 |")]
    assert len(small) == 2 and "| 0.22 | yes | bucket 64 |" in small[0]
    assert "| 1,150 µs | 1,000 µs (57) | 2.5 µs | 150.0 µs | 87% | 5,300 µs | 990.0 µs (301) |" in small[1]
    assert "| qwen3_vl sdpa prefill_forward | 4080 | 17,000 µs | – | – | – | – | 16,950 µs | – |" in text


def test_the_report_script_rewrites_the_committed_tables_from_their_json(tmp_path):
    """``python bench/report.py`` (``make bench-report``) writes each committed ``<suite>.md`` again from its JSON."""
    proc = subprocess.run([sys.executable, str(BENCH / "report.py"), "--results", str(RESULTS), "--out",
                           str(tmp_path), "--no-plots", "--quiet"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    suites = sorted(p.stem for p in RESULTS.glob("*.json") if (RESULTS / f"{p.stem}.md").is_file())
    assert suites
    for suite in suites:
        assert (tmp_path / f"{suite}.md").read_text() == (RESULTS / f"{suite}.md").read_text(), suite
