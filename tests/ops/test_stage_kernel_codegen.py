"""The staging kernel's compiled code: where the host promises alignment, rows are read with 16-byte loads.

Compiled for sm_90 in a subprocess (the interpreter is off there), which needs no GPU:
tools/compile_stage_kernel.py counts the global loads of the PTX by width.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def counts():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "compile_stage_kernel.py")], env=env,
                          capture_output=True, text=True, timeout=300)
    if proc.returncode != 0 and ("ptxas" in proc.stderr or "backend" in proc.stderr.lower()):
        pytest.skip(f"this triton cannot compile for sm_90 here: {proc.stderr.strip().splitlines()[-1]}")
    assert proc.returncode == 0, proc.stderr
    return [json.loads(line) for line in proc.stdout.splitlines()]


def test_text_and_media_rows_read_with_16_byte_loads(counts):
    for c in counts:
        # every fp16, bf16 and fp32 row of the table and of the media, in the instance that promises alignment
        assert c["loads_v4"] == c["expected_v4"], c


def test_registers_leave_room_for_five_programs_an_sm(counts):
    # a thread's registers hold its loads in flight: an arm of one-element loads over a whole row piece took 218
    # (2 programs of 4 warps an SM, half the copy ceiling on an H200); 96 or fewer keep 5 programs an SM
    for c in counts:
        if c["registers"] is not None:
            assert c["registers"] <= 96, c
