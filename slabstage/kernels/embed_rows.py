"""The staging kernel's embedding rows: a text row from the table, a media row from its item's column blocks,
read in its source's dtype and cast to the slab's (vector loads where the host promised whole vectors)."""

from __future__ import annotations

from .layout import device as K
from .runtime import cast_to, tl, triton

__all__ = ["text_row", "media_row", "media_row_vec"]

if triton is not None:
    @triton.jit
    def _load_rows(addr, start, cols, read, code, OUT: tl.constexpr, VEC: tl.constexpr, SOFT: tl.constexpr):
        """Values at ``start + cols`` of the array at byte address ``addr`` (dtype by ``code``), cast to ``OUT``,
        0 where not ``read``. (The alignment hint goes on the pointer: the analysis stops at int-to-pointer.)"""
        if code == K.FLOAT32_CODE:
            f32 = addr.to(tl.pointer_type(tl.float32))
            if VEC:
                f32 = tl.multiple_of(f32, 16)
            x = cast_to(tl.load(f32 + start + cols, mask=read, other=0.0), OUT, SOFT)
        elif code == K.BFLOAT16_CODE:
            b16 = addr.to(tl.pointer_type(tl.bfloat16))
            if VEC:
                b16 = tl.multiple_of(b16, 16)
            x = cast_to(tl.load(b16 + start + cols, mask=read, other=0.0), OUT, SOFT)
        else:
            f16 = addr.to(tl.pointer_type(tl.float16))
            if VEC:
                f16 = tl.multiple_of(f16, 16)
            x = cast_to(tl.load(f16 + start + cols, mask=read, other=0.0), OUT, SOFT)
        return x

    # VEC: the host found every address in 16 bytes and every row stride, width and column-block bound in whole
    # 8-element units, so the loads say so and compile to 16-byte loads. A hint must sit on a value made in
    # the function that gives it (it does not reach through an argument): the pointers are made and hinted
    # inside the instance that promises (one per VEC value, in the two arms of a branch on the parameter record's
    # switch); the strides and widths the kernel loaded are hinted where it loads them, which the other
    # instance sees too, harmlessly: its pointers promise nothing, so its loads stay one element wide.

    @triton.jit
    def _source_cols(col0, offs, width, tiled, wrap, VEC: tl.constexpr):
        """The source columns of slab columns ``col0 + offs``: tiled sources repeat. A column that wraps on its
        own breaks the contiguity vector loads need: only the instance that makes no promise has it."""
        if VEC:
            if tiled:
                c0 = tl.multiple_of(col0 % width, 8)  # (the analysis does not carry divisibility through %)
            else:
                c0 = col0
            cols = c0.to(tl.int32) + offs
        else:
            if wrap:
                c0 = col0 * 0
                cols = ((col0 + offs) % width).to(tl.int32)
            elif tiled:
                c0 = col0 % width
                cols = c0.to(tl.int32) + offs
            else:
                c0 = col0
                cols = c0.to(tl.int32) + offs
        return c0, cols

    @triton.jit
    def text_row(table, rel, stride, width, code, col0, offs, keep, flags, scale, OUT: tl.constexpr,
                  VEC: tl.constexpr, SOFT: tl.constexpr):
        """Slab columns ``col0 + offs`` of table row ``rel`` (times ``scale`` in fp32 when ``F_SCALE``; +0.0
        wherever nothing was read, whatever the scale's sign)."""
        start = rel * stride
        _, cols = _source_cols(col0, offs, width, (flags & K.F_TEXT_TILED) != 0, (flags & K.F_TEXT_WRAP) != 0, VEC)
        read = keep & (cols < width)
        if (flags & K.F_SCALE) != 0:
            t = _load_rows(table, start, cols, read, code, tl.float32, VEC, SOFT)
            t = cast_to(tl.where(read, t * scale, 0.0), OUT, SOFT)
        else:
            t = _load_rows(table, start, cols, read, code, OUT, VEC, SOFT)
        return t

    @triton.jit
    def media_row(fields, nblocks, row, width, code, col0, offs, on, col_ok, flags, OUT: tl.constexpr,
                   SOFT: tl.constexpr):
        """Slab columns ``col0 + offs`` of one media row (read only when ``on``): row ``row`` of each column
        block of its item (``fields``: the item's ``C_*`` fields, address, row stride, first and end column,
        per column block, read whatever ``on``: they lie in the parameter record). One-element loads: no promise
        made."""
        wrap = (flags & K.F_MEDIA_WRAP) != 0
        c0, cols = _source_cols(col0, offs, width, (flags & K.F_MEDIA_TILED) != 0, wrap, False)
        m = tl.zeros(offs.shape, OUT)
        j = 0
        while j < nblocks:  # a while loop: the interpreter cannot range() over a runtime int
            f = fields + j * K.COLUMN_BLOCK_WORDS
            addr = tl.load(f + K.C_ADDR)
            stride = tl.load(f + K.C_STRIDE)
            lo = tl.load(f + K.C_FIRST_COL)
            hi = tl.load(f + K.C_END_COL)
            if on & (((lo < c0 + offs.shape[0]) & (hi > c0)) | wrap):  # a column block the piece misses: 4 loads
                read = on & col_ok & (cols >= lo) & (cols < hi)
                m = tl.where(read, _load_rows(addr, row * stride - lo, cols, read, code, OUT, False, SOFT), m)
            j += 1
        return m

    @triton.jit
    def media_row_vec(fields, nblocks, row, width, code, col0, on, flags, WIDTH: tl.constexpr,
                      VECTORS: tl.constexpr, OUT: tl.constexpr, SOFT: tl.constexpr):
        """:func:`media_row` where the host promised whole 16-byte vectors (every address, row stride and column-block
        bound): ``[VECTORS, 8]`` values, slab columns ``col0 + 8 * g + e``. A vector of 8 columns lies in one
        column block, so its address is found first (the fields lie in the parameter record) and the piece is read
        in one load, whatever column blocks it spans: their rows are read in one round trip, not one after another."""
        g = tl.arange(0, VECTORS) * 8
        _, gcols = _source_cols(col0, g, width, (flags & K.F_MEDIA_TILED) != 0, False, True)
        esize = tl.where(code == K.FLOAT32_CODE, 4, 2).to(tl.int64)
        at = tl.zeros((VECTORS,), tl.int64)
        j = 0
        while j < nblocks:
            f = fields + j * K.COLUMN_BLOCK_WORDS
            addr, stride = tl.load(f + K.C_ADDR), tl.load(f + K.C_STRIDE)
            lo, hi = tl.load(f + K.C_FIRST_COL), tl.load(f + K.C_END_COL)
            at = tl.where((gcols >= lo) & (gcols < hi), addr + (row * stride - lo + gcols) * esize, at)
            j += 1
        e = tl.arange(0, 8)
        # (an item's column blocks tile its width: a column within it has an address; the compares keep the mask the
        # same over each group, which the 16-byte loads need)
        read = on & (col0 + g[:, None] + e[None, :] < WIDTH) & (gcols[:, None] < width)
        at = at[:, None] + (e * esize)[None, :]
        if code == K.FLOAT32_CODE:
            f32 = tl.max_contiguous(tl.multiple_of(at.to(tl.pointer_type(tl.float32)), [16, 16]), [1, 8])
            x = cast_to(tl.load(f32, mask=read, other=0.0), OUT, SOFT)
        else:  # fp16 and bf16 rows: one 16-bit load, its bits then read as the items' dtype
            u16 = tl.max_contiguous(tl.multiple_of(at.to(tl.pointer_type(tl.uint16)), [16, 16]), [1, 8])
            bits = tl.load(u16, mask=read, other=0)
            if code == K.BFLOAT16_CODE:
                x = cast_to(bits.to(tl.bfloat16, bitcast=True), OUT, SOFT)
            else:
                x = cast_to(bits.to(tl.float16, bitcast=True), OUT, SOFT)
        return x

else:  # pragma: no cover
    text_row = media_row = media_row_vec = None
