"""The one place where arguments are checked.

Every public entry point checks its inputs through these helpers, once, before
anything is written. Each raises ``TypeError`` (wrong kind of value) or
``ValueError`` (right kind, wrong value) naming the argument and what was
expected; no ``OverflowError`` or ``AttributeError`` escapes.
"""

from __future__ import annotations

import math
import numbers
import struct

import torch

__all__ = ["check_values", "vocab_bounds", "FLOAT_DTYPES", "NotAnIntError", "NotARealError", "INT_DTYPES", "INT32_MAX",
           "check_bool", "check_not_meta", "check_choice", "check_fill", "check_int", "check_real", "check_float32",
           "check_tensor", "overlap_message", "tensors_overlap", "byte_span", "extent", "dtype_holds", "is_int",
           "is_real"]

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INT_DTYPES = (torch.int32, torch.int64)
INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
F32_MAX = float(torch.finfo(torch.float32).max)


class NotAnIntError(TypeError, ValueError):
    """An int was expected: a wrong kind of value (TypeError) for an argument with a range (ValueError)."""


class NotARealError(TypeError, ValueError):
    """A real number was expected: a wrong kind of value (TypeError) for an argument with a range (ValueError)."""


def is_int(v: object) -> bool:
    """An integer that is not a bool (Python ints, numpy integers, ...)."""
    if type(v) is int:
        return True
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def is_real(v: object) -> bool:
    """A real number that is not a bool (ints, floats, numpy scalars, fractions, ...)."""
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def _bounds(lo, hi) -> str:
    """What ``[lo, hi]`` asks for, as words (either end open when None)."""
    if lo is not None and hi is not None:
        return f" in [{lo}, {hi}]"
    if lo is not None:
        return f" >= {lo}"
    return "" if hi is None else f" <= {hi}"


def check_int(name: str, v: object, *, lo: int | None = None, hi: int | None = None) -> int:
    """``v`` as a Python int in ``[lo, hi]`` (either end open when None).

    The one rule for every count, offset and ``pad_to``: an integral value that is
    not a bool. Values past ``hi`` (default: int64) raise ``ValueError``, so no
    ``OverflowError`` escapes later.
    """
    if not is_int(v):
        raise NotAnIntError(f"{name} must be an int, got {v!r} ({type(v).__name__})")
    v = int(v)
    top = INT64_MAX if hi is None else hi
    if (lo is not None and v < lo) or v > top:
        raise ValueError(f"{name} must be an int{_bounds(lo, top if v > top else hi)}, got {v}")
    return v


def check_real(name: str, v: object, *, finite: bool = True, lo: float | None = None,
               hi: float | None = None) -> float:
    """``v`` as a Python float in ``[lo, hi]`` (either end open when None).

    A value that is not a real number (a bool included) raises :class:`NotARealError`;
    one out of range, an int past float range, or (when ``finite``) NaN or inf raises
    ``ValueError``.
    """
    if not is_real(v):
        raise NotARealError(f"{name} must be a real number{_bounds(lo, hi)}, got {v!r} ({type(v).__name__})")
    try:
        f = float(v)
    except OverflowError:
        raise ValueError(f"{name} must be a finite number{_bounds(lo, hi)}, got {v!r} (past float range)") from None
    if (finite and not math.isfinite(f)) or (lo is not None and not f >= lo) or (hi is not None and not f <= hi):
        raise ValueError(f"{name} must be {'a finite' if finite else 'a real'} number{_bounds(lo, hi)}, got {f}")
    return f


def check_float32(name: str, v: object) -> float:
    """``v`` as a Python float that float32 holds finite (what a kernel reads as an fp32 argument): the rules
    of :func:`check_real`, then a value float32 would round to inf raises ``ValueError``."""
    f = check_real(name, v)
    try:
        struct.pack("<f", f)
    except OverflowError:
        raise ValueError(f"{name} must be a finite number within float32's range (+-{F32_MAX:g}), got {f}") from None
    return f


