"""stage_batch: a prefill batch's integer slots and embeddings in one launch (the runner's path).

The same work as :func:`stage_token_inputs` followed by :func:`stage_embeddings`,
from the same jitted row helpers, with one launch and one host check instead of
two: at small batches the host, not the GPU, bounds a prefill step.
"""

from __future__ import annotations

from functools import partial

import torch

from ..staging.buffers import StagingBuffers
from ._launch import FastLaunch
from ._triton import tl, triton, use_triton
from .stage_embeddings import embeddings_key, embeddings_launch
from .stage_token_inputs import _launch as _token_launch_alone
from .stage_token_inputs import check_token_inputs, pack_host_inputs, token_launch

__all__ = ["plan_stage_batch"]

_TOK_BLOCK = 128

if triton is not None:
    from .stage_embeddings import _embed_row
    from .stage_token_inputs import _token_rows

    @triton.jit(do_not_specialize=["n", "pad_to", "vocab_start", "vocab_end", "vocab_size", "num_media",
                                   "t_n", "t_pad_to", "b"])
    def _stage_batch_kernel(
        slab_ptr, ids_ptr, table_ptr, media_ptr, media_index_ptr, errors_ptr,
        n, pad_to, vocab_start, vocab_end, vocab_size, num_media, text_scale,
        stride_slab, stride_table, stride_media,
        ids_src, pos_src, loc_src, mrope_src, seq_src, ext_src,
        ids_dst, pos_dst, loc_dst, mrope_dst, seq_dst, ext_dst, ntok_dst,
        t_n, t_pad_to, b, batch_cap, stride_mrope_src, stride_mrope_dst,
        ids_fill, pos_fill, loc_fill, mrope_fill, seq_fill, ext_fill,
        WIDTH: tl.constexpr, TEXT_WIDTH: tl.constexpr, MEDIA_WIDTH: tl.constexpr,
        BLOCK: tl.constexpr, COL_BLOCKS: tl.constexpr,
        TEXT_TILED: tl.constexpr, MEDIA_TILED: tl.constexpr,
        HAS_MEDIA: tl.constexpr, MEDIA_OWNER: tl.constexpr, HAS_SCALE: tl.constexpr,
        SOFT: tl.constexpr, BAD_ID_CODE: tl.constexpr, BAD_MEDIA_CODE: tl.constexpr,
        PAD_IDS: tl.constexpr, PAD_POS: tl.constexpr, PAD_LOC: tl.constexpr, PAD_MROPE: tl.constexpr,
        PAD_SEQ: tl.constexpr, PAD_EXT: tl.constexpr,
        HAS_LOC: tl.constexpr, HAS_MROPE: tl.constexpr, HAS_SEQ: tl.constexpr, HAS_EXT: tl.constexpr,
        REQ_BLOCK: tl.constexpr, TOK_BLOCK: tl.constexpr,
    ):
        pid = tl.program_id(0)
        _embed_row(
            pid, slab_ptr, ids_ptr, table_ptr, media_ptr, media_index_ptr, errors_ptr,
            n, pad_to, vocab_start, vocab_end, vocab_size, num_media, text_scale,
            stride_slab, stride_table, stride_media,
            WIDTH, TEXT_WIDTH, MEDIA_WIDTH, BLOCK, COL_BLOCKS, TEXT_TILED, MEDIA_TILED,
            HAS_MEDIA, MEDIA_OWNER, HAS_SCALE, SOFT, BAD_ID_CODE, BAD_MEDIA_CODE)
        row = pid // COL_BLOCKS
        if (pid % COL_BLOCKS == 0) & (row % TOK_BLOCK == 0):  # one program per TOK_BLOCK rows
            _token_rows(
                row.to(tl.int64) + tl.arange(0, TOK_BLOCK), row == 0,
                ids_src, pos_src, loc_src, mrope_src, seq_src, ext_src,
                ids_dst, pos_dst, loc_dst, mrope_dst, seq_dst, ext_dst, ntok_dst,
                t_n, t_pad_to, b, batch_cap, stride_mrope_src, stride_mrope_dst,
                ids_fill, pos_fill, loc_fill, mrope_fill, seq_fill, ext_fill,
                PAD_IDS, PAD_POS, PAD_LOC, PAD_MROPE, PAD_SEQ, PAD_EXT, HAS_LOC, HAS_MROPE, HAS_SEQ, HAS_EXT,
                REQ_BLOCK)

    _launch = FastLaunch(_stage_batch_kernel, ptr_args=(0, 1, 2, 3, 4, 5, *range(16, 29)))


def plan_stage_batch(buffers: StagingBuffers, *, input_ids, positions, table, out_cache_loc=None,
                     mrope_positions=None, seq_lens=None, extend_start_loc=None, media=None, media_index=None,
                     expand="zeros", text_scale=None, vocab_range=None, vocab_size=None, media_owner=True,
                     pad_to: int):
    """Check a whole batch (token slots and embeddings) and return its one launch, not yet run.

    Same arguments and semantics as :func:`stage_token_inputs` plus
    :func:`stage_embeddings` into ``buffers.input_embeds`` (text ids read from
    ``input_ids``, errors into ``buffers.errors``). Integer inputs (``media_index``
    too) may be host tensors: they travel in one packed non-blocking copy.
    """
    given, n, b = check_token_inputs(
        buffers, input_ids=input_ids, positions=positions, out_cache_loc=out_cache_loc,
        mrope_positions=mrope_positions, seq_lens=seq_lens, extend_start_loc=extend_start_loc, pad_to=pad_to)
    if media_index is not None and not isinstance(media_index, torch.Tensor):
        raise TypeError(f"media_index must be a torch.Tensor, got {type(media_index).__name__}")
    if media_index is not None and media_index.device != buffers.device and media_index.device.type != "cpu":
        raise ValueError(f"media_index is on {media_index.device}; expected {buffers.device} or the host")
    parts = embeddings_launch(
        buffers.input_embeds, input_ids, table, media=media, media_index=media_index, pad_to=pad_to,
        expand=expand, text_scale=text_scale, vocab_range=vocab_range, vocab_size=vocab_size,
        media_owner=media_owner, errors=buffers.errors, check_ids_device=False)
    return partial(_run, buffers, given, media_index, parts, n, pad_to, b)


def _run(buffers: StagingBuffers, given: dict, media_index, parts, n: int, pad_to: int, b: int) -> None:
    if media_index is not None:
        given = {**given, "media_index": media_index}
    given = pack_host_inputs(buffers, given)
    media_index = given.pop("media_index", None)
    if callable(parts) or not use_triton(buffers.input_embeds):  # the references, one after the other
        _token_launch_alone(buffers, given, n, pad_to, b)
        slab, _, table, media = parts.args[:4]
        parts.func(slab, given["input_ids"], table, media, media_index, **parts.keywords)
        return
    grid0, _, emb_args, emb_cx, num_warps = parts
    if not grid0:  # pad_to == 0: no slab row to write, but the token slots and the count still are
        _token_launch_alone(buffers, given, n, pad_to, b)
        return
    emb_args = (emb_args[0], given["input_ids"], emb_args[2], emb_args[3],
                media_index if media_index is not None else given["input_ids"], *emb_args[5:])
    tok_args, tok_cx, tok_key = token_launch(buffers, given, n, pad_to, b)
    emb_key = embeddings_key(emb_args)
    key = (emb_key, tok_key) if emb_key is not None and tok_key is not None else None
    _launch((grid0,), key, (*emb_args, *tok_args), {**emb_cx, **tok_cx, "TOK_BLOCK": _TOK_BLOCK}, num_warps)
