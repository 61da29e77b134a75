"""An engine's prefill: packed requests with the KV cache written, each case in a fresh process.

Model: the Qwen2-7B-shaped decoder of ``bench_replay.py`` (hidden 3584, 28 heads, 4 KV heads, head dim 128,
4 layers, bf16, sdpa). Cases (``test_prefill[case]``; ``python bench/run.py --suite prefill`` runs them all into
``bench/results/prefill.json``; each test runs its case in a fresh process, this file with ``--worker CASE``,
which prints the case's figures as one ``RESULT {json}`` line):

- ``packed_16x1024``, ``packed_4x1024``: the requests packed in one batch, ``prefill_forward(model,
  cache=...)`` captured at the batch's bucket and replayed, against (a) the same requests one by one through
  HF's forward (``model.model(input_ids=...)``), (b) a dense-mask packed forward without a KV
  cache (:func:`dense_mask_forward`: a ``[T, T]`` boolean mask, SDPA), captured and replayed, and (c)
  the same packed forward without ``cache`` (the KV write's share of the step). Also replay == eager bit for
  bit, memory (the step's peak above what was allocated before it, eager), and capture seconds
  (the Triton kernel compiled by an eager step first, so capture time is capture alone).
- ``chunked_16384``: one 16384-token prompt in four 4096-token chunks (each reading the earlier chunks from
  the cache) against one 16384-token step.

Each figure is the median of ``ROUNDS`` steps timed with a device sync around ``runner.run``; the figures go to
``extra_info`` (``metric="figures"``; the test's own timing is the worker's wall time). Skips without CUDA or
transformers.
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

HAS_CUDA = torch.cuda.is_available()
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROUNDS = 10
MEMORY: list = []  # the eager step peak MiB of each _runner, in order
CASES = ("packed_16x1024", "packed_4x1024", "chunked_16384")

pytestmark = [pytest.mark.skipif(not HAS_CUDA, reason="prefill benchmarks need a CUDA device"),
              pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers")]


def dense_mask_forward(model):
    """A packed forward without a KV cache: a ``bool[1, 1, T, T]`` mask (same request and causal; padding rows
    see themselves) and the model's sdpa attention; a reference ``prefill_forward`` is measured against."""
    lm = model.model
    layers, norm, rotary = lm.layers, lm.norm, lm.rotary_emb

    def forward(views):
        embeds = views["input_embeds"]
        T = embeds.shape[0]
        h = embeds[None]
        cos_sin = rotary(h, views["positions"][None])
        rows = torch.arange(T, device=h.device)
        lens = views["seq_lens"].long()[:, None]
        starts = views["extend_start_loc"].long()[:, None]
        inside = (rows[None] >= starts) & (rows[None] < starts + lens)
        seq = (inside * torch.arange(1, lens.shape[0] + 1, device=h.device)[:, None]).sum(0) - 1
        seq = torch.where(rows < views["num_tokens_non_padded"].long(), seq, -1)
        same = (seq[:, None] == seq[None, :]) & (seq[:, None] >= 0)
        mask = ((same & (rows[None] <= rows[:, None])) | (rows[:, None] == rows[None]))[None, None]
        for layer in layers:
            h = layer(h, attention_mask=mask, position_embeddings=cos_sin)
            h = h[0] if isinstance(h, tuple) else h
        return norm(h)[0]
    return forward


def _step_ms(runner, batch, rounds=ROUNDS) -> float:
    times = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        runner.run(batch)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _peak_mib(fn) -> float:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def _runner(forward, buffers, bucket, batch):
    """A runner of ``forward`` captured at ``bucket`` after one eager step (Triton compiles there):
    ``(runner, capture seconds)``; ``MEMORY[-1]``: the eager step's peak MiB above what was allocated before it
    (what the step's intermediates take, as its graph's pool holds them)."""
    import slabstage as ss
    eager = ss.PrefillGraphRunner(forward, buffers, buckets=[bucket], enforce_eager=True, progress=False)
    with torch.no_grad():
        eager.run(batch)
        eager_peak = _peak_mib(lambda: eager.run(batch))
    runner = ss.PrefillGraphRunner(forward, buffers, buckets=[bucket], progress=False)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    runner.capture()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    MEMORY.append(eager_peak)
    return runner, seconds


def _batch(model, cache, lens, g, chunk=None, req_offset=0):
    import slabstage.hf as sshf
    reqs = []
    for k, n in enumerate(lens):
        ids = torch.randint(0, model.config.vocab_size, (n,), generator=g)
        reqs.append(sshf.Request(ids, req_index=req_offset + k, chunk=chunk))
    return sshf.pack_requests(model, reqs, cache=cache), reqs


