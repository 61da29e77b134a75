"""Triton staging kernels, their launchers and PyTorch references."""

from .errors import (BAD_MEDIA_INDEX, BAD_TOKEN_ID, MEDIA_COUNT_MISMATCH, VALUE_OUT_OF_RANGE, StagingError,
                     default_error_word, new_error_word, raise_if_errors, reset_errors)
from .media_index import media_index_from_mask, media_index_from_spans
from .mrope import MropeLayout
from .stage_embeddings import stage_embeddings
from .stage_token_inputs import stage_token_inputs

__all__ = [
    "BAD_MEDIA_INDEX",
    "BAD_TOKEN_ID",
    "MEDIA_COUNT_MISMATCH",
    "MropeLayout",
    "StagingError",
    "VALUE_OUT_OF_RANGE",
    "default_error_word",
    "media_index_from_mask",
    "media_index_from_spans",
    "new_error_word",
    "raise_if_errors",
    "reset_errors",
    "stage_embeddings",
    "stage_token_inputs",
]
