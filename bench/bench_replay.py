"""Replay against eager on Hugging Face models, each case measured in fresh processes (first-run costs count).

Cases, one test each (``test_replay[model-attention-forward]``):

- ``qwen2_7b``: a Qwen2-7B-shaped decoder (hidden 3584, 28 heads, 4 KV heads, intermediate 18944, 4 layers,
  vocab 4096, random bf16 weights) with ``attn_implementation`` ``sdpa`` and ``eager``, buffers of one request
  a batch (one sequence, positions ``0..n-1``), three forwards:
  ``prefill_forward`` (:func:`slabstage.hf.prefill_forward`); ``mask``: ``model.model(inputs_embeds=...,
  position_ids=..., attention_mask=M)`` with ``M`` a prepared 4-D causal mask, the plain recipe of
  docs/graphs.md (boolean for sdpa; additive for eager attention, which adds its mask to the scores);
  ``plain``: the same call without a mask, which transformers masks otherwise while a stream is capturing.
- ``qwen3_vl``: the Qwen3-VL config of ``bench_hf.py`` (its builder and its step batches: 4 requests x 2
  images, cut into chunks below 4080 tokens; 4080 tokens replay in the 4096 bucket), ``prefill_forward``.

Per case a worker (this file run with ``--worker``, printing one JSON line) builds the model in a fresh
process, captures ``default_token_buckets(4096)`` with ``verify="warn"`` and measures: capture seconds a
bucket and MiB; the buckets the capture check dropped and why; at 64, 256, 1024, 2048 and 4096 tokens,
``ROUNDS`` rounds of one replay step then one eager step (an ``enforce_eager=True`` runner on the same
buffers), wall time a step (perf_counter around ``run`` and a device sync), minimum and median, the output
compared bit for bit (max abs diff) and how the step ran (its bucket, or the runner's fallback reason);
``runner.stats()`` after them; then, under torch.profiler (CPU and CUDA activity), ``PROFILED_STEPS``
steps of each: the sum of the step's kernel durations against its wall time, so ``replay wall - kernels``
is the host time a replay step leaves. A second fresh process captures the largest bucket alone (the
memory the ladder is judged against). The test's own timing is the worker's wall time; the figures are in
``extra_info`` and ``python bench/report.py`` tabulates them. For ``prefill_forward`` and ``mask``
the test then checks that the capture succeeded and that every step run at its own bucket's size equals the
eager one bit for bit. Skips without CUDA or transformers.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time

import pytest
import torch

from harness.profile import profile_steps

HAS_CUDA = torch.cuda.is_available()
SUITE = "replay"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_TOKENS = 4096
SIZES = (64, 256, 1024, 2048, 4096)
ROUNDS = 20  # replay and eager alternated, one step each a round
PROFILED_STEPS = 5
QWEN2_WIDTH, QWEN2_VOCAB = 3584, 4096
CASES = [("qwen2_7b", attn, forward) for attn in ("sdpa", "eager") for forward in ("prefill_forward", "mask", "plain")]
CASES.append(("qwen3_vl", "sdpa", "prefill_forward"))
EQUAL_FORWARDS = ("prefill_forward", "mask")  # their replay must equal eager bit for bit (docs/graphs.md)

pytestmark = [pytest.mark.skipif(not HAS_CUDA, reason="replay benchmarks need a CUDA device"),
              pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers")]


# -- the models and forwards -----------------------------------------------------------------
def build(layers: int = 4, attn: str = "sdpa"):
    """The Qwen2-7B-shaped decoder: random weights, bf16, on the GPU, eval mode."""
    import transformers as tf
    cfg = tf.Qwen2Config(vocab_size=QWEN2_VOCAB, hidden_size=QWEN2_WIDTH, intermediate_size=18944,
                         num_hidden_layers=layers, num_attention_heads=28, num_key_value_heads=4,
                         max_position_embeddings=32768)
    cfg._attn_implementation = attn
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = tf.Qwen2ForCausalLM(cfg)
    return model.to(torch.bfloat16).eval().requires_grad_(False)


def forward_of(variant: str, model, attn: str):
    """``forward(views) -> [T, H]`` of a Qwen2 model: ``prefill_forward``, ``mask`` or ``plain`` (module doc)."""
    import slabstage.hf as sshf
    if variant == "prefill_forward":
        return sshf.prefill_forward(model)
    if variant not in ("mask", "plain"):
        raise ValueError(f"unknown forward {variant!r}")
    base = model.model

    def forward(views):
        embeds, positions = views["input_embeds"][None], views["positions"][None]
        mask = None
        if variant == "mask":
            rows = torch.arange(embeds.shape[1], device=embeds.device)
            mask = (rows[None, :] <= rows[:, None])[None, None]
            if attn == "eager":  # eager attention adds the mask to its scores: a boolean one would add 0 or 1
                mask = torch.zeros(mask.shape, dtype=embeds.dtype, device=mask.device).masked_fill(
                    ~mask, torch.finfo(embeds.dtype).min)
        return base(inputs_embeds=embeds, position_ids=positions, attention_mask=mask,
                    use_cache=False).last_hidden_state[0]
    return forward


def _case(model_name: str, attn: str, variant: str, layers: int, max_tokens: int):
    """``(forward, new_buffers, batch_of)`` for a case; ``batch_of(n, g)`` is the step batch of ``n`` tokens."""
    import slabstage as ss
    if model_name == "qwen3_vl":
        import bench_hf  # the suite beside this file: its Qwen3-VL builder, buffers and step batches
        import slabstage.hf as sshf
        if (attn, variant, max_tokens) != ("sdpa", "prefill_forward", bench_hf.MAX_TOKENS):
            raise ValueError("qwen3_vl runs as bench_hf.py builds it: sdpa, prefill_forward, 4096 tokens")
        model = bench_hf._model("qwen3_vl")
        return (sshf.prefill_forward(model), lambda: bench_hf._buffers(model, mrope=True),
                lambda n, g: bench_hf._step_batch(model, "qwen3_vl", n, g))
    if model_name != "qwen2_7b":
        raise ValueError(f"unknown model {model_name!r}")
    model = build(layers, attn)
    table = torch.randn(QWEN2_VOCAB, QWEN2_WIDTH, generator=torch.Generator().manual_seed(1)).to("cuda",
                                                                                              torch.bfloat16)

    def new_buffers():
        return ss.StagingBuffers.allocate(max_num_tokens=max_tokens, max_batch_size=1, embed_width=QWEN2_WIDTH,
                                          embed_dtype=torch.bfloat16, device="cuda")

    def batch_of(n, g):
        return ss.PrefillBatch(input_ids=torch.randint(0, QWEN2_VOCAB, (n,), generator=g), positions=torch.arange(n),
                               table=table, seq_lens=torch.tensor([n], dtype=torch.int32),
                               extend_start_loc=torch.zeros(1, dtype=torch.int32))
    return forward_of(variant, model, attn), new_buffers, batch_of


# -- the worker (a fresh process) ----------------------------------------------------------------
def _wall_us(runner, batch) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    runner.run(batch)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e6


def _capture(runner) -> str | None:
    """``runner.capture()``; None, or the :class:`slabstage.CaptureError`'s message."""
    import slabstage as ss
    try:
        runner.capture()
    except ss.CaptureError as e:
        return str(e)
    return None


