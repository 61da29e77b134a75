"""Where a ``stage_embeddings`` call's host time goes, on a GPU: new media every call, 256 x 4096 bf16.

    python bench/op_host_parts.py

Prints µs a call, 300 calls back to back: the whole call; ``prepare`` (the checks and the parameter
block); ``launch`` (the block's copy and the kernel's launch) and inside it ``_kernel`` (the Triton
launch); the ring's waits. Then, alone: a Triton launch of the same
kernel with the same arguments, the launch's check of the kernel's global constants, the block's
``copy_``, a stream query.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout's slabstage

import torch  # noqa: E402

import slabstage as ss  # noqa: E402
from slabstage.kernels import launch, params  # noqa: E402
from slabstage.kernels.op_stagers import slab_stager  # noqa: E402
from slabstage.kernels.stage_kernel import stage_kernel  # noqa: E402

DEV = torch.device("cuda")
N, W, CALLS = 256, 4096, 300


def median_us(fn, k=CALLS):
    ts = []
    for _ in range(k):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e6


def main() -> None:
    table = torch.randn(32000, W, dtype=torch.bfloat16, device=DEV)
    slab = torch.empty(N, W, dtype=torch.bfloat16, device=DEV)
    ids = torch.randint(0, 32000, (N,), device=DEV)
    index = torch.full((N,), -1, dtype=torch.int64)
    media_rows = (torch.arange(N) // 64) % 2 == 1
    index[media_rows] = torch.arange(int(media_rows.sum()))
    index = index.to(DEV)
    medias = [torch.randn(N // 2, W, dtype=torch.bfloat16, device=DEV) for _ in range(CALLS + 20)]
    errors = ss.new_error_word(DEV)
    call = lambda m: ss.stage_embeddings(slab, ids, table, media=m, media_index=index, errors=errors)  # noqa: E731
    for m in medias[:20]:
        call(m)
    torch.cuda.synchronize()
    spent: dict = {}

    def timed(owner, name):
        inner = getattr(owner, name)

        def wrapper(*a, **k):
            t0 = time.perf_counter()
            out = inner(*a, **k)
            spent[name] = spent.get(name, 0.0) + time.perf_counter() - t0
            return out
        setattr(owner, name, wrapper)

    for owner, name in ((params.PinnedRing, "_wait"), (launch.Stager, "prepare"), (launch.Stager, "launch"),
                        (launch.Stager, "_kernel")):
        timed(owner, name)
    t0 = time.perf_counter()
    for m in medias[20:]:
        call(m)
    print(f"a call, back to back: {(time.perf_counter() - t0) / CALLS * 1e6:.1f} us")
    torch.cuda.synchronize()
    for name in ("prepare", "launch", "_kernel", "_wait"):
        print(f"  {name}: {spent.get(name, 0.0) / CALLS * 1e6:.1f} us a call")
    _, st = slab_stager(slab, errors)
    args = (st.params, errors, slab)
    grid = (N * st.cols,)
    alone = median_us(lambda: stage_kernel[grid](*args, **st.constexprs, num_warps=st.num_warps))
    print(f"a Triton launch alone: {alone:.1f} us")
    used = stage_kernel.used_global_vals

    def check():
        for (name, _), (val, scope) in used.items():
            if scope.get(name) != val:
                raise RuntimeError(name)
    print(f"  of which the check of its {len(used)} global constants: {median_us(check):.1f} us")
    src, dst = st.ring.tensor[:1024], st.params[:1024]
    print(f"the block's copy_: {median_us(lambda: dst.copy_(src, non_blocking=True)):.1f} us")
    print(f"torch.cuda.is_current_stream_capturing(): {median_us(torch.cuda.is_current_stream_capturing):.1f} us")
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
