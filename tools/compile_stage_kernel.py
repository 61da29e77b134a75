"""Compile the staging kernel for sm_90 on any machine (no GPU needed): its global loads by width, its registers.

    python tools/compile_stage_kernel.py                 # one JSON line per slab configuration
    python tools/compile_stage_kernel.py 4096:fp32       # just that one

Triton's wheel carries ptxas, so the PTX can be read where no GPU is. The kernel reads
every source through an address from its parameter record, in two instances: one that
promises 16-byte alignment (taken when the host found it) and one that promises nothing.
``loads_v4`` counts the 16-byte loads: the promising instance of the text (scaled or not) and
the media path must have them (``expected_v4``); if a change loses the promise, they fall back to
scalar loads and the count drops. ``registers`` is what ptxas allots a thread: with 4 warps a
program, an SM holds ``65536 // (128 * registers)`` programs and their loads in flight, so it bounds
the kernel's bandwidth (see the kernel's docstring). ``relaxed_counts`` counts the ticket's count (taken early
by thread 0, no fence: see the kernel).
``compile_s`` is the compile's wall time from an empty cache (the PTX and ptxas's cubin, the first-run cost a
process pays per configuration), ``cubin_bytes`` the code's size. tests/ops/test_stage_kernel_codegen.py runs it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # before the kernel is defined: compile it, do not interpret it
_CACHE = tempfile.TemporaryDirectory(prefix="slabstage-compile-")  # an empty Triton cache, removed at exit:
os.environ["TRITON_CACHE_DIR"] = _CACHE.name  # compile_s is a first compile's, as a fresh machine pays it

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from slabstage.kernels.stage_kernel import launch_settings, stage_kernel  # noqa: E402
from slabstage.staging.slots import SLOTS  # noqa: E402

_ARGS = ("params_ptr", "errors_ptr", "slab_ptr")
_DTYPES = {"bf16": 2, "fp16": 2, "fp32": 4}


def load_counts(width: int, slab: str = "bf16", slots: bool = True, pdl: bool = False) -> dict:
    """Global load counts of the kernel for a slab of ``width`` columns of ``slab`` dtype (``pdl``: the instance
    launched with programmatic dependent launch)."""
    constexprs, num_warps = launch_settings(width, _DTYPES[slab], len(SLOTS) if slots else 0, 8)
    constexprs["PDL"] = pdl
    block = constexprs["BLOCK"]
    names = [*_ARGS, *constexprs]
    signature = dict(params_ptr="*i64", errors_ptr="*i32", slab_ptr=f"*{slab}",
                     **{k: "constexpr" for k in constexprs})
    source = ASTSource(stage_kernel, signature, constexprs={(names.index(k),): v for k, v in constexprs.items()},
                       attrs={(i,): [["tt.divisibility", 16]] for i in range(3)})
    t0 = time.perf_counter()
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps))
    compile_s, ptx = time.perf_counter() - t0, kernel.asm["ptx"]
    per_thread = block // (32 * num_warps)  # elements of a row piece each thread holds
    # the promising instance of each read: text rows (scaled, and not) in 16-byte loads of fp16, bf16 and fp32
    # rows; media rows in one 16-bit load (fp16 and bf16 alike) and one fp32 load
    v16, v32 = max(1, per_thread // 8), max(1, per_thread // 4)  # 16-byte loads of a row piece, 16- and 32-bit
    expected = 2 * (2 * v16 + v32) + v16 + v32
    return dict(width=width, slab=slab, block=block, num_warps=num_warps, loads=len(re.findall(r"ld\.global", ptx)),
                loads_v4=len(re.findall(r"ld\.global[^\n]*\.v4", ptx)), expected_v4=expected,
                registers=registers(ptx), compile_s=round(compile_s, 2), cubin_bytes=len(kernel.asm.get("cubin", b"")),
                pdl=pdl, gdc_waits=len(re.findall(r"griddepcontrol\.wait", ptx)),
                relaxed_counts=len(re.findall(r"atom\.global\.relaxed\.gpu\.add", ptx)))


def registers(ptx: str) -> int | None:
    """Registers a thread, as the ptxas in Triton's wheel allots them (``None`` where it cannot run)."""
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    target = re.search(r"\.target\s+(\S+)", ptx).group(1)
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        try:
            out = subprocess.run([str(ptxas), f"-arch={target}", "-v", str(src), "-o", str(Path(tmp) / "k.cubin")],
                                 capture_output=True, text=True, timeout=120)
        except OSError:
            return None
    found = re.search(r"Used (\d+) registers", out.stderr)
    return int(found.group(1)) if found else None


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Compile the staging kernel for sm_90 (no GPU needed) and print its "
                                                 "global loads by width and its registers: one JSON line per slab "
                                                 "configuration.")
    parser.add_argument("configs", nargs="*", default=["4096:bf16", "8192:bf16", "4096:fp32"],
                        help="slab configurations WIDTH:DTYPE (dtype bf16, fp16 or fp32; default: %(default)s)")
    parser.add_argument("--pdl", action="store_true", help="the instance launched with programmatic dependent launch")
    args = parser.parse_args()
    for config in args.configs:
        width, slab = config.split(":")
        print(json.dumps(load_counts(int(width), slab, pdl=args.pdl)))
    sys.exit(0)
