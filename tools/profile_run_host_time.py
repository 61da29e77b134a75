"""Host time of PrefillGraphRunner.run, piece by piece (GPU; prints a dict of median µs per call).

    python tools/profile_run_host_time.py

Same shapes as the README's host-time row: 2048-token buffers, a 4096-wide bf16
slab, a 300-token batch with 100 media rows, a one-linear forward.
"""
import statistics
import time

import torch

import slabstage as ss
from slabstage.graph_runner.nvtx import range_pop, range_push

dev = torch.device("cuda")


def us(f, reps=300, rounds=9):
    for _ in range(reps):
        f()
    torch.cuda.synchronize()
    out = []
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(reps):
            f()
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
text = ss.PrefillBatch(input_ids=ids[:300], positions=torch.arange(300, device=dev), table=table)
hb = ss.PrefillBatch(input_ids=ids[:300].cpu(), positions=torch.arange(300), table=table, media=media,
                     media_index=mi.cpu())
r.run(batch)
b = r.last_bucket
sig = r._signature
g, out = r._graphs[b]
r.run(batch)
fast0 = r._stage.fast_launches
r.run(batch)
run_, fn, meta, tail, cb = next(iter(r._stage._entries.values()))
st = r._stage._static
stream = torch._C._cuda_getCurrentRawStream(0)
args = (st.slab, ids.data_ptr(), table.data_ptr(), media.data_ptr(), mi.data_ptr(), st.errors, 300, b, 0, 1000, 1000,
        100, 1.0, st.width, 4096, 4096, ids.data_ptr(), batch.positions.data_ptr(), *st.dsts[2:4], *st.dsts[4:6],
        *st.dsts, 300, b, 0, st.batch_cap, st.mrope_dst_stride, st.mrope_dst_stride, *st.fills, *tail)
res = {
    "fast path taken": r._stage.fast_launches > fast0,
    "run(device inputs)": us(lambda: r.run(batch)),
    "run(text only)": us(lambda: r.run(text)),
    "run(host inputs)": us(lambda: r.run(hb)),
    "bucket_for": us(lambda: r.bucket_for(300)),
    "registry.check": us(lambda: r.registry.check(sig)),
    "stage (cached path)": us(lambda: r._stage(batch, b, sig)),
    "kernel launcher alone": us(lambda: run_(b * cb, 1, 1, stream, fn, meta, None, None, None, *args)),
    "stage (full path)": us(lambda: r._stage(batch, b, None)),
    "nvtx push+pop": us(lambda: (range_push("x"), range_pop())),
    "replay": us(g.replay),
    "empty loop": us(lambda: None),
}
print(res)
