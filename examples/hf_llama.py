"""A Hugging Face transformers model, staged and replayed by slabstage.

A ``LlamaConfig`` shrunk to 2 layers, hidden 256, 4 heads (2 key/value heads),
vocabulary 1000, with random weights (nothing is downloaded), runs through
:class:`slabstage.PrefillGraphRunner`: text rows come from the model's own
embedding table, "media" rows (random rows standing in for a vision encoder)
are scattered in with :func:`slabstage.media_index_from_spans`, and the forward
feeds the slab to the model as ``inputs_embeds``. Each replay is compared with
the model's eager forward on the same staged buffers (bit-identical), and with a
plain unpadded ``model(inputs_embeds=..., position_ids=...)`` call (to rounding).

transformers is an optional extra, never a core dependency of slabstage::

    pip install 'slabstage[hf]'        # or: pip install transformers
    python examples/hf_llama.py [--device cuda] [--max-tokens 512]

Without transformers this prints how to install it and exits with status 0.
Checked (eager, on CPU) with transformers 5.17 and 5.24.

Why the forward passes its own 4-D mask: with ``attention_mask=None`` and
``position_ids`` given, transformers' ``create_causal_mask`` looks for packed
sequences in ``position_ids`` and, for a single sequence, decides on the host
(``.all()``, a sync) to return no mask so that SDPA runs with ``is_causal=True``;
while a CUDA graph is being captured it skips that check and materialises a
mask instead. Captured and eager runs would then take different SDPA kernels
(flash vs. memory-efficient on a GPU), which need not agree bit for bit. A prepared
4-D boolean mask is passed through untouched, so the forward is the same
sync-free code path in both, and it also keeps padding rows (position 0, after
the batch) in sequences of their own.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

import torch

import slabstage as ss

VOCAB, HIDDEN, LAYERS, HEADS, KV_HEADS = 1000, 256, 2, 4, 2


def build_model(device, dtype: torch.dtype = torch.float32, seed: int = 0):
    """A random-weight ``LlamaModel`` (the decoder without the LM head), in eval mode, on ``device``."""
    from transformers import LlamaConfig, LlamaModel

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                         num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                         max_position_embeddings=8192, attn_implementation="sdpa")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaModel(config)
    return model.to(device=device, dtype=dtype).eval().requires_grad_(False)


def packed_causal_mask(positions: torch.Tensor) -> torch.Tensor:
    """``bool[1, 1, T, T]``: causal within each sequence; a sequence starts where the position is 0."""
    seq = torch.cumsum(positions == 0, 0)
    rows = torch.arange(positions.shape[0], device=positions.device)
    return ((seq[:, None] == seq[None, :]) & (rows[None, :] <= rows[:, None]))[None, None]


def make_forward(model):
    """``forward(views) -> [T, hidden]`` for the runner: the slab and positions into the HF model."""

    def forward(views: dict) -> torch.Tensor:
        positions = views["positions"]
        out = model(inputs_embeds=views["input_embeds"][None], position_ids=positions[None],
                    attention_mask=packed_causal_mask(positions), use_cache=False)
        return out.last_hidden_state[0]

    return forward


def make_batch(model, num_tokens: int, generator: torch.Generator) -> ss.PrefillBatch:
    """One sequence of ``num_tokens`` tokens: random text ids around one span of random "encoder" rows."""
    device = model.embed_tokens.weight.device
    n = num_tokens
    m = int(torch.randint(0, n // 2 + 1, (1,), generator=generator))  # media rows
    start = int(torch.randint(0, n - m + 1, (1,), generator=generator))
    encoder_rows = torch.randn(m, HIDDEN, generator=generator).to(device)  # fp32 rows: the kernel casts
    return ss.PrefillBatch(
        input_ids=torch.randint(0, VOCAB, (n,), generator=generator),
        positions=torch.arange(n),
        seq_lens=torch.tensor([n], dtype=torch.int32),
        extend_start_loc=torch.tensor([0], dtype=torch.int32),
        table=model.embed_tokens.weight,
        media=encoder_rows if m else None,
        media_index=ss.media_index_from_spans([(start, m, 0)], n, device=device) if m else None,
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Run a small random-weight Llama through slabstage's graph runner.")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=["bf16", "fp32"], default=None, help="default: bf16 on CUDA, fp32 on CPU")
    p.add_argument("--max-tokens", type=int, default=None, help="slab capacity (default: 512 on CUDA, 128 on CPU)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # the runner's capture line
    try:
        import transformers
    except ImportError:
        print("examples/hf_llama.py needs transformers, an optional extra of slabstage: "
              "pip install 'slabstage[hf]' (or pip install transformers). Nothing to do without it.")
        return 0

    device = torch.device(args.device)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    capacity = args.max_tokens or (512 if device.type == "cuda" else 128)
    model = build_model(device, dtype, args.seed)
    buffers = ss.StagingBuffers.allocate(max_num_tokens=capacity, max_batch_size=1, embed_width=HIDDEN,
                                         embed_dtype=dtype, device=device)
    forward = make_forward(model)
    runner = ss.PrefillGraphRunner(forward, buffers)
    print(f"transformers {transformers.__version__}: LlamaModel, {LAYERS} layers, hidden {HIDDEN}, "
          f"{HEADS} heads ({KV_HEADS} kv), vocab {VOCAB}, random weights, sdpa, {dtype} on {device}")
    runner.capture()
    if runner.captured:
        print(f"captured {len(runner.buckets)} graphs ({runner.buckets[0]}..{runner.buckets[-1]} tokens) "
              f"in {runner.capture_seconds:.2f} s")
    else:
        print("no CUDA device: the runner runs eagerly (nothing is captured)")

    g = torch.Generator().manual_seed(args.seed)
    sizes = sorted({s for s in (1, 7, 16, 33, 100, 129, 250, 300, 512, capacity // 2 + 3, capacity) if s <= capacity})
    print(f"{'tokens':>6} {'media':>5} {'route':<10} {'run ms':>7}  {'== eager':<8}  max|diff| vs unpadded HF call")
    failures = 0
    with torch.no_grad():
        for n in sizes:
            batch = make_batch(model, n, g)
            start = time.perf_counter()
            out = runner.run(batch, clone=True)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            run_ms = (time.perf_counter() - start) * 1e3
            bucket = runner.last_bucket
            ref = forward(buffers.registry.views(bucket or n))[:n]  # same staged buffers, same shape
            plain = model(inputs_embeds=buffers.input_embeds[:n][None],
                          position_ids=buffers.positions[:n][None], use_cache=False).last_hidden_state[0]
            same = torch.equal(out, ref)
            failures += not same
            diff = (out.float() - plain.float()).abs().max().item()
            media = 0 if batch.media is None else batch.media.shape[0]
            route = f"graph {bucket}" if bucket is not None else "eager"
            print(f"{n:>6} {media:>5} {route:<10} {run_ms:>7.2f}  {'yes' if same else 'NO':<8}  {diff:.2e}")
    if failures:
        print(f"FAILED: {failures} of {len(sizes)} batches differ from the eager forward")
        return 1
    print(f"OK: all {len(sizes)} batches bit-identical to the eager forward on the same buffers")
    return 0


if __name__ == "__main__":
    sys.exit(main())
