"""slabstage.hf on Hugging Face models: the multimodal merge path, replay against eager, capture cost.

- ``test_merge``: one Qwen3-VL prefill step's merge, from encoder outputs ready (media
  items on the device) to the graph's replay launched, for three implementations on the
  same inputs:
  ``slabstage`` (``pack_requests`` items, one staging launch, ``runner.run``);
  ``engine`` (embedding, ``torch.cat`` of the image features, ``masked_scatter`` into
  the embeddings, a DeepStack side buffer filled by boolean index, copies into the
  static buffers); ``sglang`` (embedding, placeholder count checked with ``.item()``,
  ``cumsum`` + ``index_copy_``, DeepStack rows found with ``nonzero``, copies, tail zeroed).
  Device time (CUDA events, ``device_bench``) of the merge followed by the replay of an
  empty graph (so the replay launch is inside, the model is not); ``extra_info``: host
  syncs counted under ``torch.cuda.set_sync_debug_mode("warn")``, and the wall time of the
  whole step with the real model's graph (median of ``STEP_ROUNDS``, perf_counter + sync).
- ``test_step``: the prefill step, replay against eager, on a Qwen2-7B-shaped decoder
  (hidden 3584, 28 heads / 4 kv heads, intermediate 18944, 4 layers, random bf16) and on
  the Qwen3-VL config, at 64, 256, 1024, 4096 tokens. The two are also measured
  alternating, ``ALT_ROUNDS`` rounds of ``ALT_ITERS`` steps each; medians and the ratio
  go to ``extra_info`` (``alt_replay_ms``, ``alt_eager_ms``, ``speedup``).
- ``test_capture``: seconds and GPU memory to capture ``default_token_buckets(4096)``.

Qwen3-VL config: hidden 2048, 4 decoder layers, 16 heads / 8 kv heads, intermediate 6144,
3 DeepStack levels (slab 8192 wide), 4 requests x 2 images of 448 rows, 4080 tokens, bf16.
Every device benchmark skips without CUDA.
"""

from __future__ import annotations

import statistics
import time
import warnings

import pytest
import torch

import slabstage as ss
from harness import synced_us

transformers = pytest.importorskip("transformers")

import slabstage.hf as sshf  # noqa: E402
from slabstage.hf.tiny import IMAGE, VISION_END, VISION_START, tiny_model  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
SUITE = "hf"
MAX_TOKENS = 4096
STEP_TOKENS = [64, 256, 1024, 4096]
ALT_ROUNDS, ALT_ITERS, STEP_ROUNDS = 8, 20, 50
IMAGE_GRID = (1, 32, 56)  # 448 rows after the 2x2 merge
TEXT = 40

pytestmark = pytest.mark.skipif(not HAS_CUDA, reason="hf benchmarks need a CUDA device")

MODELS = {
    "qwen3_vl": dict(family="qwen3_vl", hidden=2048, layers=4, heads=16, kv_heads=8, intermediate=6144,
                     vocab=32000, deepstack=3),
    "qwen2_7b": dict(family="qwen2", hidden=3584, layers=4, heads=28, kv_heads=4, intermediate=18944, vocab=32000),
}
_CACHE: dict = {}


def _model(name: str):
    if name not in _CACHE:
        cfg = dict(MODELS[name])
        _CACHE[name] = tiny_model(cfg.pop("family"), **cfg, dtype=torch.bfloat16, device="cuda")
    return _CACHE[name]


def _vl_requests(model, g):
    """4 requests x 2 images: text, image, text, image, text; items are random encoder outputs."""
    H, k = model.config.text_config.hidden_size, 3
    rows = IMAGE_GRID[0] * IMAGE_GRID[1] * IMAGE_GRID[2] // 4
    requests = []
    for _ in range(4):
        text = [torch.randint(0, 80, (TEXT,), generator=g) for _ in range(3)]
        image = torch.cat([torch.tensor([VISION_START]), torch.full((rows,), IMAGE), torch.tensor([VISION_END])])
        ids = torch.cat([text[0], image, text[1], image, text[2]])
        grid = torch.tensor([IMAGE_GRID, IMAGE_GRID])
        items = [tuple(torch.randn(rows, H, device="cuda", dtype=torch.bfloat16) for _ in range(1 + k))
                 for _ in range(2)]
        requests.append(sshf.Request(ids, items, image_grid_thw=grid,
                                     mrope_positions=sshf.mrope_positions(model, ids, grid)))
    return requests


