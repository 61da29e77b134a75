"""The staging kernel's compiled code: media rows are read with 16-byte loads, items as well as one tensor.

Compiled for sm_90 in a subprocess (the interpreter is off there), which needs no GPU:
tools/compile_stage_kernel.py counts the global loads of the PTX by width.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


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


def test_every_media_form_reads_with_16_byte_loads(counts):
    for c in counts:
        assert c["scalar_b16"] == 0, c  # a 2-byte load per element: the media path lost its vector loads
        assert c["loads_v4"] > 0, c


def test_items_cost_no_more_loads_per_block_than_the_tensor(counts):
    tensor = next(c for c in counts if c["media_mode"] == 1)
    for c in counts:
        if c["media_mode"] == 2:
            # the item's fields and the item search are a few scalar loads; the rows stay 16 bytes wide
            assert c["loads_v4"] <= tensor["loads_v4"] + 4 * c["blocks"], c
