"""One-call GPU probe: correctness, sync-freedom, launch-config sweep and host time of the staging kernels.

python tools/probe_staging_kernels.py [--quick]   (writes a JSON summary to $OUT or /tmp)
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import time

import torch
import triton
import triton.testing

import slabstage as ss
from host_timing import host_us
from slabstage.kernels.reference import stage_embeddings_reference

# the module, not the function of the same name that slabstage.kernels exports
se = importlib.import_module("slabstage.kernels.stage_embeddings")


def make_case(n, width, dev, *, text_w=None, media_w=None, dtype=torch.bfloat16, vocab=32000, block=64, seed=0):
    g = torch.Generator(device=dev).manual_seed(seed)
    text_w = text_w or width
    media_w = media_w or width
    table = torch.randn(vocab, text_w, device=dev, dtype=dtype, generator=g)
    ids = torch.randint(0, vocab, (n,), device=dev, generator=g)
    rows = torch.arange(n, device=dev)
    is_media = (rows // block) % 2 == 1
    mi = torch.where(is_media, torch.cumsum(is_media.int(), 0) - 1, -1).to(torch.int32)
    m = int(is_media.sum())
    media = torch.randn(max(m, 1), media_w, device=dev, dtype=dtype, generator=g)
    return table, ids, media, mi, is_media


def check_correct(dev):
    results = []
    for (n, W, tw, mw, expand, dtype, mdtype) in [
        (1000, 4096, 4096, 4096, "zeros", torch.bfloat16, torch.bfloat16),
        (777, 4097, 1000, 4097, "zeros", torch.float16, torch.float32),
        (513, 16384, 4096, 4096, "repeat", torch.bfloat16, torch.float32),
        (300, 3 * 1024, 1024, 3 * 1024, "zeros", torch.float32, torch.bfloat16),
        (64, 1000, 1000, 1000, "zeros", torch.bfloat16, torch.float16),
    ]:
        table, ids, media, mi, _ = make_case(n, W, dev, text_w=tw, media_w=mw, dtype=dtype)
        media = media.to(mdtype)
        slab = torch.full((n + 40, W), float("nan"), device=dev, dtype=dtype)
        ref = slab.clone()
        ids[3] = -5
        kw = dict(pad_to=n + 17, expand=expand, text_scale=1.5)
        e1, e2 = ss.new_error_word(dev), ss.new_error_word(dev)
        ss.stage_embeddings(slab, ids, table, media=media, media_index=mi, errors=e1, **kw)
        stage_embeddings_reference(ref, ids, table, media, mi, vocab_start=0, vocab_end=table.shape[0],
                                   vocab_size=table.shape[0], media_owner=True, errors=e2, **kw)
        ok = torch.equal(slab[: n + 17], ref[: n + 17]) and torch.isnan(slab[n + 17:].float()).all().item()
        ok = ok and torch.equal(e1, e2)
        results.append(dict(n=n, W=W, tw=tw, mw=mw, expand=expand, dtype=str(dtype), ok=bool(ok),
                            err=e1.tolist()))
    return results


def check_sync_free(dev):
    buf = ss.StagingBuffers.allocate(max_num_tokens=4096, max_batch_size=8, embed_width=1024,
                                     embed_dtype=torch.bfloat16, device=dev)
    table, ids, media, mi, is_media = make_case(2000, 1024, dev)
    spans = [(100, 50, 0), (400, 30, 50)]
    ids_h, pos_h = ids.cpu(), torch.arange(2000)
    seq = torch.tensor([1000, 1000], dtype=torch.int32)
    ext = torch.tensor([0, 1000], dtype=torch.int32)
    ss.stage_token_inputs(buf, input_ids=ids_h, positions=pos_h, seq_lens=seq, extend_start_loc=ext, pad_to=2048)
    pos_d = pos_h.to(dev)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    import traceback
    try:
        mi2 = ss.media_index_from_spans(spans, 2000, device=dev)
        mi3 = ss.media_index_from_mask(is_media, media.shape[0], errors=buf.errors)
        ss.stage_token_inputs(buf, input_ids=ids_h, positions=pos_h, seq_lens=seq, extend_start_loc=ext, pad_to=2048)
        ss.stage_token_inputs(buf, input_ids=ids, positions=pos_d, pad_to=2048)
        ss.stage_embeddings(buf.input_embeds, ids, table, media=media, media_index=mi3, pad_to=2048,
                            errors=buf.errors)
        ss.stage_embeddings(buf.input_embeds, buf.input_ids[:2000], table, media=media, media_index=mi2,
                            pad_to=2048, errors=buf.errors)
        ok = True
        msg = ""
    except Exception:  # noqa: BLE001
        ok, msg = False, traceback.format_exc()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return dict(ok=ok, msg=msg, errors=buf.errors.tolist())


def bench(fn, rep=200):
    return triton.testing.do_bench(fn, warmup=25, rep=rep, return_mode="median") * 1e3  # us


def copy_ceiling(dev):
    a = torch.empty(2**30, dtype=torch.uint8, device=dev)  # 1 GiB
    b = torch.empty_like(a)
    us = bench(lambda: b.copy_(a), rep=300)
    return 2 * a.numel() / (us * 1e-6) / 1e12, us


def sweep(dev, ceiling_tbps, quick):
    out = []
    shapes = [(256, 4096), (2048, 4096), (8192, 4096), (32768, 4096), (2048, 16384), (8192, 16384)]
    configs = [None, (4096, 4), (4096, 8), (2048, 4), (2048, 2), (1024, 2), (8192, 8), (1024, 4), (512, 1)]
    if quick:
        configs = configs[:4]
    settings = importlib.import_module("slabstage.kernels.plan")  # holds the one launch-settings helper
    orig = settings.row_launch_config
    for n, W in shapes:
        table, ids, media, mi, is_media = make_case(n, W, dev)
        slab = torch.empty(n, W, device=dev, dtype=torch.bfloat16)
        nbytes = 2 * n * W * 2 + n * 12
        floor_us = nbytes / (ceiling_tbps * 1e12) * 1e6
        # D2D copy of the same bytes, same run
        src = torch.empty(n * W, dtype=torch.bfloat16, device=dev)
        dst = torch.empty_like(src)
        cp_us = bench(lambda dst=dst, src=src: dst.copy_(src))
        row = dict(n=n, W=W, floor_us=floor_us, copy_us=cp_us, configs={})
        for cfg in configs:
            if cfg is not None:
                settings.row_launch_config = lambda width, eb, divides=(), max_block_bytes=8192, c=cfg: c
            try:
                def f(slab=slab, ids=ids, table=table, media=media, mi=mi):
                    return ss.stage_embeddings(slab, ids, table, media=media, media_index=mi)
                f()
                us = bench(f)
            finally:
                settings.row_launch_config = orig
            row["configs"][str(cfg)] = dict(us=us, frac_ceiling=floor_us / us, vs_copy=cp_us / us)
        # peer: vLLM-current way (index_put with pinned mask, copy)
        mask_cpu = is_media.cpu().pin_memory()

        def vllm(ids=ids, table=table, media=media, slab=slab, mask_cpu=mask_cpu):
            emb = torch.nn.functional.embedding(ids, table)
            emb[mask_cpu.to(dev, non_blocking=True)] = media
            slab.copy_(emb)
        row["vllm_index_put_us"] = bench(vllm)
        out.append(row)
        print(n, W, f"floor {floor_us:.1f}us copy {cp_us:.1f}us",
              {k: round(v["us"], 1) for k, v in row["configs"].items()}, f"vllm {row['vllm_index_put_us']:.1f}",
              flush=True)
    return out


def _host_us(f):
    return host_us(f, reps=50, rounds=20)[1]  # the median


def host_time(dev):
    res = {}
    stk = importlib.import_module("slabstage.kernels.stage_token_inputs")
    table, ids, media, mi, _ = make_case(2048, 4096, dev)
    slab = torch.empty(2048, 4096, device=dev, dtype=torch.bfloat16)
    buf = ss.StagingBuffers.allocate(max_num_tokens=2048, max_batch_size=8, embed_width=4096,
                                     embed_dtype=torch.bfloat16, device=dev)
    pos = torch.arange(2048, device=dev)
    ids_h, pos_h = ids.cpu(), pos.cpu()
    plan_e = se.plan_stage_embeddings(slab, ids, table, media=media, media_index=mi)
    plan_t = stk.plan_stage_token_inputs(buf, input_ids=ids, positions=pos, pad_to=2048)
    cases = {
        "stage_embeddings": lambda: ss.stage_embeddings(slab, ids, table, media=media, media_index=mi),
        "stage_embeddings.plan": lambda: se.plan_stage_embeddings(slab, ids, table, media=media, media_index=mi),
        "stage_embeddings.launch": plan_e,
        "stage_token_inputs_dev": lambda: ss.stage_token_inputs(buf, input_ids=ids, positions=pos, pad_to=2048),
        "stage_token_inputs.plan": lambda: stk.plan_stage_token_inputs(buf, input_ids=ids, positions=pos,
                                                                       pad_to=2048),
        "stage_token_inputs.launch": plan_t,
        "stage_token_inputs_host": lambda: ss.stage_token_inputs(buf, input_ids=ids_h, positions=pos_h,
                                                                 pad_to=2048),
        "registry.check": (lambda s=buf.registry.signature(): buf.registry.check(s)),
        "nvtx push+pop": lambda: (torch.cuda.nvtx.range_push("x"), torch.cuda.nvtx.range_pop()),
        "slice": lambda: buf.input_ids[:2000],
        "media_index_from_spans": lambda: ss.media_index_from_spans([(0, 100, 0), (500, 100, 100)], 2048,
                                                                    device=dev),
        "pin+copy 2k int64": lambda: ids_h.pin_memory().to(dev, non_blocking=True),
    }
    for name, f in cases.items():
        res[name] = _host_us(f)
    print("host us/call:", {k: round(v, 1) for k, v in res.items()}, flush=True)
    return res


def graph_device_us(dev, n, W, rot=4):
    """Device time per stage_embeddings call without launch gaps: R calls on R input sets in one graph."""
    sets = [make_case(n, W, dev, seed=s) for s in range(rot)]
    slabs = [torch.empty(n, W, device=dev, dtype=torch.bfloat16) for _ in range(rot)]
    fns = [lambda t=t, s=s: ss.stage_embeddings(s, t[1], t[0], media=t[2], media_index=t[3])
           for t, s in zip(sets, slabs)]
    srcs = [torch.empty(n * W, dtype=torch.bfloat16, device=dev) for _ in range(rot)]
    dsts = [torch.empty_like(x) for x in srcs]
    out = {}
    for name, calls in (("stage", fns), ("copy", [lambda a=a, b=b: b.copy_(a) for a, b in zip(srcs, dsts)])):
        for f in calls:
            f()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            g.capture_begin()
            for _ in range(8):
                for f in calls:
                    f()
            g.capture_end()
        torch.cuda.current_stream().wait_stream(s)
        g.replay()
        torch.cuda.synchronize()
        ms = triton.testing.do_bench(g.replay, warmup=10, rep=100, return_mode="median")
        out[name] = ms * 1e3 / (8 * rot)
    return out


def runner_probe(dev):
    buf = ss.StagingBuffers.allocate(max_num_tokens=2048, max_batch_size=8, embed_width=1024,
                                     embed_dtype=torch.bfloat16, device=dev)
    lin = torch.nn.Linear(1024, 1024, device=dev, dtype=torch.bfloat16)

    def fwd(v):
        return lin(v["input_embeds"]).float().cumsum(0) * 0 + lin(v["input_embeds"]).float()

    r = ss.PrefillGraphRunner(fwd, buf, progress=False)
    t0 = time.perf_counter()
    r.capture()
    cap = time.perf_counter() - t0
    table, ids, media, mi, _ = make_case(300, 1024, dev)
    batch = ss.PrefillBatch(input_ids=ids.cpu(), positions=torch.arange(300), table=table, media=media,
                            media_index=mi)
    out = r.run(batch, clone=True)
    eager = fwd(buf.registry.views(r.last_bucket))[:300]
    same = torch.equal(out, eager)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            r.run(batch)
        sync_ok = True
    except Exception as e:  # noqa: BLE001
        sync_ok = repr(e)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    for _ in range(20):
        r.run(batch)
    torch.cuda.synchronize()
    ts = []
    for _ in range(10):
        t0 = time.perf_counter()
        for _ in range(50):
            r.run(batch)
        ts.append((time.perf_counter() - t0) / 50 * 1e6)
        torch.cuda.synchronize()
    batch_dev = ss.PrefillBatch(input_ids=ids, positions=torch.arange(300, device=dev), table=table, media=media,
                                media_index=mi)
    dev_us = _host_us(lambda: r.run(batch_dev))
    g, _ = r.graphs[r.last_bucket]
    replay_us = _host_us(g.replay)
    res = dict(buckets=len(r.buckets), capture_s=cap, host_us_dev_inputs=dev_us, graph_replay_us=replay_us,
               capture_mib=r.capture_bytes / 2**20, replay_equal=same, sync_ok=sync_ok,
               host_us_per_run=statistics.median(ts))
    print("runner:", res, flush=True)
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    dev = torch.device("cuda")
    info = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                date=time.strftime("%Y-%m-%d"))
    print(info, flush=True)
    info["correct"] = check_correct(dev)
    print("correct:", [c["ok"] for c in info["correct"]], flush=True)
    info["sync"] = check_sync_free(dev)
    print("sync:", info["sync"], flush=True)
    tbps, us = copy_ceiling(dev)
    info["ceiling_tbps"] = tbps
    print(f"copy ceiling {tbps:.3f} TB/s", flush=True)
    info["host"] = host_time(dev)
    info["graph_device_us"] = {}
    for n, W in [(256, 4096), (2048, 4096), (8192, 4096), (2048, 16384)]:
        info["graph_device_us"][f"{n}x{W}"] = r = graph_device_us(dev, n, W)
        print("graph device us", n, W, {k: round(v, 2) for k, v in r.items()},
              f"floor {(2 * n * W * 2 + 12 * n) / (tbps * 1e12) * 1e6:.2f}", flush=True)
    info["runner"] = runner_probe(dev)
    info["sweep"] = sweep(dev, tbps, args.quick)
    path = os.path.join(os.environ.get("OUT", "/tmp"), "gpu_probe.json")
    with open(path, "w") as f:
        json.dump(info, f, indent=1)


if __name__ == "__main__":
    main()
