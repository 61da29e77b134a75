"""A representative multimodal prefill workload to look at in Nsight Systems (or torch.profiler).

    nsys profile -t cuda,nvtx -o slabstage python bench/nvtx_workload.py
    nsys profile -t cuda,nvtx --capture-range=cudaProfilerApi python bench/nvtx_workload.py   # steady state only
    python bench/nvtx_workload.py --torch-profiler trace.json   # Chrome trace (chrome://tracing, Perfetto)

It allocates :class:`slabstage.StagingBuffers`, builds a small model that reads
``views["input_embeds"]`` (:class:`slabstage.models.ToyMultimodalModel` when it
is there, else two ``nn.Linear`` layers), captures it with
:class:`slabstage.PrefillGraphRunner` over the default bucket ladder up to
``--graph-max-tokens`` (half the capacity, as engines cap their prefill graphs),
then runs a stream of multimodal batches of varied sizes (host-side integer
inputs, half the rows media in one span per sequence): each step stages and
replays, or runs eagerly when the batch is larger than the largest graph.

In the timeline, each step is a ``profile.step`` range holding ``slabstage.stage``
(two short kernels: token inputs and embeddings, after one host-to-device copy)
and ``slabstage.replay`` (one graph launch) or ``slabstage.eager`` (the model's
kernels, launched one by one); ``slabstage.capture`` covers the capture at the
start. Without CUDA every batch runs eagerly, and the script says so. The
cudaProfilerStart/Stop pair brackets the measured steps, after the warm-up.
"""

from __future__ import annotations

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
if __name__ == "__main__" and sys.path and os.path.abspath(sys.path[0] or os.curdir) == _HERE:
    # Run as a script, bench/ heads sys.path: put the checkout there, so its slabstage
    # is found installed or not.
    sys.path[0] = os.path.dirname(_HERE)

import argparse  # noqa: E402
import contextlib  # noqa: E402
import math  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402

from slabstage import (PrefillBatch, PrefillGraphRunner, StagingBuffers, default_token_buckets,  # noqa: E402
                       media_index_from_spans)
from slabstage.graph_runner.nvtx import nvtx_range  # noqa: E402


class StandIn(nn.Module):
    """Two linear layers over the slab: enough to give the graph some work."""

    def __init__(self, width: int, vocab: int, device, dtype) -> None:
        super().__init__()
        self.embed_width = width
        self.table = nn.Parameter(torch.randn(vocab, width, device=device, dtype=dtype), requires_grad=False)
        self.up = nn.Linear(width, 2 * width, device=device, dtype=dtype)
        self.down = nn.Linear(2 * width, width, device=device, dtype=dtype)
        self.requires_grad_(False)

    def forward(self, views: dict) -> torch.Tensor:
        return self.down(torch.nn.functional.gelu(self.up(views["input_embeds"])))


