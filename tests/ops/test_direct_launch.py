"""A kernel launched past Triton's JIT call: the compiled kernel's launcher gets what a JIT call would give it,
and a JIT call serves every launch the compiled kernel cannot (another dtype, alignment, launch hooks).

The interpreter has no compiled kernels, so these launches go to a stand-in for a JIT function that records
what it is given; the CUDA tests launch the staging kernel itself this way.
"""

import pytest
import torch

from slabstage.kernels import runtime


class Compiled:
    def __init__(self, log):
        self.log, self.function, self.packed_metadata = log, "function", ("warps", "ctas", "shared")

    def run(self, *args):
        self.log.append(("direct", args))


class Jit:
    """What a JIT function shows a launch: its argument names, ``fn[grid](*args, **kw)``, a compiled kernel back."""

    arg_names = ["a_ptr", "b_ptr", "WIDTH", "FLAG"]

    def __init__(self):
        self.log = []

    def __getitem__(self, grid):
        def launch(*args, **kw):
            self.log.append(("jit", grid, args, kw))
            return Compiled(self.log)
        return launch


@pytest.fixture
def launch(monkeypatch):
    monkeypatch.setattr(runtime, "_hooks_set", lambda: False)
    fn = Jit()
    d = runtime.DirectLaunch(fn, {"FLAG": True, "WIDTH": 7}, num_warps=4)
    d.direct = True  # (as on a GPU with Triton 3.4 or later)
    return fn, d


def test_later_launches_call_the_compiled_kernel_with_the_jit_calls_arguments(launch):
    fn, d = launch
    a, b = torch.zeros(8, dtype=torch.int64), torch.zeros(4, dtype=torch.float32)
    d(5, 11, a, b)
    d(9, 12, a, b)
    assert fn.log[0] == ("jit", (5,), (a, b), {"FLAG": True, "WIDTH": 7, "num_warps": 4})
    kind, args = fn.log[1]
    # grid, stream, the kernel and its metadata, no launch metadata or hooks, then every argument in the
    # kernel's order (the constexprs too: the launcher takes them)
    assert kind == "direct" and args[:9] == (9, 1, 1, 12, "function", ("warps", "ctas", "shared"), None, None, None)
    assert args[9:11] == (a, b) and args[11:] == (7, True)
    assert len(fn.log) == 2


def test_another_dtype_is_a_jit_call_first(launch):
    fn, d = launch
    a = torch.zeros(8, dtype=torch.int64)
    d(1, 0, a, torch.zeros(4, dtype=torch.float32))
    d(1, 0, a, torch.zeros(4, dtype=torch.bfloat16))
    d(1, 0, a, torch.zeros(4, dtype=torch.bfloat16))
    assert [e[0] for e in fn.log] == ["jit", "jit", "direct"]


def test_an_unaligned_tensor_is_always_a_jit_call(launch):
    """Triton compiles a kernel for pointers 16-byte aligned and another for the rest: only the first is kept."""
    fn, d = launch
    a, b = torch.zeros(8, dtype=torch.int64), torch.zeros(8, dtype=torch.float32)
    for _ in range(3):
        d(1, 0, a, b[1:])
    d(1, 0, a, b)
    d(1, 0, a, b)
    assert [e[0] for e in fn.log] == ["jit"] * 4 + ["direct"]


def test_launch_hooks_see_every_launch(launch, monkeypatch):
    fn, d = launch
    a, b = torch.zeros(8, dtype=torch.int64), torch.zeros(4, dtype=torch.float32)
    d(1, 0, a, b)
    monkeypatch.setattr(runtime, "_hooks_set", lambda: True)
    d(1, 0, a, b)
    assert [e[0] for e in fn.log] == ["jit", "jit"]


def test_under_the_interpreter_every_launch_is_a_jit_call():
    fn = Jit()
    d = runtime.DirectLaunch(fn, {"FLAG": True, "WIDTH": 7})
    a, b = torch.zeros(8, dtype=torch.int64), torch.zeros(4, dtype=torch.float32)
    d(1, 0, a, b)
    d(1, 0, a, b)
    assert d.direct is (runtime._knobs is not None and not runtime.INTERPRET)
    if runtime.INTERPRET:
        assert [e[0] for e in fn.log] == ["jit", "jit"]