def check_bool(name: str, v: object) -> bool:
    """``v`` must be a bool itself: ``1``, ``np.True_`` and other look-alikes are refused."""
    if type(v) is not bool:
        raise TypeError(f"{name} must be a bool, got {v!r} ({type(v).__name__})")
    return v


def check_choice(name: str, v: object, choices: tuple) -> object:
    if not any(v == c and type(v) is type(c) for c in choices):
        raise ValueError(f"{name} must be one of {', '.join(repr(c) for c in choices)}, got {v!r}")
    return v


def check_not_meta(run, names, args: tuple) -> None:
    """A custom op's fake implementation given real ``meta`` tensors (not a tracer's fake tensors, which report
    the device they stand for) raises what the op itself raises for them: ``run(*args)`` is the op's
    implementation, which checks every tensor before anything is written; ``ValueError`` naming the first
    meta tensor (``names``: the op's argument names) if it does not raise."""
    meta = [name for name, a in zip(names, args) if isinstance(a, torch.Tensor) and a.device.type == "meta"]
    if meta:
        run(*args)
        raise ValueError(f"{meta[0]} is on meta: a staging op reads and writes real memory")


def _dtype_names(dtypes) -> str:
    return ", ".join(str(d).replace("torch.", "") for d in dtypes)


def check_tensor(name: str, t: object, *, dtypes=None, device=None, host_ok: bool = False, dims: int | None = None,
                 shape: tuple | None = None, last_contiguous: bool = True) -> torch.Tensor:
    """Check that ``t`` is a tensor with one of ``dtypes``, on ``device`` (or the host when ``host_ok``),
    with ``dims`` axes and ``shape`` (None entries are free), contiguous along its last axis.

    Raises ``TypeError`` for a non-tensor or a wrong dtype, ``ValueError`` for the rest.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.layout is not torch.strided or t.is_nested:
        raise TypeError(f"{name} must be a dense (strided) tensor, got a "
                        f"{'nested' if t.is_nested else str(t.layout).replace('torch.', '')} tensor")
    if dtypes is not None and t.dtype not in dtypes:
        raise TypeError(f"{name} dtype must be one of {_dtype_names(dtypes)}, got {t.dtype}")
    if device is not None and t.device != device and not (host_ok and t.device.type == "cpu"):
        where = f"{device} or the host (CPU)" if host_ok else str(device)
        raise ValueError(f"{name} is on {t.device}; expected {where}")
    if dims is not None and t.dim() != dims:
        raise ValueError(f"{name} must be {dims}-D, got shape {tuple(t.shape)}")
    if shape is not None and (t.dim() != len(shape) or any(w is not None and s != w
                                                          for s, w in zip(t.shape, shape))):
        want = "(" + ", ".join("*" if w is None else str(w) for w in shape) + ")"
        raise ValueError(f"{name} must have shape {want}, got {tuple(t.shape)}")
    if last_contiguous and t.dim() and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous along its last axis, got stride {t.stride()}")
    return t


def extent(shape, stride) -> int:
    """Elements from a tensor's first to one past its last (0 when it has none)."""
    if 0 in shape:
        return 0
    return 1 + sum((s - 1) * abs(st) for s, st in zip(shape, stride))


def byte_span(t: torch.Tensor) -> tuple[int, int]:
    """[first, last) bytes of storage that ``t`` can touch."""
    start = t.data_ptr()
    return start, start + extent(t.shape, t.stride()) * t.element_size()


