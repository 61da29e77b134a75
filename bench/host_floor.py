"""run() host time beside its floor: the torch reads a step cannot skip, with no check at all.

    python bench/host_floor.py [--steps 400]      (CUDA; writes $OUT/host_floor.json)

For each case of ``bench/run_host_time.py`` (256 tokens, new tensors every step), three timings of the
same batches, alternated in rounds of 50 steps in one process:

- ``run``: ``PrefillGraphRunner.run`` (the registry check, the batch's checks, its block, the replay);
- ``phases``: the same steps cut into those four parts (medians of each part);
- ``floor``: what any step must do and nothing more: read every registry slot's address, shape, strides
  and dtype, read every tensor of the batch once per attribute a check needs (dtype, device, shape,
  strides or contiguity, address), pack a block of as many words into pinned memory, copy host integer
  inputs into it, replay the graph. No comparison, no lookup, no error path.

The floor is what a step costs on this host through torch's Python API whatever the checks do; ``run``
minus the floor is what slabstage's own logic costs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import struct
import time
from ctypes import c_char, memmove
from itertools import chain
from operator import attrgetter

import sys

import torch

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path[:1]:
    sys.path.insert(0, _ROOT)  # the checkout's slabstage

import slabstage as ss  # noqa: E402
from slabstage.kernels.validate import check_batch  # noqa: E402

DEV = torch.device("cuda")
H, T, N = 4096, 8192, 256
SPANS = [(16 * k, 8, 8 * k) for k in range(16)]  # 16 spans of 8 media rows: 128 media rows
_T = torch.Tensor
_dtype, _dev, _size, _stride, _ptr, _dense = attrgetter("dtype"), _T.get_device, _T.size, _T.stride, _T.data_ptr, \
    _T.is_contiguous


def forward(views):
    return views["input_embeds"][:, :8] * 2


def runner_for(width):
    buf = ss.StagingBuffers.allocate(max_num_tokens=T, max_batch_size=8, embed_width=width,
                                     embed_dtype=torch.bfloat16, device=DEV)
    return ss.PrefillGraphRunner(forward, buf, buckets=[64, 256, 1024], progress=False, verify="off").capture()


def flat(batch):
    """``(tensors read with their strides, item blocks read with is_contiguous)``."""
    plain = [t for t in (batch.input_ids, batch.positions, batch.seq_lens, batch.extend_start_loc, batch.table,
                         batch.media_index) if t is not None]
    media = batch.media
    blocks = [media] if isinstance(media, _T) else list(chain.from_iterable(m if type(m) is tuple else (m,)
                                                                            for m in media))
    return plain, blocks


class Floor:
    """A zero-logic step. It packs into a pinned scratch block of the ring's size and replays a stand-in graph
    of three small kernels (the runner's graph would stage whatever the ring holds)."""

    def __init__(self, runner):
        self.reg = runner.signature.fast[0]
        ring = runner.stager.ring
        self.k, self.slot_words = ring.k, ring.slot_words
        self.scratch = torch.zeros(ring.words.size, dtype=torch.int64, pin_memory=True)
        self.base = self.scratch.data_ptr()
        self.mv = memoryview((c_char * (8 * ring.words.size)).from_address(self.base)).cast("B")
        self.step = 0
        self.packers = {}  # words -> struct.Struct (a block's length comes in few sizes)
        x = torch.zeros(N, 8, device=DEV)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            x.add_(1)
            y = x * 2
            y.mul_(3)

    def run(self, batch):
        reg = self.reg
        list(map(_ptr, reg)), list(map(_size, reg)), list(map(_stride, reg)), list(map(_dtype, reg))
        plain, blocks = flat(batch)
        ts = plain + blocks
        dtypes, devs, sizes = tuple(map(_dtype, ts)), tuple(map(_dev, ts)), tuple(map(_size, ts))
        tuple(map(_stride, plain)), tuple(map(_dense, blocks))
        ptrs = tuple(map(_ptr, ts))
        words = 64 + 4 * len(blocks)
        packer = self.packers.get(words) or self.packers.setdefault(words, struct.Struct(f"<{words}q"))
        self.step = step = self.step + 1
        at = (step % self.k) * self.slot_words
        packer.pack_into(self.mv, 8 * at, *ptrs, *[0] * (words - len(ptrs)))
        end = self.base + 8 * (at + words)
        for i in range(len(plain)):  # host integer inputs: their bytes into the block, from what was read
            if devs[i] < 0:
                nbytes = sizes[i].numel() * dtypes[i].itemsize
                memmove(end, ptrs[i], nbytes)
                end += nbytes
        self.graph.replay()


def phases(runner, batch, out):
    st, reg, sig = runner.stager, runner.registry, runner.signature
    t0 = time.perf_counter_ns()
    reg.check(sig)
    t1 = time.perf_counter_ns()
    c = check_batch(st.dst, batch, N, st.configs)
    t2 = time.perf_counter_ns()
    st._write(c, False)
    t3 = time.perf_counter_ns()
    st.replay(runner.graphs[N][0])
    t4 = time.perf_counter_ns()
    for k, v in zip(("registry", "checks", "block", "replay"), (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
        out[k].append(v / 1e3)


def measure(runner, make, steps):
    floor = Floor(runner)
    ways = dict(run=lambda b, o: o.append(_timed(runner.run, b)),
                floor=lambda b, o: o.append(_timed(floor.run, b)),
                phases=lambda b, o: phases(runner, b, o))
    got = dict(run=[], floor=[], phases=dict(registry=[], checks=[], block=[], replay=[]))
    for _ in range(2):  # warm every way
        for name, way in ways.items():
            for b in [make() for _ in range(20)]:
                way(b, [] if name != "phases" else dict(registry=[], checks=[], block=[], replay=[]))
    for _ in range(steps // 50):
        for name, way in ways.items():
            batches = [make() for _ in range(50)]  # new tensors every step
            torch.cuda.synchronize()
            for i, b in enumerate(batches):
                way(b, got[name])
                if i % 8 == 7:
                    torch.cuda.synchronize()
    med = statistics.median
    return dict(run=med(got["run"]), floor=med(got["floor"]),
                phases={k: med(v) for k, v in got["phases"].items()}, steps=len(got["run"]))


def _timed(fn, b):
    t0 = time.perf_counter_ns()
    fn(b)
    return (time.perf_counter_ns() - t0) / 1e3


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=400)
    steps = p.parse_args().steps
    table = torch.randn(1000, H, dtype=torch.bfloat16, device=DEV)

    def ids_pos():
        return torch.randint(0, 1000, (N,), device=DEV), torch.arange(N, device=DEV)

    def index(device=DEV):
        return ss.media_index_from_spans(SPANS, N, device=device)

    def bf16(*shape):
        return torch.randn(*shape, dtype=torch.bfloat16, device=DEV)

    cases = {
        "one_tensor": lambda: ss.PrefillBatch(*ids_pos(), table=table, media=bf16(128, H), media_index=index()),
        "items16": lambda: ss.PrefillBatch(*ids_pos(), table=table, media=[bf16(8, H) for _ in range(16)],
                                           media_index=index()),
        "host": lambda: ss.PrefillBatch(input_ids=torch.randint(0, 1000, (N,)), positions=torch.arange(N),
                                        table=table, media=bf16(128, H), media_index=index("cpu"),
                                        seq_lens=torch.tensor([N], dtype=torch.int32),
                                        extend_start_loc=torch.tensor([0], dtype=torch.int32)),
    }
    out = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, date=time.strftime("%Y-%m-%d %H:%M UTC",
                                                                                          time.gmtime()))
    runner = runner_for(H)
    for name, make in cases.items():
        out[name] = measure(runner, make, steps)
        print(name, json.dumps(out[name]), flush=True)
    del runner
    runner = runner_for(4 * H)
    out["deepstack16"] = measure(runner, lambda: ss.PrefillBatch(
        *ids_pos(), table=table, media=[tuple(bf16(8, H) for _ in range(4)) for _ in range(16)],
        media_index=index()), steps)
    print("deepstack16", json.dumps(out["deepstack16"]), flush=True)
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "host_floor.json"), "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
