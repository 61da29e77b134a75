"""Writing a checked batch's parameter block (:mod:`slabstage.kernels.params`) into the pinned ring.

:class:`BlockWriter` is the half of :class:`~slabstage.kernels.launch.Stager` that turns a
:class:`~slabstage.kernels.validate.Checked` batch into words: the header, each integer source, the item
and segment lists, and host integer inputs copied into the block itself.
"""

from __future__ import annotations

import struct
from ctypes import c_char, memmove

import torch

from .mrope import SEGMENT_WORDS
from .params import (F_MEDIA, F_MEDIA_TILED, F_MEDIA_VEC, F_MEDIA_WRAP, F_SCALE, F_TEXT_TILED, F_TEXT_VEC,
                     F_TEXT_WRAP, FLOAT_CODE, H_FLAGS, H_ITEMS, H_NUM_MEDIA, H_PAD_TO, H_STEP, H_TABLE, H_VOCAB_START,
                     HEADER_WORDS, INT_CODE, LAYOUT_CODE, SOURCE_WORDS)
from .validate import LAYOUT_SLOT, Checked

__all__ = ["BlockWriter", "MAX_ITEM_WORDS"]

MAX_ITEM_WORDS = 1 << 14  # the room of the item and segment lists in a parameter block: 1 + 4 x blocks
# words an item, 8 words a segment of mrope positions


def _f32_bits(x: float) -> int:
    return struct.unpack("<i", struct.pack("<f", x))[0]


