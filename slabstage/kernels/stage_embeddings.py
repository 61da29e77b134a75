"""stage_embeddings: text rows gathered, media rows scattered, padding zeroed, one launch."""

from __future__ import annotations

import numbers
from functools import partial

import torch

from ..staging.width import check_source_width
from ._launch import FastLaunch, int_spec
from ._triton import FLOAT_DTYPES, SOFT_CASTS, cast_to, row_launch_config, tl, triton, use_triton
from .errors import BAD_MEDIA_INDEX, BAD_TOKEN_ID, check_error_word, default_error_word, raise_if_errors
from .reference import stage_embeddings_reference

__all__ = ["stage_embeddings", "plan_stage_embeddings"]

if triton is not None:

    @triton.jit
    def _embed_row(
        pid, slab_ptr, ids_ptr, table_ptr, media_ptr, media_index_ptr, errors_ptr,
        n, pad_to, vocab_start, vocab_end, vocab_size, num_media, text_scale,
        stride_slab, stride_table, stride_media,
        WIDTH: tl.constexpr, TEXT_WIDTH: tl.constexpr, MEDIA_WIDTH: tl.constexpr,
        BLOCK: tl.constexpr, COL_BLOCKS: tl.constexpr,
        TEXT_TILED: tl.constexpr, MEDIA_TILED: tl.constexpr,
        HAS_MEDIA: tl.constexpr, MEDIA_OWNER: tl.constexpr, HAS_SCALE: tl.constexpr,
        SOFT: tl.constexpr, BAD_ID_CODE: tl.constexpr, BAD_MEDIA_CODE: tl.constexpr,
    ):
        """Program ``pid`` of the staging grid: BLOCK columns of one slab row."""
        # The COL_BLOCKS pieces of a row are neighbours in launch order, so a tiled
        # source is re-read from L2, not from memory.
        row = (pid // COL_BLOCKS).to(tl.int64)
        col0 = (pid % COL_BLOCKS) * BLOCK
        offs = tl.arange(0, BLOCK)
        cols = col0 + offs
        col_ok = cols < WIDTH
        live = row < n  # rows in [n, pad_to) are padding: zeros, nothing read

        tok = tl.load(ids_ptr + row, mask=live, other=0).to(tl.int64)
        if HAS_MEDIA:
            mi = tl.load(media_index_ptr + row, mask=live, other=-1).to(tl.int64)
        else:
            mi = tl.zeros((), tl.int64) - 1
        is_media = live & (mi >= 0)
        is_text = live & (mi < 0)
        bad_id = is_text & ((tok < 0) | (tok >= vocab_size))
        bad_media = is_media & (mi >= num_media)
        read_text = is_text & (tok >= vocab_start) & (tok < vocab_end) & (tok < vocab_size)

        flag = (bad_id | bad_media) & (col0 == 0)  # one report per row
        code = tl.where(bad_id, BAD_ID_CODE, BAD_MEDIA_CODE)
        tl.atomic_or(errors_ptr, code, mask=flag)
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
        val = cast_to(t, slab_ptr.dtype.element_ty, SOFT)

        if HAS_MEDIA and MEDIA_OWNER:
            read_media = is_media & (mi < num_media)
            if MEDIA_TILED:
                m_cols = (col0 % MEDIA_WIDTH) + offs
                m_mask = col_ok & read_media
            else:
                m_cols = cols
                m_mask = (cols < MEDIA_WIDTH) & read_media
            m = tl.load(media_ptr + mi * stride_media + m_cols, mask=m_mask, other=0.0)
            val = tl.where(is_media, cast_to(m, slab_ptr.dtype.element_ty, SOFT), val)

        tl.store(slab_ptr + row * stride_slab + cols, val, mask=col_ok)

    @triton.jit(do_not_specialize=["n", "pad_to", "vocab_start", "vocab_end", "vocab_size", "num_media"])
    def _stage_embeddings_kernel(
        slab_ptr, ids_ptr, table_ptr, media_ptr, media_index_ptr, errors_ptr,
        n, pad_to, vocab_start, vocab_end, vocab_size, num_media, text_scale,
        stride_slab, stride_table, stride_media,
        WIDTH: tl.constexpr, TEXT_WIDTH: tl.constexpr, MEDIA_WIDTH: tl.constexpr,
        BLOCK: tl.constexpr, COL_BLOCKS: tl.constexpr,
        TEXT_TILED: tl.constexpr, MEDIA_TILED: tl.constexpr,
        HAS_MEDIA: tl.constexpr, MEDIA_OWNER: tl.constexpr, HAS_SCALE: tl.constexpr,
        SOFT: tl.constexpr, BAD_ID_CODE: tl.constexpr, BAD_MEDIA_CODE: tl.constexpr,
    ):
        _embed_row(
            tl.program_id(0), slab_ptr, ids_ptr, table_ptr, media_ptr, media_index_ptr, errors_ptr,
            n, pad_to, vocab_start, vocab_end, vocab_size, num_media, text_scale,
            stride_slab, stride_table, stride_media,
            WIDTH, TEXT_WIDTH, MEDIA_WIDTH, BLOCK, COL_BLOCKS, TEXT_TILED, MEDIA_TILED,
            HAS_MEDIA, MEDIA_OWNER, HAS_SCALE, SOFT, BAD_ID_CODE, BAD_MEDIA_CODE)


def _is_int(x: object) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def vocab_bounds(vocab_range, vocab_size, table_rows: int) -> tuple[int, int, int]:
    """``(vocab_start, vocab_end, vocab_size)`` checked against a table of ``table_rows`` rows."""
    if vocab_range is None:
        vocab_start, vocab_end = 0, table_rows
    else:
        if (not isinstance(vocab_range, (tuple, list)) or len(vocab_range) != 2
                or not all(_is_int(v) for v in vocab_range)):
            raise ValueError(f"vocab_range must be a (start, end) pair of ints, got {vocab_range!r}")
        vocab_start, vocab_end = int(vocab_range[0]), int(vocab_range[1])
        if not 0 <= vocab_start <= vocab_end or vocab_end - vocab_start > table_rows:
            raise ValueError(f"vocab_range {vocab_range!r} needs 0 <= start <= end and end - start <= "
                             f"{table_rows} table rows")
    if vocab_size is None:
        vocab_size = vocab_end
    elif not _is_int(vocab_size) or vocab_size < vocab_end:
        raise ValueError(f"vocab_size must be an int >= vocab end {vocab_end}, got {vocab_size!r}")
    return vocab_start, vocab_end, int(vocab_size)


def _check_source(name: str, t: object, device: torch.device, *, floating: bool, dims: int) -> None:
    """Raise TypeError/ValueError when ``t`` is not a valid ``name`` argument; each attribute is read once."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    allowed = FLOAT_DTYPES if floating else (torch.int32, torch.int64)
    if t.dtype not in allowed:
        raise TypeError(f"{name} dtype must be one of {', '.join(str(d) for d in allowed)}, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but the slab is on {device}: all inputs must share one device")
    if t.dim() != dims:
        what = "2-D [rows, width]" if dims == 2 else "1-D"
        raise ValueError(f"{name} must be {what}, got shape {tuple(t.shape)}")
    if t.stride(-1) != 1 and t.shape[-1] > 1:
        raise ValueError(f"{name} must be contiguous along its last axis, got stride {t.stride()}")


def stage_embeddings(
    slab: torch.Tensor,
    input_ids: torch.Tensor,
    table: torch.Tensor,
    *,
    media: torch.Tensor | None = None,
    media_index: torch.Tensor | None = None,
    pad_to: int | None = None,
    expand: str = "zeros",
    text_scale: float | None = None,
    vocab_range: tuple[int, int] | None = None,
    vocab_size: int | None = None,
    media_owner: bool = True,
    errors: torch.Tensor | None = None,
    strict: bool = False,
) -> torch.Tensor:
    """Write one prefill batch's embeddings into ``slab`` and zero its padding.

    With ``n = len(input_ids)``: row ``r < n`` gets ``media[media_index[r]]`` when
    ``media_index[r] >= 0``, else ``table[input_ids[r]]`` (times ``text_scale``,
    computed in fp32, when given); rows ``[n, pad_to)`` get zeros; rows past
    ``pad_to`` are not touched. Sources are cast to the slab's dtype.

    Args:
        slab: ``[rows, W]`` float, row stride exactly ``W`` (the ``input_embeds`` slot).
        input_ids: ``[n]`` int32/int64.
        table: ``[V, Ht]`` float, contiguous rows; ``Ht <= W``.
        media: ``[M, Hm]`` float, contiguous rows; ``Hm <= W``.
        media_index: ``[n]`` int32/int64; ``-1`` (any negative) marks a text row.
        pad_to: rows to write in all, ``n <= pad_to <= rows`` (default ``n``).
        expand: how a source narrower than ``W`` fills the row: ``"zeros"`` or
            ``"repeat"`` (tiled; ``W`` must be a multiple of the source width).
        vocab_range: ``(start, end)``: the table holds vocabulary rows
            ``start..end-1`` (vocab-parallel shard); other valid ids give zero rows.
        vocab_size: the whole vocabulary's size, for the bad-id check (default:
            ``end`` of ``vocab_range``, else ``len(table)``).
        media_owner: ``False`` writes zeros at media rows (the rank that does not
            own media under tensor parallelism).
        errors: the device error word (:func:`new_error_word`); default: a
            module-level word per device.
        strict: check the error word at once and raise (synchronises; for debugging).

    A text id outside ``[0, vocab_size)`` or a media index ``>= M`` zero-fills the
    row and sets the error word; nothing is read out of bounds. Host-side checks
    raise ``TypeError``/``ValueError`` (``WidthContractError`` for widths) before
    anything is written. Returns ``slab``. One kernel launch, no host sync unless
    ``strict``.
    """
    plan_stage_embeddings(
        slab, input_ids, table, media=media, media_index=media_index, pad_to=pad_to, expand=expand,
        text_scale=text_scale, vocab_range=vocab_range, vocab_size=vocab_size, media_owner=media_owner,
        errors=errors)()
    if strict:
        raise_if_errors(errors if errors is not None else default_error_word(slab.device))
    return slab


def plan_stage_embeddings(slab, input_ids, table, *, media=None, media_index=None, pad_to=None, expand="zeros",
                          text_scale=None, vocab_range=None, vocab_size=None, media_owner=True, errors=None):
    """Check every argument of :func:`stage_embeddings` and return the launch, not yet run.

    Lets a caller validate several staging steps before any of them writes.
    """
    parts = embeddings_launch(slab, input_ids, table, media=media, media_index=media_index, pad_to=pad_to,
                              expand=expand, text_scale=text_scale, vocab_range=vocab_range, vocab_size=vocab_size,
                              media_owner=media_owner, errors=errors)
    if callable(parts):
        return parts
    grid0, key, args, constexprs, num_warps = parts
    return partial(_launch, (grid0,), key, args, constexprs, num_warps) if grid0 else _nothing


def embeddings_launch(slab, input_ids, table, *, media=None, media_index=None, pad_to=None, expand="zeros",
                      text_scale=None, vocab_range=None, vocab_size=None, media_owner=True, errors=None,
                      check_ids_device: bool = True):
    """Checks, then ``(grid0, key, args, constexprs, num_warps)`` for the Triton kernel or a reference partial.

    ``check_ids_device=False`` lets ``input_ids``/``media_index`` stay on the host
    (the fused batch launch moves them itself); they are then not dereferenced here.
    """
    if not isinstance(slab, torch.Tensor):
        raise TypeError(f"slab must be a torch.Tensor, got {type(slab).__name__}")
    device = slab.device
    if slab.dtype not in FLOAT_DTYPES or slab.dim() != 2:
        raise ValueError(f"slab must be a 2-D float16/bfloat16/float32 tensor [rows, width], "
                         f"got {slab.dtype} {tuple(slab.shape)}")
    rows, width = slab.shape
    if slab.stride() != (width, 1):
        raise ValueError(f"slab rows must be contiguous with stride ({width}, 1), got {slab.stride()}")
    _check_source("input_ids", input_ids, device if check_ids_device else input_ids.device, floating=False, dims=1)
    n = input_ids.shape[0]
    _check_source("table", table, device, floating=True, dims=2)
    if expand != "zeros" and expand != "repeat":
        raise ValueError(f'expand must be "zeros" or "repeat", got {expand!r}')
    text_width = table.shape[1]
    if text_width != width:
        check_source_width("table", text_width, width, expand)
    media_width = width
    if media is not None:
        _check_source("media", media, device, floating=True, dims=2)
        media_width = media.shape[1]
        if media_width != width:
            check_source_width("media", media_width, width, expand)
        if media_index is None:
            raise ValueError("media was given without media_index: say which rows are media rows")
    if media_index is not None:
        _check_source("media_index", media_index, device if check_ids_device else media_index.device,
                      floating=False, dims=1)
        if media_index.shape[0] != n:
            raise ValueError(f"media_index has {media_index.shape[0]} entries but input_ids has {n}: one per token")
    if pad_to is None:
        pad_to = n
    elif not _is_int(pad_to) or not n <= pad_to <= rows:
        raise ValueError(f"pad_to must be an int in [n={n}, slab rows={rows}], got {pad_to!r}")
    if n > rows:
        raise ValueError(f"{n} tokens exceed the slab's {rows} rows")
    if text_scale is not None and (isinstance(text_scale, bool) or not isinstance(text_scale, numbers.Real)):
        raise TypeError(f"text_scale must be a float or None, got {text_scale!r}")
    vocab_start, vocab_end, vocab_size = vocab_bounds(vocab_range, vocab_size, table.shape[0])
    if errors is None:
        errors = default_error_word(device)
    else:
        check_error_word(errors, device)

    if use_triton(slab):
        has_media = media is not None
        text_tiled = expand == "repeat" and text_width < width
        media_tiled = has_media and expand == "repeat" and media_width < width
        tiled = (text_width,) * text_tiled + (media_width,) * media_tiled
        block, num_warps = row_launch_config(width, slab.element_size(), divides=tiled)
        col_blocks = (width + block - 1) // block
        media_arg = media if has_media else slab
        index_arg = media_index if media_index is not None else input_ids
        table_stride = table.stride(0)
        media_stride = media_arg.stride(0)
        args = (slab, input_ids, table, media_arg, index_arg, errors,
                n, pad_to, vocab_start, vocab_end, vocab_size, media.shape[0] if has_media else 0,
                float(text_scale) if text_scale is not None else 1.0,
                width, table_stride, media_stride)
        constexprs = dict(
            WIDTH=width, TEXT_WIDTH=text_width, MEDIA_WIDTH=media_width, BLOCK=block, COL_BLOCKS=col_blocks,
            TEXT_TILED=text_tiled, MEDIA_TILED=media_tiled, HAS_MEDIA=media_index is not None,
            MEDIA_OWNER=bool(media_owner) and has_media, HAS_SCALE=text_scale is not None, SOFT=SOFT_CASTS,
            BAD_ID_CODE=BAD_TOKEN_ID, BAD_MEDIA_CODE=BAD_MEDIA_INDEX)
        key = embeddings_key(args) if check_ids_device else None  # fused path keys itself
        return pad_to * col_blocks, key, args, constexprs, num_warps
    return partial(
        stage_embeddings_reference,
        slab, input_ids, table, media if media_index is not None else None, media_index, pad_to=pad_to,
        expand=expand, text_scale=text_scale, vocab_start=vocab_start, vocab_end=vocab_end,
        vocab_size=vocab_size, media_owner=bool(media_owner), errors=errors)


def embeddings_key(args: tuple):
    """What Triton specialises the embeddings launch on; None when a pointer is not 16-byte aligned."""
    slab, ids, table, media, index, errors = args[:6]
    if (slab.data_ptr() | ids.data_ptr() | table.data_ptr() | media.data_ptr() | index.data_ptr()
            | errors.data_ptr()) & 15:
        return None
    return (slab.dtype, ids.dtype, table.dtype, media.dtype, index.dtype, int_spec(args[13]), int_spec(args[14]),
            int_spec(args[15]))  # FastLaunch adds the constexprs and num_warps


def _nothing() -> None:
    return None


_launch = FastLaunch(_stage_embeddings_kernel, ptr_args=(0, 1, 2, 3, 4, 5)) if triton is not None else None
