"""One model layout through the runner: the batch sizes, the checks of each batch, its report and summary."""

from __future__ import annotations

import bisect
import random
import statistics
from dataclasses import dataclass, field

import torch

from ..graph_runner import PrefillBatch, PrefillGraphRunner, default_token_buckets
from ..models import VARIANTS, ToyMultimodalModel
from ..staging import StagingBuffers, StagingError, raise_if_errors
from .batches import build_batch, reference_merge

__all__ = ["Result", "buckets_for", "plan_sizes", "run_variant", "summary"]

MAX_BATCH_SIZE = 8
# The order batch kinds come in on a GPU; a kind with no size in range is skipped.
_KIND_CYCLE = ("between", "exact", "between", "pad>ratio", "between", "beyond")


# -- sizes --------------------------------------------------------------------------------
def buckets_for(capacity: int) -> list[int]:
    """The buckets the demo captures: the default ladder but its top band, so the eager fallback shows."""
    ladder = default_token_buckets(capacity)
    return ladder[:-1] or ladder


def _kind(n: int, buckets: list[int], ratio: float) -> str:
    i = bisect.bisect_left(buckets, n)
    if i == len(buckets):
        return "beyond"
    if buckets[i] == n:
        return "exact"
    return "pad>ratio" if buckets[i] > n * ratio else "between"


def plan_sizes(steps: int, buckets: list[int], capacity: int, ratio: float, rng: random.Random) -> list[tuple]:
    """``steps`` (kind, tokens) pairs cycling through the kinds that occur in ``[1, capacity]``.

    A kind says how the batch relates to the captured buckets: ``exact`` (a
    bucket's size), ``between`` (padded up to the next bucket), ``pad>ratio``
    (that bucket pads too much: eager) and ``beyond`` (past the largest: eager).
    """
    by_kind: dict[str, list[int]] = {}
    for n in range(1, capacity + 1):
        by_kind.setdefault(_kind(n, buckets, ratio), []).append(n)
    cycle = [k for k in _KIND_CYCLE if k in by_kind] or sorted(by_kind)
    return [(kind, rng.choice(by_kind[kind])) for kind in (cycle[i % len(cycle)] for i in range(steps))]


# -- checks -------------------------------------------------------------------------------
def outputs_match(out: torch.Tensor, ref: torch.Tensor) -> bool:
    return torch.equal(out, ref)


def _errors_clean(errors: torch.Tensor) -> bool:
    try:
        raise_if_errors(errors)
    except StagingError:
        return False
    return True


def _mark() -> torch.cuda.Event:
    """A CUDA event recorded now, on the device timeline."""
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def _micros(start: torch.cuda.Event, end: torch.cuda.Event) -> float:
    return start.elapsed_time(end) * 1e3


@dataclass
class Result:
    """What one layout's batches came to."""

    variant: str
    batches: int = 0
    failed: int = 0
    replayed: int = 0
    replay_us: list = field(default_factory=list)
    eager_us: list = field(default_factory=list)


def _header(cuda: bool) -> str:
    head = f"{'#':>3} {'tokens':>6} {'seqs':>4} {'images':>6} {'media':>5}  "
    if cuda:
        head += f"{'kind':<9} {'ran as':<10} {'stage us':>9} {'run us':>9} {'ref us':>9}  "
    return head + "slab  output"


# -- one layout -----------------------------------------------------------------------------
def run_variant(variant: str, args, device: torch.device, dtype: torch.dtype, capacity: int, steps: int,
                say) -> Result:
    """``steps`` random batches of the ``variant`` toy model through a runner over ``capacity`` tokens.

    ``args``: the demo's options (``seed``, ``max_padding_ratio``, ``quiet``); ``say`` prints a line
    unless quiet. Each batch's staged slab, runner output and error word are checked (module docstring
    of :mod:`slabstage.demo`); a line of the report says how it ran and what the checks found.
    """
    cuda = device.type == "cuda"
    model = ToyMultimodalModel(variant, seed=args.seed, device=device, dtype=dtype)
    buckets = buckets_for(capacity)
    marks: list = []  # on CUDA, the event recorded when staging ends (after_stage)
    runner = _runner(model, args, capacity, buckets, marks if cuda else None, say)
    g = torch.Generator().manual_seed(args.seed + VARIANTS.index(variant))
    rng = random.Random(args.seed * 1000 + VARIANTS.index(variant))
    if runner.captured:
        sizes = plan_sizes(steps, buckets, capacity, runner.max_padding_ratio, rng)
    else:  # nothing captured: every batch runs eagerly, unpadded, so the bucket kinds do not apply
        sizes = [(None, rng.randint(1, capacity)) for _ in range(steps)]

    def batch_for(n: int) -> PrefillBatch:
        return build_batch(model, n, num_seqs=rng.randint(1, min(4, n)), media_fraction=rng.uniform(0.0, 0.6),
                           g=g)

    if cuda:
        runner.run(batch_for(sizes[0][1]))  # warm-up: compiles the staging kernels, first replay
    say(_header(cuda))
    result = Result(variant)
    for i, (kind, n) in enumerate(sizes):
        say(f"{i:>3} " + _check_batch(model, runner, batch_for(n), kind, marks if cuda else None, result))
    return result


