"""Launch a ``@triton.jit`` kernel by argument name, with the compiled variant cached.

The kernel's own ``def`` is the one declaration of its arguments. From it
:class:`FastLaunch` derives the signature order, which arguments are pointers
(names ending in ``_ptr``), which integers Triton specialises (all but
``do_not_specialize``), the defaults of optional arguments and the cache key of
a compiled variant. Callers pass arguments by name, in a dict.

``kernel[grid](...)`` re-binds and re-specialises every argument on each call,
and its launcher asks the driver about every tensor pointer: 25-50 us per launch
on a slow host core, more than the kernel itself runs at small batches.
A cached variant is launched with plain integer pointers instead. Anything
FastLaunch cannot vouch for (the interpreter, a launch hook such as a profiler's,
an unknown launcher convention) goes through the ordinary JIT call, by keyword.
"""

from __future__ import annotations

import inspect
import types

import torch

from .runtime import HAS_TRITON, INTERPRET, INTERPRETER_LOCK, triton

__all__ = ["FastLaunch", "Variant", "int_spec", "launch_hooks_set"]

_I32 = (-(2**31), 2**31 - 1)


def int_spec(v: int) -> int:
    """What Triton specialises a runtime int on: == 1, divisible by 16, or 64-bit."""
    if not _I32[0] <= v <= _I32[1]:
        return 3
    return 1 if v == 1 else (2 if not v & 15 else 0)


_KNOBS = getattr(triton, "knobs", None)
_RUNTIME, _CHAIN = getattr(_KNOBS, "runtime", None), getattr(_KNOBS, "HookChain", None)


def launch_hooks_set() -> bool:
    """Whether a launch hook (a profiler's, a debugger's) wants to see launches; read on every launch."""
    if _RUNTIME is None:
        return True  # an older triton: take the ordinary path
    # triton >= 3.4 keeps a HookChain that is never None; it is set when it has calls
    enter, leave = _RUNTIME.launch_enter_hook, _RUNTIME.launch_exit_hook
    if type(enter) is _CHAIN and type(leave) is _CHAIN:  # the usual case, without a getattr
        return bool(enter.calls or leave.calls)
    return (enter is not None and bool(getattr(enter, "calls", True))) or \
        (leave is not None and bool(getattr(leave, "calls", True)))


_NO_DEFAULT = inspect.Parameter.empty


def _params(fn) -> list[tuple[str, bool, bool, object]]:
    """``(name, is constexpr, do not specialise, default)`` of each parameter of a jitted kernel."""
    if hasattr(fn, "params"):  # a JITFunction
        return [(p.name, p.is_constexpr, bool(p.do_not_specialize), p.default if p.has_default else _NO_DEFAULT)
                for p in fn.params]
    # the interpreter's InterpretedFunction: the Python signature (specialisation does not apply)
    return [(p.name, "constexpr" in str(p.annotation), True, p.default)
            for p in inspect.signature(fn.fn).parameters.values()]


class Variant:
    """One compiled variant of a kernel, launched with integer arguments in signature order.

    ``launch(grid0, values)`` takes every runtime argument in signature order
    (``FastLaunch.runtime``), pointers as ints. It returns False, launching
    nothing, when the values would make Triton compile another variant (an
    unaligned pointer, another integer specialisation): the caller then takes the
    ordinary path.
    """

    __slots__ = ("ptr_at", "spec_at", "specs", "run", "function", "head", "tail", "device_index", "_stream")

    def __init__(self, launcher: "FastLaunch", kernel, tail: tuple, values: list, device_index: int) -> None:
        self.ptr_at, self.spec_at = launcher.ptr_at, launcher.spec_at
        self.specs = tuple(int_spec(values[i]) for i in self.spec_at)
        self.function, self.tail, self.device_index = kernel.function, tail, device_index
        self._stream = torch._C._cuda_getCurrentRawStream
        run = kernel.run
        self.run, self.head = run, (kernel.packed_metadata, None, None, None)
        c_launch = getattr(run, "launch", None)
        if (isinstance(c_launch, types.BuiltinFunctionType) and getattr(run, "global_scratch_size", 1) == 0
                and getattr(run, "profile_scratch_size", 1) == 0 and hasattr(run, "launch_pdl")):
            # the launcher's compiled entry point, without its Python wrapper (which only adds the
            # cooperative-grid and PDL switches and the scratch buffers, none here): a microsecond a launch
            self.run = c_launch
            self.head = (run.launch_cooperative_grid, run.launch_pdl, None, None, *self.head)

    def launch(self, grid0: int, values: list, trusted: bool = False) -> bool:
        """Launch, unless the values would make another variant. ``trusted``: the caller has checked that
        (as a cache keyed on every specialisation does)."""
        if not trusted:
            align = 0
            for i in self.ptr_at:
                align |= values[i]
            if align & 15:
                return False
            for i, spec in zip(self.spec_at, self.specs):
                if int_spec(values[i]) != spec:
                    return False
        self.launch_trusted(grid0, values)
        return True

    def launch_trusted(self, grid0: int, values: list) -> None:
        """:meth:`launch` with ``trusted=True``, for a hot path that has checked the values itself."""
        self.run(grid0, 1, 1, self._stream(self.device_index), self.function, *self.head, *values, *self.tail)


