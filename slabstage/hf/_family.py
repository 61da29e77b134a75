"""Which Hugging Face model family a loaded model belongs to, and where its parts are.

One place that knows transformers' layout (checked against transformers 5.x):
``...ForConditionalGeneration`` / ``...ForCausalLM`` wrap a base model
(``model.model``); a VLM's base model holds ``visual`` and ``language_model``;
a decoder LM's base model is itself the language model.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..staging.width import WidthContractError

__all__ = ["Family", "family_of", "TEXT_FAMILIES", "MROPE_FAMILIES", "DEEPSTACK_FAMILIES"]

TEXT_FAMILIES = ("llama", "qwen2", "qwen3")
MROPE_FAMILIES = ("qwen2_vl", "qwen2_5_vl")
DEEPSTACK_FAMILIES = ("qwen3_vl", "qwen3_vl_moe")
SUPPORTED = TEXT_FAMILIES + MROPE_FAMILIES + DEEPSTACK_FAMILIES
# the text halves of the VLMs above, loaded alone: no vision tower, no DeepStack levels, no rope index
BARE_TEXT_OF_VLM = tuple(f"{f}_text" for f in MROPE_FAMILIES + DEEPSTACK_FAMILIES)


@dataclass(frozen=True)
class Family:
    """The parts of one loaded model that the adapters use."""

    name: str  # config.model_type: "llama", "qwen2_5_vl", "qwen3_vl", ...
    model: object  # what the user passed
    base: object  # the base model: Qwen3VLModel, LlamaModel, ...
    language_model: object  # the decoder: has .layers, .norm, .rotary_emb, .embed_tokens
    text_config: object
    vision_config: object | None

    @property
    def is_vlm(self) -> bool:
        return self.name in MROPE_FAMILIES + DEEPSTACK_FAMILIES

    @property
    def has_deepstack(self) -> bool:
        return self.name in DEEPSTACK_FAMILIES

    @property
    def hidden_size(self) -> int:
        return int(self.text_config.hidden_size)

    @property
    def num_layers(self) -> int:
        return len(self.language_model.layers)

    @property
    def deepstack_levels(self) -> int:
        """How many DeepStack levels HF actually adds: one per decoder layer, from layer 0, at most."""
        if not self.has_deepstack:
            return 0
        return min(len(self.vision_config.deepstack_visual_indexes or ()), self.num_layers)


def family_of(model: object, what: str) -> Family:
    """Identify ``model`` (a transformers model as loaded) or raise naming what it lacks.

    Raises :class:`WidthContractError` for the bare text model of a VLM (no DeepStack
    information, no vision tower) and ``TypeError`` for anything unsupported.
    """
    where = type(model).__name__
    config = getattr(model, "config", None)
    name = getattr(config, "model_type", None)
    if config is None or name is None:
        raise TypeError(f"slabstage.hf.{what}: {where} is not a transformers model (it has no config.model_type)")
    if name in BARE_TEXT_OF_VLM:
        raise WidthContractError(
            f"slabstage.hf.{what}: {where} is the text model of a VLM ({name}) loaded alone: it carries no "
            f"DeepStack levels, vision tower or rope index; pass the ...ForConditionalGeneration or ...Model "
            f"that holds it")
    if name not in SUPPORTED:
        raise TypeError(f"slabstage.hf.{what}: {where} (model_type {name!r}) is not supported; "
                        f"supported model types: {', '.join(SUPPORTED)}")
    base = getattr(model, "base_model", model)
    lm = getattr(base, "language_model", base)
    for part in ("layers", "norm", "rotary_emb", "embed_tokens"):
        if not hasattr(lm, part):
            raise TypeError(f"slabstage.hf.{what}: {where}'s language model {type(lm).__name__} lacks .{part}; "
                            f"this transformers layout is not supported (checked with transformers 5.x)")
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    vision_config = getattr(config, "vision_config", None)
    if name in MROPE_FAMILIES + DEEPSTACK_FAMILIES and (vision_config is None or not hasattr(base, "visual")):
        raise TypeError(f"slabstage.hf.{what}: {where} ({name}) lacks its vision tower (.visual) or vision_config")
    if getattr(text_config, "hidden_size", None) is None:
        raise TypeError(f"slabstage.hf.{what}: {where}'s text config lacks hidden_size")
    return Family(name, model, base, lm, text_config, vision_config)
