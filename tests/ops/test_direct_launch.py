"""A kernel launched past Triton's JIT call: the compiled kernel's launcher gets what a JIT call would give it,
and a JIT call serves every launch the compiled kernel cannot (another dtype, alignment, launch hooks).

The interpreter has no compiled kernels, so these launches go to a stand-in for a JIT function that records
what it is given; the CUDA tests launch the staging kernel itself this way.
"""

import pytest
import torch

from slabstage import new_error_word, stage_embeddings
from slabstage.staging import launch as launches
from slabstage.staging import op_stagers
from builders import gen, poisoned, randint, randn, same_bytes  # noqa: I001 - tests/builders.py
from expected import expected_slab  # noqa: I001 - tests/expected.py


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
    monkeypatch.setattr(launches, "_hooks_set", lambda: False)
    fn = Jit()
    d = launches.DirectLaunch(fn, {"FLAG": True, "WIDTH": 7}, num_warps=4)
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


def test_a_launcher_that_refuses_the_arguments_turns_direct_launches_off(launch, caplog):
    """A Triton whose compiled launcher takes its arguments otherwise raises before it launches anything: that
    launch and every later one go through the JIT call, and a warning says so."""
    fn, d = launch
    a, b = torch.zeros(8, dtype=torch.int64), torch.zeros(4, dtype=torch.float32)
    d(1, 0, a, b)

    def refuse(*args):
        fn.log.append(("refused", args))
        raise TypeError("function takes exactly 13 arguments")
    d.compiled[(torch.int64, torch.float32)].run = refuse
    with caplog.at_level("WARNING", logger="slabstage"):
        d(2, 0, a, b)
        d(3, 0, a, b)
    assert [e[0] for e in fn.log] == ["jit", "refused", "jit", "jit"] and fn.log[2][1] == (2,)
    assert not d.direct and "refused its arguments" in caplog.text


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
    monkeypatch.setattr(launches, "_hooks_set", lambda: True)
    d(1, 0, a, b)
    assert [e[0] for e in fn.log] == ["jit", "jit"]


def test_under_the_interpreter_every_launch_is_a_jit_call():
    fn = Jit()
    d = launches.DirectLaunch(fn, {"FLAG": True, "WIDTH": 7})
    a, b = torch.zeros(8, dtype=torch.int64), torch.zeros(4, dtype=torch.float32)
    d(1, 0, a, b)
    d(1, 0, a, b)
    assert d.direct is (launches._knobs is not None and not launches.INTERPRET)
    if launches.INTERPRET:
        assert [e[0] for e in fn.log] == ["jit", "jit"]


# -- on a GPU: the staging kernel itself ------------------------------------------------------------------------
class Counting:
    """The staging kernel, counting its JIT calls."""

    def __init__(self, fn):
        self.fn, self.arg_names, self.jit_calls = fn, fn.arg_names, 0

    def __getitem__(self, grid):
        self.jit_calls += 1
        return self.fn[grid]


@pytest.mark.cuda
@pytest.mark.parametrize("width", [64, 33])
def test_on_a_gpu_views_aligned_or_not_get_exact_slabs_and_aligned_ones_skip_the_jit_call(width):
    """Views of one poisoned slab at row offsets 0..7 (a bf16 row of 33 columns is 66 bytes: only offset 0 is
    16-byte aligned), new ids and media each time, under the sync check: each view holds exactly the expected
    slab, and every launch after the first aligned one went past the JIT call."""
    dev, T, V = torch.device("cuda"), 48, 50
    g = gen(5)
    table = randn(g, V, width, device=dev)
    base, errors = poisoned(T + 8, width, torch.bfloat16, dev), new_error_word(dev)
    stage_embeddings(base, randint(g, 0, V, 4, device=dev), table, errors=errors)  # (the stager, compiled)
    launch = op_stagers.slab_stager(base, errors)[1]._launch
    launch.fn = counting = Counting(launch.fn)
    launch.compiled.clear()
    for off in range(8):
        view, n = base[off:off + T], 20 + off
        ids, media = randint(g, 0, V, n, device=dev), randn(g, 6, width, device=dev)
        mi = torch.full((n,), -1, dtype=torch.int64)
        mi[3 + off:9 + off] = torch.arange(6)
        before, index = view.clone(), mi.to(dev)
        torch.cuda.set_sync_debug_mode("error")
        try:
            stage_embeddings(view, ids, table, media=media, media_index=index, errors=errors, pad_to=n + 3)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        expected, _ = expected_slab(before, ids, table, media, mi, pad_to=n + 3)
        assert same_bytes(view, expected), f"the view at row {off}"
    assert launch.direct
    aligned = [off for off in range(8) if (off * width * 2) % 16 == 0]
    assert counting.jit_calls == 1 + 8 - len(aligned)  # the first aligned launch, and every unaligned one
    assert list(launch.compiled) == [(torch.int64, torch.int32, torch.bfloat16)]


@pytest.mark.cuda
def test_on_a_gpu_a_launch_hook_sees_every_staging_launch():
    """A profiler's launch hook (Triton's knobs) is called for each staging launch, direct launches or not."""
    knobs = pytest.importorskip("triton.knobs")
    dev = torch.device("cuda")
    slab, errors = torch.zeros(16, 64, dtype=torch.bfloat16, device=dev), new_error_word(dev)
    table, ids = torch.randn(10, 64, device=dev), torch.arange(10, device=dev)
    stage_embeddings(slab, ids, table, errors=errors)
    stage_embeddings(slab, ids, table, errors=errors)  # (later launches of this stager would be direct)
    seen = []

    def hook(metadata):
        seen.append(metadata)

    chain = knobs.runtime.launch_enter_hook
    if hasattr(chain, "add"):
        chain.add(hook)
    else:  # (Triton 3.4: one hook)
        knobs.runtime.launch_enter_hook = hook
    try:
        for _ in range(3):
            stage_embeddings(slab, ids, table, errors=errors)
    finally:
        if hasattr(chain, "remove"):
            chain.remove(hook)
        else:
            knobs.runtime.launch_enter_hook = None
    torch.cuda.synchronize()
    assert len(seen) == 3
