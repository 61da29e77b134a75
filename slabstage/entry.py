"""Entry: a handle to rows of one :class:`~slabstage.cache.EncoderCache` entry, as a batch's ``media`` lists it.

The cache makes handles (:mod:`slabstage.cache`) and the batch checks recognise them
(:mod:`slabstage.staging.validate`); both read this one definition.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["Entry"]


class Entry(NamedTuple):
    """A handle to rows ``[first, first + rows)`` of one cache entry (what ``media`` lists). Take one from
    :meth:`EncoderCache.put` or :meth:`EncoderCache.get`; :meth:`part` gives a row range of it (a chunk)."""

    cache: "EncoderCache"  # noqa: F821 - the cache that made it (slabstage.cache.EncoderCache)
    slot: int
    gen: int
    first: int
    rows: int

    def part(self, start: int, stop: int) -> "Entry":
        """Rows ``[start, stop)`` of this handle (a chunk of an item)."""
        if type(start) is not int or type(stop) is not int or not 0 <= start <= stop <= self.rows:
            raise ValueError(f"Entry.part({start!r}, {stop!r}): need 0 <= start <= stop <= {self.rows} (its rows)")
        return Entry(self.cache, self.slot, self.gen, self.first + start, stop - start)