class FastLaunch:
    """The launcher of one ``@triton.jit`` kernel; see the module docstring."""

    def __init__(self, fn) -> None:
        self.fn = fn
        params = _params(fn)
        self.runtime = tuple(name for name, const, _, _ in params if not const)
        self.constexprs = tuple(name for name, const, _, _ in params if const)
        self.ptrs = tuple(k for k in self.runtime if k.endswith("_ptr"))
        # Triton specialises integers (== 1, divisible by 16, 64-bit); a float default marks a float argument
        self.specialised = tuple(name for name, const, dns, default in params
                                 if not const and not dns and not name.endswith("_ptr") and type(default) is not float)
        self.defaults = {name: default for name, _, _, default in params if default is not _NO_DEFAULT}
        self.at = {name: i for i, name in enumerate(self.runtime)}  # runtime argument -> position
        self.ptr_at = tuple(self.at[k] for k in self.ptrs)
        self.spec_at = tuple(self.at[k] for k in self.specialised)
        self.cache: dict = {}
        self.enabled = HAS_TRITON and not INTERPRET

    def complete(self, args: dict) -> dict:
        """``args`` with every omitted argument filled: an optional pointer (default None) by the first
        pointer given, which the kernel never dereferences for it, anything else by its default."""
        missing = [k for k in self.runtime if k not in args]
        if not missing:
            return args
        out = dict(args)
        dummy = next(args[k] for k in self.ptrs if k in args)
        for k in missing:
            if k not in self.defaults:
                raise TypeError(f"{self.fn.__name__}: argument {k!r} is required")
            out[k] = dummy if k in self.ptrs and self.defaults[k] is None else self.defaults[k]
        return out

    def key(self, args: dict, constexprs: dict, num_warps: int):
        """What Triton specialises this launch on: dtypes and 16-byte alignment of the pointers,
        the integer specialisations, the constexprs and num_warps."""
        ptrs = tuple((args[k].dtype, args[k].data_ptr() & 15 == 0) for k in self.ptrs)
        return ptrs, tuple(int_spec(args[k]) for k in self.specialised), tuple(constexprs.values()), num_warps

    def __call__(self, grid0: int, args: dict, constexprs: dict, num_warps: int) -> Variant | None:
        """Launch ``grid0`` programs; return the cached :class:`Variant` that ran, or None."""
        args = self.complete(args)
        constexprs = {k: constexprs[k] if k in constexprs else self.defaults[k] for k in self.constexprs}
        if INTERPRET:
            with INTERPRETER_LOCK:
                self.fn[(grid0,)](**args, **constexprs, num_warps=num_warps)
            return None
        key = self.key(args, constexprs, num_warps) if self.enabled else None
        variant = self.cache.get(key) if key is not None else None
        if variant is not None and not launch_hooks_set():
            values = [args[k] for k in self.runtime]
            for i in self.ptr_at:
                values[i] = values[i].data_ptr()
            if variant.launch(grid0, values):
                return variant
        kernel = self.fn[(grid0,)](**args, **constexprs, num_warps=num_warps)
        if key is not None and key not in self.cache:
            self.cache[key] = variant = self._variant(kernel, args, constexprs)
        return variant

    def _variant(self, kernel, args: dict, constexprs: dict) -> Variant | None:
        """The compiled kernel as a :class:`Variant`, or None when its launcher convention is unknown."""
        try:
            signature = kernel.src.signature
            _ = kernel.run  # loads the module and builds the launcher
            if kernel.function is None:
                return None
        except Exception:  # noqa: BLE001 - any surprise: stay on the ordinary path
            return None
        names = [*self.runtime, *self.constexprs]
        if names[len(names) - len(constexprs):] != list(constexprs):
            return None  # constexprs must close the signature, in order
        if len(signature) == len(names):  # triton >= 3.3: every parameter, constexprs too
            tail = tuple(constexprs.values())
        elif len(signature) == len(names) - len(constexprs):  # older: runtime arguments only
            tail = ()
        else:
            return None
        device = next(args[k].device for k in self.ptrs)
        return Variant(self, kernel, tail, [args[k] for k in self.runtime], device.index)
