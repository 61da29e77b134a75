"""``python -m slabstage demo``: stage random multimodal batches, run the prefill forward, check each one independently.

For each layout of :class:`slabstage.models.ToyMultimodalModel` (plain, deepstack,
hyper-connections) the demo allocates :class:`StagingBuffers` at the model's
declared slab width, hands the forward to :class:`PrefillGraphRunner` and runs a
stream of random batches built as an engine builds them: a token stream with a
placeholder token wherever an image goes, the encoder's rows for those images,
and ``media_index`` from the host-side spans.

Every batch is checked against a merge that shares no code with slabstage:
plain torch gathers the table rows of the text tokens, scatters the media rows
to the placeholder rows in order, widens them by the model's policy and zeroes
the padding. The demo requires, bit for bit, that

1. the staged slab (the bucket's rows) equals that merge, and
2. the runner's output equals an eager forward of the model over that merge,

and that the device error word stays clean.

On a GPU the runner captures CUDA graphs and the table shows where each batch
ran (its graph bucket, or eager) and device times from CUDA events. Without a
GPU, ``python -m slabstage demo`` runs the Triton kernels under Triton's
interpreter (``TRITON_INTERPRET=1``, set by ``slabstage.__main__``), nothing is
captured, every batch runs eagerly, and no times are shown: they would time the
interpreter. Exit status 1 when any check fails.

``--model`` naming a Hugging Face family (``qwen3-vl``, ``llama``, ...) hands the arguments to ``slabstage.hf.demo``
(needs ``pip install slabstage[hf]``).
"""

from __future__ import annotations

import argparse
import bisect
import importlib.util
import logging
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .graph_runner import PrefillBatch, PrefillGraphRunner, default_token_buckets
from .kernels import StagingError, media_index_from_spans, raise_if_errors
from .models import VARIANTS, ToyMultimodalModel
from .staging import StagingBuffers

__all__ = ["main", "reference_merge", "widen", "plan_sizes", "kernel_path"]

# toy, then the Hugging Face families slabstage.hf.demo builds (slabstage.hf.tiny.FAMILIES, spelt with dashes)
HF_MODELS = ("qwen3-vl", "qwen3-vl-moe", "qwen2.5-vl", "qwen2-vl", "llama", "qwen2", "qwen3")
MODELS = ("toy", *HF_MODELS)
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_MAX_BATCH_SIZE = 8
# The order batch kinds come in on a GPU; a kind with no size in range is skipped.
_KIND_CYCLE = ("between", "exact", "between", "pad>ratio", "between", "beyond")


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m slabstage demo",
        description="Stage random multimodal batches into the slab of a toy model (plain, deepstack and "
                    "hyper-connection layouts), run them through PrefillGraphRunner (CUDA graphs on a GPU, "
                    "eager on CPU) and check each against an independent plain-torch merge and an eager "
                    "forward over it, bit for bit. Without a GPU the Triton kernels run under Triton's "
                    "interpreter.")
    p.add_argument("--model", choices=MODELS, default="toy",
                   help="toy: the built-in toy model (default); the others: a tiny random Hugging Face model "
                        "of that family (needs pip install slabstage[hf]; its own options follow, see --model "
                        "qwen3-vl --help)")
    p.add_argument("--variant", choices=[*VARIANTS, "all"], default="all",
                   help="which model layout to run (default: all)")
    p.add_argument("--steps", type=int, default=None, help="batches per variant (default: 12 on CUDA, 6 on CPU)")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="slab capacity in tokens (default: 2048 on CUDA, 96 on CPU)")
    p.add_argument("--device", default=None, help="torch device (default: cuda when available, else cpu)")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default=None,
                   help="slab and model dtype (default: bf16 on CUDA, fp32 on CPU)")
    p.add_argument("--max-padding-ratio", type=float, default=1.5,
                   help="batches whose bucket is more than this times their size run eagerly (default: 1.5)")
    p.add_argument("--seed", type=int, default=0, help="seed for weights and batches (default: 0)")
    p.add_argument("--quiet", action="store_true", help="print only the per-variant summaries and the verdict")
    args = p.parse_args(argv)
    if args.steps is not None and args.steps < 1:
        p.error(f"--steps must be >= 1, got {args.steps}")
    if args.max_tokens is not None and args.max_tokens < 1:
        p.error(f"--max-tokens must be >= 1, got {args.max_tokens}")
    if args.max_padding_ratio < 1:
        p.error(f"--max-padding-ratio must be >= 1, got {args.max_padding_ratio}")
    return args


