"""Host code: the width contract, the buffers and registry, the one validation, the stager, the ops and references."""

from .buffers import ERROR_WORD_SIZE, StagingBuffers, new_error_word
from .registry import BufferRegistry, RegistryMismatchError, Slot, SlotSignature
from .validate import check_media_width, check_source_width
from .width import WidthContractError, resolve_input_embeds_width

__all__ = ["BufferRegistry", "ERROR_WORD_SIZE", "RegistryMismatchError", "Slot", "SlotSignature", "StagingBuffers",
           "WidthContractError", "check_media_width", "check_source_width", "new_error_word",
           "resolve_input_embeds_width"]
