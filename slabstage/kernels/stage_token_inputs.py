"""stage_token_inputs: every integer slot of a batch copied and padded in one launch."""

from __future__ import annotations

import torch

from .launch import Inputs, Stager

__all__ = ["stage_token_inputs"]


def stage_token_inputs(
    buffers,
    *,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    out_cache_loc: torch.Tensor | None = None,
    mrope_positions: torch.Tensor | None = None,
    seq_lens: torch.Tensor | None = None,
    extend_start_loc: torch.Tensor | None = None,
    pad_to: int,
) -> None:
    """Copy a batch's integer inputs into ``buffers`` and pad each tail, in one launch.

    Token slots (``input_ids``, ``positions``, ``out_cache_loc``: ``[n]``;
    ``mrope_positions``: ``[3, n]``) fill ``[0, n)`` and get their slot's pad value
    in ``[n, pad_to)``; per-request slots (``seq_lens``, ``extend_start_loc``:
    ``[b]``) fill ``[0, b)`` and are padded to the buffer's ``max_batch_size``;
    ``num_tokens_non_padded`` becomes ``n``. Slots not given are left as they are.

    Inputs are int32/int64 tensors on the buffers' device or on the host; host
    inputs travel to the device in the launch's parameter block (one non-blocking
    copy from pinned memory). A host value its slot's dtype cannot hold is refused;
    a device one is recorded in the error word (``VALUE_OUT_OF_RANGE``). Every
    destination slot is checked. Raises ``TypeError``/``ValueError`` before anything
    is written.
    """
    src = Inputs(input_ids=input_ids, positions=positions, out_cache_loc=out_cache_loc,
                 mrope_positions=mrope_positions, seq_lens=seq_lens, extend_start_loc=extend_start_loc)
    Stager.for_buffers(buffers, embed=False).stage(src, pad_to)
