"""The bench report (python bench/report.py) renders the figures a suite's JSON holds."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
RESULTS = BENCH / "results"
sys.path.insert(0, str(BENCH))  # the harness lives beside the suites, not in the package
try:
    from harness.headline import BEGIN, END, MISSING, headline, readme_block, write_readme
    from harness.profile import step_figures
    from harness.report import markdown
finally:
    sys.path.remove(str(BENCH))


CAPTURE = {"suite": "graph_runner", "impl": "capture", "metric": "capture", "buckets": 44, "capture_s": 2.788,
           "s_per_bucket": 0.06336, "bytes_all": 243269632, "bytes_largest": 234881024, "memory_ratio": 1.0357,
           "pool_bytes_all": 207618048, "pool_bytes_largest": 199229440, "pool_ratio": 1.0421,
           "largest_alone_s": 0.3268}  # bench_graph_runner.py's test_capture, as it fills extra_info


def _doc(benchmarks: list) -> dict:
    return {"machine_info": {"slabstage": {"gpu": "NVIDIA H200"}}, "benchmarks": benchmarks}


def test_capture_is_shown_as_seconds_a_bucket_not_as_a_subprocess_wall_time():
    data = _doc([{"name": "test_capture", "stats": {"median": 7.53}, "extra_info": CAPTURE}])
    text = markdown("graph_runner", data)
    info = next(b["extra_info"] for b in data["benchmarks"] if b["extra_info"].get("metric") == "capture")
    assert f"({info['s_per_bucket']:.3f} per bucket)" in text
    assert "| test_capture |" not in text  # the benchmark's own timing is the capture subprocess's wall time


def test_rows_named_by_their_case_are_told_apart_by_tokens_or_by_test_and_sides_are_columns():
    def bench(name, param, metric, case, side, tokens, median):
        return {"name": f"{name}[{param}]", "param": param, "stats": {"median": median},
                "extra_info": {"metric": metric, "case": case, "path": side, "tokens": tokens}}
    data = _doc([bench("test_pack_host", "a-layout", "host", "qwen 4x2", "layout", 4080, 1e-4),
                 bench("test_pack_host", "a-rope", "host", "qwen 4x2", "rope_index", 4080, 2e-3),
                 bench("test_pack_run_host", "a-layout", "host", "qwen 4x2", "layout", 4080, 5e-4),
                 bench("test_step", "64", "wall", "step", "replay", 64, 1e-3),
                 bench("test_step", "256", "wall", "step", "replay", 256, 2e-3)])
    text = markdown("mrope", data)
    assert "| qwen 4x2 (test_pack_host) | 100.0 µs | 2,000 µs |" in text  # two sides of one case: one row
    assert "| qwen 4x2 (test_pack_run_host) | 500.0 µs | – |" in text  # the same case in another test: its own
    assert "| step, 64 tokens | 1,000 µs |" in text and "| step, 256 tokens | 2,000 µs |" in text


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


def test_ab_comparisons_are_shown_with_their_ratio_and_target_not_as_a_loop_wall_time():
    info = dict(suite="encoder_cache", metric="ab", measure="host", case="run() host", impl="16 cached entries",
                reference_impl="one media tensor", tokens=256, ours_us=36.0, reference_us=32.0, ratio=1.125,
                target="<=1.2", met=True, rounds=400)
    text = markdown("encoder_cache", _doc([{"name": "test_run_host[entries]", "stats": {"median": 0.5},
                                            "extra_info": info}]))
    assert "| test_run_host[entries] |" not in text
    row = "| run() host | 256 | 16 cached entries | 36.0 µs | one media tensor | 32.0 µs | 1.125 | <=1.2 | yes |"
    assert row in text


def test_a_latency_comparison_shows_the_hosts_part_of_each_side():
    info = dict(suite="encoder_cache", metric="ab", measure="latency", case="merge latency", impl="from the cache",
                reference_impl="engine-style merge", tokens=4096, ours_us=267.0, reference_us=1096.0, ratio=4.1,
                target=">=5.0", met=False, rounds=100, ours_host_us=190.5, reference_host_us=88.25)
    text = markdown("encoder_cache", _doc([{"name": "test_merge[latency]", "stats": {"median": 0.5},
                                            "extra_info": info}]))
    assert "| merge latency | 4096 | 190.5 µs / 267.0 µs | 88.2 µs / 1,096 µs |" in text


def test_a_replays_profile_is_shown_kernel_by_kernel():
    profile = {"ours": dict(span_us=11.5, by_kernel={"fetch_kernel": 2.1, "stage_kernel": 3.9, "mul": 1.5}),
               "reference": dict(span_us=6.0, by_kernel={"_lightllm_style_kernel": 3.2, "mul": 1.5})}
    info = dict(suite="encoder_cache", metric="ab", measure="device", case="replay device", impl="runner replay",
                reference_impl="LightLLM kernel + forward in a graph", tokens=256, ours_us=15.0, reference_us=7.0,
                ratio=2.14, target="<=1.2", met=False, rounds=100, profile=profile)
    text = markdown("encoder_cache", _doc([{"name": "test_replay[256]", "stats": {"median": 0.5},
                                            "extra_info": info}]))
    # each side named as the comparison names it (a suite compares one case against several references)
    assert "| replay device | 256 | runner replay | 11.5 µs | fetch_kernel 2.1; stage_kernel 3.9; mul 1.5 |" in text
    assert ("| replay device | 256 | LightLLM kernel + forward in a graph | 6.0 µs | _lightllm_style_kernel 3.2; "
            "mul 1.5 |") in text


def test_step_figures_sum_the_gpu_work_inside_each_range_by_kernel():
    def ev(cat, name, ts, dur):
        return {"cat": cat, "name": name, "ts": ts, "dur": dur}
    events = [ev("user_annotation", "s.ours", 0, 100), ev("user_annotation", "s.ours", 200, 100),
              ev("kernel", "fetch", 10, 2), ev("kernel", "stage", 14, 4), ev("gpu_memcpy", "copy", 20, 1),
              ev("kernel", "fetch", 210, 4), ev("kernel", "stage", 216, 6),
              ev("kernel", "elsewhere", 150, 5)]  # in no range: not counted
    fig = step_figures(events, "s.ours")
    assert fig["by_kernel"] == {"fetch": 3.0, "stage": 5.0}
    assert fig["kernels"] == 2 and fig["kernel_us"] == 8.0 and fig["copy_us"] == 0.5 and fig["span_us"] == 11.5
    assert step_figures(events, "s.other") == {}


def test_the_report_script_writes_each_suites_tables_from_their_json(tmp_path):
    """``python bench/report.py`` (``make bench-report``) writes ``<suite>.md`` from each suite's JSON."""
    results = tmp_path / "results"
    results.mkdir()
    data = _doc([{"name": "test_capture", "stats": {"median": 7.53}, "extra_info": CAPTURE}])
    (results / "graph_runner.json").write_text(json.dumps(data))
    proc = subprocess.run([sys.executable, str(BENCH / "report.py"), "--results", str(results), "--no-plots",
                           "--quiet"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (results / "graph_runner.md").read_text() == markdown("graph_runner", data)


def test_the_engine_figure_is_drawn_from_the_prefill_and_generate_figures(tmp_path):
    """The README's figure: ``python bench/report.py --results bench/results`` draws ``engine.png``."""
    pytest.importorskip("matplotlib")
    proc = subprocess.run([sys.executable, str(BENCH / "report.py"), "--results", str(RESULTS), "--out",
                           str(tmp_path), "--quiet"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (tmp_path / "engine.png").stat().st_size > 10_000


def test_the_readmes_measured_table_is_written_from_bench_results():
    """Every figure the README's "Measured" table quotes is a suite's: the block between its markers is what
    ``python bench/report.py --readme README.md`` writes from bench/results."""
    readme = (BENCH.parent / "README.md").read_text()
    assert readme_block(readme) == headline(RESULTS)


def test_the_headline_shows_a_case_missing_from_the_result_set_and_writes_between_the_markers(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    case = {"replay_ms": 59.3, "hf_per_request_ms": 73.5, "dense_ms": 115.3, "speedup_vs_hf": 1.24,
            "speedup_vs_dense": 1.94}
    doc = _doc([{"name": f"test_prefill[packed_{b}x1024]", "extra_info": case} for b in (16, 4)])
    doc["datetime"] = "2026-12-05T05:06:05+00:00"
    (results / "prefill.json").write_text(json.dumps(doc))
    text = headline(results)
    assert text.startswith("One NVIDIA H200, 2026-12-05.")
    assert "| 59.3 / 59.3 ms | HF one request at a time 73.5 / 73.5 ms;" in text
    assert text.count(MISSING) == 7  # every other row: the set has no such case
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\n{BEGIN}\nold table\n{END}\n\nafter\n")
    write_readme(readme, results)
    assert readme.read_text() == f"# x\n\n{BEGIN}\n{text}{END}\n\nafter\n"
    with pytest.raises(ValueError, match="markers|block"):
        readme_block("# no markers")