def _runner(model, args, capacity: int, buckets: list, marks: list | None, say) -> PrefillGraphRunner:
    """The captured runner of ``model`` over a slab of ``capacity`` tokens; ``marks`` (CUDA) gets an event when
    staging ends. Says the layout and what the capture took."""
    declared = getattr(model, "input_embeds_hidden_size", None)
    source = f"declares input_embeds_hidden_size={declared}" if declared else "the config hidden size"
    say(f"\n== {model.variant}: hidden {model.hidden_size}, slab width {model.embed_width} ({source}), "
        f"media rows {model.media_width} wide, expand={model.expand!r}")
    buffers = StagingBuffers.allocate(max_num_tokens=capacity, max_batch_size=MAX_BATCH_SIZE,
                                      embed_width=model.embed_width, embed_dtype=model.dtype, device=model.device)
    runner = PrefillGraphRunner(model, buffers, buckets=buckets, max_padding_ratio=args.max_padding_ratio,
                                after_stage=None if marks is None else (lambda pad_to: marks.append(_mark())),
                                progress=not args.quiet)
    runner.capture()
    if runner.captured:
        say(f"capture: {len(buckets)} graphs ({buckets[0]}..{buckets[-1]} tokens) in "
            f"{runner.capture_seconds:.2f} s, {runner.capture_bytes / 2**20:.1f} MiB")
    return runner


def _check_batch(model, runner: PrefillGraphRunner, batch: PrefillBatch, kind, marks: list | None,
                 result: Result) -> str:
    """Run ``batch`` and check its slab, error word and output against the plain-torch merge and an eager
    forward over it; count it in ``result`` and return its report line (times on CUDA, where ``marks`` is)."""
    n, images, cuda = batch.num_tokens, batch.media or [], marks is not None
    if cuda:
        marks.clear()
    start = _mark() if cuda else None
    out = runner.run(batch, clone=True)
    end = _mark() if cuda else None
    bucket = runner.last_bucket
    pad_to = bucket or n
    ref_views = reference_merge(model, batch, pad_to)
    ref_start = _mark() if cuda else None
    ref = model(ref_views)[:n]
    ref_end = _mark() if cuda else None
    slab_ok = torch.equal(runner.buffers.input_embeds[:pad_to], ref_views["input_embeds"])
    slab_ok = _errors_clean(runner.buffers.errors) and slab_ok
    out_ok = outputs_match(out, ref)
    result.batches += 1
    result.failed += not (slab_ok and out_ok)
    row = f"{n:>6} {batch.seq_lens.shape[0]:>4} {len(images):>6} {sum(item.shape[0] for item in images):>5}  "
    if cuda:
        torch.cuda.synchronize(runner.buffers.device)
        stage_us, run_us = _micros(start, marks[0]), _micros(marks[0], end)
        ref_us = _micros(ref_start, ref_end)
        if bucket is not None:
            result.replayed += 1
            result.replay_us.append(run_us)
            result.eager_us.append(ref_us)
        ran_as = f"graph {bucket}" if bucket is not None else "eager"
        row += f"{kind:<9} {ran_as:<10} {stage_us:>9.1f} {run_us:>9.1f} {ref_us:>9.1f}  "
    return row + f"{'yes' if slab_ok else 'NO':<4}  {'yes' if out_ok else 'NO'}"


def summary(r: Result, cuda: bool) -> str:
    line = f"{r.variant}: {r.batches - r.failed}/{r.batches} batches match the plain-torch merge and its eager forward"
    if not cuda:
        return line + " (no CUDA graphs without a GPU: every batch ran eagerly)"
    line += f" ({r.replayed} replayed from graphs, {r.batches - r.replayed} eager)"
    if r.replay_us:
        line += (f"; median graph run {statistics.median(r.replay_us):.1f} us vs eager forward "
                 f"{statistics.median(r.eager_us):.1f} us")
    return line
