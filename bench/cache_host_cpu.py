"""run()'s host time on the CPU with cache entries as media, device launches stubbed out (issue 38's host target).

    TRITON_INTERPRET=1 python bench/cache_host_cpu.py [--calls 5000] [--profile CASE]

The runner's stager takes its Triton path (the interpreter) with ``Stager._kernel`` and ``Stager._fetch`` made
no-ops, so a call is the checks and the parameter block (and the eager forward of almost nothing). Cases, µs a
call (median of blocks of 100 calls): ``one`` (one media tensor), ``entries`` (16 cache entries), ``deep`` (16
entries of 4 DeepStack blocks), ``entries_get`` (16 entries, their ``get_many`` in the call), ``get_many`` (16
keys' lookup alone), ``items`` (16 item tensors). Each case's extra over ``one`` is printed per entry.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import sys
import time

os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout's slabstage

import torch  # noqa: E402

import slabstage as ss  # noqa: E402
from slabstage.cache import EncoderCache  # noqa: E402
from slabstage.kernels import launch  # noqa: E402

N, W = 256, 64


def cases() -> dict:
    bufs = ss.StagingBuffers.allocate(max_num_tokens=N, max_batch_size=4, embed_width=W, embed_dtype=torch.float32,
                                      device="cpu")
    runner = ss.PrefillGraphRunner(lambda v: v["input_embeds"][:1], bufs, buckets=[N], progress=False)
    rows, per, pool = N // 2, N // 32, 8
    table = torch.randn(1000, W)
    ids = torch.randint(0, 1000, (pool, N))
    pos = torch.arange(N).repeat(pool, 1)
    index = torch.full((N,), -1, dtype=torch.int64)
    gap = (N - rows) // 16
    for r in range(16):
        at = r * (gap + per) + gap
        index[at:at + per] = torch.arange(r * per, (r + 1) * per)
    media = torch.randn(pool, rows, W)
    items = torch.randn(pool, 16, per, W)
    cache = EncoderCache(W, torch.float32, "cpu", device_budget_bytes=64 * per * W * 4)
    deep = EncoderCache(W, torch.float32, "cpu", device_budget_bytes=64 * per * W * 4)
    keys = list(range(16))
    for k in keys:
        cache.put(k, torch.randn(per, W))
        deep.put(k, tuple(torch.randn(per, W // 4) for _ in range(4)))
    counts = [per] * 16
    got, dgot = cache.get_many(keys, counts), deep.get_many(keys, counts)
    state = [0]

    def step(media_of):
        i = state[0] = state[0] + 1
        j = i % pool
        return runner.run(ss.PrefillBatch(input_ids=ids[j], positions=pos[j], table=table, media=media_of(j),
                                          media_index=index))

    return {
        "one": lambda: step(lambda j: media[j]),
        "entries": lambda: step(lambda j: got),
        "deep": lambda: step(lambda j: dgot),
        "entries_get": lambda: step(lambda j: cache.get_many(keys, counts)),
        "get_many": lambda: cache.get_many(keys, counts),
        "items": lambda: step(lambda j: list(items[j])),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=5000)
    ap.add_argument("--profile", default=None)
    args = ap.parse_args()

    def kernel(self, grid, params):  # (what the kernel reports: the step it staged)
        self.ring._done[0] = self._pending[0]

    launch.Stager._kernel = kernel
    launch.Stager._fetch = lambda self, grid: None
    got = {}
    for name, fn in cases().items():
        if args.profile and name != args.profile:
            continue
        for _ in range(200):
            fn()
        if args.profile:
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(args.calls):
                fn()
            prof.disable()
            pstats.Stats(prof).sort_stats("tottime").print_stats(25)
            continue
        blocks = []
        for _ in range(args.calls // 100):
            t0 = time.perf_counter_ns()
            for _ in range(100):
                fn()
            blocks.append((time.perf_counter_ns() - t0) / 100 / 1e3)
        got[name] = statistics.median(blocks)
        extra = "" if name in ("one", "get_many") else \
            f"  ({got[name] / got['one']:.2f}x one; {(got[name] - got['one']) / 16:+.2f} us an item)"
        print(f"{name}: {got[name]:.1f} us a call{extra}", flush=True)


if __name__ == "__main__":
    main()
