"""Hugging Face model adapters: the slab width, a capturable prefill forward, media items,
mrope positions, a paged KV cache and request packing for Llama, Qwen2, Qwen3, Qwen2-VL, Qwen2.5-VL, Qwen3-VL
and Qwen3-VL-MoE (``transformers>=5.1,<6``, an optional extra: ``pip install 'slabstage[hf]'``; an
older transformers is refused on first use).

Every function takes the model as loaded (``...ForConditionalGeneration``, ``...Model``,
``LlamaForCausalLM``, ...). See docs/hf.md.
"""

from .forward import prefill_forward
from .kv_cache import KVCache
from .media import media_items
from .mrope import mm_token_type_ids, mrope_positions
from .pack import Request, pack_requests
from .width import input_embeds_width

__all__ = ["KVCache", "Request", "input_embeds_width", "media_items", "mm_token_type_ids", "mrope_positions",
           "pack_requests", "prefill_forward"]
