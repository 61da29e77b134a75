"""Which Hugging Face model family a loaded model belongs to, and where its parts are: the one place that knows
transformers' layout (a VLM's base model holds ``visual`` and ``language_model``; a decoder LM's base model is
itself the language model). Every entry point calls :func:`family_of` first, so the checks common to all of them
(the transformers version, length-dependent rope) live here.
"""

from __future__ import annotations

import functools
import sys
import weakref
from dataclasses import dataclass

from ..staging.width import WidthContractError

__all__ = ["Family", "family_of", "TEXT_FAMILIES", "MROPE_FAMILIES", "DEEPSTACK_FAMILIES", "MIN_TRANSFORMERS",
           "length_dependent_rope", "transformers_version"]

TEXT_FAMILIES = ("llama", "qwen2", "qwen3")
MROPE_FAMILIES = ("qwen2_vl", "qwen2_5_vl")
DEEPSTACK_FAMILIES = ("qwen3_vl", "qwen3_vl_moe")
VLM_FAMILIES = MROPE_FAMILIES + DEEPSTACK_FAMILIES
SUPPORTED = TEXT_FAMILIES + VLM_FAMILIES
# the text halves of the VLMs above, loaded alone: no vision tower, no DeepStack levels, no rope index
BARE_TEXT_OF_VLM = tuple(f"{f}_text" for f in VLM_FAMILIES)
# 5.0.0 cannot build Qwen3-VL-MoE's text model (it reads a pad_token_id its config lacks); 5.1 and 5.2 take
# get_rope_index without mm_token_type_ids, which slabstage.hf.mrope_positions handles. Keep in step with
# pyproject.toml's hf and test extras, docs/hf.md and tests/hf/test_transformers_minimum.py.
MIN_TRANSFORMERS = "5.1.0"
# the entry points that run several packed sequences through one rotary call: there a rope whose frequencies
# follow the longest position in the call would give every sequence the frequencies of the longest one
PACKED_ROPE_ENTRY_POINTS = ("prefill_forward", "pack_requests", "generate")


@dataclass(frozen=True)
class Family:
    """The parts of one loaded model that the adapters use."""

    name: str  # config.model_type: "llama", "qwen2_5_vl", "qwen3_vl", ...
    model: object  # what the user passed
    base: object  # the base model: Qwen3VLModel, LlamaModel, ...
    language_model: object  # the decoder: has .layers, .norm, .rotary_emb, .embed_tokens
    text_config: object
    vision_config: object | None

    @functools.cached_property
    def merge(self) -> int:
        """The vision tower's spatial merge size (a VLM's)."""
        return int(self.vision_config.spatial_merge_size)

    @functools.cached_property
    def placeholder_ids(self) -> tuple[int, int]:
        """``(image_token_id, video_token_id)`` of a VLM's config."""
        config = self.model.config
        return config.image_token_id, config.video_token_id

    @functools.cached_property
    def tokens_per_second(self):
        """Qwen2.5-VL's ``vision_config.tokens_per_second`` (None for every other family)."""
        return getattr(self.vision_config, "tokens_per_second", None) if self.name == "qwen2_5_vl" else None

    @functools.cached_property
    def is_vlm(self) -> bool:
        return self.name in VLM_FAMILIES

    @functools.cached_property
    def has_deepstack(self) -> bool:
        return self.name in DEEPSTACK_FAMILIES

    @property
    def hidden_size(self) -> int:
        return int(self.text_config.hidden_size)

    @property
    def num_layers(self) -> int:
        return len(self.language_model.layers)

    @property
    def deepstack_features(self) -> int:
        """How many DeepStack features the vision tower emits per item (docs/hf.md, "DeepStack levels")."""
        if not self.has_deepstack:
            return 0
        tower = self.base.visual
        indexes = getattr(tower, "deepstack_visual_indexes", None)
        if indexes is None:
            indexes = self.vision_config.deepstack_visual_indexes
        indexes = list(indexes or ())
        blocks = getattr(tower, "blocks", None)
        depth = len(blocks) if blocks is not None else int(self.vision_config.depth)
        return sum(1 for i in range(depth) if i in indexes)

    @property
    def deepstack_levels(self) -> int:
        """How many DeepStack levels HF adds: at most one per decoder layer."""
        return min(self.deepstack_features, self.num_layers)


