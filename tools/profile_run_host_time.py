"""Host time of PrefillGraphRunner.run, piece by piece (GPU; prints a dict of median µs per call).

    python tools/profile_run_host_time.py

Same shapes as the README's host-time row: 2048-token buffers, a 4096-wide bf16
slab, a 300-token batch with 100 media rows, a one-linear forward.
"""
import torch
from host_timing import host_us

import slabstage as ss
from slabstage.graph_runner.nvtx import range_pop, range_push

dev = torch.device("cuda")


def us(f):
    return host_us(f)[1]  # the median


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
sig = r.signature
g, out = r.graphs[b]
r.run(batch)
cached0 = r.stager.cached_launches
r.run(batch)
res = {
    "cached path taken": r.stager.cached_launches > cached0,
    "run(device inputs)": us(lambda: r.run(batch)),
    "run(text only)": us(lambda: r.run(text)),
    "run(host inputs)": us(lambda: r.run(hb)),
    "bucket_for": us(lambda: r.bucket_for(300)),
    "registry.check": us(lambda: r.registry.check(sig)),
    "stage (cached path)": us(lambda: r.stager(batch, b, sig)),
    "stage (full path)": us(lambda: r.stager(batch, b, None)),
    "nvtx push+pop": us(lambda: (range_push("x"), range_pop())),
    "replay": us(g.replay),
    "empty loop": us(lambda: None),
}
print(res)
