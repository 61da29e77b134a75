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


# a bf16 slab of one column block (the most registers), an fp32 one of two (4096 columns, 2048 a block) and a
# bf16 one of two (8192)
CONFIGS = ["4096:bf16", "4096:fp32", "8192:bf16"]
# a slab one column wide: a program writes a piece of one column, which no vector arm can take, yet every arm
# is compiled (an arm whose shapes come from the piece must still make sense there)
TINY = ["1:bf16"]


def compiled(configs):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "compile_stage_kernel.py"), *configs], env=env,
                          capture_output=True, text=True, timeout=300)
    if proc.returncode != 0 and ("ptxas" in proc.stderr or "backend" in proc.stderr.lower()):
        pytest.skip(f"this triton cannot compile for sm_90 here: {proc.stderr.strip().splitlines()[-1]}")
    assert proc.returncode == 0, proc.stderr
    return [json.loads(line) for line in proc.stdout.splitlines()]


@pytest.fixture(scope="module")
def compiled_all():
    return compiled(CONFIGS + TINY)


@pytest.fixture(scope="module")
def counts(compiled_all):
    return compiled_all[:len(CONFIGS)]


def check_loads(counts):
    for c in counts:
        # every fp16, bf16 and fp32 row of the table and of the media, in the instance that promises alignment
        assert c["loads_v4"] == c["expected_v4"], c


def check_registers(counts):
    # a thread's registers hold its loads in flight: an arm of one-element loads over a whole row piece took 218
    # (2 programs of 4 warps an SM, half the copy ceiling on an H200); 96 or fewer keep 5 programs an SM
    for c in counts:
        if c["registers"] is not None:
            assert c["registers"] <= 96, c


def test_text_and_media_rows_read_with_16_byte_loads(counts):
    check_loads(counts)


def test_registers_leave_room_for_five_programs_an_sm(counts):
    check_registers(counts)


def test_a_slab_one_column_wide_compiles(compiled_all):
    assert [(c["width"], c["block"]) for c in compiled_all[len(CONFIGS):]] == [(1, 1)]


def test_the_pdl_instance_waits_once_and_costs_no_registers(counts):
    """Launched with programmatic dependent launch, the kernel waits for the work ahead of it once
    (``griddepcontrol.wait``) and holds the registers and loads of the instance without it."""
    pdl = compiled(["--pdl", "4096:bf16"])[0]
    plain = counts[0]
    assert (plain["pdl"], plain["gdc_waits"], pdl["gdc_waits"]) == (False, 0, 1)
    assert (pdl["registers"], pdl["loads"]) == (plain["registers"], plain["loads"])


def test_the_ticket_is_counted_once_without_a_fence(counts):
    """Thread 0 counts the program on the ticket with one relaxed add (inline PTX): a fenced count would wait for
    the program's stores, a count through Triton's scalar atomic for a barrier."""
    for c in counts:
        assert c["relaxed_counts"] == 1, c


def test_pdl_only_where_a_kernel_is_compiled_for_cuda():
    import torch

    from slabstage.staging.launch import use_pdl
    assert not use_pdl(torch.device("cpu"))