def work(model_name: str, attn: str, variant: str, what: str, layers: int = 4, max_tokens: int = MAX_TOKENS) -> dict:
    """One worker's figures: ``what="ladder"`` (everything but the largest bucket alone) or ``"largest"``."""
    import transformers

    import slabstage as ss
    forward, new_buffers, batch_of = _case(model_name, attn, variant, layers, max_tokens)
    buffers = new_buffers()
    capacity = buffers.registry.capacity
    if what == "largest":
        alone = ss.PrefillGraphRunner(forward, buffers, buckets=[capacity], progress=False)
        with torch.no_grad():
            error = _capture(alone)
        return dict(largest_alone_s=alone.capture_seconds,
                    largest_alone_mib=alone.capture_bytes / 2**20 if error is None else None)
    runner = ss.PrefillGraphRunner(forward, buffers, progress=False)
    eager = ss.PrefillGraphRunner(forward, buffers, enforce_eager=True, progress=False)
    g = torch.Generator().manual_seed(0)
    sizes = []
    with torch.no_grad():
        t0 = time.perf_counter()
        capture_error = _capture(runner)  # (on an error every step runs eagerly: "not_captured")
        capture_wall_s = time.perf_counter() - t0
        batches = [batch_of(n, g) for n in SIZES if n <= capacity]
        for batch in batches:
            replayed = runner.run(batch, clone=True)
            ran_as = runner.last_bucket if runner.last_bucket is not None else runner.last_fallback
            reference = eager.run(batch, clone=True)
            times = {"replay": [], "eager": []}
            for _ in range(ROUNDS):
                times["replay"].append(_wall_us(runner, batch))
                times["eager"].append(_wall_us(eager, batch))
            r_min, r_med = min(times["replay"]), statistics.median(times["replay"])
            e_min, e_med = min(times["eager"]), statistics.median(times["eager"])
            bucket = next(b for b in runner.buckets if b >= batch.num_tokens)
            sizes.append(dict(tokens=batch.num_tokens, bucket=bucket, ran_as=ran_as,
                              replay_min_us=r_min, replay_median_us=r_med, eager_min_us=e_min, eager_median_us=e_med,
                              ratio_min=r_min / e_min, ratio_median=r_med / e_med,
                              equal=torch.equal(replayed, reference),
                              max_abs_diff=(replayed.float() - reference.float()).abs().max().item()))
        stats = runner.stats()
        for row, batch in zip(sizes, batches):  # profiled last: the profiler's set-up stays out of the rest
            row["profile"] = profile_steps({"replay": lambda b=batch: runner.run(b),
                                           "eager": lambda b=batch: eager.run(b)}, PROFILED_STEPS, "bench_replay")
            kernels = row["profile"]["replay"].get("kernel_us")
            row["host_overhead_us"] = row["replay_median_us"] - kernels if kernels else None
    checks = runner.checks.values()
    return dict(model=model_name, attn=attn, forward=variant, layers=layers, buckets=len(runner.buckets),
                capture_s=runner.capture_seconds, capture_wall_s=capture_wall_s,
                capture_s_per_bucket=runner.capture_seconds / len(runner.buckets),
                capture_mib=runner.capture_bytes / 2**20, capture_error=capture_error,
                check_device_s=sum(c["replay_us"] + c["eager_us"] for c in checks) / 1e6,
                dropped={str(b): c["dropped"] for b, c in runner.checks.items() if c["dropped"]},
                stats=dict(replays={str(b): k for b, k in stats["replays"].items()}, eager=stats["eager"],
                           padded_rows=stats["padded_rows"]),
                sizes=sizes, rounds=ROUNDS, profiled_steps=PROFILED_STEPS,
                versions=dict(torch=torch.__version__, transformers=transformers.__version__,
                              gpu=torch.cuda.get_device_name()))


