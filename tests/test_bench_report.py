"""The bench report (python -m slabstage.bench report) renders the figures a suite's JSON holds."""

import json
from pathlib import Path

from slabstage.bench.report import markdown

RESULTS = Path(__file__).resolve().parents[1] / "bench" / "results"


def test_capture_is_shown_as_seconds_a_bucket_not_as_a_subprocess_wall_time():
    data = json.loads((RESULTS / "graph_runner.json").read_text())
    text = markdown("graph_runner", data)
    info = next(b["extra_info"] for b in data["benchmarks"] if b["extra_info"].get("metric") == "capture")
    assert f"({info['s_per_bucket']:.3f} per bucket)" in text
    assert "| test_capture |" not in text  # the benchmark's own timing is the capture subprocess's wall time
