"""The integer slots of the prefill path, declared once.

Every token-axis integer slot (and the per-request ones) is one row of :data:`SLOTS`.
From it come the buffers :meth:`StagingBuffers.allocate` makes, the fields a
:class:`~slabstage.PrefillBatch` must have, the slot descriptors of the staging
kernel's parameter record, the PyTorch reference, the validation and the custom
op's schema, :func:`~slabstage.stage_token_inputs`' keywords, :class:`StagingBuffers`' properties,
:class:`~slabstage.PrefillBatch`'s fields and the batch the runner captures with. Adding a slot is a row
here, and only that (``COUNT`` slots stay last).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..kernels.layout import COUNT, REQUESTS, ROWS, TOKENS

__all__ = ["SlotSpec", "SLOTS", "SOURCE_SLOTS", "NEEDED_SLOTS", "TOKENS", "ROWS", "REQUESTS", "COUNT"]

# how a slot is laid out and what the kernel writes into it: TOKENS, ROWS, REQUESTS, COUNT (kernels.layout)


class SlotSpec(NamedTuple):
    name: str
    kind: int
    dtype: torch.dtype
    rows: int = 1  # ROWS: how many
    required: bool = False  # every batch gives it
    switch: str | None = None  # StagingBuffers.allocate's bool argument that adds it (None: always there)
    pad: int | str | None = "zeros"  # what padded rows get: the registry's pad policy (None: left as they are)
    probe: int | str | None = 0  # what the runner stages while capturing: a value for every row, "ids" (random
    # token ids), "positions" (0..n-1 in each row), "count" (the probe's token count) or None (not staged)


SLOTS = (
    SlotSpec("input_ids", TOKENS, torch.int64, required=True, probe="ids"),
    SlotSpec("positions", TOKENS, torch.int64, required=True, probe="positions"),
    SlotSpec("out_cache_loc", TOKENS, torch.int64),  # dtype: allocate's cache_loc_dtype; probe: slot 0, the
    # KV cache's sink (capture writes no real request's slots)
    SlotSpec("mrope_positions", ROWS, torch.int64, rows=3, switch="mrope", probe="positions"),
    SlotSpec("seq_lens", REQUESTS, torch.int32, probe="count"),
    SlotSpec("extend_start_loc", REQUESTS, torch.int32),
    SlotSpec("prefix_lens", REQUESTS, torch.int32),  # tokens of each request already in the KV cache
    SlotSpec("req_indices", REQUESTS, torch.int32),  # each request's row of the KV cache's req_to_token
    SlotSpec("num_tokens_non_padded", COUNT, torch.int32, pad=None, probe=None),
)
SOURCE_SLOTS = tuple(s for s in SLOTS if s.kind != COUNT)  # the slots a batch gives a source for
NEEDED_SLOTS = tuple(s.name for s in SLOTS if s.required or s.kind == COUNT)  # buffers without one cannot stage
assert SLOTS[len(SOURCE_SLOTS):] == tuple(s for s in SLOTS if s.kind == COUNT), "COUNT slots come last"
