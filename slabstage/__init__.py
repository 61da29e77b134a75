"""slabstage: stage multimodal prefill embeddings into a fixed-address slab, then replay.

See README.md for the contract, the kernels and the graph runner.
"""

__version__ = "0.1.0"


from . import ops  # noqa: F401  registers torch.ops.slabstage.*
from .distributed import SlabAllReduce, all_reduce_in_forward, vocab_parallel_args, vocab_shard
from .graph_runner import CaptureError, PrefillBatch, PrefillGraphRunner, default_token_buckets
from .staging import (BAD_MEDIA_INDEX, BAD_TOKEN_ID, MEDIA_COUNT_MISMATCH, VALUE_OUT_OF_RANGE, BufferRegistry,
                      MropeLayout, RegistryMismatchError, StagingBuffers, StagingError, WidthContractError,
                      media_index_from_mask, media_index_from_spans, new_error_word, raise_if_errors, reset_errors,
                      resolve_input_embeds_width, stage_embeddings, stage_token_inputs)


__all__ = [
    "BAD_MEDIA_INDEX",
    "BAD_TOKEN_ID",
    "BufferRegistry",
    "CaptureError",
    "MEDIA_COUNT_MISMATCH",
    "MropeLayout",
    "PrefillBatch",
    "PrefillGraphRunner",
    "RegistryMismatchError",
    "SlabAllReduce",
    "StagingBuffers",
    "StagingError",
    "VALUE_OUT_OF_RANGE",
    "WidthContractError",
    "__version__",
    "all_reduce_in_forward",
    "default_token_buckets",
    "media_index_from_mask",
    "media_index_from_spans",
    "new_error_word",
    "raise_if_errors",
    "reset_errors",
    "resolve_input_embeds_width",
    "stage_embeddings",
    "stage_token_inputs",
    "vocab_parallel_args",
    "vocab_shard",
]
