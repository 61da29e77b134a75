"""Host time of run() and its parts per token count, on the graph runner benchmark's toy model.

    python tools/profile_run_host_time_by_bucket.py
"""
import statistics
import time

import torch

from slabstage import PrefillGraphRunner, StagingBuffers
from slabstage.models import ToyMultimodalModel, make_batch


def us(f, reps=200, rounds=7, sync_each=True):
    out = []
    for _ in range(rounds):
        total = 0.0
        for _ in range(reps):
            if sync_each:
                torch.cuda.synchronize()
            t = time.perf_counter()
            f()
            total += time.perf_counter() - t
        out.append(total / reps * 1e6)
    return round(statistics.median(out), 2)


model = ToyMultimodalModel("plain", hidden_size=1024, vocab_size=32000, num_layers=4, num_heads=16, device="cuda",
                           dtype=torch.bfloat16, seed=0)
buffers = StagingBuffers.allocate(max_num_tokens=4096, max_batch_size=16, embed_width=model.embed_width,
                                  embed_dtype=torch.bfloat16, device="cuda")
r = PrefillGraphRunner(model, buffers, progress=False).capture()
g = torch.Generator().manual_seed(0)
for n in (16, 256, 1000, 4096):
    batch = make_batch(model, n, media_fraction=0.5, num_seqs=min(4, n), generator=g, device="cuda")
    r.run(batch)
    r.run(batch)
    b = r.last_bucket
    graph, _ = r.graphs[b]
    sig = r.signature
    print(n, b, {"run": us(lambda batch=batch: r.run(batch)),
                 "stage": us(lambda batch=batch, b=b, sig=sig: r.stager(batch, b, sig)),
                 "replay": us(graph.replay), "check": us(lambda sig=sig: r.registry.check(sig)),
                 "fast": r.stager.cached_launches}, flush=True)
