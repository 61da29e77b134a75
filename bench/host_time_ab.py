"""run() host time, another checkout's slabstage against this one, alternated round by round in one process.

    python bench/host_time_ab.py OLD_CHECKOUT [CASES]        (CUDA; CASES: one,items16,host,ds16)

The VM's host varies between leases and within one (a third from one minute to the next), so two trees are
only compared in one process, in turn: OLD_CHECKOUT's ``slabstage`` is copied into a temporary folder as
``slabstage_old`` (its custom ops renamed so that both register) and imported beside this checkout's. Each
case: a runner of each tree (buckets 64/256/1024, a forward of one multiply), new tensors every step
(256 tokens: new ids, positions, media, media index), rounds of 100 steps with a sync every 8, 14 rounds
(the first two are warm-up), the trees' order swapped each round; the min and median of the rounds'
medians. First, the floor: this tree's 256-token graph replayed alone.
"""

from __future__ import annotations

import os
import re
import shutil
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

import slabstage  # noqa: E402

DEV = torch.device("cuda")
H, N = 4096, 256
SPANS = [(16 * k, 8, 8 * k) for k in range(16)]  # 16 spans of 8 media rows: 128 media rows


def old_package(checkout: str):
    """``checkout``'s slabstage, imported as ``slabstage_old``."""
    where = tempfile.mkdtemp()
    shutil.copytree(os.path.join(checkout, "slabstage"), os.path.join(where, "slabstage_old"))
    ops = os.path.join(where, "slabstage_old", "ops.py")
    with open(ops) as f:
        text = re.sub(r"\bslabstage(?=::|\")", "slabstage_old", f.read())
    with open(ops, "w") as f:
        f.write(text.replace("torch.ops.slabstage.", "torch.ops.slabstage_old."))
    sys.path.insert(0, where)
    import slabstage_old
    return slabstage_old


def inputs(case: str, table: torch.Tensor) -> dict:
    ids, pos, where = torch.randint(0, 1000, (N,), device=DEV), torch.arange(N, device=DEV), DEV
    extra = {}
    if case == "items16":
        media = [torch.randn(8, H, dtype=torch.bfloat16, device=DEV) for _ in range(16)]
    elif case == "ds16":
        media = [tuple(torch.randn(8, H, dtype=torch.bfloat16, device=DEV) for _ in range(4)) for _ in range(16)]
    else:
        media = torch.randn(128, H, dtype=torch.bfloat16, device=DEV)
    if case == "host":  # integer inputs on the host: they travel in the parameter block
        ids, pos, where = ids.cpu(), pos.cpu(), "cpu"
        extra = dict(seq_lens=torch.tensor([N], dtype=torch.int32), extend_start_loc=torch.zeros(1, dtype=torch.int32))
    return dict(input_ids=ids, positions=pos, table=table, media=media,
                media_index=slabstage.media_index_from_spans(SPANS, N, device=where), **extra)


def runner(pkg, width: int):
    buffers = pkg.StagingBuffers.allocate(max_num_tokens=8192, max_batch_size=8, embed_width=width,
                                          embed_dtype=torch.bfloat16, device=DEV)
    return pkg.PrefillGraphRunner(lambda views: views["input_embeds"][:, :8] * 2, buffers, buckets=[64, 256, 1024],
                                  progress=False).capture()


def timed(step, batches) -> float:
    """The median µs of ``step(b)`` over ``batches``, a sync every 8 steps."""
    torch.cuda.synchronize()
    times = []
    for i, b in enumerate(batches):
        t0 = time.perf_counter_ns()
        step(b)
        times.append(time.perf_counter_ns() - t0)
        if i % 8 == 7:
            torch.cuda.synchronize()
    return statistics.median(times) / 1e3


def main() -> int:
    old = old_package(sys.argv[1])
    cases = sys.argv[2].split(",") if len(sys.argv) > 2 else ["one", "items16", "host", "ds16"]
    table = torch.randn(1000, H, dtype=torch.bfloat16, device=DEV)
    graph = runner(slabstage, H).graphs[N][0]
    floor = [timed(lambda _: graph.replay(), [None] * 100) for _ in range(14)][2:]
    print(f"graph.replay() alone: min {min(floor):.1f} med {statistics.median(floor):.1f} us", flush=True)
    for case in cases:
        width = 4 * H if case == "ds16" else H
        trees = {"old": (old, runner(old, width)), "new": (slabstage, runner(slabstage, width))}
        medians = {"old": [], "new": []}
        for r in range(14):
            made = [inputs(case, table) for _ in range(100)]
            for name in ("old", "new") if r % 2 else ("new", "old"):
                pkg, run = trees[name]
                median = timed(run.run, [pkg.PrefillBatch(**kw) for kw in made])
                if r >= 2:  # (the first two rounds warm up)
                    medians[name].append(median)
        o, n = medians["old"], medians["new"]
        print(f"{case:8s} run() host us: old min {min(o):6.1f} med {statistics.median(o):6.1f} | new min "
              f"{min(n):6.1f} med {statistics.median(n):6.1f} | ratio of medians "
              f"{statistics.median(o) / statistics.median(n):.2f}x", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
