"""stage_token_inputs: every integer slot of a batch copied and padded in one launch.

Kernel: ``slabstage/kernels/stage_kernel.py::stage_kernel`` without its embedding arm; tests:
``tests/ops/test_stage_token_inputs.py``; benchmark: ``bench/bench_stage_token_inputs.py``.
"""

from __future__ import annotations

import inspect

import torch

from .slots import SOURCE_SLOTS
from .stager import Stager
from .validate import Inputs

__all__ = ["stage_token_inputs"]

_NAMES = frozenset(s.name for s in SOURCE_SLOTS)
_NEEDED = tuple(s.name for s in SOURCE_SLOTS if s.required)


def stage_token_inputs(buffers, *, pad_to: int, **sources: torch.Tensor | None) -> None:
    """Copy a batch's integer inputs into ``buffers`` and pad each tail, in one launch.

    One keyword per slot of :data:`~slabstage.staging.slots.SLOTS` that a batch gives
    (``input_ids`` and ``positions`` always; ``out_cache_loc``, ``mrope_positions``,
    ``seq_lens``, ``extend_start_loc``, ``prefix_lens``, ``req_indices`` when there).
    Token slots (``[n]``; ``mrope_positions``: ``[3, n]``) fill ``[0, n)`` and get their
    slot's pad value in ``[n, pad_to)``; per-request slots (``[b]``) fill ``[0, b)`` and
    are padded to the buffer's ``max_batch_size``; ``num_tokens_non_padded`` becomes
    ``n``. Slots not given are left as they are.

    Inputs are int32/int64 tensors on the buffers' device or on the host; host
    inputs travel to the device in the launch's parameter record (one non-blocking
    copy from pinned memory). A host value its slot's dtype cannot hold is refused;
    a device one is recorded in the error word (``VALUE_OUT_OF_RANGE``). Every
    destination slot is checked. Raises ``TypeError``/``ValueError`` before anything
    is written.
    """
    if not _NAMES.issuperset(sources) or not all(name in sources for name in _NEEDED):
        _bad_keywords(sources)
    Stager.for_buffers(buffers, embed=False).stage(Inputs(**sources), pad_to)


def _bad_keywords(sources: dict) -> None:
    unknown = sorted(set(sources) - _NAMES)
    if unknown:
        raise TypeError(f"stage_token_inputs() got an unexpected keyword argument {unknown[0]!r}")
    missing = [name for name in _NEEDED if name not in sources]
    raise TypeError(f"stage_token_inputs() missing required keyword argument {missing[0]!r}")


# the signature callers (and help()) see: one keyword per slot, the required ones without a default
stage_token_inputs.__signature__ = inspect.Signature(
    [inspect.Parameter("buffers", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    + [inspect.Parameter(s.name, inspect.Parameter.KEYWORD_ONLY, annotation="torch.Tensor")
       for s in SOURCE_SLOTS if s.required]
    + [inspect.Parameter(s.name, inspect.Parameter.KEYWORD_ONLY, default=None, annotation="torch.Tensor | None")
       for s in SOURCE_SLOTS if not s.required]
    + [inspect.Parameter("pad_to", inspect.Parameter.KEYWORD_ONLY, annotation="int")])
