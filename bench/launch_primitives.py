"""Host cost of the primitives a staging step is built from (a Triton launch, graph.replay, pinned copies,
events), and which of them sync-debug mode allows.

    python bench/launch_primitives.py     (CUDA; JSON to $OUT/primitives.json)
"""
import ctypes
import json
import os
import struct
import sys
import time

import numpy as np
import torch
import triton
import triton.language as tl

dev = torch.device("cuda")
OUT = os.environ.get("OUT", "/tmp")
res = {}


def host_us(name, fn, n=3000, warm=300):
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    ts = []
    for i in range(n):
        t0 = time.perf_counter_ns()
        fn()
        ts.append(time.perf_counter_ns() - t0)
        if i % 32 == 31:
            torch.cuda.synchronize()
    ts.sort()
    res[name] = dict(p10=ts[n // 10] / 1e3, med=ts[n // 2] / 1e3, p90=ts[9 * n // 10] / 1e3)
    print(f"{name:55s} p10 {res[name]['p10']:7.2f}  med {res[name]['med']:7.2f}  p90 {res[name]['p90']:7.2f} us",
          flush=True)


@triton.jit
def k4(p_ptr, e_ptr, s_ptr, n, A: tl.constexpr, B: tl.constexpr, C: tl.constexpr, D: tl.constexpr,
       E: tl.constexpr, F: tl.constexpr, G: tl.constexpr):
    x = tl.load(p_ptr)
    tl.store(s_ptr + tl.program_id(0), x + n)


@triton.jit
def k20(a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, b0, b1, b2, b3, b4, b5, b6, b7, b8, b9,
        A: tl.constexpr, B: tl.constexpr):
    x = tl.load(a0)
    tl.store(a1 + tl.program_id(0), x + b0 + b1 + b2 + b3 + b4 + b5 + b6 + b7 + b8 + b9)


p = torch.zeros(64, dtype=torch.int64, device=dev)
s = torch.zeros(4096, dtype=torch.int64, device=dev)
e = torch.zeros(4, dtype=torch.int32, device=dev)
host_us("triton launch, 4 runtime + 7 constexpr args", lambda: k4[(64,)](p, e, s, 5, A=1, B=2, C=3, D=4, E=5, F=6, G=7))
ptrs = [torch.zeros(64, dtype=torch.int64, device=dev) for _ in range(10)]
host_us("triton launch, 20 runtime args", lambda: k20[(64,)](*ptrs, *range(10), A=1, B=2))

# graph replay of a small graph
g = torch.cuda.CUDAGraph()
st = torch.cuda.Stream()
st.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(st):
    k4[(64,)](p, e, s, 5, A=1, B=2, C=3, D=4, E=5, F=6, G=7)
    with torch.cuda.graph(g, stream=st):
        k4[(64,)](p, e, s, 5, A=1, B=2, C=3, D=4, E=5, F=6, G=7)
torch.cuda.current_stream().wait_stream(st)
torch.cuda.synchronize()
host_us("graph.replay() (one kernel)", g.replay)

pin = torch.empty(1 << 20, dtype=torch.uint8, pin_memory=True)
dblk = torch.empty(1 << 20, dtype=torch.uint8, device=dev)
for k in (512, 4096, 65536):
    pv, dv = pin[:k], dblk[:k]
    host_us(f"copy_ pinned->device {k} B, views prebuilt", lambda dv=dv, pv=pv: dv.copy_(pv, non_blocking=True))
    host_us(f"copy_ pinned->device {k} B, slicing each time",
            lambda k=k: dblk[:k].copy_(pin[:k], non_blocking=True))
host_us("narrow+copy_ 4096 B", lambda: dblk.narrow(0, 0, 4096).copy_(pin.narrow(0, 0, 4096), non_blocking=True))
ev = torch.cuda.Event()
host_us("Event.record()", ev.record)
host_us("Event.query()", ev.query)
host_us("torch.cuda.Event() construct", torch.cuda.Event)
host_us("torch.cuda.current_stream()", torch.cuda.current_stream)
host_us("torch.cuda.current_stream().cuda_stream", lambda: torch.cuda.current_stream().cuda_stream)
host_us("torch._C._cuda_getCurrentRawStream(0)", lambda: torch._C._cuda_getCurrentRawStream(0))
host_us("torch.cuda.is_current_stream_capturing()", torch.cuda.is_current_stream_capturing)
host_us("torch.empty(4096, uint8, cuda)", lambda: torch.empty(4096, dtype=torch.uint8, device=dev))
host_us("torch.empty(4096, uint8, pinned)", lambda: torch.empty(4096, dtype=torch.uint8, pin_memory=True))
mv = (ctypes.c_char * (1 << 20)).from_address(pin.data_ptr())
S = struct.Struct("<40q")
vals = list(range(40))
host_us("struct.pack_into 40 int64 into pinned", lambda: S.pack_into(mv, 0, *vals))
npv = pin.numpy().view(np.int64)
host_us("numpy slice assign 40 int64 from list", lambda: npv.__setitem__(slice(0, 40), vals))
src = torch.arange(4096, dtype=torch.int64)
host_us("ctypes.memmove 32 KiB", lambda: ctypes.memmove(pin.data_ptr(), src.data_ptr(), 32768))
host_us("ctypes.memmove 256 B", lambda: ctypes.memmove(pin.data_ptr(), src.data_ptr(), 256))
x = torch.zeros(100, dtype=torch.int64, device=dev)
for expr in ("x.dtype", "x.shape", "x.stride()", "x.data_ptr()", "x.device", "x.get_device()", "x.is_contiguous()",
             "x.is_cuda", "x.is_pinned()"):
    host_us(f"attr {expr}", eval(f"lambda: {expr}"))
items = [torch.zeros(64, 128, device=dev) for _ in range(64)]
dp = torch.Tensor.data_ptr
host_us("list(map(Tensor.data_ptr, 64 items))", lambda: list(map(dp, items)))
host_us("list(map(Tensor.size, 64 items))", lambda: list(map(torch.Tensor.size, items)))
host_us("[t.data_ptr() for t in 64 items]", lambda: [t.data_ptr() for t in items])

# sync debug mode: which of these raise?
torch.cuda.set_sync_debug_mode("error")
for name, fn in (("Event.query", ev.query), ("Event.record", ev.record),
                 ("copy_ non_blocking pinned->device", lambda: dblk[:512].copy_(pin[:512], non_blocking=True)),
                 ("graph.replay", g.replay), ("triton launch", lambda: k4[(64,)](p, e, s, 5, A=1, B=2, C=3, D=4,
                                                                               E=5, F=6, G=7))):
    try:
        fn()
        res[f"sync_debug {name}"] = "ok"
    except Exception as exc:  # noqa: BLE001
        res[f"sync_debug {name}"] = f"raised {type(exc).__name__}: {exc}"
    print("sync_debug", name, res[f"sync_debug {name}"], flush=True)
torch.cuda.set_sync_debug_mode(0)
res["env"] = dict(torch=torch.__version__, triton=triton.__version__, gpu=torch.cuda.get_device_name(),
                  python=sys.version.split()[0])
json.dump(res, open(os.path.join(OUT, "primitives.json"), "w"), indent=1)
