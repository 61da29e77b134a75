"""Writing a checked batch's parameter block (:mod:`slabstage.kernels.params`) into the pinned ring.

:class:`ParamsWriter` is the half of :class:`~slabstage.kernels.launch.Stager` that turns a
:class:`~slabstage.kernels.validate.Checked` batch into words: the header, each integer source, the item
and segment lists, and host integer inputs copied into the parameter block itself. What a configuration fixes (dtype
codes, widths, switches) is a template made once per :class:`~slabstage.kernels.configuration.Config`; a batch
writes the words that change.
"""

from __future__ import annotations

import struct
from ctypes import c_char, memmove

import torch

from .mrope import SEGMENT_WORDS
from .params import (MAX_ITEM_WORDS, F_MEDIA, F_MEDIA_TILED, F_MEDIA_VEC, F_MEDIA_WRAP, F_SCALE, F_TEXT_TILED,
                     F_TEXT_VEC, F_TEXT_WRAP, FLOAT_CODE, H_B, H_COUNTER, H_DONE, H_FLAGS, H_IDS, H_IDS_DTYPE, H_INDEX,
                     H_INDEX_DTYPE, H_ITEMS, H_N, H_NUM_MEDIA, H_PAD_TO, H_SCALE, H_STEP, H_TABLE, H_TABLE_DTYPE,
                     H_TABLE_STRIDE, H_TABLE_WIDTH, H_VOCAB_START, H_WORDS, HEADER_WORDS, INT_CODE, LAYOUT_CODE,
                     S_ADDR, S_DTYPE, S_STRIDE, SOURCE_WORDS)
from ..staging.slots import ROWS
from .configuration import ELEM, LAYOUT_SLOT, Config
from .validate import Checked

__all__ = ["ParamsWriter", "MAX_ITEM_WORDS"]


def _f32_bits(x: float) -> int:
    return struct.unpack("<i", struct.pack("<f", x))[0]


