"""The demo's command line: options, what stages the slab, the Hugging Face hand-off, the verdict.

The contract the demo checks is in :mod:`slabstage.demo`.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import sys
import time
from contextlib import contextmanager

import torch

from ..models import VARIANTS
from .run import buckets_for, run_variant, summary

__all__ = ["main", "kernel_path", "HF_MODELS", "MODELS"]

# toy, then the Hugging Face families slabstage.hf.demo builds (slabstage.hf.tiny.FAMILIES, spelt with dashes)
HF_MODELS = ("qwen3-vl", "qwen3-vl-moe", "qwen2.5-vl", "qwen2-vl", "llama", "qwen2", "qwen3")
MODELS = ("toy", *HF_MODELS)
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


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


def _hf_demo(argv: list[str]) -> int:
    try:
        from ..hf.demo import main as hf_main
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

    started = time.perf_counter()
    print(f"slabstage demo: {', '.join(variants)} on {device} ({str(dtype).removeprefix('torch.')}), "
          f"slab capacity {capacity} tokens, {steps} batches per variant, seed {args.seed}")
    print(f"staging: {kernel_path(device)}")
    _say_what_runs(cuda, capacity, args.max_padding_ratio, say)
    with _log_inline(args.quiet), torch.no_grad():
        results = [run_variant(variant, args, device, dtype, capacity, steps, say) for variant in variants]
    print()
    for r in results:
        print(summary(r, cuda))
    total, bad = sum(r.batches for r in results), sum(r.failed for r in results)
    elapsed = time.perf_counter() - started
    if bad:
        print(f"demo: FAILED: {bad} of {total} batches differ from the plain-torch merge or its eager forward "
              f"({elapsed:.1f} s)")
        return 1
    print(f"demo: OK: all {total} batches match the plain-torch merge and its eager forward, bit for bit "
          f"({elapsed:.1f} s)")
    return 0


def _say_what_runs(cuda: bool, capacity: int, ratio: float, say) -> None:
    """The graphs (or why there are none), the batches and the checks, a line each."""
    if cuda:
        buckets = buckets_for(capacity)
        say(f"graphs: {len(buckets)} buckets ({buckets[0]}..{buckets[-1]} tokens); a batch above {buckets[-1]} "
            f"tokens, or whose bucket exceeds {ratio}x its size, runs eagerly. "
            "Times: device us from CUDA events (stage; run = graph replay or eager forward; ref = eager "
            "forward over the plain-torch merge)")
    else:
        print("graphs: none, CUDA graphs need a GPU: the runner runs every batch eagerly on the staged buffers; "
              "no times shown (CPU times say nothing of the GPU path)")
    say("batches: up to 4 packed sequences, at most one image each; media reach the runner as a list of items, "
        "one encoder output per image, as an engine passes them (columns images, media: their count and rows)")
    say("checks per batch, bit for bit: slab = staged rows vs a plain-torch merge (table rows by id, media rows "
        "at their placeholders, zero padding); output = the runner's vs an eager forward over that merge")


@contextmanager
def _log_inline(quiet: bool):
    """slabstage's log (the runner's capture or eager line) printed inline as ``log: ...`` while inside; errors
    alone when ``quiet``."""
    log = logging.getLogger("slabstage")
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("log: %(message)s"))
    saved = log.level, log.propagate
    log.setLevel(logging.ERROR if quiet else logging.INFO)
    log.addHandler(handler)
    log.propagate = False
    try:
        yield
    finally:
        log.removeHandler(handler)
        log.setLevel(saved[0])
        log.propagate = saved[1]
