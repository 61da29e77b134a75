"""Items against one tensor, device time per staging call, under launch-config overrides (GPU).

    python3 tools/probe_item_launch_config.py   # JSON to $OUT/item_launch_config.json

Patches the row launch config (num_warps, the most bytes of row per program) of every staging call and
times ``stage_embeddings`` with one media tensor and with 16 items (``bench/bench_media_items.py``'s
inputs), each call after an L2 flush and a host head start long enough to cover the call's host time.
How ``_ITEM_MAX_BYTES`` in ``slabstage/kernels/plan.py`` was chosen.
"""
import importlib.util
import json
import os
import statistics
import sys

import torch

import slabstage.kernels.plan as plan
from slabstage import stage_embeddings
from slabstage.kernels.errors import new_error_word

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.append(os.path.join(ROOT, "bench"))  # (appended: bench/profile.py must not shadow the stdlib's)
_spec = importlib.util.spec_from_file_location("bench_media_items", os.path.join(ROOT, "bench/bench_media_items.py"))
bmi = importlib.util.module_from_spec(_spec)
sys.modules["bench_media_items"] = bmi
_spec.loader.exec_module(bmi)

CASES = [("items", 8192, 4096, 1), ("items", 32768, 4096, 1), ("items", 8192, 16384, 1),
         ("deepstack", 8192, 8192, 4), ("deepstack", 8192, 16384, 4)]  # (case, tokens, slab width, blocks)
CONFIGS = [(None, None), (2, None), (None, 4096), (2, 4096), (8, None), (None, 2048)]  # (num_warps, max bytes)
_ORIGINAL = plan.row_launch_config
_NOW = {"warps": None, "cap": None}


def _patched(width, elem, divides=(), max_block_bytes=8192):
    if _NOW["cap"]:  # at most, so that items in column blocks keep one block per program
        max_block_bytes = min(max_block_bytes, _NOW["cap"])
    block, num_warps = _ORIGINAL(width, elem, divides=divides, max_block_bytes=max_block_bytes)
    return block, _NOW["warps"] or num_warps


def _time(call, flush, rounds: int = 25) -> tuple[float, float]:
    out = []
    for _ in range(rounds):
        flush.zero_()
        torch.cuda._sleep(3_000_000)  # ~1.5 ms head start: the call's host time stays out of the events
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        torch.cuda.synchronize()
        out.append(start.elapsed_time(end) * 1000)
    return min(out), statistics.median(out)


def main() -> None:
    plan.row_launch_config = _patched
    flush = torch.empty(512 * 2**20, dtype=torch.uint8, device="cuda")
    res = {}
    for case, tokens, width, blocks in CASES:
        inp = bmi.make_inputs(tokens, width, "cuda", blocks=blocks, text_width=width // 4 if blocks > 1 else None)
        errors = new_error_word(inp.device)
        forms = {"plain": inp.media, "items": list(inp.items)}
        for warps, cap in CONFIGS:
            _NOW.update(warps=warps, cap=cap)
            row = {}
            for form, media in forms.items():
                def call(media=media, inp=inp, errors=errors):
                    stage_embeddings(inp.slab, inp.ids, inp.table, media=media, media_index=inp.media_index,
                                     pad_to=inp.n, errors=errors)
                call()
                torch.cuda.synchronize()
                assert torch.equal(inp.slab, inp.expected), (case, form, warps, cap)
                row[form] = _time(call, flush)
            key = f"{case} {tokens}x{width} warps={warps} cap={cap}"
            res[key] = row
            print(key, "plain %.1f items %.1f ratio %.3f" % (row["plain"][0], row["items"][0],
                                                             row["items"][0] / row["plain"][0]), flush=True)
    plan.row_launch_config = _ORIGINAL
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "item_launch_config.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
