"""Host code: the width contract, the buffers and registry, the one validation, the stager, the ops and references."""

from .buffers import ERROR_WORD_SIZE, StagingBuffers, new_error_word
from .errors import (BAD_MEDIA_INDEX, BAD_TOKEN_ID, MEDIA_COUNT_MISMATCH, VALUE_OUT_OF_RANGE, StagingError,
                     default_error_word, raise_if_errors, reset_errors)
from .media_index import media_index_from_mask, media_index_from_spans
from .mrope import MropeLayout
from .registry import BufferRegistry, RegistryMismatchError, Slot, SlotSignature
from .stage_embeddings import stage_embeddings
from .stage_token_inputs import stage_token_inputs
from .validate import check_media_width, check_source_width
from .width import WidthContractError, resolve_input_embeds_width

__all__ = ["BAD_MEDIA_INDEX", "BAD_TOKEN_ID", "BufferRegistry", "ERROR_WORD_SIZE", "MEDIA_COUNT_MISMATCH",
           "MropeLayout", "RegistryMismatchError", "Slot", "SlotSignature", "StagingBuffers", "StagingError",
           "VALUE_OUT_OF_RANGE", "WidthContractError", "check_media_width", "check_source_width",
           "default_error_word", "media_index_from_mask", "media_index_from_spans", "new_error_word",
           "raise_if_errors", "reset_errors", "resolve_input_embeds_width", "stage_embeddings", "stage_token_inputs"]
