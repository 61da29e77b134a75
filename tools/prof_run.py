import time, torch, statistics
import slabstage as ss
dev = torch.device("cuda")


def us(f, reps=300, rounds=9):
    for _ in range(reps): f()
    torch.cuda.synchronize()
    out = []
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(reps): f()
        out.append((time.perf_counter() - t) / reps * 1e6)
        torch.cuda.synchronize()
    return round(statistics.median(out), 2)


table = torch.randn(1000, 4096, device=dev, dtype=torch.bfloat16)
ids = torch.randint(0, 1000, (2048,), device=dev)
buf = ss.StagingBuffers.allocate(max_num_tokens=2048, max_batch_size=8, embed_width=4096,
                                 embed_dtype=torch.bfloat16, device=dev)
lin = torch.nn.Linear(4096, 256, device=dev, dtype=torch.bfloat16)
r = ss.PrefillGraphRunner(lambda v: lin(v["input_embeds"]), buf, progress=False).capture()
media = torch.randn(100, 4096, device=dev, dtype=torch.bfloat16)
mi = ss.media_index_from_spans([(10, 100, 0)], 300, device=dev)
batch = ss.PrefillBatch(input_ids=ids[:300], positions=torch.arange(300, device=dev), table=table, media=media,
                        media_index=mi)
hb = ss.PrefillBatch(input_ids=ids[:300].cpu(), positions=torch.arange(300), table=table, media=media,
                     media_index=mi)
r.run(batch)
b = r.last_bucket
sig = r._signature
launch = r._plan(batch, b)
hlaunch = r._plan(hb, b)
g, out = r._graphs[b]
res = {
    "run(dev inputs)": us(lambda: r.run(batch)),
    "run(host inputs)": us(lambda: r.run(hb)),
    "bucket_for": us(lambda: r.bucket_for(300)),
    "check": us(lambda: r.registry.check(sig)),
    "_plan": us(lambda: r._plan(batch, b)),
    "fused launch": us(launch),
    "fused launch host inputs": us(hlaunch),
    "stage_embeddings alone": us(lambda: ss.stage_embeddings(buf.input_embeds, ids[:300], table, media=media, media_index=mi, pad_to=320, errors=buf.errors)),
    "stage_token_inputs alone": us(lambda: ss.stage_token_inputs(buf, input_ids=ids[:300], positions=batch.positions, pad_to=320)),
    "replay": us(g.replay),
    "rows": us(lambda: out[:300]),
    "empty loop": us(lambda: None),
}
print(res)
# GPU time of one run (graph-free measure: events around many runs)
torch.cuda.synchronize()
e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
e0.record()
for _ in range(500): r.run(batch)
e1.record(); torch.cuda.synchronize()
print("wall-ish GPU us per run", e0.elapsed_time(e1) * 1e3 / 500)

# step timings inside run(), in context
import collections
from slabstage.graph_runner.nvtx import range_push, range_pop
from slabstage.graph_runner.runner import _rows
acc = collections.Counter()
pc = time.perf_counter_ns


def run_timed(batch):
    t0 = pc(); n = batch.input_ids.shape[0]; bucket = r.bucket_for(n)
    t1 = pc(); r.registry.check(r._signature)
    t2 = pc(); launch = r._plan(batch, bucket)
    t3 = pc(); range_push("slabstage.stage"); launch(); range_pop()
    t4 = pc(); graph, out = r._graphs[bucket]; range_push("slabstage.replay"); graph.replay(); range_pop()
    t5 = pc(); res = _rows(out, n, False)
    t6 = pc()
    for k, a, b in (("bucket", t0, t1), ("check", t1, t2), ("plan", t2, t3), ("stage", t3, t4), ("replay", t4, t5),
                    ("rows", t5, t6), ("total", t0, t6)):
        acc[k] += b - a
    return res


for bb, name in ((batch, "dev"), (hb, "host")):
    for _ in range(300): run_timed(bb)
    torch.cuda.synchronize(); acc.clear()
    for _ in range(2000): run_timed(bb)
    torch.cuda.synchronize()
    print(name, {k: round(v / 2000 / 1e3, 2) for k, v in acc.items()})
import gc
gc.disable()
print("run() gc off", us(lambda: r.run(batch)))
gc.enable()
