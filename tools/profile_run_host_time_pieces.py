"""Host time of PrefillGraphRunner.run and of its staging step, for the slabstage tree on PYTHONPATH (GPU).

    PYTHONPATH=$PWD python3 tools/profile_run_host_time_pieces.py new [sync]
    (cd .gpu-old && PYTHONPATH=$PWD python3 ../tools/profile_run_host_time_pieces.py old [sync])

Run it on this tree ("new") and on an older checkout ("old", whose stager is ``runner._stage`` with
``_fast``), alternating, in one session: the host is noisy, so compare minima of alternated runs.
Prints ``tag piece (min, median)`` in µs over 9 rounds of 400 calls: ``run``, the staging step, and
(new) its checks (``_match``) and its kernel launch alone, for device inputs, host inputs and (new)
16 device items; plus the registry check. A 256-token batch of a 1024-wide bf16 slab, half media rows.
With ``sync``, each figure is one call right after a device sync instead (300 samples), the mode of
``bench_graph_runner.py::test_run_host_time`` with one call.
"""
import sys

import torch
from host_timing import host_us, host_us_after_sync

import slabstage as ss

TAG = sys.argv[1] if len(sys.argv) > 1 else "new"
NEW = TAG == "new"
DEV = torch.device("cuda")
H, N = 1024, 256


AFTER_SYNC = len(sys.argv) > 2 and sys.argv[2] == "sync"


def us(f):
    return host_us_after_sync(f) if AFTER_SYNC else host_us(f, reps=400, rounds=9)


def main():
    table = torch.randn(32000, H, device=DEV, dtype=torch.bfloat16)
    buf = ss.StagingBuffers.allocate(max_num_tokens=4096, max_batch_size=16, embed_width=H,
                                     embed_dtype=torch.bfloat16, device=DEV)
    lin = torch.nn.Linear(H, 64, device=DEV, dtype=torch.bfloat16)
    runner = ss.PrefillGraphRunner(lambda v: lin(v["input_embeds"]), buf, progress=False, buckets=[256, 1024])
    runner.capture()
    g = torch.Generator().manual_seed(0)
    ids, pos = torch.randint(0, 32000, (N,), generator=g), torch.arange(N)
    media = torch.randn(128, H, device=DEV, dtype=torch.bfloat16)
    items = [t.clone() for t in media.split(8)]
    index = torch.full((N,), -1, dtype=torch.int32)
    index[64:192] = torch.arange(128, dtype=torch.int32)
    seq, ext = torch.tensor([64] * 4, dtype=torch.int32), torch.tensor([0, 64, 128, 192], dtype=torch.int32)

    def batch(host: bool, as_items: bool = False):
        move = (lambda t: t) if host else (lambda t: t.to(DEV))
        return ss.PrefillBatch(input_ids=move(ids), positions=move(pos), table=table, seq_lens=move(seq),
                               extend_start_loc=move(ext), media=list(items) if as_items else media,
                               media_index=move(index))

    stager = getattr(runner, "stager", None) or runner._stage
    sig = getattr(runner, "signature", None) or runner._signature
    cases = [("device", batch(False)), ("host", batch(True))]
    if NEW:  # the older tree takes one media tensor only
        cases.append(("device 16 items", batch(False, True)))
    res = {}
    for name, b in cases:
        runner.run(b)
        runner.run(b)
        bucket = runner.last_bucket
        res[f"{name} run"] = us(lambda b=b: runner.run(b))
        res[f"{name} stager"] = us(lambda b=b, k=bucket: stager(b, k, sig))
        if NEW:
            res[f"{name} match"] = us(lambda b=b, k=bucket: stager._match(b, k))
            key, values, keep = stager._match(b, bucket)
            variant, cols = stager.variants[key]
            res[f"{name} launch"] = us(lambda v=variant, g=bucket * cols, a=values: v.launch_trusted(g, a))
        else:
            res[f"{name} _fast"] = us(lambda b=b, k=bucket: stager._fast(b, k, sig))
    res["registry.check"] = us(lambda: runner.registry.check(sig))
    if NEW:
        from slabstage.kernels.plan import check_media
        res["check_media 16"] = us(lambda: check_media(items, buf.device, H, H, "zeros"))
        from slabstage.kernels.plan import pack_to_device
        host = [ids, pos, seq, ext, index]
        res["pack_to_device host"] = us(lambda: pack_to_device(DEV, host, buf.token_scratch))
    for k, v in res.items():
        print(TAG + " sync" * AFTER_SYNC, k, v, flush=True)


if __name__ == "__main__":
    main()
