"""Replay against eager for a Hugging Face decoder with its default attention (sdpa), each forward in a fresh process.

    python bench/graph_check.py [--layers 4] [--max-tokens 4096] [--out FILE.json]

A Qwen2-7B-shaped decoder (hidden 3584, 28 heads, 4 KV heads, random bf16 weights) under
:class:`slabstage.PrefillGraphRunner` with its default ladder and ``verify="warn"``, three forwards:

- ``plain``: ``model(inputs_embeds=..., position_ids=...)``, what a user writes first: transformers builds a
  4-D mask only while a stream is capturing, so the replay differs from eager and the check drops buckets;
- ``mask``: the same call given a prepared 4-D causal mask (the documented plain recipe);
- ``prefill_forward``: :func:`slabstage.hf.prefill_forward` over buffers of one request a batch (SDPA causal).

For each: capture seconds (a bucket), the capture's memory (and against the largest bucket captured alone), the
buckets the check dropped and why, and at 64, 256, 1024, 2048 and 4096 tokens replay and eager alternated five
rounds (minimum of each).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[0] = ROOT  # the checkout's slabstage, installed or not

SIZES = (64, 256, 1024, 2048, 4096)


def build(layers: int):
    import transformers as tf
    cfg = tf.Qwen2Config(vocab_size=4096, hidden_size=3584, intermediate_size=18944, num_hidden_layers=layers,
                         num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=32768)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = tf.Qwen2ForCausalLM(cfg)
    return model.to(torch.bfloat16).eval().requires_grad_(False)


def forward_of(variant: str, model):
    import slabstage.hf as sshf
    base = model.model
    if variant == "prefill_forward":
        return sshf.prefill_forward(model)

    def forward(views):
        embeds, positions = views["input_embeds"][None], views["positions"][None]
        mask = None
        if variant == "mask":
            rows = torch.arange(embeds.shape[1], device=embeds.device)
            mask = (rows[None, :] <= rows[:, None])[None, None]
        return base(inputs_embeds=embeds, position_ids=positions, attention_mask=mask,
                    use_cache=False).last_hidden_state[0]
    return forward


def one(variant: str, layers: int, max_tokens: int) -> dict:
    import slabstage as ss
    model = build(layers)
    buffers = ss.StagingBuffers.allocate(max_num_tokens=max_tokens, max_batch_size=1, embed_width=3584,
                                         embed_dtype=torch.bfloat16, device="cuda")
    runner = ss.PrefillGraphRunner(forward_of(variant, model), buffers, progress=False)
    with torch.no_grad():
        t0 = time.perf_counter()
        runner.capture()
        seconds = time.perf_counter() - t0
        eager = ss.PrefillGraphRunner(forward_of(variant, model), buffers, enforce_eager=True, progress=False)
        g = torch.Generator().manual_seed(0)
        table = torch.randn(4096, 3584, generator=g).to("cuda", torch.bfloat16)
        rows = {}
        for n in SIZES:
            batch = ss.PrefillBatch(input_ids=torch.randint(0, 4096, (n,), generator=g), positions=torch.arange(n),
                                    table=table, seq_lens=torch.tensor([n], dtype=torch.int32),
                                    extend_start_loc=torch.zeros(1, dtype=torch.int32))
            times = {"replay": [], "eager": []}
            outs = {}
            for _ in range(5):
                for name, r in (("replay", runner), ("eager", eager)):
                    torch.cuda.synchronize()
                    start = time.perf_counter()
                    outs[name] = r.run(batch, clone=True)
                    torch.cuda.synchronize()
                    times[name].append((time.perf_counter() - start) * 1e6)
            rows[n] = dict(replay_us=min(times["replay"]), eager_us=min(times["eager"]),
                           speedup=min(times["eager"]) / min(times["replay"]), route=runner.last_bucket,
                           fallback=runner.last_fallback,
                           max_abs_diff=(outs["replay"].float() - outs["eager"].float()).abs().max().item())
    # the largest bucket alone, in a pool of its own: what the ladder's memory is judged against
    alone = ss.PrefillGraphRunner(forward_of(variant, model), ss.StagingBuffers.allocate(
        max_num_tokens=max_tokens, max_batch_size=1, embed_width=3584, embed_dtype=torch.bfloat16, device="cuda"),
        buckets=[max_tokens], progress=False)
    with torch.no_grad():
        alone.capture()
    checks = {b: {k: v for k, v in c.items() if k != "detail"} for b, c in runner.checks.items()}
    dropped = {b: c["dropped"] for b, c in runner.checks.items() if c["dropped"]}
    check_s = sum(c["replay_us"] + c["eager_us"] for c in runner.checks.values()) / 1e6
    return dict(variant=variant, buckets=len(runner.buckets), capture_s=seconds,
                capture_s_per_bucket=seconds / len(runner.buckets), capture_mib=runner.capture_bytes / 2**20,
                largest_alone_mib=alone.capture_bytes / 2**20,
                mib_vs_largest_alone=runner.capture_bytes / max(alone.capture_bytes, 1),
                check_device_s=check_s, dropped=dropped, runs=rows, checks=checks)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=4096)
    p.add_argument("--variant", default=None, help="(one variant, in this process)")
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "graph_check.json"))
    args = p.parse_args()
    if args.variant:
        print("RESULT " + json.dumps(one(args.variant, args.layers, args.max_tokens)), flush=True)
        return 0
    import transformers
    results = dict(machine=dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                                transformers=transformers.__version__,
                                date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())), variants=[])
    for variant in ("plain", "mask", "prefill_forward"):
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--variant", variant, "--layers",
                               str(args.layers), "--max-tokens", str(args.max_tokens)], capture_output=True,
                              text=True, timeout=400)
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
        r = json.loads(line[7:]) if line else dict(variant=variant, error=proc.stderr[-3000:])
        results["variants"].append(r)
        if "error" in r:
            print(variant, "failed:", r["error"][-800:], flush=True)
            continue
        print(f"{variant:16s} capture {r['capture_s_per_bucket']:.3f} s a bucket ({r['buckets']} buckets), "
              f"{r['capture_mib']:.0f} MiB ({r['mib_vs_largest_alone']:.2f}x the largest bucket alone), "
              f"dropped {len(r['dropped'])}: {sorted(set(r['dropped'].values()))}",
              flush=True)
        for n, row in r["runs"].items():
            print(f"   {n:>5} tokens: replay {row['replay_us']:8.0f} eager {row['eager_us']:8.0f} us "
                  f"x{row['speedup']:.2f} route {row['route'] or row['fallback']} max|d| {row['max_abs_diff']:.2g}",
                  flush=True)
    json.dump(results, open(args.out, "w"), indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
