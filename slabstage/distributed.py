"""Vocab-parallel (tensor-parallel) staging: shard ranges, the media owner, the slab's all-reduce.

Every rank stages the whole batch with its shard of the embedding table (``stage_embeddings(..., vocab_range=,
vocab_size=, media_owner=)``): a text row whose id is in the shard gets its table row, any other zeros; media rows
are written by the media owner alone; padding rows are zeros everywhere. One sum all-reduce over the slab's first
``pad_to`` rows then completes every row, bit for bit the single-device slab (``x + 0 == x``). It runs in one of
two places, never both (twice would double every row): from the host before replay (:class:`SlabAllReduce` as the
runner's ``after_stage``) or inside each captured graph (:func:`all_reduce_in_forward`). ``bench/bench_tp.py``
measures both; docs/tensor_parallel.md says which to use.
"""

from __future__ import annotations

from typing import Any, Callable

import torch.distributed as dist

from .checks import check_int
from .graph_runner.nvtx import range_pop, range_push
from .staging.buffers import StagingBuffers

__all__ = ["vocab_shard", "vocab_parallel_args", "SlabAllReduce", "all_reduce_in_forward"]

ALL_REDUCE_RANGE = "slabstage.all_reduce"  # NVTX range around the host-side all-reduce


def vocab_shard(vocab_size: int, rank: int, world_size: int, *, padding: int = 1) -> tuple[int, int]:
    """The vocabulary ids ``[start, end)`` that ``rank`` holds: contiguous shards of equal size.

    The vocabulary padded to a multiple of ``padding`` is cut into ``world_size`` shards of
    ``rows = ceil(padded / world_size)`` table rows (docs/tensor_parallel.md gives each engine's
    padding); the range is clipped to the real vocabulary, so a rank past the end gets the empty
    range ``(vocab_size, vocab_size)``. Pass the rank's own table (``rows`` rows, padding included).

    Raises ``ValueError`` unless ``vocab_size >= 1``, ``world_size >= 1``,
    ``0 <= rank < world_size`` and ``padding >= 1`` are ints.
    """
    vocab_size = check_int("vocab_size", vocab_size, lo=1)
    world_size = check_int("world_size", world_size, lo=1)
    rank = check_int("rank", rank, lo=0)
    padding = check_int("padding", padding, lo=1)
    if rank >= world_size:
        raise ValueError(f"rank {rank} is not in a group of {world_size}")
    padded = -(-vocab_size // padding) * padding
    rows = -(-padded // world_size)
    start = min(rank * rows, vocab_size)
    return start, min(start + rows, vocab_size)


def vocab_parallel_args(vocab_size: int, rank: int, world_size: int, *, padding: int = 1,
                        media_rank: int = 0) -> dict[str, Any]:
    """The staging arguments of ``rank`` under tensor parallelism, for ``stage_embeddings`` or ``PrefillBatch``.

    ``{"vocab_range": vocab_shard(...), "vocab_size": vocab_size, "media_owner":
    rank == media_rank}``. ``vocab_size`` is the whole vocabulary's, so an id held
    by another rank gives a zero row, not a bad-id error; exactly one rank (default
    0) owns the media rows. Raises ``ValueError`` as :func:`vocab_shard` does, and
    unless ``0 <= media_rank < world_size``.
    """
    vocab_range = vocab_shard(vocab_size, rank, world_size, padding=padding)
    media_rank = check_int("media_rank", media_rank, lo=0)
    if media_rank >= world_size:
        raise ValueError(f"media_rank {media_rank} is not in a group of {world_size}")
    return {"vocab_range": vocab_range, "vocab_size": int(vocab_size), "media_owner": rank == media_rank}


def _check_setup(buffers: object) -> None:
    if not isinstance(buffers, StagingBuffers):
        raise TypeError(f"buffers must be StagingBuffers, got {type(buffers).__name__}")
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("torch.distributed is not initialized: call init_process_group before building "
                           "the slab's all-reduce")


def _sum_in_place(rows, group) -> None:
    range_push(ALL_REDUCE_RANGE)
    try:
        dist.all_reduce(rows, op=dist.ReduceOp.SUM, group=group)
    finally:
        range_pop()


class SlabAllReduce:
    """The runner's ``after_stage`` hook: sum ``buffers.input_embeds[:pad_to]`` over ``group``, in place.

    ``PrefillGraphRunner(forward, buffers, after_stage=SlabAllReduce(buffers, group),
    process_group=group)`` calls it with the rows just staged (the bucket, or ``n``
    on the eager path) after staging and before the replay or eager forward. One
    ``torch.distributed.all_reduce`` on the current stream: with NCCL the host
    enqueues it and does not wait; the replay that follows is ordered after it.
    Every rank must call it for the same ``pad_to`` (the runner does: same
    batches, same buckets). The slab is read through ``buffers`` at each call, so
    it follows the registry. Raises ``ValueError`` for a ``pad_to`` outside
    ``[1, slab rows]``; ``RuntimeError`` at construction when torch.distributed is
    not initialized.
    """

    def __init__(self, buffers: StagingBuffers, group=None) -> None:
        _check_setup(buffers)
        self.buffers = buffers
        self.group = group

    def __call__(self, pad_to: int) -> None:
        slab = self.buffers.input_embeds
        _sum_in_place(slab[:check_int("pad_to", pad_to, lo=1, hi=slab.shape[0])], self.group)

    def __repr__(self) -> str:
        return f"SlabAllReduce({self.buffers!r}, group={self.group!r})"


def all_reduce_in_forward(forward: Callable[[dict], Any], buffers: StagingBuffers,
                          group=None) -> Callable[[dict], Any]:
    """``forward`` preceded by the sum all-reduce of ``views["input_embeds"]`` over ``group``, in place.

    Give the result to :class:`PrefillGraphRunner` as its forward (and no
    ``after_stage`` all-reduce): capture records the NCCL all-reduce into each
    bucket's graph, so a replay runs it with no host work, and the eager path
    (warm-up, batches past the largest bucket) runs it eagerly on ``views(n)``.
    Requirements of a collective inside a CUDA graph: NCCL >= 2.9.6; every rank
    captures and replays the same buckets in the same order (same buckets, same
    batches); the process group outlives the graphs (``runner.reset()`` first).

    The returned callable raises ``ValueError`` when ``views["input_embeds"]`` does
    not start at ``buffers.input_embeds`` (the forward was wrapped for other
    buffers); ``all_reduce_in_forward`` itself raises ``TypeError`` for a forward
    that is not callable and ``RuntimeError`` when torch.distributed is not
    initialized.
    """
    if not callable(forward):
        raise TypeError(f"forward must be callable, got {type(forward).__name__}")
    _check_setup(buffers)

    def forward_after_all_reduce(views: dict) -> Any:
        embeds = views["input_embeds"]
        if embeds.data_ptr() != buffers.input_embeds.data_ptr():
            raise ValueError("views['input_embeds'] is not the start of the buffers' slab: this forward was "
                             "wrapped for other StagingBuffers")
        _sum_in_place(embeds, group)
        return forward(views)

    forward_after_all_reduce.forward = forward
    forward_after_all_reduce.group = group
    if hasattr(forward, "needs"):  # (the slots the runner requires of a batch: prefill_forward's with a KV cache)
        forward_after_all_reduce.needs = forward.needs
    return forward_after_all_reduce
