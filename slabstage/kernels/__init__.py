"""Device code: the Triton kernels and the one layout of their parameter record.

The staging kernel (:mod:`~slabstage.kernels.stage_kernel`, with its row helpers
:mod:`~slabstage.kernels.embed_rows` and :mod:`~slabstage.kernels.slot_rows`) and the fetch kernel read
:mod:`~slabstage.kernels.layout`; :mod:`~slabstage.kernels.media_index` builds ``media_index`` from a mask;
:mod:`~slabstage.kernels.packed_attention` is the packed-prefill attention. Their host launchers, checks and
PyTorch references live in :mod:`slabstage.staging`; the public ones are exported here too.
"""

from ..staging.errors import (BAD_MEDIA_INDEX, BAD_TOKEN_ID, MEDIA_COUNT_MISMATCH, VALUE_OUT_OF_RANGE, StagingError,
                              default_error_word, new_error_word, raise_if_errors, reset_errors)
from ..staging.media_index import media_index_from_mask, media_index_from_spans
from ..staging.mrope import MropeLayout
from ..staging.stage_embeddings import stage_embeddings
from ..staging.stage_token_inputs import stage_token_inputs

__all__ = ["BAD_MEDIA_INDEX", "BAD_TOKEN_ID", "MEDIA_COUNT_MISMATCH", "MropeLayout", "StagingError",
           "VALUE_OUT_OF_RANGE", "default_error_word", "media_index_from_mask", "media_index_from_spans",
           "new_error_word", "raise_if_errors", "reset_errors", "stage_embeddings", "stage_token_inputs"]
