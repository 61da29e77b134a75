"""What a stager writes, checked once per set of destinations: the slab, every integer slot, the error word.

:func:`~slabstage.staging.validate.check_batch` checks each batch against a :class:`Destinations`; its
``clear_of`` tests a source's bytes against all of them at once.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from itertools import repeat

import torch

from ..checks import (FLOAT_DTYPES, INT_DTYPES, byte_span, check_fill, check_tensor, overlap_message,
                      tensors_overlap)
from .slots import COUNT, REQUESTS, ROWS, SLOTS, SOURCE_SLOTS
from .errors import check_error_word

__all__ = ["Destinations", "INT_BITS"]

INT_BITS = {torch.int32: 32, torch.int64: 64}


class Destinations:
    """What one stager writes, checked: the slab (or None), one tensor per row of
    :data:`~slabstage.staging.slots.SLOTS` (None where the stager writes no such slot), the error word.

    ``host_ok``: integer inputs may be host tensors (they travel in the parameter record).
    ``capacity``: the most tokens every destination holds.
    """

    def __init__(self, *, slab=None, slots=None, fills=None, errors, host_ok: bool, device=None,
                 batch_cap: int | None = None) -> None:
        if slab is not None:
            check_tensor("slab", slab, dtypes=FLOAT_DTYPES, dims=2)
            device = slab.device
        self.device, self.slab, self.host_ok = device, slab, host_ok
        self.slots = tuple(slots) if slots is not None else (None,) * len(SLOTS)
        self.fills = tuple(fills) if fills is not None else (None,) * len(SLOTS)
        named = []
        if slab is not None:
            if slab.stride() != (slab.shape[1], 1):
                raise ValueError(f"slab rows must be contiguous with stride ({slab.shape[1]}, 1), got {slab.stride()}")
            named.append(("the slab", slab))
        lengths = [t.shape[0] for spec, t in zip(SLOTS, self.slots)
                   if t is not None and spec.kind == REQUESTS and t.dim() == 1]
        self.batch_cap = batch_cap if batch_cap is not None else min(lengths, default=0)  # per-request rows
        rows = [slab.shape[0]] if slab is not None else []
        for spec, t, fill in zip(SLOTS, self.slots, self.fills):
            if t is None:
                continue
            what = f"slot {spec.name!r}"
            check_tensor(what, t, dtypes=INT_DTYPES, device=device)
            if spec.kind == ROWS:
                check_tensor(what, t, dims=2, shape=(spec.rows, None))
                if t.shape[1] > 1 and t.stride(1) != 1:
                    raise ValueError(f"{what} must have contiguous rows, got stride {t.stride()}")
                rows.append(t.shape[1])
            else:
                check_tensor(what, t, dims=1)
                need = {COUNT: 1, REQUESTS: self.batch_cap}.get(spec.kind, 0)
                if t.shape[0] < need:
                    raise ValueError(f"{what} holds {t.shape[0]} entries, needs at least {need}")
                if spec.kind not in (COUNT, REQUESTS):
                    rows.append(t.shape[0])
            if fill is not None:
                check_fill(f"{what} pad", fill, t.dtype)
            named.append((what, t))
        check_error_word(errors, device, "the slab" if slab is not None else "the buffers")
        self.errors = errors
        named.append(("the error word", errors))
        self.capacity = min(rows) if rows else 0
        for k, (a, t) in enumerate(named):  # destinations that share storage would overwrite each other
            for b, u in named[k + 1:]:
                if tensors_overlap(t, u):
                    raise ValueError(overlap_message(b, a))
        self._spans([(*byte_span(t), name) for name, t in named if t.numel()])
        self.host = host_ok and device.type == "cuda"  # host integer inputs travel in the parameter record
        # per SOURCE_SLOTS row: the bits of the slot's dtype (0: the stager writes no such slot)
        self.bits = tuple(INT_BITS[t.dtype] if t is not None else 0 for t in self.slots[:len(SOURCE_SLOTS)])

    def _spans(self, spans: list) -> None:
        """Keep the destinations' ``(start, end, name)`` byte spans (non-empty, apart from each other)."""
        spans.sort()
        self._starts, self._ends, self._names = [s[0] for s in spans], [s[1] for s in spans], [s[2] for s in spans]
        self.lo = spans[0][0] if spans else 0
        self.hi = spans[-1][1] if spans else 0

    def holding(self, slab, slots, errors) -> "Destinations":
        """A copy of these checked destinations holding the given tensors (which have the checked ones'
        addresses, shapes, strides, dtypes and devices: the checks' results are theirs)."""
        out = object.__new__(Destinations)
        out.__dict__.update(self.__dict__)
        out.slab, out.slots, out.errors = slab, slots, errors
        return out

    def slab_view(self, slab: torch.Tensor, errors: torch.Tensor) -> "Destinations | None":
        """These checked destinations of a slab alone (their tensors dropped or not), for ``slab``: a tensor of
        the checked slab's dtype, width and device, and ``errors``: the checked error word (same address,
        shape, strides, dtype and device). The checks' results come from ``slab``'s address and rows; None
        where only the full checks can tell (a slab not a plain row-contiguous 2-D tensor, or one that
        overlaps the error word)."""
        if type(slab) is not torch.Tensor or slab.layout is not torch.strided or slab.is_nested:
            return None
        rows, width = slab.shape
        if slab.stride() != (width, 1):
            return None
        start = slab.data_ptr()
        end = start + rows * width * slab.element_size()
        word = self._names.index("the error word")
        e0, e1 = self._starts[word], self._ends[word]
        if rows and start < e1 and e0 < end:
            return None
        out = self.holding(slab, self.slots, errors)
        out._spans([(start, end, "the slab"), (e0, e1, "the error word")] if rows else [(e0, e1, "the error word")])
        out.capacity = rows
        return out

    def _hit(self, start: int, end: int) -> str | None:
        """The name of a destination that bytes ``[start, end)`` (a source's) overlap, or None."""
        if end <= self.lo or start >= self.hi or start == end:
            return None
        j = bisect_right(self._ends, start)  # the destinations are apart and sorted: the first ending past start
        return self._names[j] if j < len(self._starts) and self._starts[j] < end else None

    def clear_of(self, src_name: str, start: int, end: int) -> None:
        """Raise unless bytes ``[start, end)`` (a source's) miss every destination."""
        name = self._hit(start, end)
        if name is not None:
            raise ValueError(overlap_message(src_name, name))

    def clear_of_all(self, lows: list, highs: list, spans) -> None:
        """:meth:`clear_of` for every ``[lows[k], highs[k])`` (each non-empty); ``spans()`` yields ``(name, start,
        end)`` of the same spans, for the error's name (only made when one overlaps). A span misses every
        destination when as many destinations start before its end as end at or before its start."""
        if list(map(bisect_left, repeat(self._starts), highs)) != list(map(bisect_right, repeat(self._ends), lows)):
            for name, start, end in spans():
                self.clear_of(name, start, end)