class ParamsWriter:
    """Writes parameter blocks for a :class:`~slabstage.kernels.launch.Stager` (which holds the ring, the
    device parameter block and the destinations this reads)."""

    def _template(self, config: Config, c: Checked) -> tuple:
        """``(words, sources read in place, sources copied into the parameter block)``: the words that
        ``config`` fixes, and where each integer source's words go (``(read position, word, is rows)``;
        ``(read position, word, element bytes)``)."""
        values = [0] * (HEADER_WORDS + SOURCE_WORDS * self.num_slots)
        values[H_DONE], values[H_COUNTER] = self.ring.done_addr, self._counter_addr
        dtypes, shapes = c.reads[1], c.reads[3]
        in_place, in_block = [], []
        for at, k, kind, _, _, elem, host, _ in config.sources:
            w = HEADER_WORDS + SOURCE_WORDS * k
            values[w + S_DTYPE] = INT_CODE[dtypes[at]]
            (in_block if host else in_place).append((at, w, elem) if host else (at, w, kind == ROWS))
        if self.dst.slab is not None:
            width, tw = self.width, shapes[config.table][1]
            flags = F_SCALE if c.scale is not None else 0
            if tw < width and c.expand == "repeat":
                flags |= F_TEXT_TILED if tw % self.program_cols == 0 else F_TEXT_WRAP
            values[H_FLAGS], values[H_ITEMS] = flags, self._items_at
            values[H_TABLE_WIDTH], values[H_TABLE_DTYPE] = tw, FLOAT_CODE[dtypes[config.table]]
            values[H_IDS_DTYPE] = INT_CODE[dtypes[0]]
            if config.index is not None:
                values[H_INDEX_DTYPE] = INT_CODE[dtypes[config.index]]
        config.template = values, tuple(in_place), tuple(in_block)
        return config.template

    def _write(self, c: Checked, own_params: bool) -> None:
        config, plan, segments = c.config, c.media, c.segments
        item_words = 0 if plan is None else len(plan.starts) + len(plan.fields)
        seg_words = 0 if segments is None else len(segments)  # (their room was checked with the batch)
        base = self._base
        if own_params:  # a device parameter block of its own (in the capturing graph's pool), kept with its host one
            with torch.inference_mode(False):
                own = torch.zeros(self.words_for(c.n), dtype=torch.int64, device=self.dst.device)
            base = own.data_ptr()
        template, in_place, in_block = config.template or self._template(config, c)
        values = template.copy()
        end = 8 * (self._items_at + item_words + seg_words)  # bytes: host inputs follow the item and segment lists
        parts = []  # (byte offset in the block, address, bytes per row, rows, row stride in bytes)
        _, dtypes, _, shapes, strides, ptrs = c.reads
        for at, w, rows in in_place:
            values[w + S_ADDR] = ptrs[at]
            if rows:
                values[w + S_STRIDE] = strides[at][0]
        for at, w, elem in in_block:
            addr, stride, end = _into_block(shapes[at], strides[at], ptrs[at], elem, parts, base, end)
            values[w + S_ADDR], values[w + S_STRIDE] = addr, stride
        if seg_words:  # the mrope slot's source: the segment list after the item list
            w = HEADER_WORDS + SOURCE_WORDS * LAYOUT_SLOT
            values[w + S_ADDR] = base + 8 * (self._items_at + item_words)
            values[w + S_DTYPE], values[w + S_STRIDE] = LAYOUT_CODE, seg_words // SEGMENT_WORDS  # (the count)
        if self.dst.slab is not None:
            end = self._embed_header(values, c, parts, base, end)
        words = -(-end // 8)
        if own_params:
            step, at = 0, 0
            values[H_DONE], values[H_COUNTER] = self.ring.spare_done_addr, self._spare_addr
            block = torch.zeros(words, dtype=torch.int64, device="cpu", pin_memory=True)
            self._kept.append((block, own))
            mv = memoryview((c_char * (8 * words)).from_address(block.data_ptr())).cast("B")
            start = block.data_ptr()
            block.numpy()[HEADER_WORDS + SOURCE_WORDS * self.num_slots:self._items_at] = self._dest
        else:
            step, at = self.ring.take()
            mv, start = self._mv, self.ring.base + 8 * at
        values[H_STEP], values[H_WORDS], values[H_N], values[H_B], values[H_PAD_TO] = step, words, c.n, c.b, c.pad_to
        self._dynamic.pack_into(mv, 8 * at, *values)
        if plan is not None:
            _words(item_words).pack_into(mv, 8 * (at + self._items_at), *plan.starts, *plan.fields)
        if seg_words:
            _words(seg_words).pack_into(mv, 8 * (at + self._items_at + item_words), *segments)
        for off, addr, row, rows, stride in parts:  # host inputs, row by row (mrope rows may lie apart)
            for r in range(rows):
                memmove(start + off + r * row, addr + r * stride, row)
        if own_params:
            own[:words].copy_(block, non_blocking=True)
            self._now = own
        else:
            self._now = self.params
            self._pending = (step, at, words)

    def _embed_header(self, values: list, c: Checked, parts: list, base: int, end: int) -> int:
        config, plan = c.config, c.media
        _, dtypes, _, shapes, strides, ptrs = c.reads
        t = config.table
        tptr, s0, tw = ptrs[t], strides[t][0], shapes[t][1]
        flags = values[H_FLAGS]
        if not (tptr & 15 or (s0 | tw) & 7 or flags & F_TEXT_WRAP):
            flags |= F_TEXT_VEC
        if self.num_slots:  # the embeddings read the ids where the integer half reads them
            ids_addr = values[HEADER_WORDS]
        elif config.host_ids:
            ids_addr, _, end = _into_block(shapes[0], strides[0], ptrs[0], ELEM[dtypes[0]], parts, base, end)
        else:
            ids_addr = ptrs[0]
        i = config.index
        if i is not None:
            if config.host_index:
                values[H_INDEX], _, end = _into_block(shapes[i], strides[i], ptrs[i], ELEM[dtypes[i]], parts, base, end)
            else:
                values[H_INDEX] = ptrs[i]
        values[H_VOCAB_START:H_SCALE] = c.bounds
        if c.scale is not None:
            values[H_SCALE] = _f32_bits(c.scale)
        values[H_TABLE], values[H_TABLE_STRIDE], values[H_IDS] = tptr, s0, ids_addr
        if plan is not None:
            if c.media_owner:
                flags |= F_MEDIA
            mw = plan.width
            if mw < self.width and c.expand == "repeat":
                flags |= F_MEDIA_TILED if mw % self.program_cols == 0 else F_MEDIA_WRAP
            if plan.vec and not flags & F_MEDIA_WRAP:
                flags |= F_MEDIA_VEC
            values[H_NUM_MEDIA:H_ITEMS] = (plan.rows, len(plan.starts), plan.column_blocks, FLOAT_CODE[plan.dtype], mw)
        values[H_FLAGS] = flags
        return end


_STRUCTS: dict = {}


def _words(count: int) -> struct.Struct:
    """The packer of ``count`` int64 words (one a length: item lists come in few lengths)."""
    packer = _STRUCTS.get(count)
    if packer is None:
        packer = _STRUCTS[count] = struct.Struct(f"<{count}q")
    return packer


def _into_block(shape, stride, ptr: int, elem: int, parts: list, base: int, end: int) -> tuple[int, int, int]:
    """``(device address, row stride, new end)`` of a host integer input copied into the parameter block at byte ``end``
    (rows end to end, 16-byte aligned)."""
    at = (end + 15) & ~15
    row = shape[-1] * elem
    rows = shape[0] if len(shape) == 2 else 1
    parts.append((at, ptr, row, rows, (stride[0] if len(shape) == 2 else 0) * elem))
    return base + at, shape[-1], at + rows * row