def _buffers(model, mrope):
    return ss.StagingBuffers.allocate(max_num_tokens=MAX_TOKENS, max_batch_size=16,
                                      embed_width=sshf.input_embeds_width(model), embed_dtype=torch.bfloat16,
                                      device="cuda", mrope=mrope)


def _capture(forward, views):
    """One CUDA graph of ``forward(views)`` (the peers' own capture; warm-up on a side stream first)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        forward(views)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = forward(views)
    return graph, out


# -- the merge path ----------------------------------------------------------------------
class PeerMerge:
    """The engine-style and SGLang-like merges into the same static buffers as slabstage's."""

    def __init__(self, model, buffers, batch, requests):
        self.table = model.model.language_model.embed_tokens.weight
        self.H = self.table.shape[1]
        self.k = buffers.embed_width // self.H - 1
        self.buffers, self.n = buffers, batch.num_tokens
        pin = lambda t: t.pin_memory()  # noqa: E731
        self.ids, self.positions = pin(batch.input_ids), pin(batch.positions)
        self.mrope, self.seq_lens, self.starts = pin(batch.mrope_positions), pin(batch.seq_lens), \
            pin(batch.extend_start_loc)
        self.items = [item for r in requests for item in r.media]  # per item, as an encoder cache holds them

    def _inputs(self, pad_to):
        b, n = self.buffers, self.n
        ids = b.input_ids[:n]
        ids.copy_(self.ids, non_blocking=True)
        b.positions[:n].copy_(self.positions, non_blocking=True)
        b.mrope_positions[:, :n].copy_(self.mrope, non_blocking=True)
        for t in (b.input_ids, b.positions):
            t[n:pad_to].zero_()
        b.mrope_positions[:, n:pad_to].zero_()
        B = self.seq_lens.shape[0]
        b.seq_lens.zero_()
        b.extend_start_loc.zero_()
        b.seq_lens[:B].copy_(self.seq_lens, non_blocking=True)
        b.extend_start_loc[:B].copy_(self.starts, non_blocking=True)
        b.num_tokens_non_padded.fill_(n)
        return ids

    def engine(self, pad_to):
        ids = self._inputs(pad_to)
        slab, H, n = self.buffers.input_embeds, self.H, self.n
        embeds = torch.nn.functional.embedding(ids, self.table)
        mask = ids == IMAGE
        features = torch.cat([item[0] for item in self.items])
        embeds = embeds.masked_scatter(mask[:, None], features)
        deepstack = torch.zeros(n, self.k * H, dtype=embeds.dtype, device=embeds.device)
        deepstack[mask] = torch.cat([torch.cat([item[1 + j] for item in self.items]) for j in range(self.k)], 1)
        slab[:n, :H].copy_(embeds)
        slab[:n, H:].copy_(deepstack)
        slab[n:pad_to].zero_()

    def sglang(self, pad_to):
        ids = self._inputs(pad_to)
        slab, H, n = self.buffers.input_embeds, self.H, self.n
        embeds = torch.nn.functional.embedding(ids, self.table)
        mask = ids == IMAGE
        features = torch.cat([item[0] for item in self.items])
        if int(mask.sum().item()) != features.shape[0]:  # SGLang checks the placeholder count on the host
            raise RuntimeError("placeholder count mismatch")
        index = torch.cumsum(mask, 0) - 1
        rows = mask.nonzero().squeeze(1)  # a second sync: the rows to merge
        embeds.index_copy_(0, rows, features[index[rows]])
        deepstack = torch.zeros(n, self.k * H, dtype=embeds.dtype, device=embeds.device)
        deepstack.index_copy_(0, rows, torch.cat([torch.cat([item[1 + j] for item in self.items])
                                                  for j in range(self.k)], 1))
        slab[:n, :H].copy_(embeds)
        slab[:n, H:].copy_(deepstack)
        slab[n:pad_to].zero_()


