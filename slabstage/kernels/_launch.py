"""Launch compiled Triton kernels without the JIT's per-call argument binding.

``kernel[grid](...)`` re-binds and re-specialises every argument on each call,
and its launcher asks the driver about every tensor pointer: 25-50 us per launch
on a slow host core, more than the kernel itself runs at small batches.
:class:`FastLaunch` keeps the compiled kernel under a key that the op computes
from what Triton specialises on (dtypes, 16-byte alignment of every pointer,
divisibility of specialised integers, constexprs, num_warps) and calls its
launcher with plain integer pointers. Anything it cannot vouch for (the
interpreter, a launch hook such as a profiler's, an unaligned pointer, an
unknown launcher convention) goes through the ordinary JIT call.
"""

from __future__ import annotations

import torch

from ._triton import HAS_TRITON, INTERPRET, triton

__all__ = ["FastLaunch", "int_spec"]


def int_spec(v: int) -> int:
    """What Triton specialises a non-constexpr int on: == 1, divisible by 16."""
    return 1 if v == 1 else (2 if not v & 15 else 0)


_RUNTIME = getattr(getattr(triton, "knobs", None), "runtime", None)


def _hooks_set() -> bool:
    """Whether a launch hook (a profiler's, a debugger's) wants to see launches; read on every launch."""
    if _RUNTIME is None:
        return True  # an older triton: take the ordinary path
    # triton >= 3.4 keeps a HookChain that is never None; it is set when it has calls
    enter, leave = _RUNTIME.launch_enter_hook, _RUNTIME.launch_exit_hook
    return (enter is not None and bool(getattr(enter, "calls", True))) or \
        (leave is not None and bool(getattr(leave, "calls", True)))


class FastLaunch:
    """A cache of compiled variants of one ``@triton.jit`` kernel and a direct launcher.

    ``key`` must determine how Triton specialises the runtime arguments (dtypes,
    alignment, integer divisibility); the constexprs and num_warps are added to it
    here. Pass None to take the ordinary path (for instance when a pointer is not
    16-byte aligned). ``args`` are the
    runtime arguments in signature order; ``ptr_args`` the positions of tensors
    among them; ``constexprs`` the compile-time ones, in signature order, last.
    """

    def __init__(self, fn, ptr_args: tuple[int, ...]) -> None:
        self.fn = fn
        self.ptr_args = ptr_args
        self.cache: dict = {}
        self.enabled = HAS_TRITON and not INTERPRET

    def lookup(self, key, constexprs: dict, num_warps: int):
        """The cached ``(kernel, constexpr tail)`` of a variant launched before, or None."""
        entry = self.cache.get((key, num_warps, *constexprs.values())) if key is not None else None
        return entry if entry is not None and entry[0] is not None else None

    def __call__(self, grid: tuple, key, args: tuple, constexprs: dict, num_warps: int) -> None:
        if key is not None:  # every constexpr and num_warps always pick the variant, whatever the op's key says
            key = (key, num_warps, *constexprs.values())
        entry = self.cache.get(key) if self.enabled and key is not None else None
        if entry is None or entry[0] is None or _hooks_set():
            kernel = self.fn[grid](*args, **constexprs, num_warps=num_warps)
            if self.enabled and key is not None and key not in self.cache:
                self.cache[key] = self._entry(kernel, constexprs)
            return
        kernel, tail = entry
        fast = list(args)
        for i in self.ptr_args:
            fast[i] = args[i].data_ptr()
        kernel.run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1,
                   torch._C._cuda_getCurrentRawStream(args[self.ptr_args[0]].device.index), kernel.function,
                   kernel.packed_metadata, None, None, None, *fast, *tail)

    def _entry(self, kernel, constexprs: dict):
        """(kernel, constexpr values to append), or (None, ()) when the convention is unknown."""
        try:
            signature = kernel.src.signature
            kernel.run  # loads the module and builds the launcher
            if kernel.function is None:
                return None, ()
        except Exception:  # noqa: BLE001 - any surprise: stay on the ordinary path
            return None, ()
        names = list(self.fn.arg_names)
        if names[len(names) - len(constexprs):] != list(constexprs):
            return None, ()  # constexprs must close the signature, in order
        if len(signature) == len(names):  # triton >= 3.3: every parameter, constexprs too
            return kernel, tuple(constexprs.values())
        if len(signature) == len(names) - len(constexprs):  # older: runtime arguments only
            return kernel, ()
        return None, ()
