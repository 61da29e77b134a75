"""The standalone ops' host time on the CPU, device launches stubbed out: what a call costs in Python.

    TRITON_INTERPRET=1 python bench/op_host_cpu.py [--calls 10000] [--profile CASE]

The stager takes its Triton path (the interpreter), with ``Stager._kernel`` and ``Stager._fetch`` made
no-ops, so a call is the checks, the stager's lookup and the parameter block. Cases, µs a call back to back:
``same`` (one slab, new ids each call), ``views`` (a new view ``base[:n]`` each call), ``op`` (the custom op
``torch.ops.slabstage.stage_embeddings``), ``tokens`` (``torch.ops.slabstage.stage_token_inputs``),
``runner_stage`` (the runner's stager of the same buffers: the floor). ``--profile CASE`` prints cProfile's
top entries for that case.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time

os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout's slabstage

import torch  # noqa: E402

import slabstage as ss  # noqa: E402
from slabstage.kernels import launch  # noqa: E402

N, W, V = 256, 64, 1000


def cases(calls: int) -> dict:
    table = torch.randn(V, W)
    base = torch.empty(N + 64, W)
    errors = ss.new_error_word(torch.device("cpu"))
    ids = [torch.randint(0, V, (N,)) for _ in range(64)]
    index = torch.full((N,), -1, dtype=torch.int64)
    index[64:128] = torch.arange(64)
    media = torch.randn(64, W)
    bufs = ss.StagingBuffers.allocate(max_num_tokens=N + 64, embed_width=W, embed_dtype=torch.float32,
                                      device="cpu", max_batch_size=8)
    pos = [torch.arange(N) for _ in range(64)]
    stager = launch.Stager.for_buffers(bufs, embed=False)
    src = [launch.Inputs(input_ids=i, positions=p) for i, p in zip(ids, pos)]
    reg = bufs.registry
    from slabstage.ops import stage_embeddings_op, stage_token_inputs_op
    from slabstage.staging.slots import SLOTS, SOURCE_SLOTS
    dsts = [reg[s.name] if s.name in reg else None for s in SLOTS]
    fills = [reg.slot(s.name).fill_value if s.name in reg else None for s in SLOTS]
    fills_i, pads = [int(f or 0) for f in fills], [f is not None for f in fills]

    def tok_args(k):
        s = {"input_ids": ids[k % 64], "positions": pos[k % 64]}
        return (*dsts, bufs.errors, *(s.get(x.name) for x in SOURCE_SLOTS), N, fills_i, pads)

    return {
        "same": lambda k: ss.stage_embeddings(base, ids[k % 64], table, media=media, media_index=index,
                                              errors=errors),
        "views": lambda k: ss.stage_embeddings(base[:N + k % 7], ids[k % 64], table, media=media,
                                               media_index=index, errors=errors),
        "op": lambda k: torch.ops.slabstage.stage_embeddings(base[:N + k % 7], ids[k % 64], table, media, index,
                                                             errors, N, "zeros", None, 0, V, V, True),
        "op_wrapper": lambda k: stage_embeddings_op(base[:N + k % 7], ids[k % 64], table, media=media,
                                                    media_index=index, errors=errors),
        "tokens_wrapper": lambda k: stage_token_inputs_op(bufs, input_ids=ids[k % 64], positions=pos[k % 64],
                                                          pad_to=N),
        "tokens": lambda k: torch.ops.slabstage.stage_token_inputs(*tok_args(k)),
        "runner_stage": lambda k: stager.stage(src[k % 64], N),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=10000)
    ap.add_argument("--profile", default=None)
    args = ap.parse_args()

    def kernel(self, grid, params):  # (what the kernel reports: the step it staged)
        self.ring._done[0] = self._pending[0]

    launch.Stager._kernel = kernel
    launch.Stager._fetch = lambda self, grid: None
    import slabstage.ops  # noqa: F401  (registers the custom ops)
    for name, fn in cases(args.calls).items():
        if args.profile and name != args.profile:
            continue
        for k in range(200):
            fn(k)
        if args.profile:
            prof = cProfile.Profile()
            prof.enable()
            for k in range(args.calls):
                fn(k)
            prof.disable()
            pstats.Stats(prof).sort_stats("tottime").print_stats(30)
            continue
        t0 = time.perf_counter_ns()
        for k in range(args.calls):
            fn(k)
        print(f"{name}: {(time.perf_counter_ns() - t0) / args.calls / 1e3:.1f} us a call")


if __name__ == "__main__":
    main()
