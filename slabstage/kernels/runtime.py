"""Where Triton runs, the one helper that picks launch settings, and exact casts."""

from __future__ import annotations

import contextlib
import os
import threading

import torch

try:  # triton is a Linux dependency; elsewhere the references serve
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only on platforms without triton
    triton = None
    tl = None
    HAS_TRITON = False

# Read once, when the kernels are defined: the interpreter must be chosen before that.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

# The interpreter (triton 3.x) rounds fp32 -> bf16 half-up, flushes bf16 subnormals on the way
# to fp32 and casts bf16 -> fp16 through integers; the kernels then cast by bits so that CPU runs
# match torch bit for bit.
SOFT_CASTS = INTERPRET

# The interpreter keeps per-launch state in module globals: two Python threads launching at once
# corrupt each other's launch. Every interpreter launch holds this lock.
INTERPRETER_LOCK = threading.Lock()
_NO_LOCK = contextlib.nullcontext()


def launch_lock(device: torch.device):
    """What a launch on ``device`` holds: the interpreter's lock on the CPU, nothing on a GPU."""
    return INTERPRETER_LOCK if device.type == "cpu" else _NO_LOCK


def _patch_once_per_launch() -> None:
    """Under the interpreter, patch ``triton.language`` for a device function once per launch, not per call.

    Triton's interpreter (3.x) re-patches ``triton.language`` every time a program calls a ``@triton.jit``
    function (``tl.zeros`` is one), a scan of the language's modules that took about a third of the staging
    kernel's interpreted time. A second patch for the same function within one launch finds everything
    patched by the first and changes nothing, so it is skipped: the same results, sooner. Nothing changes
    where the interpreter's internals are not the ones this was written against.
    """
    try:
        from triton.runtime import interpreter
    except ImportError:  # pragma: no cover
        return
    patch, grid_call = getattr(interpreter, "_patch_lang", None), getattr(interpreter, "GridExecutor", None)
    if patch is None or grid_call is None or getattr(patch, "_slabstage", False):
        return
    grid_call = grid_call.__call__
    state = threading.local()  # the functions patched in this thread's launch

    class _Patched:
        def restore(self) -> None:
            pass

    def patch_once(fn, *args):
        seen = getattr(state, "seen", None)
        if seen is not None:
            if fn in seen:
                return _Patched()
            seen.add(fn)
        return patch(fn, *args)

    def launch(self, *args, **kwargs):
        outer, state.seen = getattr(state, "seen", None), set()
        try:
            return grid_call(self, *args, **kwargs)
        finally:
            state.seen = outer

    patch_once._slabstage = True
    interpreter._patch_lang = patch_once
    interpreter.GridExecutor.__call__ = launch


def _cache_np_dtypes() -> None:
    """Under the interpreter, remember the numpy dtype of each Triton dtype: the interpreter's lookup builds a
    table of 19 dtypes at every call (an interpreted staging launch 18-25% faster without it). The same
    answers, from a dict; nothing changes where the interpreter's internals are not the ones this was
    written against."""
    try:
        from triton.runtime import interpreter
    except ImportError:  # pragma: no cover
        return
    lookup = getattr(interpreter, "_get_np_dtype", None)
    if lookup is None or getattr(lookup, "_slabstage", False):
        return
    known: dict = {}
    block = tl.block_type

    def np_dtype(tt):
        if isinstance(tt, block):  # (a block's numpy dtype is its element's)
            tt = tt.element_ty
        try:
            found = known.get(tt)
        except TypeError:  # (a pointer type is unhashable: the lookup answers it first, at once)
            return lookup(tt)
        if found is None:
            found = known[tt] = lookup(tt)
        return found

    np_dtype._slabstage = True
    interpreter._get_np_dtype = np_dtype


if HAS_TRITON and INTERPRET:
    _patch_once_per_launch()
    _cache_np_dtypes()

if HAS_TRITON:

    class Constant(tl.constexpr):
        """A ``tl.constexpr`` that a launch compares as fast as an int.

        Every launch checks that each global its kernel reads still equals the value it was compiled
        with (``!=`` against a copy); ``tl.constexpr``'s ``!=`` builds new objects (~0.7 µs on the CI
        machine). The staging kernels read their layout constants as attributes of a module, which
        no launch compares (:mod:`slabstage.kernels.consts`); their checksum is the one global."""

        def __ne__(self, other):
            if type(other) is type(self):
                return self.value != other.value
            return super().__ne__(other)

        __hash__ = tl.constexpr.__hash__

    @triton.jit
    def cast_to(x, DST: tl.constexpr, SOFT: tl.constexpr):
        """x cast to DST with torch's rounding (round to nearest even), subnormals kept."""
        if x.dtype == DST:
            return x
        if SOFT and x.dtype == tl.bfloat16:  # exact: a bf16 is the top half of an fp32
            y = (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
        else:
            y = x.to(tl.float32)  # exact for every other source dtype we accept
        if DST == tl.float32:
            return y
        if SOFT and DST == tl.bfloat16:
            bits = y.to(tl.uint32, bitcast=True)
            bits = bits + 0x7FFF + ((bits >> 16) & 1)
            half = tl.where(y != y, 0x7FC0, bits >> 16).to(tl.uint16)
            return half.to(tl.bfloat16, bitcast=True)
        return y.to(DST)
else:  # pragma: no cover
    Constant = cast_to = None


def use_triton(device: torch.device) -> bool:
    """Triton runs on CUDA devices, and on the CPU under TRITON_INTERPRET=1."""
    return HAS_TRITON and (device.type == "cuda" or (INTERPRET and device.type == "cpu"))


def next_pow2(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


def row_launch_config(width: int, elem_bytes: int, *, divides: tuple[int, ...] = (),
                      max_block_bytes: int = 8192) -> tuple[int, int]:
    """(BLOCK, num_warps) for kernels that move one row piece per program.

    BLOCK is a power of two of at most ``max_block_bytes`` that covers ``width``
    when it can; it also divides each width in ``divides`` (tiled sources need
    whole pieces). num_warps gives each thread about four 16-byte vectors.
    """
    block = min(next_pow2(width), max(16, max_block_bytes // elem_bytes))
    for w in divides:
        while w % block:
            block //= 2
    vectors = max(1, block * elem_bytes // 16)
    num_warps = min(8, max(1, vectors // (32 * 4)))
    return block, next_pow2(num_warps)