def kernel_path(device: torch.device) -> str:
    """What stages the slab on ``device``: the Triton kernels, under the interpreter or not, or the reference.

    On CPU this follows ``TRITON_INTERPRET`` as slabstage's kernels read it when
    they were defined (``python -m slabstage`` sets it before that when there is
    no GPU).
    """
    has_triton = importlib.util.find_spec("triton") is not None
    if device.type == "cuda":
        return "the Triton kernels" if has_triton else "the PyTorch reference (triton is not installed)"
    if not has_triton:
        return "the PyTorch reference (triton is not installed)"
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return "the Triton kernels under Triton's interpreter (TRITON_INTERPRET=1)"
    return "the PyTorch reference (TRITON_INTERPRET is 0 or unset)"


# -- batches, as an engine builds them ------------------------------------------------------
def build_batch(model: ToyMultimodalModel, n: int, *, num_seqs: int, media_fraction: float,
                g: torch.Generator) -> PrefillBatch:
    """``n`` tokens in ``num_seqs`` packed sequences; each sequence holds at most one image.

    An image is ``round(len * media_fraction)`` placeholder tokens
    (``model.media_token_id``) at a random offset; text ids never equal the
    placeholder. Media rows come from ``model.encode``; ``media_index`` from the
    spans, as an engine that knows where its images sit builds it.
    """
    cuts = (torch.randperm(n - 1, generator=g)[: num_seqs - 1] + 1).sort().values.tolist()
    starts = [0, *cuts]
    lens = [end - start for start, end in zip(starts, [*cuts, n])]
    input_ids = torch.randint(0, model.media_token_id, (n,), generator=g)  # media_token_id is the last id
    spans, num_media = [], 0
    for start, length in zip(starts, lens):
        m = round(length * media_fraction)
        if m:
            dst = start + int(torch.randint(0, length - m + 1, (1,), generator=g))
            input_ids[dst:dst + m] = model.media_token_id
            spans.append((dst, m, num_media))
            num_media += m
    media = media_index = None
    if num_media:
        media = model.encode(torch.randn(num_media, model.patch_dim, generator=g))
        media_index = media_index_from_spans(spans, n, device="cpu", num_media_rows=num_media)
    return PrefillBatch(
        input_ids=input_ids, positions=torch.cat([torch.arange(length) for length in lens]),
        table=model.embed_tokens.weight, seq_lens=torch.tensor(lens, dtype=torch.int32),
        extend_start_loc=torch.tensor(starts, dtype=torch.int32), media=media, media_index=media_index,
        expand=model.expand)


