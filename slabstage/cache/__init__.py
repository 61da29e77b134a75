"""The encoder-output cache: encoder outputs kept in the slab's format and staged by handle."""

from .encoder_cache import CacheFullError, EncoderCache, Entry, StaleEntryError

__all__ = ["EncoderCache", "Entry", "StaleEntryError", "CacheFullError"]