def _count_syncs(fn) -> int:
    """Host syncs of one ``fn()`` call, as ``set_sync_debug_mode("warn")`` reports them (one warning each).

    Only the per-sync warnings count: the mode's own one-time notice ("a prototype
    feature and does not yet detect all synchronizing operations") is not a sync.
    """
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    return sum("called a synchronizing" in str(w.message) for w in caught)


def _wall_ms(fn, rounds) -> float:
    return statistics.median(synced_us(fn) for _ in range(rounds)) / 1e3


@pytest.fixture(scope="module")
def merge_setup():
    model = _model("qwen3_vl")
    requests = _vl_requests(model, torch.Generator().manual_seed(0))
    forward = sshf.prefill_forward(model)
    buffers = _buffers(model, mrope=True)
    batch = sshf.pack_requests(model, requests)
    n = batch.num_tokens
    bucket = next(b for b in ss.default_token_buckets(MAX_TOKENS) if b >= n)
    empty = ss.PrefillGraphRunner(lambda views: views["input_embeds"][:, :1] * 1, buffers, buckets=[bucket],
                                  progress=False).capture()  # replay launch, no model
    full = ss.PrefillGraphRunner(forward, _buffers(model, mrope=True), buckets=[bucket], progress=False).capture()
    peer_buffers = _buffers(model, mrope=True)
    peers = PeerMerge(model, peer_buffers, batch, requests)
    empty_graph, _ = _capture(lambda views: views["input_embeds"][:, :1] * 1, peer_buffers.registry.views(bucket))
    full_graph, full_out = _capture(forward, peer_buffers.registry.views(bucket))
    with torch.no_grad():  # every implementation stages the same slab and gives the same output
        want = full.run(batch, clone=True)
        for impl in ("engine", "sglang"):
            getattr(peers, impl)(bucket)
            full_graph.replay()
            assert torch.equal(peer_buffers.input_embeds[:bucket], full.buffers.input_embeds[:bucket]), impl
            torch.testing.assert_close(full_out[:n].float(), want.float(), rtol=5e-2, atol=1e-1)
    pack_ms = _wall_ms(lambda: sshf.pack_requests(model, requests), 5)  # host work a scheduler does ahead
    yield dict(model=model, batch=batch, bucket=bucket, empty=empty, full=full, peers=peers,
               empty_graph=empty_graph, full_graph=full_graph, pack_ms=pack_ms)
    empty.reset()
    full.reset()


@pytest.mark.parametrize("impl", ["slabstage", "engine", "sglang"])
def test_merge(device_bench, merge_setup, impl):
    s = merge_setup
    bucket, batch, peers = s["bucket"], s["batch"], s["peers"]
    info = {}
    if impl == "slabstage":
        merge = lambda: s["empty"].run(batch)  # noqa: E731
        step = lambda: s["full"].run(batch)  # noqa: E731
        info["pack_requests_host_ms"] = s["pack_ms"]
    else:
        fn = getattr(peers, impl)

        def merge():
            fn(bucket)
            s["empty_graph"].replay()

        def step():
            fn(bucket)
            s["full_graph"].replay()

    syncs = _count_syncs(merge)
    if impl == "slabstage":  # and the strict proof: any sync in the merge raises
        torch.cuda.set_sync_debug_mode("error")
        try:
            merge()
        finally:
            torch.cuda.set_sync_debug_mode(0)
        info["sync_debug_error_mode"] = "passed"
    device_bench(merge)
    device_bench.extra_info.update(suite=SUITE, impl=impl, case="qwen3_vl merge", tokens=batch.num_tokens,
                                   bucket=bucket, media_rows=int((batch.media_index >= 0).sum()),
                                   host_syncs=syncs, step_wall_ms=_wall_ms(step, STEP_ROUNDS),
                                   **info)


