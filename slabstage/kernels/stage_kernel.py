"""The staging kernel: a batch's embeddings and integer slots, in one launch.

One ``@triton.jit`` kernel serves the three staging ops. ``EMBED`` and
``TOKENS`` switch its two halves, so :func:`stage_embeddings` launches it with
the token half off, :func:`stage_token_inputs` with the embedding half off and
the runner with both. Its ``def`` is the one declaration of the arguments:
:class:`~slabstage.kernels.launch.FastLaunch` derives everything else from it.
Optional arguments carry defaults (None for a pointer), so a caller names only
what it uses.

Grid: one program per ``BLOCK`` columns of one slab row, ``COL_BLOCKS`` programs
per row, rows ``[0, pad_to)`` (with the embedding half off: one program per
``TOK_BLOCK`` rows). The program at column block 0 of every ``TOK_BLOCK``-th row
also copies ``TOK_BLOCK`` rows of each integer slot; the program of row 0 writes
the per-request slots and the token count.
"""

from __future__ import annotations

from .errors import BAD_MEDIA_INDEX, BAD_TOKEN_ID, VALUE_OUT_OF_RANGE
from .launch import FastLaunch
from .runtime import SOFT_CASTS, cast_to, tl, triton

__all__ = ["stage_kernel", "STAGE", "TOK_BLOCK", "ITEM_CHUNK", "MEDIA_NONE", "MEDIA_TENSOR", "MEDIA_ITEMS",
           "ITEM_FIELDS"]

TOK_BLOCK = 128  # integer-slot rows per program
ITEM_CHUNK = 32  # item starts read per vector load when finding a media row's item
MEDIA_NONE, MEDIA_TENSOR, MEDIA_ITEMS = 0, 1, 2
ITEM_FIELDS = 4  # per item block in the item table: address, row stride, first column, end column

