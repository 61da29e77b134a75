"""Where does capture memory go? Reserved/allocated bytes per bucket, and the graph pool's segments.

    python tools/probe_capture_memory.py [--tokens 4096] [--json out.json]

For the toy model of bench/bench_graph_runner.py: captures the largest bucket
alone, then the whole ladder, recording before/after each forward call (warm-up
and capture) the reserved and allocated bytes, and at the end the segments of
the graph pool (size, allocated, blocks). Prints a summary; ``--json`` keeps all.
"""

from __future__ import annotations

import argparse
import gc
import json

import torch

from slabstage import PrefillGraphRunner, StagingBuffers, default_token_buckets
from slabstage.models import ToyMultimodalModel

MiB = 2**20


def _pool_segments(pool) -> list[dict]:
    segs = []
    for s in torch.cuda.memory_snapshot():
        if pool is not None and tuple(s.get("segment_pool_id", ())) != tuple(pool):
            continue
        segs.append(dict(pool=list(s.get("segment_pool_id", ())), size=s["total_size"],
                         allocated=s["allocated_size"], type=s["segment_type"], stream=s["stream"],
                         blocks=[(b["size"], b["state"]) for b in s["blocks"]]))
    return segs


def measure(buckets, tokens, skip_warmup=False):
    model = ToyMultimodalModel("plain", hidden_size=1024, vocab_size=32000, num_layers=4, num_heads=16,
                               device="cuda", dtype=torch.bfloat16, seed=0)
    buffers = StagingBuffers.allocate(max_num_tokens=tokens, max_batch_size=16, embed_width=model.embed_width,
                                      embed_dtype=torch.bfloat16, device="cuda")
    trace = []

    def forward(views):
        capturing = torch.cuda.is_current_stream_capturing()
        T = views["input_embeds"].shape[0]
        if skip_warmup and not capturing and T != max(buckets):
            return None
        r0, a0 = torch.cuda.memory_reserved(), torch.cuda.memory_allocated()
        out = model(views)
        trace.append(dict(T=T, capturing=capturing, reserved_before=r0, allocated_before=a0,
                          reserved_after=torch.cuda.memory_reserved(),
                          allocated_after=torch.cuda.memory_allocated(),
                          peak=torch.cuda.max_memory_allocated()))
        return out

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    # verify="off": the capture check's eager forward would allocate outside the pool, and with
    # skip_warmup the forward returns None outside capture, which the check cannot compare
    r = PrefillGraphRunner(forward, buffers, buckets=buckets, progress=False, verify="off").capture()
    segs = _pool_segments(r.pool)
    others = [s for s in _pool_segments(None) if tuple(s["pool"]) != tuple(r.pool)]
    res = dict(buckets=len(buckets), capture_bytes=r.capture_bytes, capture_s=r.capture_seconds,
               pool_bytes=sum(s["size"] for s in segs), pool_allocated=sum(s["allocated"] for s in segs),
               pool_segments=segs, other_segments=[{k: v for k, v in s.items() if k != "blocks"} for s in others],
               trace=trace)
    r.reset()
    del r, buffers, forward
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return res


def main():
    ap = argparse.ArgumentParser(description="Where capture memory goes, for the toy model (CUDA only).")
    ap.add_argument("--tokens", type=int, default=4096, help="slab capacity and largest bucket (default 4096)")
    ap.add_argument("--json", help="write every measurement to this file")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("probe_capture_memory: needs a CUDA device (it reads the CUDA caching allocator)")
    ladder = default_token_buckets(a.tokens)
    out = {}
    for name, buckets, skip in (("largest", [a.tokens], False), ("ladder", ladder, False),
                                ("largest2", [a.tokens], False), ("ladder_no_warmup", ladder, True)):
        res = measure(buckets, a.tokens, skip)
        out[name] = res
        print(f"{name:18s} buckets={res['buckets']:3d} capture={res['capture_bytes']/MiB:8.1f} MiB "
              f"pool={res['pool_bytes']/MiB:8.1f} MiB (allocated {res['pool_allocated']/MiB:.1f}) "
              f"segments={len(res['pool_segments'])} s={res['capture_s']:.2f}")
        for s in res["pool_segments"]:
            print(f"    seg {s['size']/MiB:7.2f} MiB {s['type']:5s} alloc {s['allocated']/MiB:7.2f} "
                  f"blocks {[(round(b / MiB, 2), st[0]) for b, st in s['blocks']][:12]}")
        for s in res["other_segments"]:
            print(f"    other {s['pool']} {s['size']/MiB:7.2f} MiB alloc {s['allocated']/MiB:7.2f}")
        steps = [t for t in res["trace"] if t["capturing"]][:6]
        for t in steps:
            print(f"    T={t['T']:5d} reserved {t['reserved_before']/MiB:8.1f} -> {t['reserved_after']/MiB:8.1f} "
                  f"allocated {t['allocated_before']/MiB:8.1f} -> {t['allocated_after']/MiB:8.1f} "
                  f"peak {t['peak']/MiB:8.1f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f)


if __name__ == "__main__":
    main()
