"""bench/nvtx_workload.py's workload leaves the slabstage NVTX ranges in a torch.profiler trace."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

PROFILE = Path(__file__).resolve().parents[2] / "bench" / "nvtx_workload.py"


def _load_profile_module():
    # by path and under its own name: `profile` would be the standard library's module
    spec = importlib.util.spec_from_file_location("slabstage_bench_profile", PROFILE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def trace_names(tmp_path_factory):
    if not PROFILE.exists():
        pytest.skip("bench/nvtx_workload.py is not in this checkout")
    trace = tmp_path_factory.mktemp("profile") / "trace.json"
    args = ["--steps", "3", "--warmup", "1", "--batches", "3", "--max-tokens", "64", "--width", "32",
            "--vocab", "100", "--torch-profiler", str(trace), "--quiet"]
    assert _load_profile_module().main(args) == 0
    data = json.loads(trace.read_text())
    events = data["traceEvents"] if isinstance(data, dict) else data
    return {e.get("name") for e in events}


def test_stage_and_eager_or_replay_ranges(trace_names):
    assert "slabstage.stage" in trace_names
    assert "profile.step" in trace_names
    if torch.cuda.is_available():
        assert "slabstage.capture" in trace_names
        assert "slabstage.replay" in trace_names
    else:
        assert "slabstage.eager" in trace_names


def test_eager_range_without_cuda(trace_names):
    if torch.cuda.is_available():
        pytest.skip("with CUDA every batch of the workload replays a graph")
    assert "slabstage.replay" not in trace_names
    assert "slabstage.capture" not in trace_names
