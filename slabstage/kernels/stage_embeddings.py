"""stage_embeddings: text rows gathered, media rows scattered, padding zeroed, one launch."""

from __future__ import annotations

from functools import partial

import torch

from ..checks import INT_DTYPES, check_tensor
from .errors import check_error_word, default_error_word, raise_if_errors
from .plan import ITEM_TABLES, check_embed, check_slab, embed_args, pack_host_inputs
from .reference import stage_embeddings_reference
from .runtime import use_triton
from .stage_kernel import MEDIA_ITEMS, STAGE

__all__ = ["stage_embeddings", "plan_stage_embeddings"]


def stage_embeddings(
    slab: torch.Tensor,
    input_ids: torch.Tensor,
    table: torch.Tensor,
    *,
    media=None,
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

    With ``n = len(input_ids)``: row ``r < n`` gets media row ``media_index[r]``
    when ``media_index[r] >= 0``, else ``table[input_ids[r]]`` (times
    ``text_scale``, computed in fp32, when given); rows ``[n, pad_to)`` get +0.0;
    rows past ``pad_to`` are not touched. Sources are cast to the slab's dtype.

    Args:
        slab: ``[rows, W]`` float16/bfloat16/float32, row stride exactly ``W``.
        input_ids: ``[n]`` int32/int64.
        table: ``[V, Ht]`` float, contiguous rows; ``Ht == W``, or narrower with ``expand``.
        media: one ``[M, Hm]`` tensor, or a list of items laid end to end, each a
            ``[rows_i, Hm]`` tensor or a tuple of column blocks ``(b0, ..., bk)``
            with equal rows whose widths add up to ``Hm`` (DeepStack: block 0 the
            embeddings, block i level i-1). Items share one dtype; they may be
            strided along rows and may sit in pinned host memory (read directly).
            ``Hm == W``, or ``Hm == Ht`` with ``expand``.
        media_index: ``[n]`` int32/int64; ``-1`` (any negative) marks a text row.
        pad_to: rows to write in all, ``n <= pad_to <= rows`` (default ``n``).
        expand: how a source narrower than ``W`` fills the row: ``"zeros"`` or
            ``"repeat"`` (tiled; ``W`` must be a multiple of the source width).
        text_scale: a finite float.
        vocab_range: ``(start, end)``: the table holds vocabulary rows
            ``start..end-1`` (vocab-parallel shard); other valid ids give zero rows.
        vocab_size: the whole vocabulary's size, for the bad-id check (default:
            ``end`` of ``vocab_range``, else ``len(table)``).
        media_owner: ``False`` writes zeros at media rows (the rank that does not
            own media under tensor parallelism).
        errors: the device error word (:func:`new_error_word`); default: the
            word of the slab's device.
        strict: check the error word at once and raise (synchronises; for debugging).

    A text id outside ``[0, vocab_size)`` or a media index past the media rows
    zero-fills the row and sets the error word; nothing is read out of bounds.
    Every argument is checked before anything is written: ``TypeError`` /
    ``ValueError`` (``WidthContractError`` for widths). Returns ``slab``. One
    kernel launch (plus, for items, one host-to-device copy of their table,
    skipped when the same items were staged before on this stream), no host sync
    unless ``strict``.
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
    """Check every argument of :func:`stage_embeddings`; return its launch as a callable, not yet run.

    Lets a caller validate several staging steps before any of them writes.
    """
    check_slab(slab)
    device = slab.device
    check_tensor("input_ids", input_ids, dtypes=INT_DTYPES, device=device, dims=1)
    n = input_ids.shape[0]
    pad_to, plan, bounds, scale = check_embed(
        slab, table, n, media=media, media_index=media_index, pad_to=pad_to, expand=expand, text_scale=text_scale,
        vocab_range=vocab_range, vocab_size=vocab_size, media_owner=media_owner)
    errors = default_error_word(device) if errors is None else errors
    check_error_word(errors, device)
    if not use_triton(slab):
        return partial(stage_embeddings_reference, slab, input_ids, table, plan, media_index, pad_to=pad_to,
                       expand=expand, text_scale=scale, bounds=bounds, media_owner=media_owner, errors=errors)
    args, constexprs, cols, num_warps = embed_args(slab, table, plan, bounds, scale, expand=expand,
                                                   media_owner=media_owner, has_index=media_index is not None)
    args.update(errors_ptr=errors, ids_ptr=input_ids, n=n, pad_to=pad_to)
    if media_index is not None:
        args["media_index_ptr"] = media_index
    constexprs["TOKENS"] = False
    return partial(_launch, pad_to * cols, args, constexprs, num_warps, plan)


def _launch(grid0: int, args: dict, constexprs: dict, num_warps: int, plan) -> None:
    if not grid0:
        return
    if plan is not None and plan.mode == MEDIA_ITEMS:
        device = args["slab_ptr"].device
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():  # the graph owns its own copy
            table = pack_host_inputs(device, {"items_ptr": plan.table})["items_ptr"]
        else:
            stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else None
            table = ITEM_TABLES.get(device, plan.table, stream)
        args = {**args, "items_ptr": table}
    STAGE(grid0, args, constexprs, num_warps)
