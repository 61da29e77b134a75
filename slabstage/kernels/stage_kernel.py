"""The staging kernel: a batch's embeddings and integer slots, read from one parameter block.

One ``@triton.jit`` kernel serves every staging path (the runner's graphs and its
eager path, ``stage_embeddings``, ``stage_token_inputs``, the custom ops). Its
runtime arguments are fixed for a set of destinations: the parameter block, the
error word, the slab, ``pad_to``. Everything a batch changes (``n``, the sources'
addresses and dtypes, vocabulary bounds, ``text_scale``, the media items) is data
in the block (:mod:`slabstage.kernels.params`), so a captured launch serves every
batch. Constexprs are what the destinations fix: the slab's width and dtype, the
piece of a row one program writes, how many integer slots there are.

Grid: with ``EMBED``, ``pad_to * COL_BLOCKS`` programs, one per ``BLOCK`` columns of
a slab row; the program at column block 0 of every ``TOK_BLOCK``-th row also copies
those rows of each integer slot. Without it, one program per ``TOK_BLOCK`` rows.
Program 0 writes the per-request slots and the token count, and stores the step
number into the ring's ``done`` word.

A program's row is media, text or zeros (padding, a refused id or media index,
media another rank owns): one arm runs. Sources of any dtype the host accepts are
read through their address with the dtype the block names (a uniform branch per
program). Where the host found every address, row stride and bound in whole 16-byte
vectors (``F_TEXT_VEC``, ``F_MEDIA_VEC``) the loads carry that promise and compile
to 16-byte loads; otherwise the arm walks its piece ``PIECE`` columns at a time.

Registers decide the speed: a thread's registers hold its loads in flight, and the
kernel's registers are those of its largest arm. One-element loads take an address
each, so an arm that made them over the whole ``BLOCK`` would set every launch's
occupancy (218 registers a thread at 4096 bf16 columns, 4 warps: 2 programs an SM,
half the copy ceiling); walking ``PIECE`` columns keeps it near the vector arm's (64-80).
"""

from __future__ import annotations

import zlib
from types import ModuleType

from .errors import BAD_MEDIA_INDEX, BAD_TOKEN_ID, VALUE_OUT_OF_RANGE
from .params import (D_ADDR, D_DTYPE, D_FILL, D_KIND, D_LENGTH, D_PAD, D_ROWS, D_STRIDE, DEST_WORDS, F_MEDIA,
                     F_MEDIA_TILED, F_MEDIA_VEC, F_MEDIA_WRAP, F_SCALE, F_TEXT_TILED, F_TEXT_VEC, F_TEXT_WRAP, H_B,
                     H_COUNTER, H_DONE, H_FLAGS, H_IDS, H_IDS_DTYPE, H_INDEX, H_INDEX_DTYPE, H_ITEM_BLOCKS, H_ITEMS,
                     H_MEDIA_DTYPE, H_MEDIA_WIDTH, H_N, H_NUM_ITEMS, H_NUM_MEDIA, H_SCALE, H_STEP, H_TABLE,
                     H_TABLE_DTYPE, H_TABLE_STRIDE, H_TABLE_WIDTH, H_VOCAB_END, H_VOCAB_SIZE, H_VOCAB_START,
                     H_WORDS, HEADER_WORDS, S_ADDR, S_DTYPE, S_STRIDE, SOURCE_WORDS)
from .mrope import I_F32, I_F64, I_INT, SEGMENT_WORDS
from .params import LAYOUT_CODE
from .runtime import SOFT_CASTS, Constant, cast_to, next_pow2, row_launch_config, tl, triton
from ..staging.slots import COUNT, REQUESTS

__all__ = ["stage_kernel", "fetch_kernel", "launch_settings", "TOK_BLOCK", "ITEM_CHUNK", "FETCH_CHUNK"]

TOK_BLOCK = 128  # integer-slot rows per program
ITEM_CHUNK = 32  # item starts read per vector load when finding a media row's item
FETCH_CHUNK = 512  # parameter-block words a fetch program copies (4 KiB)



