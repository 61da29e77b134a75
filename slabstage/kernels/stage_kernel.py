"""The staging kernel: a batch's embeddings and integer slots, read from one parameter record
(:mod:`slabstage.kernels.layout`; docs/design.md, "One kernel, one parameter record").

Launch arguments are fixed for a set of destinations (the parameter record, the error word, the slab);
constexprs are what the destinations fix: the slab's width and dtype, the columns of a row one program writes
(``BLOCK``, Triton's block size), how many integer slots there are.

Grid (:func:`grid_size`): first ``NUM_SLOTS`` programs per ``TOKEN_ROWS`` rows of ``pad_to`` (at least one
block), program ``i`` of them writing rows ``[(i // NUM_SLOTS) * TOKEN_ROWS, ...)`` of integer slot ``i % NUM_SLOTS``
(the first block's also the per-request slots and the token count); then, with ``EMBED``, ``pad_to *
ROW_PROGRAMS`` programs, one per ``BLOCK`` columns of a slab row (programs past them write nothing). A slot's
chain of dependent loads runs in a program of its own, in the launch's first wave, beside the slab rows' rather
than before one of them. Program 0 stores the step number into the ring's ``done`` word. In a graph's record
every program counts itself on the ticket (``H_TICKET``) once it has read ``H_LIVE``.

Registers decide the speed: the kernel's registers are those of its largest arm, so the arm without the host's
16-byte promise (``F_TEXT_VEC``, ``F_MEDIA_VEC``: one address per element) walks its piece ``PIECE`` columns at
a time (at 4096 bf16 columns and 4 warps, over the whole ``BLOCK`` it would take 218 registers a thread: 2
programs an SM, half the copy ceiling).
"""

from __future__ import annotations

from .layout import TOKEN_ROWS, device as K
from .embed_rows import media_row, media_row_vec, text_row
from .runtime import count_in, count_out, gdc_wait, next_pow2, row_launch_config, tl, triton
from .slot_rows import copy_pad, ints, mrope_rows, store_ints

__all__ = ["stage_kernel", "launch_settings", "grid_size"]


