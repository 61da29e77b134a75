"""One registry of named buffers, shared by staging, capture and replay."""

from __future__ import annotations

from dataclasses import dataclass
from operator import attrgetter
from typing import NamedTuple, Union

import torch

from ..checks import check_fill, check_int, is_real

__all__ = ["BufferRegistry", "RegistryMismatchError", "RegistrySignature", "SlotSignature", "Slot", "PadPolicy"]

PadPolicy = Union[str, int, float, None]  # "zeros", a fill value, or None (leave)


class RegistryMismatchError(RuntimeError):
    """A slot's tensor changed (address, shape, stride, dtype or device) since capture."""


class SlotSignature(NamedTuple):
    data_ptr: int
    shape: tuple
    stride: tuple
    dtype: torch.dtype
    device: torch.device


@dataclass(frozen=True)
class Slot:
    tensor: torch.Tensor
    token_axis: int | None  # None: not sliced by views(n) (per-request and scalar slots)
    pad: PadPolicy

    @property
    def fill_value(self) -> float | int | None:
        """The value padded rows get, or None when they are left as they are."""
        return 0 if self.pad == "zeros" else self.pad


class RegistrySignature(dict):
    """slot name -> :class:`SlotSignature`, plus what :meth:`BufferRegistry.check` needs to be quick."""

    __slots__ = ("fast", "version")


_ptr, _size, _stride, _dtype = torch.Tensor.data_ptr, torch.Tensor.size, torch.Tensor.stride, attrgetter("dtype")


def slot_signature(t: torch.Tensor) -> SlotSignature:
    """What a slot's checks depend on: address, shape, strides, dtype, device."""
    return SlotSignature(t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t.device)


def _check_pad(name: str, pad: PadPolicy, dtype: torch.dtype) -> None:
    """The pad policy is known, and a fill value is one that ``dtype`` stores as given (no silent 0 or inf)."""
    if pad is None or (isinstance(pad, str) and pad == "zeros"):
        return
    if not is_real(pad):
        raise ValueError(f"slot {name!r}: pad must be 'zeros', a number or None, got {pad!r}")
    check_fill(f"slot {name!r}: pad", pad, dtype)