def build_model(width: int, vocab: int, device, dtype, say):
    """(forward, table): the toy model when slabstage.models has it, else the stand-in."""
    try:
        from slabstage.models import ToyMultimodalModel
    except ImportError:
        ToyMultimodalModel = None
    if ToyMultimodalModel is not None:
        try:
            heads = max(1, width // 128) if width >= 128 else 2
            model = ToyMultimodalModel("plain", hidden_size=width, vocab_size=vocab, num_layers=2,
                                       num_heads=heads, device=device, dtype=dtype)
            if getattr(model, "embed_width", width) != width:
                raise ValueError(f"embed_width {model.embed_width} != {width}")
            say(f"model: ToyMultimodalModel(plain, hidden {width}, 2 layers, {heads} heads)")
            return model, model.embed_tokens.weight
        except Exception as e:  # an API that moved on: profile the stand-in rather than nothing
            say(f"model: ToyMultimodalModel unusable here ({e!r}); using two nn.Linear layers")
    else:
        say("model: two nn.Linear layers over input_embeds (slabstage.models not found)")
    model = StandIn(width, vocab, device, dtype)
    return model, model.table


def make_batches(count: int, max_tokens: int, table: torch.Tensor, media_pool: torch.Tensor,
                 seed: int) -> list[PrefillBatch]:
    """``count`` batches of log-uniform sizes in [16, max_tokens] (the first one the smallest,
    the last one the largest), 1-8 sequences each.

    Integer inputs stay on the host (the runner packs and moves them); each
    sequence holds one media span of half its rows, taken from ``media_pool``.
    """
    g = torch.Generator().manual_seed(seed)
    vocab = table.shape[0]
    batches = []
    lo = min(16, max_tokens)
    for k in range(count):
        # the first batch the smallest, the last the largest: both paths show up in any run
        u = 0.0 if k == 0 else 1.0 if k == count - 1 else float(torch.rand((), generator=g))
        n = max(1, min(max_tokens, round(math.exp(math.log(lo) + u * (math.log(max_tokens) - math.log(lo))))))
        b = int(torch.randint(1, min(8, n) + 1, (), generator=g))
        cuts = sorted((torch.randperm(n - 1, generator=g)[:b - 1] + 1).tolist()) if b > 1 else []
        starts = [0, *cuts]
        lens = [e - s for s, e in zip(starts, [*cuts, n])]
        spans, m = [], 0
        for s, length in zip(starts, lens):
            k = length // 2
            if k:
                off = int(torch.randint(0, length - k + 1, (), generator=g))
                spans.append((s + off, k, m))
                m += k
        batches.append(PrefillBatch(
            input_ids=torch.randint(0, vocab, (n,), generator=g),
            positions=torch.cat([torch.arange(length) for length in lens]),
            out_cache_loc=torch.randperm(4 * max_tokens, generator=g)[:n],
            seq_lens=torch.tensor(lens, dtype=torch.int32),
            extend_start_loc=torch.tensor(starts, dtype=torch.int32),
            table=table,
            media=media_pool[:m] if m else None,
            media_index=media_index_from_spans(spans, n, device="cpu", num_media_rows=m) if m else None,
        ))
    return batches


def parse_args(argv=None) -> argparse.Namespace:
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200, help="measured steps (default 200)")
    p.add_argument("--warmup", type=int, default=20, help="steps before the measured ones (default 20)")
    p.add_argument("--max-tokens", type=int, default=8192 if cuda else 256,
                   help="buffer capacity and largest batch (default 8192; 256 without CUDA)")
    p.add_argument("--width", type=int, default=4096 if cuda else 128,
                   help="slab width = model hidden size (default 4096; 128 without CUDA)")
    p.add_argument("--vocab", type=int, default=32000 if cuda else 1000)
    p.add_argument("--graph-max-tokens", type=int, default=None,
                   help="largest captured bucket; bigger batches run eagerly (default: half of --max-tokens)")
    p.add_argument("--batches", type=int, default=16, help="distinct batches the steps cycle through")
    p.add_argument("--eager", action="store_true", help="capture no graphs (compare the eager timeline)")
    p.add_argument("--torch-profiler", metavar="PATH", default=None,
                   help="record with torch.profiler and write a Chrome trace to PATH")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true", help="no progress bars, no summary")
    args = p.parse_args(argv)
    if args.steps < 1 or args.warmup < 0 or args.max_tokens < 1 or args.width < 2 or args.batches < 1:
        p.error("--steps, --max-tokens, --batches must be >= 1, --width >= 2, --warmup >= 0")
    return args


def _progress(iterable, total: int, desc: str, quiet: bool):
    if quiet:
        return iterable
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return iterable
    return tqdm(iterable, total=total, desc=desc, unit="step", leave=False)


def main(argv=None) -> int:
    args = parse_args(argv)
    say = (lambda *_: None) if args.quiet else (lambda msg: print(f"profile: {msg}", flush=True))
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    if not cuda:
        say("no CUDA device: the runner runs every batch eagerly (no graphs, no NVTX); "
            "the ranges still reach torch.profiler")
    torch.manual_seed(args.seed)

    buffers = StagingBuffers.allocate(max_num_tokens=args.max_tokens, max_batch_size=8, embed_width=args.width,
                                      embed_dtype=dtype, device=device)
    model, table = build_model(args.width, args.vocab, device, dtype, say)
    media_pool = torch.randn(args.max_tokens, args.width, device=device, dtype=dtype)
    batches = make_batches(args.batches, args.max_tokens, table, media_pool, args.seed)
    graph_max = args.graph_max_tokens or max(1, args.max_tokens // 2)
    runner = PrefillGraphRunner(model, buffers, buckets=default_token_buckets(min(graph_max, args.max_tokens)),
                                enforce_eager=args.eager, progress=not args.quiet)

    profiler = contextlib.nullcontext()
    if args.torch_profiler:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        profiler = torch.profiler.profile(activities=activities)

    replayed = 0
    with torch.no_grad(), profiler as prof:
        runner.capture()
        if runner.captured:
            say(f"captured {len(runner.buckets)} buckets ({runner.buckets[0]}..{runner.buckets[-1]} tokens) "
                f"in {runner.capture_seconds:.1f} s, {runner.capture_bytes / 2**20:.0f} MiB")
        for i in _progress(range(args.warmup), args.warmup, "warm-up", args.quiet):
            runner.run(batches[i % len(batches)])
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.profiler.start()  # nsys --capture-range=cudaProfilerApi starts here
        start = time.perf_counter()
        for i in _progress(range(args.steps), args.steps, "steps", args.quiet):
            with nvtx_range("profile.step"):
                runner.run(batches[i % len(batches)])
            replayed += runner.last_bucket is not None
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.profiler.stop()
        seconds = time.perf_counter() - start

    if args.torch_profiler:
        prof.export_chrome_trace(args.torch_profiler)
        say(f"wrote the Chrome trace {args.torch_profiler}")
    tokens = sum(batches[i % len(batches)].num_tokens for i in range(args.steps))
    say(f"{args.steps} steps ({replayed} replayed, {args.steps - replayed} eager), {tokens} tokens, "
        f"{seconds / args.steps * 1e3:.2f} ms per step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