class BlockWriter:
    """Writes parameter blocks for a :class:`~slabstage.kernels.launch.Stager` (which holds the ring, the
    device block and the destinations this reads)."""

    def _write(self, c: Checked, own_block: bool) -> None:
        plan, segments = c.media, c.segments
        item_words = 0 if plan is None else len(plan.starts) + len(plan.fields)
        seg_words = 0 if segments is None else len(segments)
        if item_words + seg_words > MAX_ITEM_WORDS:
            what = f"media has {len(plan.items)} items of {plan.blocks} column blocks" if plan is not None else ""
            if seg_words:
                what += (" and " if what else "") + f"the mrope layouts make {seg_words // SEGMENT_WORDS} segments"
            raise ValueError(f"{what}: their lists take {item_words + seg_words} words, at most {MAX_ITEM_WORDS} "
                             f"fit the parameter block")
        base = self._base
        if own_block:  # a device block of its own (in the capturing graph's pool), kept with its host block
            with torch.inference_mode(False):
                own = torch.zeros(self.words_for(c.n), dtype=torch.int64, device=self.dst.device)
            base = own.data_ptr()
        ns = self.num_slots
        values = [0] * (HEADER_WORDS + SOURCE_WORDS * ns)
        end = 8 * (self._items_at + item_words + seg_words)  # bytes: host inputs follow the item and segment lists
        parts = []  # (byte offset in the block, address, bytes per row, rows, row stride in bytes)
        host = self.dst.host
        for s, t in enumerate(c.sources if ns else ()):  # (SOURCE_SLOTS come first in SLOTS)
            if t is not None:
                w = HEADER_WORDS + SOURCE_WORDS * s
                values[w], values[w + 2], end = _place(c.reads[s], host, parts, base, end)
                values[w + 1] = INT_CODE[c.reads[s][1]]
        if seg_words:  # the mrope slot's source: the segment list after the item list
            w = HEADER_WORDS + SOURCE_WORDS * LAYOUT_SLOT
            values[w:w + 3] = base + 8 * (self._items_at + item_words), LAYOUT_CODE, seg_words // SEGMENT_WORDS
        if self.dst.slab is not None:
            end = self._embed_header(values, c, parts, base, end)
        words = -(-end // 8)
        if own_block:
            step, at, done, counter = 0, 0, self.ring.spare_done_addr, self._spare_addr
            block = torch.zeros(words, dtype=torch.int64, device="cpu", pin_memory=True)
            self._kept.append((block, own))
            mv = memoryview((c_char * (8 * words)).from_address(block.data_ptr())).cast("B")
            array, start = block.numpy(), block.data_ptr()
            array[HEADER_WORDS + SOURCE_WORDS * ns:self._items_at] = self._dest
        else:
            step, at = self.ring.take()
            done, counter, mv, array = self.ring.done_addr, self._counter_addr, self._mv, self.ring.words
            start = self.ring.base + 8 * at
        values[H_STEP:H_VOCAB_START] = step, done, counter, words, c.n, c.b
        values[H_PAD_TO] = c.pad_to
        self._dynamic.pack_into(mv, 8 * at, *values)
        if plan is not None:
            i = at + self._items_at
            array[i:i + len(plan.starts)] = plan.starts
            array[i + len(plan.starts):i + item_words] = plan.fields
        if seg_words:
            i = at + self._items_at + item_words
            array[i:i + seg_words] = segments
        for off, addr, row, rows, stride in parts:  # host inputs, row by row (mrope rows may lie apart)
            for r in range(rows):
                memmove(start + off + r * row, addr + r * stride, row)
        if own_block:
            own[:words].copy_(block, non_blocking=True)
            self._now = own
        else:
            self._now = self.params
            self._pending = (step, at, words)

    def _embed_header(self, values: list, c: Checked, parts: list, base: int, end: int) -> int:
        width, plan = self.dst.slab.shape[1], c.media
        _, tdtype, _, _, (_, tw), (s0, _), tptr = c.table_read
        flags = F_SCALE if c.scale is not None else 0
        if tw < width and c.expand == "repeat":
            flags |= F_TEXT_TILED if tw % self.block == 0 else F_TEXT_WRAP
        if not (tptr & 15 or (s0 | tw) & 7 or flags & F_TEXT_WRAP):
            flags |= F_TEXT_VEC
        if self.num_slots:  # the embeddings read the ids where the integer half reads them
            ids_addr = values[HEADER_WORDS]
        else:
            ids_addr, _, end = _place(c.ids_read, self.dst.host, parts, base, end)
        index_addr = 0
        if c.index is not None:
            index_addr, _, end = _place(c.index_read, self.dst.host, parts, base, end)
        values[H_VOCAB_START:H_FLAGS] = (*c.bounds, _f32_bits(c.scale) if c.scale is not None else 0)
        values[H_TABLE:H_NUM_MEDIA] = (tptr, s0, tw, FLOAT_CODE[tdtype], ids_addr, INT_CODE[c.ids_read[1]],
                                       index_addr, INT_CODE[c.index_read[1]] if c.index is not None else 0)
        if plan is not None:
            if c.media_owner:
                flags |= F_MEDIA
            mw = plan.width
            if mw < width and c.expand == "repeat":
                flags |= F_MEDIA_TILED if mw % self.block == 0 else F_MEDIA_WRAP
            if plan.vec and not flags & F_MEDIA_WRAP:
                flags |= F_MEDIA_VEC
            values[H_NUM_MEDIA:H_ITEMS] = (plan.rows, len(plan.starts), plan.blocks, FLOAT_CODE[plan.dtype], mw)
        values[H_FLAGS] = flags
        values[H_ITEMS] = self._items_at
        return end


def _place(read, host: bool, parts: list, base: int, end: int) -> tuple[int, int, int]:
    """``(device address, row stride, new end)`` of an integer input: in place on the device, or, a host
    input next to CUDA destinations, in the block at byte ``end`` (rows end to end, 16-byte aligned)."""
    _, dtype, device, _, shape, stride, ptr = read
    if host and device < 0:
        at = (end + 15) & ~15
        elem = 4 if dtype == torch.int32 else 8
        row = shape[-1] * elem
        rows = shape[0] if len(shape) == 2 else 1
        parts.append((at, ptr, row, rows, (stride[0] if len(shape) == 2 else 0) * elem))
        return base + at, shape[-1], at + rows * row
    return ptr, (stride[0] if len(shape) == 2 else 0), end
