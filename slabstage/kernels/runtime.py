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
_NOTHING = contextlib.nullcontext()


def launch_context(device: torch.device):
    """What a launch on ``device`` runs in: the interpreter's lock on the CPU; on a GPU, ``device`` made the
    current one when it is not (Triton compiles for and launches on the current device)."""
    if device.type == "cpu":
        return INTERPRETER_LOCK
    if device.index is None or torch.cuda.current_device() == device.index:
        return _NOTHING
    return torch.cuda.device(device.index)


if HAS_TRITON:

    class Constant(tl.constexpr):
        """A ``tl.constexpr`` that a launch compares as fast as an int.

        Every launch checks that each global its kernel reads still equals the value it was compiled
        with (``!=`` against a copy); ``tl.constexpr``'s ``!=`` builds new objects (~0.7 µs on the CI
        machine). The staging kernels read their layout constants as attributes of a module, which
        no launch compares (:data:`slabstage.kernels.layout.device`); their checksum is the one global."""

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


try:  # programmatic dependent launch (triton 3.4 and later)
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - older triton, or none
    gdc_launch_dependents = gdc_wait = None


def use_pdl(device: torch.device) -> bool:
    """Programmatic dependent launch for the staging kernel on ``device``: a CUDA device of compute capability
    9.0 or later (Hopper) and a Triton that has it, unless ``SLABSTAGE_PDL=0``. The kernel then starts while the
    launch before it finishes and waits for it (``griddepcontrol.wait``) before its first read."""
    return (gdc_wait is not None and not INTERPRET and device.type == "cuda"
            and os.environ.get("SLABSTAGE_PDL", "1") != "0" and torch.cuda.get_device_capability(device)[0] >= 9)


# The launcher convention DirectLaunch calls (the compiled kernel's ``run``: grid, stream, function, metadata,
# launch metadata, hooks, then every argument, constexprs too), read in Triton 3.4, 3.5 and 3.6, whose
# ``knobs`` hold the launch hooks; another Triton gets JIT calls.
try:
    from triton import knobs as _knobs

    if tuple(int(x) for x in triton.__version__.split(".")[:2]) not in ((3, 4), (3, 5), (3, 6)):
        _knobs = None
except (ImportError, ValueError, AttributeError):  # pragma: no cover - another triton, or none
    _knobs = None


class DirectLaunch:
    """Launches of one Triton kernel whose arguments are tensors, with fixed constexprs and launch options, past
    the Python a JIT call runs each time (binding the arguments, the specialization key, the cache lookup, the
    globals check, the launch hooks' metadata): the first launch for a set of the tensors' dtypes, all 16-byte
    aligned, is a JIT call, which compiles the kernel or finds it compiled; later ones call that compiled kernel's
    launcher with the same arguments. A JIT call serves the launches it cannot: under the interpreter, with
    another alignment, with a Triton whose launcher convention was not read (``_knobs``), while a profiler
    has set Triton's launch hooks (they see every launch), and with ``SLABSTAGE_DIRECT_LAUNCH=0``."""

    def __init__(self, fn, constexprs: dict, **options) -> None:
        self.fn, self.kw = fn, {**constexprs, **options}
        self.tail = tuple(constexprs[n] for n in fn.arg_names if n in constexprs)  # (the launcher takes them too)
        self.direct = _knobs is not None and not INTERPRET and os.environ.get("SLABSTAGE_DIRECT_LAUNCH", "1") != "0"
        self.compiled: dict = {}

    def __call__(self, grid: int, stream: int, *args: torch.Tensor) -> None:
        """Launch ``grid`` programs over ``args`` on the raw CUDA ``stream`` (the current one's handle)."""
        if self.direct:
            aligned = not sum(t.data_ptr() & 15 for t in args)
            key = tuple(t.dtype for t in args) if aligned else None
            k = self.compiled.get(key)
            if k is not None and not _hooks_set():
                k.run(grid, 1, 1, stream, k.function, k.packed_metadata, None, None, None, *args, *self.tail)
                return
            k = self.fn[(grid,)](*args, **self.kw)
            if key is not None:
                self.compiled[key] = k
            return
        self.fn[(grid,)](*args, **self.kw)


def _hooks_set() -> bool:
    """Whether Triton runs launch hooks (a chain of them from 3.6, one or None before)."""
    r = _knobs.runtime
    return bool(getattr(r.launch_enter_hook, "calls", r.launch_enter_hook)
                or getattr(r.launch_exit_hook, "calls", r.launch_exit_hook))


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
