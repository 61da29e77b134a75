"""Where the time of media items goes: forms of the same media rows, the item table kept or copied (GPU).

    PYTHONPATH=$PWD python3 tools/probe_item_forms.py   # JSON to $OUT/item_forms.json (default /tmp)

Times ``stage_embeddings`` (device time per call, each call after an L2 flush and a host head start
long enough to cover its host time) on ``bench/bench_media_items.py``'s inputs, the media given as:

- ``plain``: one pre-concatenated tensor;
- ``items``: the bench's items (16 tensors, or 16 tuples of 4 column blocks);
- ``wide_items``: 16 items, each one tensor of full width (row slices of ``plain``);
- ``views``: 16 tuples of column views of ``plain`` (the memory of ``plain``, read through the table);
- ``one_item_blocks``: one item, a tuple of 4 separate block tensors (as an encoder returns DeepStack);
- ``odd_pool``: 16 tuples of 4 blocks at offsets in one pool that are not powers of two apart.

Each item form twice: ``kept`` (the same items every call: the item table is copied to the device once)
and ``copied`` (``ITEM_TABLES.clear()`` before each call: each call copies its table first). Also the
latency of a bare host-to-device copy of a few table sizes. How the items' overhead was found to be
the table's copy, not the kernel's item lookup.
"""
import json
import os

import torch
from probe_item_launch_config import _time as _time_rounds  # (tools/ is the script's directory)
from probe_item_launch_config import bmi  # bench/bench_media_items.py, loaded once

from slabstage import stage_embeddings
from slabstage.kernels.errors import new_error_word
from slabstage.kernels.plan import ITEM_TABLES

CASES = [(8192, 8192, 4), (8192, 16384, 4), (8192, 4096, 1)]  # tokens, slab width, column blocks per item
COPY_BYTES = [64, 640, 1024, 1280, 2048, 4096, 65536]


def _time(call, flush) -> tuple[float, float]:
    """(min, median) µs of 30 calls, each after an L2 flush and a host head start."""
    low, median = _time_rounds(call, flush, rounds=30)
    return round(low, 2), round(median, 2)


def _forms(inp, blocks: int) -> dict:
    media, width = inp.media, inp.width
    starts = [sum(inp.lens[:i]) for i in range(len(inp.lens))]
    h = width // blocks
    cols = [(j * h, (j + 1) * h) for j in range(blocks)]
    forms = {"plain": media, "items": list(inp.items),
             "wide_items": [media[s:s + n] for s, n in zip(starts, inp.lens)]}
    if blocks > 1:
        forms["views"] = [tuple(media[s:s + n, a:b] for a, b in cols) for s, n in zip(starts, inp.lens)]
        forms["one_item_blocks"] = [tuple(media[:, a:b].contiguous() for a, b in cols)]
        pool = torch.empty(media.numel() + 64 * 4096, dtype=media.dtype, device=media.device)
        at, odd = 0, []
        for s, n in zip(starts, inp.lens):
            parts = []
            for a, b in cols:
                t = pool[at:at + n * h].view(n, h)
                t.copy_(media[s:s + n, a:b])
                parts.append(t)
                at += n * h + 2048 + 8 * 37  # 16-byte aligned, not a power of two apart
            odd.append(tuple(parts))
        forms["odd_pool"] = odd
    return forms


def main() -> None:
    flush = torch.empty(512 * 2**20, dtype=torch.uint8, device="cuda")
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    for nbytes in COPY_BYTES:
        pinned = torch.ones(nbytes, dtype=torch.uint8).pin_memory()
        dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        key = f"h2d copy {nbytes} B"
        res[key] = _time(lambda dev=dev, pinned=pinned: dev.copy_(pinned, non_blocking=True), flush)
        print(key, res[key], flush=True)
    for tokens, width, blocks in CASES:
        inp = bmi.make_inputs(tokens, width, "cuda", blocks=blocks, text_width=width // blocks)
        errors = new_error_word(inp.device)
        for form, media in _forms(inp, blocks).items():
            for table in ("kept",) if form == "plain" else ("kept", "copied"):
                def call(media=media, fresh=table == "copied", inp=inp, errors=errors):
                    if fresh:
                        ITEM_TABLES.clear()
                    stage_embeddings(inp.slab, inp.ids, inp.table, media=media, media_index=inp.media_index,
                                     pad_to=inp.n, errors=errors)
                call()
                torch.cuda.synchronize()
                assert torch.equal(inp.slab, inp.expected), form
                key = f"{tokens}x{width} blocks={blocks} {form} table={table}"
                res[key] = _time(call, flush)
                print(key, "min %.2f median %.2f" % res[key], flush=True)
        del inp
        torch.cuda.empty_cache()
    out = os.path.join(os.environ.get("OUT", "/tmp"), "item_forms.json")
    with open(out, "w") as f:
        json.dump(res, f, indent=1)
    print("wrote", out)


if __name__ == "__main__":
    main()