# -- replay against eager ------------------------------------------------------------------
def _step_batch(model, name, tokens, g):
    if name == "qwen3_vl":
        requests = _vl_requests(model, g)
        whole = sshf.pack_requests(model, requests)
        if tokens >= whole.num_tokens:
            return whole
        per = tokens // 4  # 4 requests, each cut to a chunk (images cut where the chunk ends)
        chunks = [sshf.Request(**{**vars(r), "chunk": (0, per + (tokens % 4 if i == 3 else 0))})
                  for i, r in enumerate(requests)]
        return sshf.pack_requests(model, chunks)
    lens = [tokens // 4] * 3 + [tokens - 3 * (tokens // 4)]
    return sshf.pack_requests(model, [sshf.Request(torch.randint(0, 32000, (n,), generator=g)) for n in lens])


@pytest.fixture(scope="module", params=list(MODELS))
def step_setup(request):
    name = request.param
    model = _model(name)
    buffers = _buffers(model, mrope=name == "qwen3_vl")
    forward = sshf.prefill_forward(model)
    replay = ss.PrefillGraphRunner(forward, buffers, progress=False).capture()
    eager = ss.PrefillGraphRunner(forward, buffers, enforce_eager=True, progress=False)
    g = torch.Generator().manual_seed(0)
    batches = {n: _step_batch(model, name, n, g) for n in STEP_TOKENS}
    yield name, replay, eager, batches, {}
    replay.reset()


def _step(runner, batch):
    def step():
        with torch.no_grad():
            runner.run(batch)
        torch.cuda.synchronize()
    return step


def _alternate(replay, eager, batch) -> dict:
    """Replay and eager steps alternating, ALT_ROUNDS rounds of ALT_ITERS each: the median per step."""
    out = {"replay": [], "eager": []}
    for _ in range(ALT_ROUNDS):
        for impl, runner in (("replay", replay), ("eager", eager)):
            step = _step(runner, batch)
            step()
            start = time.perf_counter()
            for _ in range(ALT_ITERS):
                step()
            out[impl].append((time.perf_counter() - start) * 1e3 / ALT_ITERS)
    r, e = statistics.median(out["replay"]), statistics.median(out["eager"])
    return dict(alt_replay_ms=r, alt_eager_ms=e, speedup=e / r, alt_rounds=ALT_ROUNDS, alt_iters=ALT_ITERS)


@pytest.mark.parametrize("tokens", STEP_TOKENS)
@pytest.mark.parametrize("impl", ["replay", "eager"])
def test_step(benchmark, step_setup, impl, tokens):
    name, replay, eager, batches, alternated = step_setup
    batch = batches[tokens]
    runner = replay if impl == "replay" else eager
    with torch.no_grad():
        out = runner.run(batch, clone=True)
        ref = eager.run(batch, clone=True)
    torch.testing.assert_close(out.float(), ref.float(), rtol=5e-2, atol=1e-1)  # bf16: another bucket, same math
    if tokens not in alternated:
        alternated[tokens] = _alternate(replay, eager, batch)
    benchmark._timer = time.perf_counter
    benchmark.pedantic(_step(runner, batch), setup=torch.cuda.synchronize, rounds=100, warmup_rounds=10,
                       iterations=1)
    benchmark.extra_info.update(suite=SUITE, case=f"{name} step", impl=impl, tokens=batch.num_tokens,
                                bucket=replay.bucket_for(batch.num_tokens), metric="wall",
                                timer="perf_counter+sync", **alternated[tokens])


@pytest.mark.parametrize("name", list(MODELS))
def test_capture(benchmark, name):
    model = _model(name)
    forward = sshf.prefill_forward(model)
    result = {}

    def capture():
        runner = ss.PrefillGraphRunner(forward, _buffers(model, mrope=name == "qwen3_vl"), progress=False)
        runner.capture()
        result.update(buckets=len(runner.buckets), capture_s=runner.capture_seconds, bytes=runner.capture_bytes)
        runner.reset()

    benchmark._timer = time.perf_counter
    benchmark.pedantic(capture, rounds=1, iterations=1)
    benchmark.extra_info.update(suite=SUITE, case=f"{name} capture", impl="capture", metric="capture",
                                s_per_bucket=result["capture_s"] / result["buckets"],
                                mib=result["bytes"] / 2**20, **result)
