"""The staging kernel's integer-slot rows: read a source's ints, write a slot's row with its padding and range
check, and mrope positions computed from a segment list (:mod:`slabstage.staging.mrope`)."""

from __future__ import annotations

from .layout import device as K
from .runtime import tl, triton

__all__ = ["copy_pad", "put_row", "mrope_rows", "ints", "store_ints"]

if triton is not None:
    @triton.jit
    def ints(addr, code, offs, mask, other):
        """int64 values at ``offs`` of the int32 (``INT32_CODE``) or int64 (``INT64_CODE``) array at byte
        address ``addr``."""
        if code == K.INT64_CODE:
            v = tl.load(addr.to(tl.pointer_type(tl.int64)) + offs, mask=mask, other=other)
        else:
            v = tl.load(addr.to(tl.pointer_type(tl.int32)) + offs, mask=mask, other=other).to(tl.int64)
        return v

    @triton.jit
    def store_ints(addr, code, offs, val, mask):
        if code == K.INT64_CODE:
            tl.store(addr.to(tl.pointer_type(tl.int64)) + offs, val, mask=mask)
        else:
            tl.store(addr.to(tl.pointer_type(tl.int32)) + offs, val.to(tl.int32), mask=mask)

    @triton.jit
    def put_row(dd, errors_ptr, offs, val, count, limit, r):
        """Row ``r`` of the slot whose destination is described at ``dd``: ``val`` below ``count``, the pad
        value in ``[count, limit)`` when the slot pads. A value the destination's dtype cannot hold is stored
        truncated and recorded in the error word: a narrowing copy is never silent."""
        dst_code = tl.load(dd + K.D_DTYPE)
        dst = tl.load(dd + K.D_ADDR) + r * tl.load(dd + K.D_STRIDE) * (4 * dst_code)  # a byte address
        keep = offs < count
        if dst_code == K.INT32_CODE:
            lost = keep & (val.to(tl.int32).to(tl.int64) != val)
            tl.atomic_or(errors_ptr + K.ERROR_CODES, K.VALUE_OUT_OF_RANGE, mask=tl.max(lost.to(tl.int32), axis=0) > 0)
        if tl.load(dd + K.D_PAD) != 0:
            val = tl.where(keep, val, tl.load(dd + K.D_FILL))
            keep = offs < limit
        store_ints(dst, dst_code, offs, val, keep)

    @triton.jit
    def copy_pad(sd, dd, errors_ptr, offs, count, limit, r):
        """Row ``r`` of the slot whose source is described at ``sd``: copied below ``count`` (:func:`put_row`)."""
        src_code = tl.load(sd + K.S_DTYPE)
        src = tl.load(sd + K.S_ADDR) + r * tl.load(sd + K.S_STRIDE) * (4 * src_code)  # a byte address
        put_row(dd, errors_ptr, offs, ints(src, src_code, offs, offs < count, 0), count, limit, r)

    @triton.jit
    def mrope_rows(sd, dd, errors_ptr, rows, n, pad_to):
        """The three rows of an mrope slot at ``rows``, computed from the batch's segment list
        (:mod:`slabstage.staging.mrope`: the source's address and its segment count): each row's segment
        by a binary search over their first rows, then its text or media position."""
        seg = tl.load(sd + K.S_ADDR).to(tl.pointer_type(tl.int64))
        count = tl.load(sd + K.S_STRIDE)
        step = tl.full((), 1, tl.int64)
        while step * 2 <= count:
            step *= 2
        k = tl.zeros(rows.shape, tl.int64)  # segments starting at or before the row
        while step > 0:
            j = k + step
            first = tl.load(seg + (j - 1) * K.SEGMENT_WORDS + K.SEG_FIRST_ROW, mask=j <= count, other=2**62)
            k = tl.where(first <= rows, j, k)
            step = step // 2
        f = seg + (tl.maximum(k, 1) - 1) * K.SEGMENT_WORDS
        live = rows < n
        row0 = tl.load(f + K.SEG_FIRST_ROW, mask=live, other=0)
        base = tl.load(f + K.SEG_BASE, mask=live, other=0)
        area = tl.load(f + K.SEG_AREA, mask=live, other=0)
        cols = tl.maximum(tl.load(f + K.SEG_COLUMNS, mask=live, other=1), 1)
        code = tl.load(f + K.SEG_CODE, mask=live, other=0)
        word = tl.load(f + K.SEG_INTERVAL, mask=live, other=0)
        text = area == 0
        q = rows - row0 + tl.load(f + K.SEG_OFFSET, mask=live, other=0)
        area = tl.where(text, 1, area)
        frame = q // area
        # floor(frame * interval) as torch computes arange(t) * interval: exact for an int, else in the
        # interval's float32 or float64 and truncated
        w32 = tl.where(code == K.INTERVAL_F32, word, 0).to(tl.int32).to(tl.float32, bitcast=True)  # (others: 0.0)
        w64 = tl.where(code == K.INTERVAL_F64, word, 0).to(tl.float64, bitcast=True)
        f32 = (frame.to(tl.float32) * w32).to(tl.int64)
        f64 = (frame.to(tl.float64) * w64).to(tl.int64)
        temporal = tl.where(code == K.INTERVAL_INT, frame * word, tl.where(code == K.INTERVAL_F32, f32, f64))
        linear = rows + base
        put_row(dd, errors_ptr, rows, tl.where(text, linear, base + temporal), n, pad_to, 0)
        put_row(dd, errors_ptr, rows, tl.where(text, linear, base + (q % area) // cols), n, pad_to, 1)
        put_row(dd, errors_ptr, rows, tl.where(text, linear, base + q % cols), n, pad_to, 2)

else:  # pragma: no cover
    copy_pad = put_row = mrope_rows = ints = store_ints = None
