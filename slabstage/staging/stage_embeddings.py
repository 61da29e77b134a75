"""stage_embeddings: text rows gathered, media rows scattered, padding zeroed, one launch (through the stager of
the slab's storage: :mod:`slabstage.staging.op_stagers`).

Kernel: ``slabstage/kernels/stage_kernel.py::stage_kernel`` (every staging path's); PyTorch reference:
:func:`slabstage.staging.reference.stage_embeddings_reference`; tests: ``tests/ops/test_stage_embeddings.py``;
benchmark: ``bench/bench_stage_embeddings.py``.
"""

from __future__ import annotations

import torch

from .errors import default_error_word, raise_if_errors
from .op_stagers import slab_stager
from .validate import Inputs

__all__ = ["stage_embeddings"]


def stage_embeddings(slab: torch.Tensor, input_ids: torch.Tensor, table: torch.Tensor, *, media=None,
                     media_index: torch.Tensor | None = None, pad_to: int | None = None, expand: str = "zeros",
                     text_scale: float | None = None, vocab_range: tuple[int, int] | None = None,
                     vocab_size: int | None = None, media_owner: bool = True, errors: torch.Tensor | None = None,
                     strict: bool = False) -> torch.Tensor:
    """Write one prefill batch's embeddings into ``slab`` and zero its padding.

    With ``n = len(input_ids)``: row ``r < n`` gets media row ``media_index[r]``
    when ``media_index[r] >= 0``, else ``table[input_ids[r]]`` (times
    ``text_scale``, computed in fp32, when given); rows ``[n, pad_to)`` get +0.0;
    rows past ``pad_to`` are not touched. Sources are cast to the slab's dtype.

    Args:
        slab: ``[rows, W]`` float16/bfloat16/float32, row stride exactly ``W``.
        input_ids: ``[n]`` int32/int64, on the slab's device.
        table: ``[V, Ht]`` float, contiguous rows; ``Ht == W``, or narrower with ``expand``.
        media: one ``[M, Hm]`` tensor, or a list of items laid end to end, each a
            ``[rows_i, Hm]`` tensor or a tuple of column blocks ``(b0, ..., bk)``
            with equal rows whose widths add up to ``Hm`` (DeepStack: block 0 the
            embeddings, block i level i-1). Items share one dtype; they may be
            strided along rows and may sit in pinned host memory (read directly).
            ``Hm == W``, or ``Hm == Ht`` with ``expand``.
        media_index: ``[n]`` int32/int64 on the slab's device; ``-1`` (any negative) marks a text row.
        pad_to: rows to write in all, ``n <= pad_to <= rows`` (default ``n``).
        expand: how a source narrower than ``W`` fills the row: ``"zeros"`` or ``"repeat"`` (tiled; ``W``
            a multiple of the source width).
        text_scale: a finite number that float32 holds (past its range: ``ValueError``).
        vocab_range: ``(start, end)``: the table holds vocabulary rows ``start..end-1`` (vocab-parallel
            shard); other valid ids give zero rows.
        vocab_size: the whole vocabulary's size, for the bad-id check (default: ``end`` of ``vocab_range``,
            else ``len(table)``).
        media_owner: ``False`` writes zeros at media rows (a rank that does not own media under TP).
        errors: the device error word (:func:`new_error_word`); default: the word of the slab's device.
        strict: check the error word at once and raise (synchronises; for debugging).

    A text id outside ``[0, vocab_size)`` or a media index past the media rows zero-fills the row and sets the
    error word; nothing is read out of bounds. Every argument is checked before anything is written:
    ``TypeError`` / ``ValueError`` (``WidthContractError`` for widths). Returns ``slab``. One host-to-device
    copy of the parameter record and one kernel launch on the current stream, no host sync unless ``strict``.
    """
    if errors is None:
        errors = default_error_word(slab.device) if isinstance(slab, torch.Tensor) else None
    src = Inputs(input_ids=input_ids, table=table, media=media, media_index=media_index, expand=expand,
                 text_scale=text_scale, vocab_range=vocab_range, vocab_size=vocab_size, media_owner=media_owner)
    dst, stager = slab_stager(slab, errors)
    stager.stage_into(dst, src, pad_to)
    if strict:
        raise_if_errors(errors)
    return slab
