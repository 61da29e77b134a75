"""Where a step's device time goes: steps run under torch.profiler (CPU and CUDA activity), each inside a named
range, and the GPU activity inside each range summed, by kernel and in all (bench_replay.py, bench_encoder_cache.py).
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile

import torch

__all__ = ["profile_steps", "step_figures"]


def profile_steps(steps: dict, n_steps: int, tag: str = "bench") -> dict:
    """``{name: step_figures}`` for ``steps = {name: fn}``: ``n_steps`` calls of each, a device sync after each
    call inside its range ``{tag}.{name}``."""
    from torch.profiler import ProfilerActivity, profile, record_function
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for name, fn in steps.items():
            for _ in range(n_steps):
                with record_function(f"{tag}.{name}"):
                    fn()
                    torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f).get("traceEvents", [])
    return {name: step_figures(events, f"{tag}.{name}") for name in steps}


def step_figures(events: list, name: str) -> dict:
    """Medians over the ranges ``name`` of a Chrome trace: ``wall_us`` (the range), ``kernel_us`` (the kernels
    that ran inside it, summed), ``kernels`` (their count), ``copy_us`` (memcpy and memset), ``span_us`` (first
    GPU activity's start to the last one's end: the kernels and the gaps between them) and ``by_kernel`` (each
    kernel's name, its first 80 characters, and its median µs). A GPU event belongs to the range its midpoint
    is in."""
    steps = [e for e in events if e.get("cat") == "user_annotation" and e.get("name") == name and "dur" in e]
    gpu = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e]
    per, by_kernel = [], {}
    for s in steps:
        lo, hi = float(s["ts"]), float(s["ts"]) + float(s["dur"])
        inside = [e for e in gpu if lo <= float(e["ts"]) + float(e["dur"]) / 2 <= hi]
        kernels = [e for e in inside if e["cat"] == "kernel"]
        for e in kernels:
            by_kernel.setdefault(str(e.get("name"))[:80], []).append(float(e["dur"]))
        span = (max(float(e["ts"]) + float(e["dur"]) for e in inside) - min(float(e["ts"]) for e in inside)
                if inside else 0.0)
        per.append(dict(wall_us=hi - lo, kernel_us=sum(float(e["dur"]) for e in kernels), kernels=len(kernels),
                        copy_us=sum(float(e["dur"]) for e in inside if e["cat"] != "kernel"), span_us=span))
    if not per:
        return {}
    out = {k: statistics.median(p[k] for p in per) for k in per[0]}
    out["by_kernel"] = {k: statistics.median(v) for k, v in by_kernel.items()}
    return out