def work(case: str) -> dict:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import bench_replay

    import slabstage as ss
    import slabstage.hf as sshf
    model = bench_replay.build(4, "sdpa")
    g = torch.Generator().manual_seed(0)
    out = {"case": case}
    with torch.no_grad():
        if case.startswith("packed_"):
            B, L = (int(x) for x in case[len("packed_"):].split("x"))
            T = B * L
            buffers = ss.StagingBuffers.allocate(max_num_tokens=T, max_batch_size=B, embed_width=3584,
                                                 embed_dtype=torch.bfloat16, device="cuda")
            cache = sshf.KVCache.allocate(model, B, L)
            batch, reqs = _batch(model, cache, [L] * B, g)
            ours, out["capture_s"] = _runner(sshf.prefill_forward(model, cache=cache), buffers, T, batch)
            out["replay_ms"] = _step_ms(ours, batch)
            out["peak_mib"] = MEMORY[-1]
            replayed = ours.run(batch, clone=True)
            eager = sshf.prefill_forward(model, cache=cache)(buffers.registry.views(T))
            out["replay_equals_eager"] = bool(torch.equal(replayed, eager))
            nocache, _ = _runner(sshf.prefill_forward(model), buffers, T, batch)
            out["no_cache_ms"] = _step_ms(nocache, batch)
            out["kv_write_share"] = max(0.0, (out["replay_ms"] - out["no_cache_ms"]) / out["replay_ms"])
            del nocache
            dense, out["dense_capture_s"] = _runner(dense_mask_forward(model), buffers, T, batch)
            out["dense_ms"] = _step_ms(dense, batch)
            out["dense_peak_mib"] = MEMORY[-1]
            del dense
            ids = [r.input_ids.cuda() for r in reqs]

            def per_request():
                for x in ids:
                    model.model(input_ids=x[None], use_cache=False)
            per_request()
            times = []
            for _ in range(ROUNDS):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                per_request()
                torch.cuda.synchronize()
                times.append((time.perf_counter() - t0) * 1e3)
            out["hf_per_request_ms"] = statistics.median(times)
            out["hf_peak_mib"] = _peak_mib(per_request)
            out["speedup_vs_hf"] = out["hf_per_request_ms"] / out["replay_ms"]
            out["speedup_vs_dense"] = out["dense_ms"] / out["replay_ms"]
        elif case == "chunked_16384":
            N, C = 16384, 4096
            cache = sshf.KVCache.allocate(model, 2, N)
            ids = torch.randint(0, model.config.vocab_size, (N,), generator=g)
            big = ss.StagingBuffers.allocate(max_num_tokens=N, max_batch_size=1, embed_width=3584,
                                             embed_dtype=torch.bfloat16, device="cuda")
            whole = sshf.pack_requests(model, [sshf.Request(ids, req_index=0)], cache=cache)
            one, out["capture_s_16384"] = _runner(sshf.prefill_forward(model, cache=cache), big, N, whole)
            out["one_step_ms"] = _step_ms(one, whole)
            out["one_step_peak_mib"] = MEMORY[-1]
            ref = one.run(whole, clone=True)
            del one
            small = ss.StagingBuffers.allocate(max_num_tokens=C, max_batch_size=1, embed_width=3584,
                                               embed_dtype=torch.bfloat16, device="cuda")
            chunks = [sshf.pack_requests(model, [sshf.Request(ids, req_index=1, chunk=(s, s + C))], cache=cache)
                      for s in range(0, N, C)]
            runner, out["capture_s_4096"] = _runner(sshf.prefill_forward(model, cache=cache), small, C, chunks[0])
            for c in chunks:  # warm: every chunk's prefix written
                runner.run(c)
            times = []
            for _ in range(ROUNDS):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for c in chunks:
                    runner.run(c)
                torch.cuda.synchronize()
                times.append((time.perf_counter() - t0) * 1e3)
            out["four_chunks_ms"] = statistics.median(times)
            out["chunked_ratio"] = out["four_chunks_ms"] / out["one_step_ms"]
            parts = [runner.run(c, clone=True) for c in chunks]
            diff = (torch.cat(parts).float() - ref.float()).abs().max().item()
            out["chunks_vs_whole_max_abs_diff"] = diff
        else:
            raise ValueError(f"unknown case {case!r}; one of {CASES}")
    return out


def in_child(case: str) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", case]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600)
    line = next((ln for ln in reversed(proc.stdout.splitlines()) if ln.startswith("RESULT {")), None)
    if proc.returncode != 0 or line is None:
        raise RuntimeError(f"{case} exited {proc.returncode}:\n{proc.stderr[-4000:]}")
    return json.loads(line[len("RESULT "):])


@pytest.mark.parametrize("case", CASES)
def test_prefill(benchmark, case):
    result = {}
    benchmark._timer = time.perf_counter
    benchmark.pedantic(lambda: result.update(in_child(case)), rounds=1, iterations=1)
    benchmark.extra_info.update(suite="prefill", metric="figures", impl=case, **result)
    if case.startswith("packed_"):
        assert result["replay_equals_eager"]


def main() -> int:
    p = argparse.ArgumentParser(description="the worker of bench_prefill.py: one case's figures as a JSON line")
    p.add_argument("--worker", choices=CASES, required=True, help="run one case here, print its RESULT line")
    args = p.parse_args()
    print("RESULT " + json.dumps(work(args.worker)), flush=True)
    return 0


if __name__ == "__main__":
    sys.path.insert(1, ROOT)
    sys.exit(main())
