"""tools/sanitize_workload.py --small runs to its OK line on the CPU, the kernels under the Triton interpreter.

The compute-sanitizer phases (tools/gpu_sanitize.sh) run the full workload on a GPU; this smoke test keeps
the script itself in step with the public API, so that a sanitizer run cannot pass over a workload that
stopped before launching anything.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WORKLOAD = ROOT / "tools" / "sanitize_workload.py"


def test_sanitize_workload_small_runs_ok():
    # CPU only, even on a GPU machine: the interpreter runs the kernels on CPU tensors
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=path, CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, str(WORKLOAD), "--small"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"the workload exited {proc.returncode}:\n{out[-4000:]}"
    lines = proc.stdout.strip().splitlines()
    assert lines and lines[-1] == "SANITIZE WORKLOAD OK", f"no OK line last:\n{out[-4000:]}"
    assert "CPU (Triton interpreter" in proc.stdout, proc.stdout