def in_child(model_name: str, attn: str, variant: str, what: str, *, layers: int = 4,
             max_tokens: int = MAX_TOKENS) -> dict:
    """:func:`work` in a fresh process (this file with ``--worker``); its JSON line as a dict."""
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", model_name, attn, variant, what,
           "--layers", str(layers), "--max-tokens", str(max_tokens)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600)
    line = next((ln for ln in reversed(proc.stdout.splitlines()) if ln.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        raise RuntimeError(f"{' '.join(cmd[1:])} exited {proc.returncode}:\n{proc.stderr[-4000:]}")
    return json.loads(line[len("RESULT "):])


def combine(ladder: dict, largest: dict) -> dict:
    """The ladder's figures with the largest bucket alone beside them."""
    alone = largest["largest_alone_mib"]
    ratio = ladder["capture_mib"] / alone if alone and ladder["capture_error"] is None else None
    return dict(ladder, **largest, mib_vs_largest_alone=ratio)


def measure(model_name: str, attn: str, variant: str, **kw) -> dict:
    """A case's figures: the ladder's worker, then the largest bucket alone's, each in a fresh process."""
    ladder = in_child(model_name, attn, variant, "ladder", **kw)
    return combine(ladder, in_child(model_name, attn, variant, "largest", **kw))


# -- the suite ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("model_name, attn, variant", CASES, ids=["-".join(c) for c in CASES])
def test_replay(benchmark, model_name, attn, variant):
    result = {}

    def ladder():  # first, so that the first case's worker meets a cold machine
        result.update(in_child(model_name, attn, variant, "ladder"))

    benchmark._timer = time.perf_counter
    benchmark.pedantic(ladder, rounds=1, iterations=1)
    figures = combine(result, in_child(model_name, attn, variant, "largest"))
    benchmark.extra_info.update(suite=SUITE, impl=f"{model_name} {attn} {variant}", case=f"{model_name} {attn}",
                                metric="replay", timer="worker wall time", **figures)
    if variant in EQUAL_FORWARDS:
        assert figures["capture_error"] is None, figures["capture_error"]
        differ = [s["tokens"] for s in figures["sizes"] if s["bucket"] == s["tokens"] and not s["equal"]]
        assert not differ, f"replay differs from eager at {differ} tokens (max abs diff in extra_info)"


def main() -> int:
    p = argparse.ArgumentParser(description="the worker of bench_replay.py: one case's figures as a JSON line")
    p.add_argument("--worker", nargs=4, metavar=("MODEL", "ATTN", "FORWARD", "WHAT"), required=True,
                   help="e.g. qwen2_7b sdpa prefill_forward ladder (WHAT: ladder or largest)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=MAX_TOKENS)
    args = p.parse_args()
    print("RESULT " + json.dumps(work(*args.worker, layers=args.layers, max_tokens=args.max_tokens)), flush=True)
    return 0


if __name__ == "__main__":
    sys.path.insert(1, ROOT)  # the checkout's slabstage, installed or not (bench/ stays first, for bench_hf)
    sys.exit(main())