if triton is not None:
    _SOFT = tl.constexpr(SOFT_CASTS)
    _BAD_ID = tl.constexpr(BAD_TOKEN_ID)
    _BAD_MEDIA = tl.constexpr(BAD_MEDIA_INDEX)
    _RANGE = tl.constexpr(VALUE_OUT_OF_RANGE)
    _TOK_BLOCK = tl.constexpr(TOK_BLOCK)
    _ITEM_CHUNK = tl.constexpr(ITEM_CHUNK)

    @triton.jit
    def _copy_pad(src_ptr, dst_ptr, errors_ptr, offs, count, limit, fill, PAD: tl.constexpr):
        """dst[offs] = src[offs] below count; = fill in [count, limit) when PAD.

        A value the destination's dtype cannot hold is still stored (truncated) but
        recorded in the error word: a narrowing copy is never silent.
        """
        keep = offs < count
        val = tl.load(src_ptr + offs, mask=keep, other=0)
        if dst_ptr.dtype.element_ty != src_ptr.dtype.element_ty:
            lost = keep & (val.to(dst_ptr.dtype.element_ty).to(val.dtype) != val)
            tl.atomic_or(errors_ptr, _RANGE, mask=tl.max(lost.to(tl.int32), axis=0) > 0)
        if PAD:
            tl.store(dst_ptr + offs, tl.where(keep, val, fill).to(dst_ptr.dtype.element_ty), mask=offs < limit)
        else:
            tl.store(dst_ptr + offs, val.to(dst_ptr.dtype.element_ty), mask=keep)

    @triton.jit(do_not_specialize=["n", "pad_to", "vocab_start", "vocab_end", "vocab_size", "num_media", "num_items",
                                   "b", "stride_mrope"])
    def stage_kernel(
        errors_ptr, ids_ptr, n, pad_to,
        # embeddings
        slab_ptr=None, table_ptr=None, media_ptr=None, media_index_ptr=None, items_ptr=None,
        vocab_start=0, vocab_end=0, vocab_size=0, num_media=0, num_items=0, text_scale=1.0,
        stride_slab=0, stride_table=0, stride_media=0,
        # integer slots
        pos_ptr=None, loc_ptr=None, mrope_ptr=None, seq_ptr=None, ext_ptr=None,
        ids_dst_ptr=None, pos_dst_ptr=None, loc_dst_ptr=None, mrope_dst_ptr=None, seq_dst_ptr=None,
        ext_dst_ptr=None, ntok_dst_ptr=None,
        b=0, batch_cap=0, stride_mrope=0, stride_mrope_dst=0,
        ids_fill=0, pos_fill=0, loc_fill=0, mrope_fill=0, seq_fill=0, ext_fill=0,
        EMBED: tl.constexpr = True, TOKENS: tl.constexpr = True,
        WIDTH: tl.constexpr = 1, TEXT_WIDTH: tl.constexpr = 1, MEDIA_WIDTH: tl.constexpr = 1,
        BLOCK: tl.constexpr = 16, COL_BLOCKS: tl.constexpr = 1,
        TEXT_TILED: tl.constexpr = False, MEDIA_TILED: tl.constexpr = False,
        MEDIA_MODE: tl.constexpr = 0, ITEM_BLOCKS: tl.constexpr = 1, ITEM_VEC: tl.constexpr = 1,
        ITEM_WHOLE: tl.constexpr = False,
        MEDIA_OWNER: tl.constexpr = True, HAS_SCALE: tl.constexpr = False,
        PAD_IDS: tl.constexpr = False, PAD_POS: tl.constexpr = False, PAD_LOC: tl.constexpr = False,
        PAD_MROPE: tl.constexpr = False, PAD_SEQ: tl.constexpr = False, PAD_EXT: tl.constexpr = False,
        HAS_LOC: tl.constexpr = False, HAS_MROPE: tl.constexpr = False, HAS_SEQ: tl.constexpr = False,
        HAS_EXT: tl.constexpr = False, REQ_BLOCK: tl.constexpr = 1,
    ):
        pid = tl.program_id(0)
        if EMBED:
            row = (pid // COL_BLOCKS).to(tl.int64)
            col0 = (pid % COL_BLOCKS) * BLOCK
        else:
            row = pid.to(tl.int64) * _TOK_BLOCK
            col0 = 0
        if EMBED:
            offs = tl.arange(0, BLOCK)
            cols = col0 + offs
            col_ok = cols < WIDTH
            live = row < n  # rows in [n, pad_to) are padding: zeros, nothing read

            tok = tl.load(ids_ptr + row, mask=live, other=0).to(tl.int64)
            if MEDIA_MODE != 0:
                mi = tl.load(media_index_ptr + row, mask=live, other=-1).to(tl.int64)
            else:
                mi = tl.zeros((), tl.int64) - 1
            is_media = live & (mi >= 0)
            is_text = live & (mi < 0)
            bad_id = is_text & ((tok < 0) | (tok >= vocab_size))
            bad_media = is_media & (mi >= num_media)
            read_text = is_text & (tok >= vocab_start) & (tok < vocab_end) & (tok < vocab_size)

            flag = (bad_id | bad_media) & (col0 == 0)  # one report per row
            tl.atomic_or(errors_ptr, tl.where(bad_id, _BAD_ID, _BAD_MEDIA), mask=flag)
            tl.atomic_add(errors_ptr + 1, 1, mask=flag)
            tl.atomic_min(errors_ptr + 2, row.to(tl.int32), mask=flag)

            if TEXT_TILED:  # the launcher made BLOCK divide TEXT_WIDTH: a piece stays contiguous
                t_cols = (col0 % TEXT_WIDTH) + offs
                t_mask = col_ok & read_text
            else:
                t_cols = cols
                t_mask = (cols < TEXT_WIDTH) & read_text
            t = tl.load(table_ptr + (tok - vocab_start) * stride_table + t_cols, mask=t_mask, other=0.0)
            if HAS_SCALE:
                t = t.to(tl.float32) * text_scale
            val = cast_to(t, slab_ptr.dtype.element_ty, _SOFT)
            # +0.0 wherever nothing was read, whatever the scale's sign (0 * -s is -0.0)
            val = tl.where(t_mask, val, 0.0).to(slab_ptr.dtype.element_ty)

            if MEDIA_MODE != 0 and MEDIA_OWNER:
                read_media = is_media & (mi < num_media)
                if MEDIA_TILED:
                    mcol0 = col0 % MEDIA_WIDTH
                    m_cols = mcol0 + offs
                    m_ok = col_ok
                else:
                    mcol0 = col0
                    m_cols = cols
                    m_ok = cols < MEDIA_WIDTH
                if MEDIA_MODE == 1:
                    m = tl.load(media_ptr + mi * stride_media + m_cols, mask=m_ok & read_media, other=0.0)
                else:
                    # the media row's item: how many items start at or before it, minus one
                    item = tl.zeros((), tl.int64) - 1
                    c = 0
                    while c < num_items:  # a while loop: the interpreter cannot range() over a runtime int
                        k = c + tl.arange(0, _ITEM_CHUNK)
                        starts = tl.load(items_ptr + k, mask=k < num_items, other=2**62)
                        item += tl.sum((starts <= mi).to(tl.int64), axis=0)
                        c += _ITEM_CHUNK
                    item = tl.maximum(item, 0)
                    first = tl.load(items_ptr + item, mask=read_media, other=0)
                    fields = items_ptr + num_items + item * (ITEM_BLOCKS * 4)
                    if ITEM_WHOLE:
                        # the host made BLOCK divide every block boundary: this program's columns lie in one
                        # column block of the item; pick its fields with scalar selects, then load once
                        addr = tl.zeros((), tl.int64)
                        stride = addr
                        c_lo = addr
                        found = mcol0 < 0
                        for j in tl.static_range(ITEM_BLOCKS):
                            lo = tl.load(fields + 4 * j + 2, mask=read_media, other=0)
                            hi = tl.load(fields + 4 * j + 3, mask=read_media, other=0)
                            hit = (mcol0 >= lo) & (mcol0 < hi)
                            addr = tl.where(hit, tl.load(fields + 4 * j, mask=read_media, other=0), addr)
                            stride = tl.where(hit, tl.load(fields + 4 * j + 1, mask=read_media, other=0), stride)
                            c_lo = tl.where(hit, lo, c_lo)
                            found = found | hit
                        base = addr.to(tl.pointer_type(media_ptr.dtype.element_ty))
                        start = (mi - first) * stride + (mcol0 - c_lo)
                        if ITEM_VEC > 1:
                            base = tl.multiple_of(base, 16)
                            start = tl.multiple_of(start, ITEM_VEC)
                        m = tl.load(base + start + offs, mask=m_ok & read_media & found, other=0.0)
                    else:
                        m = tl.zeros((BLOCK,), media_ptr.dtype.element_ty)
                        for j in tl.static_range(ITEM_BLOCKS):
                            addr = tl.load(fields + 4 * j, mask=read_media, other=0)
                            stride = tl.load(fields + 4 * j + 1, mask=read_media, other=0)
                            c_lo = tl.load(fields + 4 * j + 2, mask=read_media, other=0)
                            c_hi = tl.load(fields + 4 * j + 3, mask=read_media, other=0)
                            base = addr.to(tl.pointer_type(media_ptr.dtype.element_ty))
                            start = (mi - first) * stride + (mcol0 - c_lo)
                            if ITEM_VEC > 1:  # the host checked: addresses, row strides and block columns
                                # in 16-byte units (the bounds too: masks come in whole vectors, loads stay 16 B)
                                base = tl.multiple_of(base, 16)
                                start = tl.multiple_of(start, ITEM_VEC)
                                c_lo = tl.multiple_of(c_lo, ITEM_VEC)
                                c_hi = tl.multiple_of(c_hi, ITEM_VEC)
                            in_block = m_ok & read_media & (m_cols >= c_lo) & (m_cols < c_hi)
                            m = tl.where(in_block, tl.load(base + start + offs, mask=in_block, other=0.0), m)
                val = tl.where(is_media, cast_to(m, slab_ptr.dtype.element_ty, _SOFT), val)

            tl.store(slab_ptr + row * stride_slab + cols, val, mask=col_ok & (row < pad_to))

        if TOKENS:
            if (col0 == 0) & (row % _TOK_BLOCK == 0):  # one program per _TOK_BLOCK rows
                offs_t = row + tl.arange(0, _TOK_BLOCK)
                _copy_pad(ids_ptr, ids_dst_ptr, errors_ptr, offs_t, n, pad_to, ids_fill, PAD_IDS)
                _copy_pad(pos_ptr, pos_dst_ptr, errors_ptr, offs_t, n, pad_to, pos_fill, PAD_POS)
                if HAS_LOC:
                    _copy_pad(loc_ptr, loc_dst_ptr, errors_ptr, offs_t, n, pad_to, loc_fill, PAD_LOC)
                if HAS_MROPE:
                    for k in tl.static_range(3):
                        _copy_pad(mrope_ptr + k * stride_mrope, mrope_dst_ptr + k * stride_mrope_dst, errors_ptr,
                                  offs_t, n, pad_to, mrope_fill, PAD_MROPE)
                if row == 0:  # per-request slots and the token count: small, one program
                    req = tl.arange(0, REQ_BLOCK)
                    if HAS_SEQ:
                        _copy_pad(seq_ptr, seq_dst_ptr, errors_ptr, req, b, batch_cap, seq_fill, PAD_SEQ)
                    if HAS_EXT:
                        _copy_pad(ext_ptr, ext_dst_ptr, errors_ptr, req, b, batch_cap, ext_fill, PAD_EXT)
                    tl.store(ntok_dst_ptr, n.to(ntok_dst_ptr.dtype.element_ty))

    STAGE = FastLaunch(stage_kernel)
else:  # pragma: no cover
    stage_kernel = STAGE = None
