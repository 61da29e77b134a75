"""run() host time with new tensors every step (public API only, so it runs against any checkout).

    python bench/run_host_time.py CHECKOUT LABEL     (CUDA; imports CHECKOUT's slabstage; $OUT/host_time_LABEL.json)
    PROFILE=1 python bench/run_host_time.py CHECKOUT  (a cProfile of run())
"""
import json
import os
import statistics
import sys
import time

sys.path.insert(0, sys.argv[1])
import torch  # noqa: E402

import slabstage as ss  # noqa: E402

dev = torch.device("cuda")
H, T = 4096, 8192
OUT = os.environ.get("OUT", "/tmp")


def buffers(width=H, mrope=False):
    return ss.StagingBuffers.allocate(max_num_tokens=T, max_batch_size=8, embed_width=width,
                                      embed_dtype=torch.bfloat16, device=dev, mrope=mrope)


def forward(views):
    return views["input_embeds"][:, :8] * 2


def measure(label, runner, make, steps=400, warm=50):
    batches = [make(i) for i in range(steps + warm)]  # every batch a new set of tensors
    for b in batches[:warm]:
        runner.run(b)
    torch.cuda.synchronize()
    ts = []
    for i, b in enumerate(batches[warm:]):
        t0 = time.perf_counter_ns()
        runner.run(b)
        ts.append((time.perf_counter_ns() - t0) / 1e3)
        if i % 8 == 7:
            torch.cuda.synchronize()
    ts.sort()
    r = dict(p10=ts[len(ts) // 10], median=statistics.median(ts), p90=ts[9 * len(ts) // 10])
    print(f"{sys.argv[2]:6s} {label:48s} p10 {r['p10']:7.1f} med {r['median']:7.1f} p90 {r['p90']:7.1f} us", flush=True)
    return r


def main():
    table = torch.randn(1000, H, dtype=torch.bfloat16, device=dev)
    n = 256
    res = {}
    buf = buffers()
    runner = ss.PrefillGraphRunner(forward, buf, buckets=[64, 256, 1024], progress=False).capture()
    spans = [(16 * k, 8, 8 * k) for k in range(16)]  # 16 spans of 8 media rows: 128 media rows

    def index():
        return ss.media_index_from_spans(spans, n, device=dev)

    def dev_ids():
        return torch.randint(0, 1000, (n,), device=dev), torch.arange(n, device=dev)

    def one_tensor(i):
        ids, pos = dev_ids()
        return ss.PrefillBatch(input_ids=ids, positions=pos, table=table,
                               media=torch.randn(128, H, dtype=torch.bfloat16, device=dev), media_index=index())

    def items16(i):
        ids, pos = dev_ids()
        return ss.PrefillBatch(input_ids=ids, positions=pos, table=table,
                               media=[torch.randn(8, H, dtype=torch.bfloat16, device=dev) for _ in range(16)],
                               media_index=index())

    def host_inputs(i):
        return ss.PrefillBatch(input_ids=torch.randint(0, 1000, (n,)), positions=torch.arange(n), table=table,
                               media=torch.randn(128, H, dtype=torch.bfloat16, device=dev),
                               media_index=ss.media_index_from_spans(spans, n, device="cpu"),
                               seq_lens=torch.tensor([n], dtype=torch.int32),
                               extend_start_loc=torch.tensor([0], dtype=torch.int32))

    graph = runner.graphs[n][0]  # the floor: the 256-token bucket's graph replayed alone, no staging

    class Replay:
        def run(self, batch):
            graph.replay()

    res["replay_alone"] = measure("graph.replay() alone (the floor)", Replay(), lambda i: None)
    res["one_tensor"] = measure("256 tok, device inputs, one new media tensor", runner, one_tensor)
    res["items16"] = measure("256 tok, device inputs, 16 new items", runner, items16)
    res["host"] = measure("256 tok, host int inputs, one new media tensor", runner, host_inputs)
    del runner
    wide = buffers(width=4 * H)
    runner = ss.PrefillGraphRunner(forward, wide, buckets=[64, 256, 1024], progress=False).capture()

    def deepstack16(i):
        ids, pos = dev_ids()
        items = [tuple(torch.randn(8, H, dtype=torch.bfloat16, device=dev) for _ in range(4)) for _ in range(16)]
        return ss.PrefillBatch(input_ids=ids, positions=pos, table=table, media=items, media_index=index())

    res["deepstack16"] = measure("256 tok, 16 new DeepStack items of 4 blocks", runner, deepstack16)
    json.dump(res, open(os.path.join(OUT, f"host_time_{sys.argv[2]}.json"), "w"), indent=1)


def profile():
    """cProfile of run(): one new media tensor, 256 tokens."""
    import cProfile
    import pstats
    table = torch.randn(1000, H, dtype=torch.bfloat16, device=dev)
    n = 256
    runner = ss.PrefillGraphRunner(forward, buffers(), buckets=[64, 256, 1024], progress=False).capture()
    spans = [(16 * k, 8, 8 * k) for k in range(16)]
    batches = [ss.PrefillBatch(input_ids=torch.randint(0, 1000, (n,), device=dev),
                               positions=torch.arange(n, device=dev),
                               table=table, media=torch.randn(128, H, dtype=torch.bfloat16, device=dev),
                               media_index=ss.media_index_from_spans(spans, n, device=dev)) for _ in range(3000)]
    for b in batches[:200]:
        runner.run(b)
    torch.cuda.synchronize()
    pr = cProfile.Profile()
    pr.enable()
    for i, b in enumerate(batches[200:]):
        runner.run(b)
        if i % 8 == 7:
            torch.cuda.synchronize()
    pr.disable()
    pstats.Stats(pr).sort_stats("tottime").print_stats(22)


if __name__ == "__main__":
    profile() if os.environ.get("PROFILE") else main()
