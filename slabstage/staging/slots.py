"""The integer slots of the prefill path, declared once.

Every token-axis integer slot (and the per-request ones) is one row of :data:`SLOTS`.
From it come the buffers :meth:`StagingBuffers.allocate` makes, the fields a
:class:`~slabstage.PrefillBatch` must have, the slot descriptors of the staging
kernel's parameter block, the PyTorch reference, the validation and the custom
op's schema. Adding a slot is a row here and a field on ``PrefillBatch``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["SlotSpec", "SLOTS", "SOURCE_SLOTS", "TOKENS", "ROWS", "REQUESTS", "COUNT"]

# how a slot is laid out and what the kernel writes into it
TOKENS = 0  # [T]: rows [0, n) copied, [n, pad_to) padded
ROWS = 1  # [rows, T] (token axis 1): each row as TOKENS
REQUESTS = 2  # [max_batch_size]: [0, b) copied, the rest padded
COUNT = 3  # [1]: the batch's token count, never padded


class SlotSpec(NamedTuple):
    name: str
    kind: int
    dtype: torch.dtype
    rows: int = 1  # ROWS: how many
    required: bool = False  # every batch gives it
    switch: str | None = None  # StagingBuffers.allocate's bool argument that adds it (None: always there)


SLOTS = (
    SlotSpec("input_ids", TOKENS, torch.int64, required=True),
    SlotSpec("positions", TOKENS, torch.int64, required=True),
    SlotSpec("out_cache_loc", TOKENS, torch.int64),  # dtype: allocate's cache_loc_dtype
    SlotSpec("mrope_positions", ROWS, torch.int64, rows=3, switch="mrope"),
    SlotSpec("seq_lens", REQUESTS, torch.int32),
    SlotSpec("extend_start_loc", REQUESTS, torch.int32),
    SlotSpec("prefix_lens", REQUESTS, torch.int32),  # tokens of each request already in the KV cache
    SlotSpec("req_indices", REQUESTS, torch.int32),  # each request's row of the KV cache's req_to_token
    SlotSpec("num_tokens_non_padded", COUNT, torch.int32),
)
SOURCE_SLOTS = tuple(s for s in SLOTS if s.kind != COUNT)  # the slots a batch gives a source for
