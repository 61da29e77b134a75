"""How a staging launch reaches the device: where Triton runs (:func:`use_triton`), programmatic dependent launch
(:func:`use_pdl`), the context a launch runs in (:func:`launch_context`) and the direct launcher of a stager's
kernels (:class:`DirectLaunch`)."""

from __future__ import annotations

import contextlib
import logging
import os
import threading

import torch

from ..kernels.runtime import HAS_TRITON, INTERPRET, gdc_wait, triton

__all__ = ["DirectLaunch", "launch_context", "use_pdl", "use_triton", "INTERPRETER_LOCK"]

log = logging.getLogger("slabstage")

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
    has set Triton's launch hooks (they see every launch), and with ``SLABSTAGE_DIRECT_LAUNCH=0``. A launcher
    that refuses the arguments (it parses them before it launches anything) turns direct launches off for good,
    with a warning: the JIT call then makes that launch and the later ones."""

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
                try:
                    k.run(grid, 1, 1, stream, k.function, k.packed_metadata, None, None, None, *args, *self.tail)
                    return
                except (TypeError, AttributeError) as e:  # (refused before the launch: nothing was queued)
                    self._give_up(e)
                    self.fn[(grid,)](*args, **self.kw)
                    return
            k = self.fn[(grid,)](*args, **self.kw)
            if key is not None:
                self.compiled[key] = k
            return
        self.fn[(grid,)](*args, **self.kw)

    def _give_up(self, error: Exception) -> None:
        self.direct = False
        log.warning("slabstage: %s's compiled launcher refused its arguments (%s: %s); launching it through "
                    "Triton's JIT call from now on", getattr(self.fn, "__name__", "the kernel"), type(error).__name__,
                    error)


def _hooks_set() -> bool:
    """Whether Triton runs launch hooks (a chain of them from 3.6, one or None before)."""
    r = _knobs.runtime
    return bool(getattr(r.launch_enter_hook, "calls", r.launch_enter_hook)
                or getattr(r.launch_exit_hook, "calls", r.launch_exit_hook))


def use_triton(device: torch.device) -> bool:
    """Triton runs on CUDA devices, and on the CPU under TRITON_INTERPRET=1."""
    return HAS_TRITON and (device.type == "cuda" or (INTERPRET and device.type == "cpu"))