def widen(rows: torch.Tensor, width: int, expand: str) -> torch.Tensor:
    """``rows`` at ``width`` columns by the width contract's ``expand`` policy (plain torch, no slabstage code):
    zeros past their own width, or repeated across it."""
    if rows.shape[1] == width:
        return rows
    if expand == "repeat":
        return rows.repeat(1, width // rows.shape[1])
    return F.pad(rows, (0, width - rows.shape[1]))


def reference_merge(model: ToyMultimodalModel, batch: PrefillBatch, pad_to: int) -> dict:
    """The forward's inputs for ``batch`` padded to ``pad_to`` rows, merged in plain torch.

    ``input_embeds``: text rows are table rows gathered by id, media rows are
    ``batch.media`` scattered to the placeholder rows in order, both widened to
    the slab by ``model.expand``; rows ``[n, pad_to)`` are zero. ``positions``:
    the batch's, then zeros. Uses neither ``media_index`` nor any slabstage code.
    """
    n = batch.num_tokens
    device, dtype, width = model.device, model.dtype, model.embed_width
    ids = batch.input_ids.to(device)
    is_media = ids == model.media_token_id
    num_media = 0 if batch.media is None else batch.media.shape[0]
    if int(is_media.sum()) != num_media:
        raise AssertionError(f"{int(is_media.sum())} placeholder tokens for {num_media} media rows")
    embeds = torch.zeros(pad_to, width, dtype=dtype, device=device)
    merged = widen(batch.table[ids].to(dtype), width, model.expand)
    if num_media:
        merged[is_media] = widen(batch.media.to(dtype), width, model.expand)
    embeds[:n] = merged
    positions = torch.zeros(pad_to, dtype=torch.int64, device=device)
    positions[:n] = batch.positions.to(device)
    return {"input_embeds": embeds, "positions": positions}


# -- sizes --------------------------------------------------------------------------------
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


def slabs_match(staged: torch.Tensor, ref: torch.Tensor) -> bool:
    return torch.equal(staged, ref)


def _errors_clean(errors: torch.Tensor) -> bool:
    try:
        raise_if_errors(errors)
    except StagingError:
        return False
    return True


class _Clock:
    """CUDA events on the device timeline."""

    @staticmethod
    def mark() -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    @staticmethod
    def micros(start: torch.cuda.Event, end: torch.cuda.Event) -> float:
        return start.elapsed_time(end) * 1e3


@dataclass
class _Result:
    variant: str
    batches: int = 0
    failed: int = 0
    replayed: int = 0
    replay_us: list | None = None
    eager_us: list | None = None


def _run_variant(variant: str, args, device: torch.device, dtype: torch.dtype, capacity: int, steps: int,
                 say) -> _Result:
    cuda = device.type == "cuda"
    model = ToyMultimodalModel(variant, seed=args.seed, device=device, dtype=dtype)
    declared = getattr(model, "input_embeds_hidden_size", None)
    source = f"declares input_embeds_hidden_size={declared}" if declared else "the config hidden size"
    say(f"\n== {variant}: hidden {model.hidden_size}, slab width {model.embed_width} ({source}), "
        f"media rows {model.media_width} wide, expand={model.expand!r}")
    buffers = StagingBuffers.allocate(max_num_tokens=capacity, max_batch_size=_MAX_BATCH_SIZE,
                                      embed_width=model.embed_width, embed_dtype=dtype, device=device)
    buckets = _buckets(capacity)
    marks: list = []
    runner = PrefillGraphRunner(model, buffers, buckets=buckets, max_padding_ratio=args.max_padding_ratio,
                                after_stage=(lambda pad_to: marks.append(_Clock.mark())) if cuda else None,
                                progress=not args.quiet)
    runner.capture()
    if runner.captured:
        say(f"capture: {len(buckets)} graphs ({buckets[0]}..{buckets[-1]} tokens) in "
            f"{runner.capture_seconds:.2f} s, {runner.capture_bytes / 2**20:.1f} MiB")

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
        say(f"{'#':>3} {'tokens':>6} {'seqs':>4} {'media':>5}  {'kind':<9} {'ran as':<10} "
            f"{'stage us':>9} {'run us':>9} {'ref us':>9}  slab  output")
    else:
        say(f"{'#':>3} {'tokens':>6} {'seqs':>4} {'media':>5}  slab  output")
    result = _Result(variant, replay_us=[], eager_us=[])
    for i, (kind, n) in enumerate(sizes):
        batch = batch_for(n)
        num_media = 0 if batch.media is None else batch.media.shape[0]
        marks.clear()
        start = _Clock.mark() if cuda else None
        out = runner.run(batch, clone=True)
        end = _Clock.mark() if cuda else None
        bucket = runner.last_bucket
        pad_to = bucket or n
        ref_views = reference_merge(model, batch, pad_to)
        ref_start = _Clock.mark() if cuda else None
        ref = model(ref_views)[:n]
        ref_end = _Clock.mark() if cuda else None
        slab_ok = slabs_match(buffers.input_embeds[:pad_to], ref_views["input_embeds"])
        slab_ok = _errors_clean(buffers.errors) and slab_ok
        out_ok = outputs_match(out, ref)
        result.batches += 1
        result.failed += not (slab_ok and out_ok)
        verdict = "yes" if slab_ok else "NO", "yes" if out_ok else "NO"
        if cuda:
            torch.cuda.synchronize(device)
            stage_us, run_us = _Clock.micros(start, marks[0]), _Clock.micros(marks[0], end)
            ref_us = _Clock.micros(ref_start, ref_end)
            if bucket is not None:
                result.replayed += 1
                result.replay_us.append(run_us)
                result.eager_us.append(ref_us)
            ran_as = f"graph {bucket}" if bucket is not None else "eager"
            say(f"{i:>3} {n:>6} {batch.seq_lens.shape[0]:>4} {num_media:>5}  {kind:<9} {ran_as:<10} "
                f"{stage_us:>9.1f} {run_us:>9.1f} {ref_us:>9.1f}  {verdict[0]:<4}  {verdict[1]}")
        else:
            say(f"{i:>3} {n:>6} {batch.seq_lens.shape[0]:>4} {num_media:>5}  {verdict[0]:<4}  {verdict[1]}")
    return result


def _summary(r: _Result, cuda: bool) -> str:
    line = f"{r.variant}: {r.batches - r.failed}/{r.batches} batches match the plain-torch merge and its eager forward"
    if not cuda:
        return line + " (no CUDA graphs without a GPU: every batch ran eagerly)"
    line += f" ({r.replayed} replayed from graphs, {r.batches - r.replayed} eager)"
    if r.replay_us:
        line += (f"; median graph run {statistics.median(r.replay_us):.1f} us vs eager forward "
                 f"{statistics.median(r.eager_us):.1f} us")
    return line


def _hf_demo(argv: list[str]) -> int:
    try:
        from .hf.demo import main as hf_main
    except ImportError as e:
        print(f"demo: --model {argv[1]} needs the Hugging Face extra: pip install 'slabstage[hf]' ({e})",
              file=sys.stderr)
        return 2
    return hf_main(argv)


def _split_model(argv: list[str]) -> tuple[str, list[str]]:
    """``--model`` and the other arguments (those go to the chosen model's demo)."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--model", default="toy")  # a bad value is refused by the full parser, with its usage
    known, rest = pre.parse_known_args(argv)
    return known.model, rest


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    model_name, rest = _split_model(argv)
    if model_name in HF_MODELS:
        return _hf_demo(["--model", model_name, *rest])
    args = _parse(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        print(f"demo: --device {args.device} asked for, but no CUDA device is available", file=sys.stderr)
        return 2
    cuda = device.type == "cuda"
    dtype = _DTYPES[args.dtype or ("bf16" if cuda else "fp32")]
    capacity = args.max_tokens or (2048 if cuda else 96)
    steps = args.steps or (12 if cuda else 6)
    variants = list(VARIANTS) if args.variant == "all" else [args.variant]

    def say(line: str) -> None:
        if not args.quiet:
            print(line, flush=True)

    log = logging.getLogger("slabstage")  # the runner's capture (or eager) line, shown inline
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("log: %(message)s"))
    saved = log.level, log.propagate
    log.setLevel(logging.ERROR if args.quiet else logging.INFO)
    log.addHandler(handler)
    log.propagate = False
    started = time.perf_counter()
    print(f"slabstage demo: {', '.join(variants)} on {device} ({str(dtype).removeprefix('torch.')}), "
          f"slab capacity {capacity} tokens, {steps} batches per variant, seed {args.seed}")
    print(f"staging: {kernel_path(device)}")
    if cuda:
        buckets = _buckets(capacity)
        say(f"graphs: {len(buckets)} buckets ({buckets[0]}..{buckets[-1]} tokens); a batch above {buckets[-1]} "
            f"tokens, or whose bucket exceeds {args.max_padding_ratio}x its size, runs eagerly. "
            "Times: device us from CUDA events (stage; run = graph replay or eager forward; ref = eager "
            "forward over the plain-torch merge)")
    else:
        print("graphs: none, CUDA graphs need a GPU: the runner runs every batch eagerly on the staged buffers; "
              "no times shown (CPU times say nothing of the GPU path)")
    say("checks per batch, bit for bit: slab = staged rows vs a plain-torch merge (table rows by id, media rows "
        "at their placeholders, zero padding); output = the runner's vs an eager forward over that merge")
    results = []
    try:
        with torch.no_grad():
            for variant in variants:
                results.append(_run_variant(variant, args, device, dtype, capacity, steps, say))
    finally:
        log.removeHandler(handler)
        log.setLevel(saved[0])
        log.propagate = saved[1]
    print()
    for r in results:
        print(_summary(r, cuda))
    total, bad = sum(r.batches for r in results), sum(r.failed for r in results)
    elapsed = time.perf_counter() - started
    if bad:
        print(f"demo: FAILED: {bad} of {total} batches differ from the plain-torch merge or its eager forward "
              f"({elapsed:.1f} s)")
        return 1
    print(f"demo: OK: all {total} batches match the plain-torch merge and its eager forward, bit for bit "
          f"({elapsed:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
