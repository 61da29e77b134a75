"""The device error word and what its codes mean.

The staging kernels never read out of bounds: a row whose token id or media index
is invalid is zero-filled and reported in an ``int32[4]`` error word on the device:

======== =====================================================================
index    meaning
======== =====================================================================
0        OR of the codes below (0: nothing happened)
1        number of rows flagged since the last reset
2        first (smallest) flagged row, ``2**31 - 1`` when none
3        placeholder count found by :func:`media_index_from_mask` (last call)
======== =====================================================================

Nothing on the host looks at the word until the engine calls
:func:`raise_if_errors` (one sync, when it chooses) or passes ``strict=True``.

The words slabstage makes are normal tensors even when made under ``torch.inference_mode``; a word the caller
made there is accepted too (:func:`writing_word`).
"""

from __future__ import annotations

import threading

import torch

from ..kernels.layout import (BAD_MEDIA_INDEX, BAD_TOKEN_ID, ERROR_FIRST_ROW, ERROR_WORD_SIZE, MEDIA_COUNT_MISMATCH,
                              NO_ROW, VALUE_OUT_OF_RANGE)
from .buffers import new_error_word

__all__ = ["BAD_TOKEN_ID", "BAD_MEDIA_INDEX", "MEDIA_COUNT_MISMATCH", "VALUE_OUT_OF_RANGE", "StagingError",
           "check_error_word", "default_error_word", "describe_errors", "new_error_word", "raise_if_errors",
           "reset_errors", "writing_word"]

# the codes (bits of word 0) are named in slabstage.kernels.layout, where the kernels read them

_NAMES = {
    BAD_TOKEN_ID: "token id outside the vocabulary",
    BAD_MEDIA_INDEX: "media index past the media rows",
    MEDIA_COUNT_MISMATCH: "placeholder count differs from the media rows",
    VALUE_OUT_OF_RANGE: "integer input does not fit its slot's dtype",
}

_DEFAULT_WORDS: dict[torch.device, torch.Tensor] = {}
_DEFAULT_WORDS_LOCK = threading.Lock()  # one default word per device, whatever the threads


class StagingError(RuntimeError):
    """Bad data found on the device by a staging kernel."""

    def __init__(self, message: str, codes: int, rows: int, first_row: int | None, count: int):
        super().__init__(message)
        self.codes, self.rows, self.first_row, self.count = codes, rows, first_row, count


_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", lambda: False)


def default_error_word(device: torch.device) -> torch.Tensor:
    """The error word of ``device`` used when a call passes none: one per device, whatever the threads."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    word = _DEFAULT_WORDS.get(device)
    if word is None:
        if _compiling():  # (torch.compile traces no lock; the word is made as the trace runs)
            return _DEFAULT_WORDS.setdefault(device, new_error_word(device))
        with _DEFAULT_WORDS_LOCK:
            word = _DEFAULT_WORDS.get(device)  # another thread may have made it meanwhile
            if word is None:
                word = new_error_word(device)
                _DEFAULT_WORDS[device] = word  # published only once it is fully set up
    return word


def writing_word(errors: torch.Tensor):
    """A context in which the reference path (PyTorch ops) may update ``errors`` in place: inference mode for an
    inference tensor (PyTorch allows that anywhere), none for a normal one. The Triton path needs no context."""
    return torch.inference_mode(errors.is_inference())


def check_error_word(errors: torch.Tensor, device: torch.device, against: str = "the slab") -> None:
    """Raise ``ValueError`` unless ``errors`` is an error word on ``device`` (where ``against`` lives)."""
    if (not isinstance(errors, torch.Tensor) or errors.dtype != torch.int32 or errors.dim() != 1
            or errors.numel() < ERROR_WORD_SIZE or not errors.is_contiguous()):
        raise ValueError(f"errors must be a contiguous 1-D int32 tensor of at least {ERROR_WORD_SIZE} elements "
                         f"(see new_error_word), got {getattr(errors, 'dtype', type(errors))} "
                         f"shape {tuple(getattr(errors, 'shape', ()))}")
    if errors.device != device:
        raise ValueError(f"errors is on {errors.device} but {against} is on {device}")


def describe_errors(codes: int) -> list[str]:
    return [text for bit, text in _NAMES.items() if codes & bit] or ([f"unknown code {codes}"] if codes else [])


def reset_errors(errors: torch.Tensor) -> None:
    """Clear the word (asynchronously, on the current stream), in or outside inference mode.

    Raises ``ValueError`` before touching anything when ``errors`` is not an error word.
    """
    check_error_word(errors, getattr(errors, "device", None), "the word")
    with writing_word(errors):
        errors[:ERROR_WORD_SIZE].zero_()
        errors[ERROR_FIRST_ROW] = NO_ROW


def raise_if_errors(errors: torch.Tensor | None = None, *, device: torch.device | str | None = None) -> None:
    """Read the error word (one host sync), reset it, and raise :class:`StagingError` if set.

    With no ``errors``, the default word of ``device`` (default: the current CUDA device, else CPU) is read. An
    argument that is not an error word raises ``ValueError`` before anything is read.
    """
    if errors is None:
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        errors = default_error_word(torch.device(device))
    check_error_word(errors, getattr(errors, "device", None), "the word")
    codes, rows, first, count = (int(v) for v in errors[:ERROR_WORD_SIZE].tolist())
    if codes == 0:
        return
    reset_errors(errors)
    what = "; ".join(describe_errors(codes))
    where = f"{rows} row(s) zero-filled, first at row {first}" if rows else "no rows written from bad sources"
    if codes & MEDIA_COUNT_MISMATCH:
        where += f"; the placeholder mask had {count} media rows"
    raise StagingError(f"staging found bad input on the device: {what} ({where})", codes, rows,
                       None if first == NO_ROW else first, count)