class BufferRegistry:
    """Named slots: a tensor, its token axis and how rows past the batch are padded.

    Capture records :meth:`signature`; replay calls :meth:`check` with it, so a slot
    that was reallocated or replaced is refused instead of replayed into stale memory.
    After :meth:`freeze`, :meth:`register` and :meth:`replace` raise until
    :meth:`unfreeze`.
    """

    def __init__(self) -> None:
        self._slots: dict[str, Slot] = {}
        self._frozen = False
        self._version = 0  # bumped whenever a slot is added or swapped

    # -- building -----------------------------------------------------------------
    def register(self, name: str, tensor: torch.Tensor, *, token_axis: int | None = 0,
                 pad: PadPolicy = "zeros") -> torch.Tensor:
        """Add slot ``name``. ``token_axis=None`` marks a slot that views(n) does not slice."""
        self._refuse_if_frozen("register", name)
        if name in self._slots:
            raise ValueError(f"slot {name!r} is already registered; use replace() to swap its tensor")
        self._slots[name] = self._make_slot(name, tensor, token_axis, pad)
        self._version += 1
        return tensor

    def replace(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Swap the tensor of an existing slot, keeping its token axis and pad policy."""
        self._refuse_if_frozen("replace", name)
        old = self.slot(name)
        self._slots[name] = self._make_slot(name, tensor, old.token_axis, old.pad)
        self._version += 1
        return tensor

    def _make_slot(self, name: str, tensor: torch.Tensor, token_axis: int | None, pad: PadPolicy) -> Slot:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"slot {name!r}: expected a torch.Tensor, got {type(tensor).__name__}")
        if token_axis is not None:
            token_axis = check_int(f"slot {name!r}: token_axis", token_axis)
            if not -tensor.dim() <= token_axis < tensor.dim():
                raise ValueError(f"slot {name!r}: token_axis {token_axis} is out of range for a "
                                 f"{tensor.dim()}-d tensor")
            token_axis %= tensor.dim()
        _check_pad(name, pad, tensor.dtype)
        return Slot(tensor, token_axis, pad)

    def _refuse_if_frozen(self, what: str, name: str) -> None:
        if self._frozen:
            raise RegistryMismatchError(f"cannot {what} slot {name!r}: the registry is frozen by a captured graph; "
                                        f"drop the graphs (or call unfreeze()) first")

    def freeze(self) -> None:
        self._frozen = True

    def unfreeze(self) -> None:
        self._frozen = False

    @property
    def frozen(self) -> bool:
        return self._frozen

    # -- reading ------------------------------------------------------------------
    def __getitem__(self, name: str) -> torch.Tensor:
        try:
            return self._slots[name].tensor
        except KeyError:
            raise KeyError(f"no slot {name!r}; registered: {', '.join(self._slots) or 'none'}") from None

    def __contains__(self, name: object) -> bool:
        return name in self._slots

    def __iter__(self):
        return iter(self._slots)

    def __len__(self) -> int:
        return len(self._slots)

    def slot(self, name: str) -> Slot:
        self[name]  # raises the KeyError with the slot list
        return self._slots[name]

    @property
    def capacity(self) -> int:
        """The most tokens every token-axis slot can hold."""
        # Not cached on _version: resize_/set_ change a slot's size in place without a
        # register/replace, and a stale capacity would let a launch write past the tensor.
        sizes = [s.tensor.shape[s.token_axis] for s in self._slots.values() if s.token_axis is not None]
        return min(sizes) if sizes else 0

    def views(self, n: int) -> dict[str, torch.Tensor]:
        """Every slot, sliced to ``n`` on its token axis (slots without one whole)."""
        n = check_int("views(n): n", n, lo=0)
        out = {}
        for name, s in self._slots.items():
            if s.token_axis is None:
                out[name] = s.tensor
                continue
            size = s.tensor.shape[s.token_axis]
            if n > size:
                raise ValueError(f"views({n}): slot {name!r} holds only {size} tokens")
            out[name] = s.tensor.narrow(s.token_axis, 0, n)
        return out

    def signature(self) -> RegistrySignature:
        """Per slot: data_ptr, shape, stride, dtype and device, as they are now."""
        sig = RegistrySignature((name, slot_signature(s.tensor)) for name, s in self._slots.items())
        tensors = [s.tensor for s in self._slots.values()]
        # what matches() compares, one C-level pass per field
        sig.fast = (tensors, list(map(_ptr, tensors)), list(map(_size, tensors)), list(map(_stride, tensors)),
                    list(map(_dtype, tensors)))
        sig.version = self._version
        return sig

    def matches(self, signature: dict[str, SlotSignature]) -> bool:
        """Whether every slot is as ``signature`` recorded it (host-only, a few microseconds)."""
        if getattr(signature, "version", None) == self._version:
            ts, ptrs, sizes, strides, dtypes = signature.fast
            if (list(map(_ptr, ts)) == ptrs and list(map(_size, ts)) == sizes and list(map(_stride, ts)) == strides
                    and list(map(_dtype, ts)) == dtypes):
                return True
        return self.signature() == signature

    def check(self, signature: dict[str, SlotSignature]) -> None:
        """Raise :class:`RegistryMismatchError` naming each slot that differs from ``signature``.

        Host-only and cheap (a few microseconds): it runs before every replay.
        """
        if self.matches(signature):
            return
        now = self.signature()
        problems = []
        for name in sorted(set(now) | set(signature)):
            if name not in now:
                problems.append(f"slot {name!r} was removed")
            elif name not in signature:
                problems.append(f"slot {name!r} was added")
            else:
                for field in SlotSignature._fields:
                    was, is_ = getattr(signature[name], field), getattr(now[name], field)
                    if was != is_:
                        shown = (hex(was), hex(is_)) if field == "data_ptr" else (was, is_)
                        problems.append(f"slot {name!r} {field} changed from {shown[0]} to {shown[1]}")
        raise RegistryMismatchError("buffers changed since capture (reallocated or replaced): " + "; ".join(problems))