_KNOWN: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> {entry point: Family}


def family_of(model: object, what: str) -> Family:
    """:func:`identify` ``model`` for the entry point ``what``, once a model and entry point (config
    attribute reads cost microseconds each in transformers 5.x: a per-request path cannot pay them)."""
    try:
        known = _KNOWN.get(model)
    except TypeError:  # not weak-referenceable or hashable: not a model; identify says what it is
        return identify(model, what)
    if known is not None and what in known:
        _require_transformers(what)
        return known[what]
    fam = identify(model, what)
    _KNOWN.setdefault(model, {})[what] = fam
    return fam


def identify(model: object, what: str) -> Family:
    """The :class:`Family` of ``model`` (a transformers model as loaded) for the entry point ``what`` (it
    prefixes the errors). Raises ``ImportError`` for a transformers older than :data:`MIN_TRANSFORMERS`,
    :class:`WidthContractError` for the bare text model of a VLM, ``TypeError`` for anything unsupported, and,
    from :data:`PACKED_ROPE_ENTRY_POINTS`, ``ValueError`` for a :func:`length_dependent_rope`.
    """
    _require_transformers(what)
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
    if name in VLM_FAMILIES and (vision_config is None or not hasattr(base, "visual")):
        raise TypeError(f"slabstage.hf.{what}: {where} ({name}) lacks its vision tower (.visual) or vision_config")
    if getattr(text_config, "hidden_size", None) is None:
        raise TypeError(f"slabstage.hf.{what}: {where}'s text config lacks hidden_size")
    fam = Family(name, model, base, lm, text_config, vision_config)
    if what in PACKED_ROPE_ENTRY_POINTS:
        rope = length_dependent_rope(fam)
        if rope is not None:
            raise ValueError(
                f"slabstage.hf.{what}: {where} uses rope type {rope!r}, whose frequencies HF recomputes from the "
                f"longest position of each forward call; packed requests (and a captured graph) cannot follow "
                f"that, so {rope!r} rope is not supported: use a model with a fixed-frequency rope "
                f"(default, linear, yarn, llama3, ...)")
    return fam


def length_dependent_rope(fam: Family) -> str | None:
    """The rope type of ``fam``'s language model when HF's ``dynamic_rope_update`` recomputes its frequencies
    from the longest position of each call (a ``"dynamic"`` type, ``"longrope"``), else None."""
    kind = getattr(fam.language_model.rotary_emb, "rope_type", None)
    if kind is None:
        kind = (getattr(fam.text_config, "rope_parameters", None) or {}).get("rope_type", "default")
    # (rope_parameters keyed by layer type: one type a layer type)
    for each in map(str, kind.values() if isinstance(kind, dict) else (kind,)):
        if "dynamic" in each or each == "longrope":
            return each
    return None


def _require_transformers(what: str) -> None:
    version = transformers_version()
    if version is not None:  # (None: not a transformers model then; the type checks of family_of say so)
        _check_version(what, version)


def transformers_version() -> str | None:
    """The installed transformers' ``__version__`` (None: no transformers), read a cheap way: transformers'
    lazy module answers ``transformers.__version__`` through its ``__getattr__`` (microseconds, and the
    per-request entry points read it every call), so that read is made once; a version set on the module
    since (a test's monkeypatch) is in its ``__dict__`` and wins."""
    module = sys.modules.get("transformers")
    if module is None:
        try:
            import transformers as module
        except ImportError:
            return None
    version = module.__dict__.get("__version__")
    return _lazy_version(module) if version is None else version


@functools.lru_cache(maxsize=None)
def _lazy_version(module) -> str:
    return getattr(module, "__version__", "0")


@functools.lru_cache(maxsize=None)
def _check_version(what: str, found: str) -> None:
    from packaging.version import Version  # a dependency of transformers

    if Version(found) < Version(MIN_TRANSFORMERS):
        raise ImportError(f"slabstage.hf.{what} needs transformers>={MIN_TRANSFORMERS},<6, found {found}: "
                          f"pip install 'slabstage[hf]' (or pip install 'transformers>={MIN_TRANSFORMERS},<6')")