def tensors_overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` (on one device, neither empty) can touch a byte in common."""
    if a.device != b.device or not a.numel() or not b.numel():
        return False
    a0, a1 = byte_span(a)
    b0, b1 = byte_span(b)
    return a0 < b1 and b0 < a1


def overlap_message(src_name: str, dst_name: str) -> str:
    """What an overlap error says: ``src_name`` shares storage with ``dst_name``, which a launch writes."""
    return (f"{src_name} overlaps {dst_name} in memory: a staging source must not share storage with the "
            f"buffer it is written into")


def dtype_holds(dtype: torch.dtype, value) -> bool:
    """Whether ``value`` is stored in ``dtype`` exactly (integers in range, no NaN in an int slot)."""
    if dtype.is_floating_point:
        return is_real(value)
    if dtype == torch.bool:
        return value in (0, 1) and not isinstance(value, float)
    if not is_int(value):
        return False
    info = torch.iinfo(dtype)
    return info.min <= int(value) <= info.max


def check_fill(name: str, value: object, dtype: torch.dtype) -> int | float:
    """``value`` as a fill (pad) value that ``dtype`` stores as given, else ``ValueError`` naming ``name``.

    Integer and bool dtypes take integers (or whole floats such as ``3.0``) in their range: no NaN, no inf, no
    fraction; float dtypes take any real number within their finite range (NaN and inf stay what they are; a
    finite value that would round to inf, or an int past float range, is refused). A value that is not a real
    number (a bool included) raises ``TypeError``.
    """
    if not is_real(value):
        raise TypeError(f"{name} must be a real number, got {value!r} ({type(value).__name__})")
    shown = repr(value) if len(repr(value)) <= 24 else f"{repr(value)[:12]}... ({len(repr(value))} digits)"
    if not (dtype.is_floating_point or dtype.is_complex):
        if isinstance(value, float) and value.is_integer():
            value = int(value)  # a whole float (3.0) is held exactly; NaN, inf and 2.5 are not
        if not dtype_holds(dtype, value):
            info = torch.iinfo(dtype) if dtype != torch.bool else None
            want = "0 or 1" if info is None else f"an int in [{info.min}, {info.max}]"
            raise ValueError(f"{name} {shown} cannot be stored in {dtype}: expected {want}")
        return int(value)
    if isinstance(value, float) and not math.isfinite(value):
        return value
    top = torch.finfo(dtype).max
    if abs(value) > top:  # exact for ints of any size: no OverflowError
        raise ValueError(f"{name} {shown} cannot be stored in {dtype}: past its finite range "
                         f"(+-{top:g}), it would become inf")
    return value


_INT_RANGE = {torch.int32: (-(2**31), 2**31 - 1), torch.int64: (-(2**63), 2**63 - 1)}


def check_values(name: str, t: torch.Tensor, slot_dtype: torch.dtype) -> None:
    """A host input whose values its slot's dtype cannot hold is refused (a device one is flagged on the
    device): a narrowing copy is never silent."""
    if slot_dtype.itemsize >= t.dtype.itemsize or not t.is_cpu or not t.numel():
        return
    lo, hi = _INT_RANGE[slot_dtype]
    values = t.numpy()  # a host tensor: numpy's min and max cost a fraction of torch's
    vmin, vmax = int(values.min()), int(values.max())
    if vmin < lo or vmax > hi:
        raise ValueError(f"{name} holds {vmin if vmin < lo else vmax}, which its {slot_dtype} slot cannot hold")


def vocab_bounds(vocab_range, vocab_size, table_rows: int) -> tuple[int, int, int]:
    """``(vocab_start, vocab_end, vocab_size)`` checked against a table of ``table_rows`` rows."""
    if table_rows > INT32_MAX:
        raise ValueError(f"the table has {table_rows} rows; at most {INT32_MAX} are supported")
    if vocab_range is None:
        vocab_start, vocab_end = 0, table_rows
    else:
        if not isinstance(vocab_range, (tuple, list)) or len(vocab_range) != 2:
            raise TypeError(f"vocab_range must be a (start, end) pair of ints, got {vocab_range!r}")
        vocab_start = check_int("vocab_range start", vocab_range[0], lo=0, hi=INT32_MAX)
        vocab_end = check_int("vocab_range end", vocab_range[1], lo=vocab_start, hi=INT32_MAX)
        if vocab_end - vocab_start > table_rows:
            raise ValueError(f"vocab_range {tuple(vocab_range)!r} spans {vocab_end - vocab_start} ids but the "
                             f"table has {table_rows} rows")
    if vocab_size is None:
        return vocab_start, vocab_end, vocab_end
    return vocab_start, vocab_end, check_int("vocab_size", vocab_size, lo=vocab_end, hi=INT32_MAX)
