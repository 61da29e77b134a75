"""The slab width of a Hugging Face model."""

from __future__ import annotations

from ..staging.width import WidthContractError, resolve_input_embeds_width
from ._family import family_of

__all__ = ["input_embeds_width"]


def input_embeds_width(model) -> int:
    """Width of the ``input_embeds`` slab for ``model`` (as loaded: ``...ForConditionalGeneration``,
    ``...Model``, ``LlamaForCausalLM``, ...).

    - a declared ``input_embeds_hidden_size`` on the model wins (checked by
      :func:`slabstage.resolve_input_embeds_width`);
    - Qwen3-VL / Qwen3-VL-MoE: text hidden size x (1 + k), k the DeepStack levels HF
      applies (docs/hf.md, "DeepStack levels");
    - Qwen2-VL, Qwen2.5-VL, Llama, Qwen2, Qwen3: the text hidden size.

    Raises :class:`WidthContractError` for the bare text model of a VLM, for a vision
    tower whose output width is not the text hidden size, and for a bad declaration;
    ``TypeError`` for an unsupported model, naming what it lacks.
    """
    fam = family_of(model, "input_embeds_width")
    hidden = fam.hidden_size
    if fam.is_vlm:
        vc = fam.vision_config
        # Qwen2-VL names the merger's output hidden_size; later versions out_hidden_size
        out = getattr(vc, "out_hidden_size", None) if fam.name != "qwen2_vl" else getattr(vc, "hidden_size", None)
        if out != hidden:
            raise WidthContractError(
                f"slabstage.hf.input_embeds_width: {type(model).__name__}'s vision tower emits rows {out} wide "
                f"but the text hidden size is {hidden}: media rows would not fit column block 0 of the slab")
    return resolve_input_embeds_width(model, hidden * (1 + fam.deepstack_levels))
