"""Models that read the staging slab: a toy multimodal decoder for the demo, tests and benchmarks."""

from .toy import VARIANTS, ToyMultimodalModel, make_batch, packed_causal_mask

__all__ = ["ToyMultimodalModel", "VARIANTS", "make_batch", "packed_causal_mask"]
