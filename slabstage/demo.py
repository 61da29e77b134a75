"""``python -m slabstage demo``: stage, capture and replay the toy model; check every batch against eager.

For each variant of :class:`slabstage.models.ToyMultimodalModel` (plain, deepstack,
hyper-connections) the demo allocates :class:`StagingBuffers` at the model's
declared slab width, captures the forward with :class:`PrefillGraphRunner` (on a
machine without CUDA the runner runs eagerly and logs so), then runs a stream of
random multimodal batches of varied sizes: exactly on a bucket, between buckets,
padding beyond the allowed ratio, and beyond the largest bucket. After each run
it calls the model eagerly on the same staged buffers, cut to the same bucket,
and requires a bit-identical result (``torch.equal``).

Times are device times from CUDA events on a GPU and host times on CPU (where
the work is synchronous): ``stage`` is the runner's staging (integer inputs and
the embedding slab), ``replay`` is what follows it in ``run`` (the graph replay,
or the runner's eager forward when the batch has no bucket), ``eager`` is the
reference eager forward. Exit status 1 when any batch differs.
"""

from __future__ import annotations

import argparse
import bisect
import logging
import random
import statistics
import sys
import time

import torch

from .graph_runner import PrefillGraphRunner, default_token_buckets
from .models import VARIANTS, ToyMultimodalModel, make_batch
from .staging import StagingBuffers

__all__ = ["main"]

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_MAX_BATCH_SIZE = 8
# The order batch kinds come in; a kind with no size in range is skipped.
_KIND_CYCLE = ("between", "exact", "between", "pad>ratio", "between", "beyond")


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m slabstage demo",
        description="Stage random multimodal batches into the slab, replay the captured prefill graphs of a toy "
                    "model (plain, deepstack and hyper-connection layouts) and check each result against an "
                    "eager forward on the same buffers (bit-identical).")
    p.add_argument("--variant", choices=[*VARIANTS, "all"], default="all",
                   help="which model layout to run (default: all)")
    p.add_argument("--steps", type=int, default=12, help="batches per variant (default: 12)")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="slab capacity in tokens (default: 2048 on CUDA, 256 on CPU)")
    p.add_argument("--device", default=None, help="torch device (default: cuda when available, else cpu)")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default=None,
                   help="slab and model dtype (default: bf16 on CUDA, fp32 on CPU)")
    p.add_argument("--max-padding-ratio", type=float, default=1.5,
                   help="batches whose bucket is more than this times their size run eagerly (default: 1.5)")
    p.add_argument("--seed", type=int, default=0, help="seed for weights and batches (default: 0)")
    p.add_argument("--quiet", action="store_true", help="print only the per-variant summaries and the verdict")
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error(f"--steps must be >= 1, got {args.steps}")
    if args.max_tokens is not None and args.max_tokens < 1:
        p.error(f"--max-tokens must be >= 1, got {args.max_tokens}")
    if args.max_padding_ratio < 1:
        p.error(f"--max-padding-ratio must be >= 1, got {args.max_padding_ratio}")
    return args


