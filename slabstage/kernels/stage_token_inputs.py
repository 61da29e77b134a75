"""stage_token_inputs: every integer slot of a batch copied and padded in one launch."""

from __future__ import annotations

from functools import partial

import torch

from ..checks import check_int
from .plan import (check_destinations, check_host_values, check_sources_apart,
                   check_token_sources, pack_host_inputs, token_args)
from .reference import stage_token_inputs_reference
from .runtime import use_triton
from .stage_kernel import STAGE, TOK_BLOCK

__all__ = ["stage_token_inputs", "plan_stage_token_inputs", "check_token_batch"]


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
    inputs are packed into one pinned tensor and moved in one non-blocking copy.
    A host value its slot's dtype cannot hold is refused; a device one is recorded
    in the error word (``VALUE_OUT_OF_RANGE``). Every destination slot is checked.
    Raises ``TypeError``/``ValueError`` before anything is written.
    """
    plan_stage_token_inputs(buffers, input_ids=input_ids, positions=positions, out_cache_loc=out_cache_loc,
                            mrope_positions=mrope_positions, seq_lens=seq_lens,
                            extend_start_loc=extend_start_loc, pad_to=pad_to)()


def check_token_batch(buffers, *, pad_to, **inputs):
    """The checks of :func:`stage_token_inputs`: ``(destinations, given, n, b, pad_to)``."""
    dst = check_destinations(buffers)
    given, n, b = check_token_sources(buffers.device, batch_cap=dst.batch_cap, **inputs)
    if "mrope_positions" in given and not dst.has_mrope:
        raise ValueError("mrope_positions given but the buffers were allocated without mrope=True")
    for name in given:
        if name not in dst.dtypes:
            raise ValueError(f"{name} given but the buffers have no {name!r} slot")
    capacity = buffers.registry.capacity
    if n > capacity:
        raise ValueError(f"{n} tokens exceed the buffers' capacity of {capacity} tokens")
    pad_to = check_int("pad_to", pad_to, lo=n, hi=capacity)
    check_host_values(given, dst.dtypes)
    check_sources_apart(dst, {k: v for k, v in given.items() if v.device == buffers.device})
    return dst, given, n, b, pad_to


def plan_stage_token_inputs(buffers, *, input_ids, positions, out_cache_loc=None, mrope_positions=None,
                            seq_lens=None, extend_start_loc=None, pad_to):
    """Check every argument of :func:`stage_token_inputs`; return its launch as a callable, not yet run."""
    dst, given, n, b, pad_to = check_token_batch(
        buffers, input_ids=input_ids, positions=positions, out_cache_loc=out_cache_loc,
        mrope_positions=mrope_positions, seq_lens=seq_lens, extend_start_loc=extend_start_loc, pad_to=pad_to)
    return partial(_launch, buffers, dst, given, n, b, pad_to)


def _launch(buffers, dst, given: dict, n: int, b: int, pad_to: int) -> None:
    given = pack_host_inputs(buffers.device, given, buffers.token_scratch)
    if not use_triton(buffers.input_ids):
        stage_token_inputs_reference(buffers, given, n, pad_to, b)
        return
    mrope = given.get("mrope_positions")
    args, constexprs = token_args(dst, given, b, mrope.stride(0) if mrope is not None else 0)
    args.update(errors_ptr=buffers.errors, ids_ptr=given["input_ids"], n=n, pad_to=pad_to)
    constexprs["EMBED"] = False
    STAGE(max(1, -(-pad_to // TOK_BLOCK)), args, constexprs, 4)