def launch_settings(width: int | None, elem_bytes: int | None, num_slots: int, req_rows: int) -> tuple[dict, int]:
    """``(constexprs, num_warps)`` of :func:`stage_kernel` for a slab of ``width`` columns of ``elem_bytes``
    bytes (``None``: no slab), ``num_slots`` integer slots and a per-request slot of ``req_rows`` rows."""
    if width is None:
        block, num_warps, piece = 16, 4, 16
    else:
        block, num_warps = row_launch_config(width, elem_bytes)
        piece = min(block, 32 * num_warps * 8 // elem_bytes)  # unpromised loads: 8 bytes a thread at a time
    return dict(EMBED=width is not None, WIDTH=width or 1, BLOCK=block, ROW_PROGRAMS=-(-(width or 1) // block),
                NUM_SLOTS=num_slots, REQ_BLOCK=next_pow2(req_rows), PIECE=piece, PDL=False), num_warps


def grid_size(pad_to: int, num_slots: int, row_programs: int) -> int:
    """Programs of a :func:`stage_kernel` launch for ``pad_to`` rows: ``num_slots`` a ``TOKEN_ROWS`` block of
    them (one block at least), then ``row_programs`` a slab row (0: no slab)."""
    return -(-max(pad_to, 1) // TOKEN_ROWS) * num_slots + pad_to * row_programs  # (host ints: no constexpr)


if triton is not None:
    _KEY = K.KEY  # (the one global the kernels read: see slabstage.kernels.layout)

    @triton.jit
    def stage_kernel(params_ptr, errors_ptr, slab_ptr,
                     EMBED: tl.constexpr, WIDTH: tl.constexpr, BLOCK: tl.constexpr, ROW_PROGRAMS: tl.constexpr,
                     NUM_SLOTS: tl.constexpr, REQ_BLOCK: tl.constexpr, PIECE: tl.constexpr, PDL: tl.constexpr):
        tl.static_assert(_KEY >= 0)  # (reads the layout constants' checksum: see slabstage.kernels.layout)
        if PDL:  # launched before the work ahead of it completes (the record's copy): wait for it first
            gdc_wait()
        pid = tl.program_id(0)
        fresh = tl.load(params_ptr + K.H_LIVE)  # 1; 0: a replay with no record of its own, which writes nothing
        n = tl.load(params_ptr + K.H_N) * fresh
        pad_to = tl.load(params_ptr + K.H_PAD_TO) * fresh  # rows past it are left alone: a grid may cover more
        ticket = tl.load(params_ptr + K.H_TICKET)  # (a graph's record: see slabstage.kernels.layout, H_TICKET)
        if K.PTX:  # the count taken now, once H_LIVE is read (its register an operand), read at the end
            counted = count_in(ticket, fresh)
        if pid == 0:
            if fresh != 0:  # the step's ring slot has been copied and read: the host may write it again
                tl.store(tl.load(params_ptr + K.H_DONE).to(tl.pointer_type(tl.int64)), tl.load(params_ptr + K.H_STEP))
        slot_programs = 0
        if NUM_SLOTS > 0:
            # program i < slot_programs writes integer slot i % NUM_SLOTS, rows [tok0, tok0 + TOKEN_ROWS): the
            # grid's first programs, so that their chains of dependent loads run in the launch's first wave, each
            # in a program of its own
            slot_programs = tl.cdiv(tl.maximum(pad_to, 1), K.TOKEN_ROWS) * NUM_SLOTS * fresh
            if pid < slot_programs:
                tok0 = (pid // NUM_SLOTS).to(tl.int64) * K.TOKEN_ROWS
                offs_t = tok0 + tl.arange(0, K.TOKEN_ROWS)
                this = pid % NUM_SLOTS
                sd = params_ptr + K.HEADER_WORDS + this * K.SOURCE_WORDS
                dd = params_ptr + K.HEADER_WORDS + NUM_SLOTS * K.SOURCE_WORDS + this * K.DEST_WORDS
                kind = tl.load(dd + K.D_KIND)
                if tl.load(dd + K.D_DTYPE) != K.NO_INPUT:  # a slot this stager writes
                    if kind == K.COUNT:
                        if tok0 == 0:
                            store_ints(tl.load(dd + K.D_ADDR), tl.load(dd + K.D_DTYPE), 0, n, True)
                    elif tl.load(sd + K.S_DTYPE) != K.NO_INPUT:  # a source this batch gives
                        if kind == K.REQUESTS:
                            if tok0 == 0:
                                copy_pad(sd, dd, errors_ptr, tl.arange(0, REQ_BLOCK), tl.load(params_ptr + K.H_B),
                                          tl.load(dd + K.D_LENGTH), 0)
                        elif tl.load(sd + K.S_DTYPE) == K.LAYOUT_CODE:  # mrope positions from their layout
                            mrope_rows(sd, dd, errors_ptr, offs_t, n, pad_to)
                        else:
                            r = 0
                            rows = tl.load(dd + K.D_ROWS)
                            while r < rows:
                                copy_pad(sd, dd, errors_ptr, offs_t, n, pad_to, r)
                                r += 1

        if EMBED:
            # the slab's programs follow the slots'; a slot's program stages no slab row (row pad_to: past them)
            e = pid - slot_programs
            row = tl.where(e >= 0, e // ROW_PROGRAMS, pad_to).to(tl.int64)
            col0 = (tl.maximum(e, 0) % ROW_PROGRAMS * BLOCK).to(tl.int64)
            OUT: tl.constexpr = slab_ptr.dtype.element_ty
            # the header words that sort the row, loaded before any branch (one round trip to the cache); an
            # arm loads its own from the lines these brought in, so that only the arm that runs holds them
            flags = tl.load(params_ptr + K.H_FLAGS).to(tl.int32)
            ids, ids_code = tl.load(params_ptr + K.H_IDS), tl.load(params_ptr + K.H_IDS_DTYPE).to(tl.int32)
            index, index_code = tl.load(params_ptr + K.H_INDEX), tl.load(params_ptr + K.H_INDEX_DTYPE).to(tl.int32)
            vocab_start, vocab_end = tl.load(params_ptr + K.H_VOCAB_START), tl.load(params_ptr + K.H_VOCAB_END)
            vocab_size, num_media = tl.load(params_ptr + K.H_VOCAB_SIZE), tl.load(params_ptr + K.H_NUM_MEDIA)

            offs = tl.arange(0, BLOCK)
            cols = col0 + offs
            col_ok = cols < WIDTH
            live = row < n  # rows in [n, pad_to) are padding: zeros, nothing read
            tok = ints(ids, ids_code, row, live, 0)
            mi = ints(index, index_code, row, live & (index_code != K.NO_INPUT), -1)  # the batch may have no index
            is_media = live & (mi >= 0)
            is_text = live & (mi < 0)
            bad_id = is_text & ((tok < 0) | (tok >= vocab_size))
            bad_media = is_media & (mi >= num_media)
            read_text = is_text & (tok >= vocab_start) & (tok < vocab_end) & (tok < vocab_size)

            flag = (bad_id | bad_media) & (col0 == 0)  # one report per row
            tl.atomic_or(errors_ptr + K.ERROR_CODES, tl.where(bad_id, K.BAD_TOKEN_ID, K.BAD_MEDIA_INDEX), mask=flag)
            tl.atomic_add(errors_ptr + K.ERROR_ROWS, 1, mask=flag)
            tl.atomic_min(errors_ptr + K.ERROR_FIRST_ROW, row.to(tl.int32), mask=flag)

            # a row is media, text or zeros, the same for every column: one arm runs, and only its values live.
            # Unpromised loads are one element wide, an address each: that arm walks the piece PIECE columns
            # at a time, so it holds no more registers than the vector arm (registers bound the loads in flight).
            if row < pad_to:  # (not so for program 0 of a grid of one at pad_to = 0, and past pad_to)
                dst = slab_ptr + row * WIDTH
                read_media = is_media & (mi < num_media) & ((flags & K.F_MEDIA) != 0)  # else a media row is zeros
                if read_media:
                    num_items, nblocks = tl.load(params_ptr + K.H_NUM_ITEMS), tl.load(params_ptr + K.H_ITEM_BLOCKS)
                    mcode = tl.load(params_ptr + K.H_MEDIA_DTYPE).to(tl.int32)
                    mwidth = tl.load(params_ptr + K.H_MEDIA_WIDTH)
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
                    fields = items + num_items + item * (nblocks * K.COLUMN_BLOCK_WORDS)  # its column blocks' fields
                    if (flags & K.F_MEDIA_VEC) != 0:
                        # (a piece under 8 columns is a whole row: its one vector's store stops at WIDTH)
                        VECTORS: tl.constexpr = (BLOCK + 7) // 8
                        m = media_row_vec(fields, nblocks, in_item, tl.multiple_of(mwidth, 8), mcode, col0, read_media,
                                          flags, WIDTH, VECTORS, OUT, K.SOFT_CASTS)
                        at = col0 + tl.arange(0, VECTORS)[:, None] * 8 + tl.arange(0, 8)[None, :]
                        tl.store(dst + at, m, mask=at < WIDTH)
                    else:
                        for p in range(0, BLOCK, PIECE):
                            po = tl.arange(0, PIECE)
                            ok = col0 + p + po < WIDTH
                            m = media_row(fields, nblocks, in_item, mwidth, mcode, col0 + p, po, read_media, ok, flags,
                                          OUT, K.SOFT_CASTS)
                            tl.store(dst + col0 + p + po, m, mask=ok)
                elif read_text:
                    table, tstride = tl.load(params_ptr + K.H_TABLE), tl.load(params_ptr + K.H_TABLE_STRIDE)
                    twidth = tl.load(params_ptr + K.H_TABLE_WIDTH)
                    tcode = tl.load(params_ptr + K.H_TABLE_DTYPE).to(tl.int32)
                    scale = tl.load(params_ptr + K.H_SCALE).to(tl.int32).to(tl.float32, bitcast=True)
                    rel = tok - vocab_start
                    if (flags & K.F_TEXT_VEC) != 0:
                        t = text_row(table, rel, tl.multiple_of(tstride, 8), tl.multiple_of(twidth, 8), tcode, col0,
                                      offs, col_ok, flags, scale, OUT, True, K.SOFT_CASTS)
                        tl.store(dst + cols, t, mask=col_ok)
                    else:
                        for p in range(0, BLOCK, PIECE):
                            po = tl.arange(0, PIECE)
                            ok = col0 + p + po < WIDTH
                            t = text_row(table, rel, tstride, twidth, tcode, col0 + p, po, ok, flags, scale, OUT,
                                          False, K.SOFT_CASTS)
                            tl.store(dst + col0 + p + po, t, mask=ok)
                else:  # padding, a bad or another rank's id, a bad media index, media another rank owns
                    tl.store(dst + cols, tl.zeros((BLOCK,), OUT), mask=col_ok)

        # The ticket: the one record word a launch writes is H_LIVE, so a program may count once it has read
        # H_LIVE, and the count is relaxed (no fence: nothing waits for this program's stores)
        if ticket != 0:
            if K.PTX:
                count_out(counted, tl.num_programs(0) - 1, (params_ptr + K.H_LIVE).to(tl.int64), ticket)
            else:
                ticket_ptr = ticket.to(tl.pointer_type(tl.int32))
                if tl.atomic_add(ticket_ptr, 1, sem="relaxed") == tl.num_programs(0) - 1:
                    tl.store(params_ptr + K.H_LIVE, 0)
                    tl.store(ticket_ptr, 0)
else:  # pragma: no cover
    stage_kernel = None