class _Clock:
    """Marks on the device timeline (CUDA events) or on the host clock (CPU work is synchronous)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def micros(self, start, end) -> float:
        return start.elapsed_time(end) * 1e3 if self.cuda else (end - start) * 1e6


def _buckets(capacity: int) -> list[int]:
    ladder = default_token_buckets(capacity)
    return ladder[:-1] or ladder  # the top band stays uncaptured, so the eager fallback shows


def _kind(n: int, buckets: list[int], ratio: float) -> str:
    i = bisect.bisect_left(buckets, n)
    if i == len(buckets):
        return "beyond"
    if buckets[i] == n:
        return "exact"
    return "pad>ratio" if buckets[i] > n * ratio else "between"


def plan_sizes(steps: int, buckets: list[int], capacity: int, ratio: float, rng: random.Random) -> list[tuple]:
    """``steps`` (kind, tokens) pairs cycling through the kinds that occur in ``[1, capacity]``."""
    by_kind: dict[str, list[int]] = {}
    for n in range(1, capacity + 1):
        by_kind.setdefault(_kind(n, buckets, ratio), []).append(n)
    cycle = [k for k in _KIND_CYCLE if k in by_kind] or sorted(by_kind)
    return [(kind, rng.choice(by_kind[kind])) for kind in (cycle[i % len(cycle)] for i in range(steps))]


def outputs_match(out: torch.Tensor, ref: torch.Tensor) -> bool:
    return torch.equal(out, ref)


def _run_variant(variant: str, args, device: torch.device, dtype: torch.dtype, capacity: int, say) -> tuple:
    model = ToyMultimodalModel(variant, seed=args.seed, device=device, dtype=dtype)
    declared = getattr(model, "input_embeds_hidden_size", None)
    source = f"declares input_embeds_hidden_size={declared}" if declared else "the config hidden size"
    say(f"\n== {variant}: hidden {model.hidden_size}, slab width {model.embed_width} ({source}), "
        f"media rows {model.media_width} wide, expand={model.expand!r}")
    buffers = StagingBuffers.allocate(max_num_tokens=capacity, max_batch_size=_MAX_BATCH_SIZE,
                                      embed_width=model.embed_width, embed_dtype=dtype, device=device)
    buckets = _buckets(capacity)
    clock = _Clock(device)
    marks: list = []
    runner = PrefillGraphRunner(model, buffers, buckets=buckets, max_padding_ratio=args.max_padding_ratio,
                                after_stage=lambda pad_to: marks.append(clock.mark()), progress=not args.quiet)
    runner.capture()
    if runner.captured:
        say(f"capture: {len(buckets)} graphs ({buckets[0]}..{buckets[-1]} tokens) in "
            f"{runner.capture_seconds:.2f} s, {runner.capture_bytes / 2**20:.1f} MiB")
    else:
        say(f"capture: none on {device}, the runner runs every batch eagerly; "
            f"each result is still checked against a second eager forward")

    g = torch.Generator().manual_seed(args.seed + VARIANTS.index(variant))
    rng = random.Random(args.seed * 1000 + VARIANTS.index(variant))
    sizes = plan_sizes(args.steps, buckets, capacity, runner.max_padding_ratio, rng)

    def batch_for(n: int):
        return make_batch(model, n, media_fraction=rng.uniform(0.0, 0.6),
                          num_seqs=rng.randint(1, min(4, n)), generator=g)

    runner.run(batch_for(sizes[0][1]))  # warm-up: compiles the staging kernels, first replay
    say(f"{'#':>3} {'tokens':>6} {'seqs':>4} {'media':>5}  {'kind':<9} {'route':<10} "
        f"{'stage us':>9} {'replay us':>10} {'eager us':>9}  match")
    rows, mismatches = [], 0
    for i, (kind, n) in enumerate(sizes):
        batch = batch_for(n)
        num_media = 0 if batch.media is None else batch.media.shape[0]
        marks.clear()
        start = clock.mark()
        out = runner.run(batch, clone=True)
        end = clock.mark()
        bucket = runner.last_bucket
        ref_start = clock.mark()
        ref = model(buffers.registry.views(bucket or n))[:n]
        ref_end = clock.mark()
        if clock.cuda:
            torch.cuda.synchronize(device)
        ok = outputs_match(out, ref)
        mismatches += not ok
        stage_us = clock.micros(start, marks[0])
        replay_us = clock.micros(marks[0], end)
        eager_us = clock.micros(ref_start, ref_end)
        rows.append((bucket, replay_us, eager_us))
        route = f"graph {bucket}" if bucket is not None else "eager"
        say(f"{i:>3} {n:>6} {batch.seq_lens.shape[0]:>4} {num_media:>5}  {kind:<9} {route:<10} "
            f"{stage_us:>9.1f} {replay_us:>10.1f} {eager_us:>9.1f}  {'yes' if ok else 'NO'}")

    replays = [(r, e) for b, r, e in rows if b is not None]
    summary = (f"{variant}: {len(rows) - mismatches}/{len(rows)} batches bit-identical to eager "
               f"({len(replays)} replayed, {len(rows) - len(replays)} eager)")
    if replays:
        summary += (f"; median replay {statistics.median(r for r, _ in replays):.1f} us vs eager "
                    f"{statistics.median(e for _, e in replays):.1f} us")
    return summary, len(rows), mismatches


def main(argv: list[str] | None = None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        print(f"demo: --device {args.device} asked for, but no CUDA device is available", file=sys.stderr)
        return 2
    dtype = _DTYPES[args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    capacity = args.max_tokens or (2048 if device.type == "cuda" else 256)
    variants = list(VARIANTS) if args.variant == "all" else [args.variant]

    def say(line: str) -> None:
        if not args.quiet:
            print(line, flush=True)

    log = logging.getLogger("slabstage")  # the runner's capture (or eager) line, shown inline
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("log: %(message)s"))
    saved = log.level, log.propagate
    log.setLevel(logging.WARNING if args.quiet else logging.INFO)
    log.addHandler(handler)
    log.propagate = False
    started = time.perf_counter()
    try:
        buckets = _buckets(capacity)
        say(f"slabstage demo: {', '.join(variants)} on {device} ({dtype}), slab capacity {capacity} tokens, "
            f"{args.steps} batches per variant, seed {args.seed}")
        say(f"buckets: {len(buckets)} ({buckets[0]}..{buckets[-1]} tokens); a batch above {buckets[-1]} tokens, "
            f"or whose bucket exceeds {args.max_padding_ratio}x its size, runs eagerly")
        summaries, total, bad = [], 0, 0
        with torch.no_grad():
            for variant in variants:
                summary, count, mismatches = _run_variant(variant, args, device, dtype, capacity, say)
                summaries.append(summary)
                total += count
                bad += mismatches
    finally:
        log.removeHandler(handler)
        log.setLevel(saved[0])
        log.propagate = saved[1]
    print()
    for summary in summaries:
        print(summary)
    elapsed = time.perf_counter() - started
    if bad:
        print(f"demo: FAILED: {bad} of {total} batches differ from eager ({elapsed:.1f} s)")
        return 1
    print(f"demo: OK: all {total} batches bit-identical to eager ({elapsed:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
