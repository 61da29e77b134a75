"""CUDA graph runner around the staging slab."""

from .batch import PrefillBatch
from .buckets import default_token_buckets
from .nvtx import RANGES, nvtx_range
from .runner import CaptureError, PrefillGraphRunner

__all__ = ["CaptureError", "PrefillBatch", "PrefillGraphRunner", "RANGES", "default_token_buckets", "nvtx_range"]
