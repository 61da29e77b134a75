"""Host time of the staging steps' Python parts, on any machine (no GPU: the Triton interpreter's path).

    python bench/host_parts.py [--steps 1400] [--profile]

Measures, with new tensors every step, 256 tokens x 4096 bf16, median µs:

- ``stage_embeddings`` host part: the destinations' lookup, the batch's checks and the parameter block
  written into the pinned ring (no launch);
- the runner's step before its replay: the registry check, then the checks and the block, for one media
  tensor and for 16 media items.

The device is not involved, so this isolates what Python costs; on a GPU machine the launch or the
replay comes on top. ``--profile`` prints a cProfile of each.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ["TRITON_INTERPRET"] = "1"  # before slabstage defines its kernels: the stager writes blocks
sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the checkout's slabstage

import torch  # noqa: E402

import slabstage as ss  # noqa: E402
from slabstage.kernels.launch import Inputs, Stager  # noqa: E402
from slabstage.kernels.op_stagers import slab_stager  # noqa: E402

W, N = 4096, 256
SPANS = [(16 * k, 8, 8 * k) for k in range(16)]  # 16 spans of 8 media rows


def _timed(name, step, batches, profile):
    for b in batches[:100]:
        step(b)
    if profile:
        import cProfile
        import pstats
        pr = cProfile.Profile()
        pr.enable()
    ts = []
    for b in batches[100:]:
        t0 = time.perf_counter_ns()
        step(b)
        ts.append(time.perf_counter_ns() - t0)
    if profile:
        pr.disable()
        pstats.Stats(pr).sort_stats("tottime").print_stats(14)
    print(f"{name:60s} {statistics.median(ts) / 1e3:7.1f} us median, {min(ts) / 1e3:7.1f} min", flush=True)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=1400)
    p.add_argument("--profile", action="store_true")
    args = p.parse_args()
    steps = args.steps + 100
    table = torch.randn(32000, W, dtype=torch.bfloat16)
    ids = torch.randint(0, 32000, (N,))
    index = ss.media_index_from_spans(SPANS, N, device="cpu")

    slab = torch.zeros(N, W, dtype=torch.bfloat16)
    errors = ss.new_error_word("cpu")

    def se_host(media):
        dst, st = slab_stager(slab, errors)
        with st.lock:
            st.dst = dst
            st.prepare(Inputs(input_ids=ids, table=table, media=media, media_index=index), None)
            st.ring.commit(st._pending[0])
            st.ring._done[0] = st._pending[0]  # (no launch here reports the step: say it started)

    medias = [torch.randn(128, W, dtype=torch.bfloat16) for _ in range(steps)]
    _timed("stage_embeddings host part, one new media tensor", se_host, medias, args.profile)
    del medias

    buf = ss.StagingBuffers.allocate(max_num_tokens=1024, max_batch_size=8, embed_width=W,
                                     embed_dtype=torch.bfloat16, device="cpu")
    st = Stager.for_buffers(buf, embed=True)
    sig = buf.registry.signature()

    def runner_step(batch):
        buf.registry.check(sig)
        st.prepare(batch, N)
        st.ring.commit(st._pending[0])
        st.ring._done[0] = st._pending[0]

    def batch(media):
        return ss.PrefillBatch(input_ids=torch.randint(0, 1000, (N,)), positions=torch.arange(N), table=table,
                               media=media, media_index=ss.media_index_from_spans(SPANS, N, device="cpu"))

    for name, make in (("one new media tensor", lambda: torch.randn(128, W, dtype=torch.bfloat16)),
                       ("16 new media items", lambda: [torch.randn(8, W, dtype=torch.bfloat16) for _ in range(16)])):
        batches = [batch(make()) for _ in range(steps)]
        _timed(f"run() before the replay, {name}", runner_step, batches, args.profile)
        del batches
    return 0


if __name__ == "__main__":
    sys.exit(main())
