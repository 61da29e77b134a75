import cProfile, importlib, pstats, time, torch, io
import slabstage as ss
se = importlib.import_module("slabstage.kernels.stage_embeddings")
L = se._launch
dev = torch.device("cuda")
table = torch.randn(1000, 4096, device=dev, dtype=torch.bfloat16)
ids = torch.randint(0, 1000, (2048,), device=dev)
slab = torch.empty(2048, 4096, device=dev, dtype=torch.bfloat16)
plan = se.plan_stage_embeddings(slab, ids, table)
for _ in range(100): plan()
torch.cuda.synchronize()
print("enabled", L.enabled, "entries", [(k[:2], v[0] is not None, len(v[1])) for k, v in L.cache.items()])
print("hooks_set", importlib.import_module("slabstage.kernels._launch")._hooks_set())
for name, f in (("plan()", plan), ("stream", lambda: torch._C._cuda_getCurrentRawStream(0))):
    for _ in range(200): f()
    torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(1000): f()
    print(name, (time.perf_counter() - t) * 1e3, "us/call"); torch.cuda.synchronize()
pr = cProfile.Profile(); pr.enable()
for _ in range(2000): plan()
pr.disable(); torch.cuda.synchronize()
s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(12); print(s.getvalue()[:3000])

# the runner's run() on the graph path, device-resident inputs
buf = ss.StagingBuffers.allocate(max_num_tokens=2048, max_batch_size=8, embed_width=4096,
                                 embed_dtype=torch.bfloat16, device=dev)
lin = torch.nn.Linear(4096, 256, device=dev, dtype=torch.bfloat16)
r = ss.PrefillGraphRunner(lambda v: lin(v["input_embeds"]), buf, progress=False).capture()
media = torch.randn(100, 4096, device=dev, dtype=torch.bfloat16)
mi = ss.media_index_from_spans([(10, 100, 0)], 300, device=dev)
batch = ss.PrefillBatch(input_ids=ids[:300], positions=torch.arange(300, device=dev), table=table, media=media,
                        media_index=mi)
for _ in range(200): r.run(batch)
torch.cuda.synchronize(); t = time.perf_counter()
for _ in range(1000): r.run(batch)
print("run() us", (time.perf_counter() - t) * 1e3); torch.cuda.synchronize()
pr = cProfile.Profile(); pr.enable()
for _ in range(2000): r.run(batch)
pr.disable(); torch.cuda.synchronize()
s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(25); print(s.getvalue()[:5000])
