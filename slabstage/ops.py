"""The staging kernels as PyTorch custom ops, callable inside torch.compile without a graph break.

``torch.ops.slabstage.stage_embeddings`` and ``torch.ops.slabstage.stage_token_inputs``
declare the tensors they write (``mutates_args``) and have fake implementations,
so Dynamo traces through them and Inductor keeps them as opaque, ordered calls.
The Python wrappers :func:`stage_embeddings_op` and :func:`stage_token_inputs_op`
take the same arguments as the plain functions.
"""

from __future__ import annotations

from typing import List, Optional

import torch

from .checks import check_tensor
from .kernels.errors import default_error_word
from .kernels.plan import vocab_bounds
from .kernels.stage_embeddings import stage_embeddings
from .kernels.stage_token_inputs import stage_token_inputs
from .staging.buffers import StagingBuffers
from .staging.registry import BufferRegistry

__all__ = ["stage_embeddings_op", "stage_token_inputs_op", "HAS_CUSTOM_OPS"]

HAS_CUSTOM_OPS = hasattr(torch.library, "custom_op")  # torch >= 2.4

_TOKEN_SLOTS = ("input_ids", "positions", "out_cache_loc", "mrope_positions", "seq_lens", "extend_start_loc")

if HAS_CUSTOM_OPS:

    @torch.library.custom_op("slabstage::stage_embeddings", mutates_args=("slab", "errors"))
    def _stage_embeddings(slab: torch.Tensor, input_ids: torch.Tensor, table: torch.Tensor,
                          media: Optional[torch.Tensor], media_index: Optional[torch.Tensor], errors: torch.Tensor,
                          pad_to: int, expand: str, text_scale: Optional[float], vocab_start: int, vocab_end: int,
                          vocab_size: int, media_owner: bool) -> None:
        stage_embeddings(slab, input_ids, table, media=media, media_index=media_index, pad_to=pad_to,
                         expand=expand, text_scale=text_scale, vocab_range=(vocab_start, vocab_end),
                         vocab_size=vocab_size, media_owner=media_owner, errors=errors)

    @_stage_embeddings.register_fake
    def _(slab, input_ids, table, media, media_index, errors, pad_to, expand, text_scale, vocab_start, vocab_end,
          vocab_size, media_owner) -> None:
        return None

    @torch.library.custom_op("slabstage::stage_token_inputs",
                             mutates_args=("input_ids_dst", "positions_dst", "out_cache_loc_dst",
                                           "mrope_positions_dst", "seq_lens_dst", "extend_start_loc_dst",
                                           "num_tokens_dst"))
    def _stage_token_inputs(input_ids_dst: torch.Tensor, positions_dst: torch.Tensor,
                            out_cache_loc_dst: Optional[torch.Tensor], mrope_positions_dst: Optional[torch.Tensor],
                            seq_lens_dst: Optional[torch.Tensor], extend_start_loc_dst: Optional[torch.Tensor],
                            num_tokens_dst: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor,
                            out_cache_loc: Optional[torch.Tensor], mrope_positions: Optional[torch.Tensor],
                            seq_lens: Optional[torch.Tensor], extend_start_loc: Optional[torch.Tensor],
                            pad_to: int, fills: List[int], pads: List[bool]) -> None:
        dsts = (input_ids_dst, positions_dst, out_cache_loc_dst, mrope_positions_dst, seq_lens_dst,
                extend_start_loc_dst)
        check_tensor("num_tokens_dst", num_tokens_dst)
        reg = BufferRegistry()
        for name, dst, fill, pad in zip(_TOKEN_SLOTS, dsts, fills, pads):
            if dst is not None:
                check_tensor(f"{name}_dst", dst)
                axis = None if name in ("seq_lens", "extend_start_loc") else dst.dim() - 1
                reg.register(name, dst, token_axis=axis, pad=fill if pad else None)
        reg.register("num_tokens_non_padded", num_tokens_dst, token_axis=None, pad=None)
        requests = [d.shape[0] for d in (seq_lens_dst, extend_start_loc_dst) if d is not None and d.dim() == 1]
        buffers = StagingBuffers(reg, max_num_tokens=reg.capacity, max_batch_size=min(requests, default=1),
                                 errors=default_error_word(input_ids_dst.device))
        stage_token_inputs(buffers, input_ids=input_ids, positions=positions, out_cache_loc=out_cache_loc,
                           mrope_positions=mrope_positions, seq_lens=seq_lens, extend_start_loc=extend_start_loc,
                           pad_to=pad_to)

    @_stage_token_inputs.register_fake
    def _(input_ids_dst, positions_dst, out_cache_loc_dst, mrope_positions_dst, seq_lens_dst, extend_start_loc_dst,
          num_tokens_dst, input_ids, positions, out_cache_loc, mrope_positions, seq_lens, extend_start_loc,
          pad_to, fills, pads) -> None:
        return None


def _need_ops() -> None:
    if not HAS_CUSTOM_OPS:
        raise RuntimeError("slabstage custom ops need torch >= 2.4 (torch.library.custom_op)")


def stage_embeddings_op(slab, input_ids, table, *, media=None, media_index=None, pad_to=None, expand="zeros",
                        text_scale=None, vocab_range=None, vocab_size=None, media_owner=True, errors=None):
    """:func:`slabstage.stage_embeddings` through ``torch.ops.slabstage.stage_embeddings``."""
    _need_ops()
    check_tensor("slab", slab)
    check_tensor("input_ids", input_ids, dims=1)
    check_tensor("table", table, dims=2)
    if media is not None and not isinstance(media, torch.Tensor):
        raise TypeError("stage_embeddings_op takes media as one 2-D tensor (the custom op's schema); "
                        "stage media items with slabstage.stage_embeddings")
    start, end, size = vocab_bounds(vocab_range, vocab_size, table.shape[0])  # the op checks the rest
    torch.ops.slabstage.stage_embeddings(
        slab, input_ids, table, media, media_index,
        errors if errors is not None else default_error_word(slab.device),
        input_ids.shape[0] if pad_to is None else pad_to, expand, text_scale, start, end, size, media_owner)
    return slab


def stage_token_inputs_op(buffers: StagingBuffers, *, input_ids, positions, out_cache_loc=None,
                          mrope_positions=None, seq_lens=None, extend_start_loc=None, pad_to: int) -> None:
    """:func:`slabstage.stage_token_inputs` through ``torch.ops.slabstage.stage_token_inputs``."""
    _need_ops()
    reg = buffers.registry
    dsts = [reg[name] if name in reg else None for name in _TOKEN_SLOTS]
    fills = [int(reg.slot(name).fill_value or 0) if name in reg else 0 for name in _TOKEN_SLOTS]
    pads = [name in reg and reg.slot(name).fill_value is not None for name in _TOKEN_SLOTS]
    torch.ops.slabstage.stage_token_inputs(
        *dsts, buffers.num_tokens_non_padded, input_ids, positions, out_cache_loc, mrope_positions, seq_lens,
        extend_start_loc, pad_to, fills, pads)