def launch_settings(width: int | None, elem_bytes: int | None, num_slots: int, req_rows: int) -> tuple[dict, int]:
    """``(constexprs, num_warps)`` of :func:`stage_kernel` for a slab of ``width`` columns of ``elem_bytes``
    bytes (``None``: no slab), ``num_slots`` integer slots and a per-request slot of ``req_rows`` rows."""
    if width is None:
        block, num_warps, piece = 16, 4, 16
    else:
        block, num_warps = row_launch_config(width, elem_bytes)
        piece = min(block, 32 * num_warps * 8 // elem_bytes)  # unpromised loads: 8 bytes a thread at a time
    return dict(EMBED=width is not None, WIDTH=width or 1, BLOCK=block, COL_BLOCKS=-(-(width or 1) // block),
                NUM_SLOTS=num_slots, REQ_BLOCK=next_pow2(req_rows), PIECE=piece), num_warps


if triton is not None:
    # The layout's constants, read by the kernels as attributes of a module: a launch compares each global
    # a kernel reads with its value at compile time (51 of them, 7.6 µs a launch on the H200's host), but not
    # a module's attributes. _KEY (one global, their values' checksum) puts them in the compile cache's key.
    K = ModuleType("slabstage.kernels.stage_kernel.K")
    K.__dict__.update({name: Constant(value) for name, value in dict(
        SOFT=SOFT_CASTS, BAD_ID=BAD_TOKEN_ID, BAD_MEDIA=BAD_MEDIA_INDEX, RANGE=VALUE_OUT_OF_RANGE,
        TOK_BLOCK=TOK_BLOCK, ITEM_CHUNK=ITEM_CHUNK, HEADER=HEADER_WORDS, SRC_WORDS=SOURCE_WORDS,
        DST_WORDS=DEST_WORDS, H_STEP=H_STEP, H_DONE=H_DONE, H_N=H_N, H_B=H_B, H_VS=H_VOCAB_START,
        H_VE=H_VOCAB_END, H_VZ=H_VOCAB_SIZE, H_SCALE=H_SCALE, H_FLAGS=H_FLAGS, H_TABLE=H_TABLE,
        H_TSTRIDE=H_TABLE_STRIDE, H_TWIDTH=H_TABLE_WIDTH, H_TDTYPE=H_TABLE_DTYPE, H_IDS=H_IDS,
        H_IDS_DT=H_IDS_DTYPE, H_INDEX=H_INDEX, H_INDEX_DT=H_INDEX_DTYPE, H_NUM_MEDIA=H_NUM_MEDIA,
        H_NUM_ITEMS=H_NUM_ITEMS, H_ITEM_BLOCKS=H_ITEM_BLOCKS, H_MDTYPE=H_MEDIA_DTYPE, H_MWIDTH=H_MEDIA_WIDTH,
        H_ITEMS=H_ITEMS, H_COUNTER=H_COUNTER, H_WORDS=H_WORDS, S_ADDR=S_ADDR, S_DTYPE=S_DTYPE,
        S_STRIDE=S_STRIDE, D_ADDR=D_ADDR, D_DTYPE=D_DTYPE, D_STRIDE=D_STRIDE, D_FILL=D_FILL, D_PAD=D_PAD,
        D_KIND=D_KIND, D_ROWS=D_ROWS, D_LENGTH=D_LENGTH, F_SCALE=F_SCALE, F_MEDIA=F_MEDIA,
        F_TEXT_TILED=F_TEXT_TILED, F_TEXT_WRAP=F_TEXT_WRAP, F_MEDIA_TILED=F_MEDIA_TILED,
        F_MEDIA_WRAP=F_MEDIA_WRAP, F_TEXT_VEC=F_TEXT_VEC, F_MEDIA_VEC=F_MEDIA_VEC, REQUESTS=REQUESTS,
        COUNT=COUNT, LAYOUT=LAYOUT_CODE, SEG_WORDS=SEGMENT_WORDS, I_INT=I_INT, I_F32=I_F32,
        I_F64=I_F64).items()})
    _KEY = Constant(zlib.crc32(repr(sorted((k, v.value) for k, v in K.__dict__.items()
                                           if isinstance(v, Constant))).encode()))

    @triton.jit
    def _ints(addr, code, offs, mask, other):
        """int64 values at ``offs`` of the int32 (``code == 1``) or int64 (2) array at byte address ``addr``."""
        if code == 2:
            v = tl.load(addr.to(tl.pointer_type(tl.int64)) + offs, mask=mask, other=other)
        else:
            v = tl.load(addr.to(tl.pointer_type(tl.int32)) + offs, mask=mask, other=other).to(tl.int64)
        return v

    @triton.jit
    def _store_ints(addr, code, offs, val, mask):
        if code == 2:
            tl.store(addr.to(tl.pointer_type(tl.int64)) + offs, val, mask=mask)
        else:
            tl.store(addr.to(tl.pointer_type(tl.int32)) + offs, val.to(tl.int32), mask=mask)

    @triton.jit
    def _put_row(dd, errors_ptr, offs, val, count, limit, r):
        """Row ``r`` of the slot whose destination is described at ``dd``: ``val`` below ``count``, the pad
        value in ``[count, limit)`` when the slot pads. A value the destination's dtype cannot hold is stored
        truncated and recorded in the error word: a narrowing copy is never silent."""
        dst_code = tl.load(dd + K.D_DTYPE)
        dst = tl.load(dd + K.D_ADDR) + r * tl.load(dd + K.D_STRIDE) * (4 * dst_code)  # a byte address
        keep = offs < count
        if dst_code == 1:
            lost = keep & (val.to(tl.int32).to(tl.int64) != val)
            tl.atomic_or(errors_ptr, K.RANGE, mask=tl.max(lost.to(tl.int32), axis=0) > 0)
        if tl.load(dd + K.D_PAD) != 0:
            val = tl.where(keep, val, tl.load(dd + K.D_FILL))
            keep = offs < limit
        _store_ints(dst, dst_code, offs, val, keep)

    @triton.jit
    def _copy_pad(sd, dd, errors_ptr, offs, count, limit, r):
        """Row ``r`` of the slot whose source is described at ``sd``: copied below ``count`` (:func:`_put_row`)."""
        src_code = tl.load(sd + K.S_DTYPE)
        src = tl.load(sd + K.S_ADDR) + r * tl.load(sd + K.S_STRIDE) * (4 * src_code)  # a byte address
        _put_row(dd, errors_ptr, offs, _ints(src, src_code, offs, offs < count, 0), count, limit, r)

    @triton.jit
    def _mrope_rows(sd, dd, errors_ptr, rows, n, pad_to):
        """The three rows of an mrope slot at ``rows``, computed from the batch's segment table
        (:mod:`slabstage.kernels.mrope`: the source's address and its segment count): each row's segment
        by a binary search over their first rows, then its text or media position."""
        seg = tl.load(sd + K.S_ADDR).to(tl.pointer_type(tl.int64))
        count = tl.load(sd + K.S_STRIDE)
        step = tl.full((), 1, tl.int64)
        while step * 2 <= count:
            step *= 2
        k = tl.zeros(rows.shape, tl.int64)  # segments starting at or before the row
        while step > 0:
            j = k + step
            first = tl.load(seg + (j - 1) * K.SEG_WORDS, mask=j <= count, other=2**62)
            k = tl.where(first <= rows, j, k)
            step = step // 2
        f = seg + (tl.maximum(k, 1) - 1) * K.SEG_WORDS
        live = rows < n
        row0 = tl.load(f, mask=live, other=0)
        base = tl.load(f + 1, mask=live, other=0)
        area = tl.load(f + 2, mask=live, other=0)
        cols = tl.maximum(tl.load(f + 3, mask=live, other=1), 1)
        code = tl.load(f + 5, mask=live, other=0)
        word = tl.load(f + 6, mask=live, other=0)
        text = area == 0
        q = rows - row0 + tl.load(f + 4, mask=live, other=0)
        area = tl.where(text, 1, area)
        frame = q // area
        # floor(frame * interval) as torch computes arange(t) * interval: exact for an int, else in the
        # interval's float32 or float64 and truncated
        w32 = tl.where(code == K.I_F32, word, 0).to(tl.int32).to(tl.float32, bitcast=True)  # (others: 0.0)
        w64 = tl.where(code == K.I_F64, word, 0).to(tl.float64, bitcast=True)
        f32 = (frame.to(tl.float32) * w32).to(tl.int64)
        f64 = (frame.to(tl.float64) * w64).to(tl.int64)
        temporal = tl.where(code == K.I_INT, frame * word, tl.where(code == K.I_F32, f32, f64))
        linear = rows + base
        _put_row(dd, errors_ptr, rows, tl.where(text, linear, base + temporal), n, pad_to, 0)
        _put_row(dd, errors_ptr, rows, tl.where(text, linear, base + (q % area) // cols), n, pad_to, 1)
        _put_row(dd, errors_ptr, rows, tl.where(text, linear, base + q % cols), n, pad_to, 2)

    @triton.jit
    def _load_rows(addr, start, cols, read, code, OUT: tl.constexpr, VEC: tl.constexpr, SOFT: tl.constexpr):
        """Values at ``start + cols`` of the array at byte address ``addr`` (dtype by ``code``), cast to ``OUT``,
        0 where not ``read``. (The alignment hint goes on the pointer: the analysis stops at int-to-pointer.)"""
        if code == 2:
            f32 = addr.to(tl.pointer_type(tl.float32))
            if VEC:
                f32 = tl.multiple_of(f32, 16)
            x = cast_to(tl.load(f32 + start + cols, mask=read, other=0.0), OUT, SOFT)
        elif code == 1:
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

    # VEC: the host found every address in 16 bytes and every row stride, width and block bound in whole
    # 8-element units, so the loads say so and compile to 16-byte loads. A hint must sit on a value made in
    # the function that gives it (it does not reach through an argument): the pointers are made and hinted
    # inside the instance that promises (one per VEC value, in the two arms of a branch on the block's
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
    def _text_row(table, rel, stride, width, code, col0, offs, keep, flags, scale, OUT: tl.constexpr,
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
    def _media_row(fields, nblocks, row, width, code, col0, offs, on, col_ok, flags, OUT: tl.constexpr,
                   VEC: tl.constexpr, SOFT: tl.constexpr):
        """Slab columns ``col0 + offs`` of one media row (read only when ``on``): row ``row`` of each column
        block of its item (``fields``: the item's ``(address, row stride, first column, end column)`` per
        block, read whatever ``on``: they lie in the parameter block)."""
        wrap = (flags & K.F_MEDIA_WRAP) != 0
        c0, cols = _source_cols(col0, offs, width, (flags & K.F_MEDIA_TILED) != 0, wrap, VEC)
        m = tl.zeros(offs.shape, OUT)
        j = 0
        while j < nblocks:  # a while loop: the interpreter cannot range() over a runtime int
            addr = tl.load(fields + 4 * j)
            stride = tl.load(fields + 4 * j + 1)
            lo = tl.load(fields + 4 * j + 2)
            hi = tl.load(fields + 4 * j + 3)
            if VEC:
                stride, lo, hi = tl.multiple_of(stride, 8), tl.multiple_of(lo, 8), tl.multiple_of(hi, 8)
            if on & (((lo < c0 + offs.shape[0]) & (hi > c0)) | wrap):  # a block the piece misses: 4 loads
                read = on & col_ok & (cols >= lo) & (cols < hi)
                m = tl.where(read, _load_rows(addr, row * stride - lo, cols, read, code, OUT, VEC, SOFT), m)
            j += 1
        return m

    @triton.jit(do_not_specialize=["pad_to"])
    def stage_kernel(params_ptr, errors_ptr, slab_ptr, pad_to,
                     EMBED: tl.constexpr, WIDTH: tl.constexpr, BLOCK: tl.constexpr, COL_BLOCKS: tl.constexpr,
                     NUM_SLOTS: tl.constexpr, REQ_BLOCK: tl.constexpr, PIECE: tl.constexpr):
        tl.static_assert(_KEY >= 0)  # (names the layout's checksum: see K)
        pid = tl.program_id(0)
        n = tl.load(params_ptr + K.H_N)
        if pid == 0:  # the step's block has been read: the fetch and the host may move on
            step = tl.load(params_ptr + K.H_STEP)
            tl.store(tl.load(params_ptr + K.H_COUNTER).to(tl.pointer_type(tl.int64)), step)
            tl.store(tl.load(params_ptr + K.H_DONE).to(tl.pointer_type(tl.int64)), step)
        if EMBED:
            row = (pid // COL_BLOCKS).to(tl.int64)
            col0 = ((pid % COL_BLOCKS) * BLOCK).to(tl.int64)
        else:
            row = pid.to(tl.int64) * K.TOK_BLOCK
            col0 = tl.zeros((), tl.int64)
        if EMBED:
            OUT: tl.constexpr = slab_ptr.dtype.element_ty
            # the header words that sort the row, loaded before any branch (one round trip to the cache); an
            # arm loads its own from the lines these brought in, so that only the arm that runs holds them
            flags = tl.load(params_ptr + K.H_FLAGS).to(tl.int32)
            ids, ids_code = tl.load(params_ptr + K.H_IDS), tl.load(params_ptr + K.H_IDS_DT).to(tl.int32)
            index, index_code = tl.load(params_ptr + K.H_INDEX), tl.load(params_ptr + K.H_INDEX_DT).to(tl.int32)
            vocab_start, vocab_end = tl.load(params_ptr + K.H_VS), tl.load(params_ptr + K.H_VE)
            vocab_size, num_media = tl.load(params_ptr + K.H_VZ), tl.load(params_ptr + K.H_NUM_MEDIA)

            offs = tl.arange(0, BLOCK)
            cols = col0 + offs
            col_ok = cols < WIDTH
            live = row < n  # rows in [n, pad_to) are padding: zeros, nothing read
            tok = _ints(ids, ids_code, row, live, 0)
            mi = _ints(index, index_code, row, live & (index_code != 0), -1)  # code 0: the batch has no index
            is_media = live & (mi >= 0)
            is_text = live & (mi < 0)
            bad_id = is_text & ((tok < 0) | (tok >= vocab_size))
            bad_media = is_media & (mi >= num_media)
            read_text = is_text & (tok >= vocab_start) & (tok < vocab_end) & (tok < vocab_size)

            flag = (bad_id | bad_media) & (col0 == 0)  # one report per row
            tl.atomic_or(errors_ptr, tl.where(bad_id, K.BAD_ID, K.BAD_MEDIA), mask=flag)
            tl.atomic_add(errors_ptr + 1, 1, mask=flag)
            tl.atomic_min(errors_ptr + 2, row.to(tl.int32), mask=flag)

            # a row is media, text or zeros, the same for every column: one arm runs, and only its values live.
            # Unpromised loads are one element wide, an address each: that arm walks the piece PIECE columns
            # at a time, so it holds no more registers than the vector arm (registers bound the loads in flight).
            if row < pad_to:  # (not so only for program 0 of a grid of one, pad_to = 0)
                dst = slab_ptr + row * WIDTH
                read_media = is_media & (mi < num_media) & ((flags & K.F_MEDIA) != 0)  # else a media row is zeros
                if read_media:
                    num_items, nblocks = tl.load(params_ptr + K.H_NUM_ITEMS), tl.load(params_ptr + K.H_ITEM_BLOCKS)
                    mcode, mwidth = tl.load(params_ptr + K.H_MDTYPE).to(tl.int32), tl.load(params_ptr + K.H_MWIDTH)
                    items = params_ptr + tl.load(params_ptr + K.H_ITEMS)
                    # the media row's item: how many items start at or before it, minus one
                    item = tl.zeros((), tl.int64)
                    if num_items > 1:
                        item -= 1
                        c = 0
                        while c < num_items:
                            k = c + tl.arange(0, K.ITEM_CHUNK)
                            starts = tl.load(items + k, mask=k < num_items, other=2**62)
                            item += tl.sum((starts <= mi).to(tl.int64), axis=0)
                            c += K.ITEM_CHUNK
                        item = tl.maximum(item, 0)
                    in_item = mi - tl.load(items + item)
                    fields = items + num_items + item * (nblocks * 4)
                    if (flags & K.F_MEDIA_VEC) != 0:
                        m = _media_row(fields, nblocks, in_item, tl.multiple_of(mwidth, 8), mcode, col0, offs,
                                       read_media, col_ok, flags, OUT, True, K.SOFT)
                        tl.store(dst + cols, m, mask=col_ok)
                    else:
                        for p in range(0, BLOCK, PIECE):
                            po = tl.arange(0, PIECE)
                            ok = col0 + p + po < WIDTH
                            m = _media_row(fields, nblocks, in_item, mwidth, mcode, col0 + p, po, read_media, ok, flags,
                                           OUT, False, K.SOFT)
                            tl.store(dst + col0 + p + po, m, mask=ok)
                elif read_text:
                    table, tstride = tl.load(params_ptr + K.H_TABLE), tl.load(params_ptr + K.H_TSTRIDE)
                    twidth, tcode = tl.load(params_ptr + K.H_TWIDTH), tl.load(params_ptr + K.H_TDTYPE).to(tl.int32)
                    scale = tl.load(params_ptr + K.H_SCALE).to(tl.int32).to(tl.float32, bitcast=True)
                    rel = tok - vocab_start
                    if (flags & K.F_TEXT_VEC) != 0:
                        t = _text_row(table, rel, tl.multiple_of(tstride, 8), tl.multiple_of(twidth, 8), tcode, col0,
                                      offs, col_ok, flags, scale, OUT, True, K.SOFT)
                        tl.store(dst + cols, t, mask=col_ok)
                    else:
                        for p in range(0, BLOCK, PIECE):
                            po = tl.arange(0, PIECE)
                            ok = col0 + p + po < WIDTH
                            t = _text_row(table, rel, tstride, twidth, tcode, col0 + p, po, ok, flags, scale, OUT,
                                          False, K.SOFT)
                            tl.store(dst + col0 + p + po, t, mask=ok)
                else:  # padding, a bad or another rank's id, a bad media index, media another rank owns
                    tl.store(dst + cols, tl.zeros((BLOCK,), OUT), mask=col_ok)

        if NUM_SLOTS > 0:
            if (col0 == 0) & (row % K.TOK_BLOCK == 0):  # one program per K.TOK_BLOCK rows
                offs_t = row + tl.arange(0, K.TOK_BLOCK)
                for s in tl.static_range(NUM_SLOTS):
                    sd = params_ptr + K.HEADER + s * K.SRC_WORDS
                    dd = params_ptr + K.HEADER + NUM_SLOTS * K.SRC_WORDS + s * K.DST_WORDS
                    kind = tl.load(dd + K.D_KIND)
                    if tl.load(dd + K.D_DTYPE) != 0:  # a slot this stager writes
                        if kind == K.COUNT:
                            if row == 0:
                                _store_ints(tl.load(dd + K.D_ADDR), tl.load(dd + K.D_DTYPE), 0, n, True)
                        elif tl.load(sd + K.S_DTYPE) != 0:  # a source this batch gives
                            if kind == K.REQUESTS:
                                if row == 0:
                                    _copy_pad(sd, dd, errors_ptr, tl.arange(0, REQ_BLOCK), tl.load(params_ptr + K.H_B),
                                              tl.load(dd + K.D_LENGTH), 0)
                            elif tl.load(sd + K.S_DTYPE) == K.LAYOUT:  # mrope positions from their layout
                                _mrope_rows(sd, dd, errors_ptr, offs_t, n, pad_to)
                            else:
                                r = 0
                                rows = tl.load(dd + K.D_ROWS)
                                while r < rows:
                                    _copy_pad(sd, dd, errors_ptr, offs_t, n, pad_to, r)
                                    r += 1

    @triton.jit
    def fetch_kernel(ring_ptr, counter_ptr, params_ptr, slot_words, k, CHUNK: tl.constexpr):
        """Copy the next step's block from the pinned ring into the device block: slot ``(counter + 1) % k``,
        its first ``H_WORDS`` words; ``CHUNK`` words a program (the programs past the block's end copy
        nothing). The first launch of every captured graph."""
        tl.static_assert(_KEY >= 0)
        src = ring_ptr + ((tl.load(counter_ptr) + 1) % k) * slot_words
        offs = tl.program_id(0).to(tl.int64) * CHUNK + tl.arange(0, CHUNK)
        keep = offs < tl.load(src + K.H_WORDS)
        tl.store(params_ptr + offs, tl.load(src + offs, mask=keep, other=0), mask=keep)
else:  # pragma: no cover
    stage_kernel = fetch_kernel = None
