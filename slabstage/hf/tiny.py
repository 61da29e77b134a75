"""Tiny random Hugging Face models and prompts, built from config objects (nothing is downloaded).

For tests, the demo, the example and the benchmark: ``tiny_model(family)`` and
``tiny_prompt(model, ...)``. Sizes are parameters, so the benchmark builds its
mid-size Qwen3-VL from the same code.
"""

from __future__ import annotations

import torch

__all__ = ["FAMILIES", "tiny_model", "tiny_prompt", "tiny_request"]

FAMILIES = ("llama", "qwen2", "qwen3", "qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")
VOCAB = 96
IMAGE, VIDEO, VISION_START, VISION_END = 90, 91, 92, 93  # special ids, above every text id
PATCH, MERGE, TEMPORAL = 4, 2, 2


def _random_text(n: int, g: torch.Generator) -> torch.Tensor:
    return torch.randint(0, VISION_START - 8, (n,), generator=g)


def _placeholders(token: int, rows: int) -> torch.Tensor:
    """``rows`` placeholder tokens between a vision-start and a vision-end token."""
    return torch.cat([torch.tensor([VISION_START]), torch.full((rows,), token), torch.tensor([VISION_END])])


def _text(hidden, layers, heads, kv_heads, intermediate, vocab, **extra) -> dict:
    return dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=4096,
                rms_norm_eps=1e-6, **extra)


def _config(family: str, hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int, vocab: int,
            deepstack: int, deepstack_indexes=None, vision_depth=None, text_rope=None):
    import transformers as tf

    head_dim = hidden // heads
    quarter = head_dim // 8  # mrope sections split head_dim / 2 frequencies into t, h, w
    rope = {"rope_type": "default", "rope_theta": 10000.0,
            "mrope_section": [head_dim // 2 - 2 * quarter, quarter, quarter]}
    text = _text(hidden, layers, heads, kv_heads, intermediate, vocab)
    if text_rope is not None:
        if "vl" in family:
            raise ValueError("tiny_model: rope= is for the decoder LMs (the VLMs take mrope parameters)")
        text["rope_parameters"] = dict(text_rope)
    ids = dict(image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=VISION_START,
               vision_end_token_id=VISION_END)
    vision = dict(depth=2, num_heads=2, in_channels=3, patch_size=PATCH, spatial_merge_size=MERGE,
                  temporal_patch_size=TEMPORAL)
    if family == "llama":
        return tf.LlamaConfig(**text)
    if family == "qwen2":
        return tf.Qwen2Config(**text)
    if family == "qwen3":
        return tf.Qwen3Config(head_dim=head_dim, **text)
    if family == "qwen2_vl":
        return tf.Qwen2VLConfig(text_config=dict(text, rope_parameters=rope),
                                vision_config=dict(vision, embed_dim=16, hidden_size=hidden, mlp_ratio=2), **ids)
    if family == "qwen2_5_vl":
        return tf.Qwen2_5_VLConfig(
            text_config=dict(text, rope_parameters=rope),
            vision_config=dict(vision, hidden_size=16, intermediate_size=32, out_hidden_size=hidden,
                               window_size=PATCH * MERGE * 2, fullatt_block_indexes=[1]), **ids)
    indexes = list(range(deepstack)) if deepstack_indexes is None else list(deepstack_indexes)
    q3_vision = dict(vision, hidden_size=16, intermediate_size=32, out_hidden_size=hidden,
                     num_position_embeddings=16, deepstack_visual_indexes=indexes,
                     depth=vision_depth or max(2, deepstack))
    q3_text = dict(text, head_dim=head_dim, rope_parameters=dict(rope, mrope_interleaved=True))
    if family == "qwen3_vl":
        return tf.Qwen3VLConfig(text_config=q3_text, vision_config=q3_vision, **ids)
    if family == "qwen3_vl_moe":
        moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=intermediate // 2,
                   decoder_sparse_step=1)
        return tf.Qwen3VLMoeConfig(text_config=dict(q3_text, **moe), vision_config=q3_vision, **ids)
    raise ValueError(f"unknown family {family!r}; one of {FAMILIES}")


def tiny_model(family: str, *, hidden: int = 32, layers: int = 2, heads: int = 4, kv_heads: int = 2,
               intermediate: int = 64, vocab: int = VOCAB, deepstack: int = 2, dtype=torch.float32,
               device="cpu", seed: int = 0, attn: str = "sdpa", bare: bool = False, deepstack_indexes=None,
               vision_depth: int | None = None, rope: dict | None = None):
    """A random-weight model of ``family`` in eval mode: the ``...ForConditionalGeneration`` of a
    VLM, the ``...ForCausalLM`` of a decoder LM (``bare=True``: the base ``...Model``).

    Qwen3-VL: ``deepstack_indexes`` (default ``range(deepstack)``) and ``vision_depth`` (default
    ``max(2, deepstack)``) set the vision tower's ``deepstack_visual_indexes`` and depth.
    Decoder LMs: ``rope`` replaces the text config's ``rope_parameters`` (e.g. a dynamic rope)."""
    import transformers as tf

    config = _config(family, hidden, layers, heads, kv_heads, intermediate, vocab, deepstack, deepstack_indexes,
                     vision_depth, rope)
    config._attn_implementation = attn
    for sub in ("text_config", "vision_config"):
        if getattr(config, sub, None) is not None:
            getattr(config, sub)._attn_implementation = attn
    cls = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "qwen2_vl": "Qwen2VL", "qwen2_5_vl": "Qwen2_5_VL",
           "qwen3_vl": "Qwen3VL", "qwen3_vl_moe": "Qwen3VLMoe"}[family]
    head = "ForConditionalGeneration" if "vl" in family else "ForCausalLM"
    with torch.random.fork_rng(devices=[]), torch.device(device):  # built on the device: big configs init fast
        torch.manual_seed(seed)
        model = getattr(tf, cls + ("Model" if bare else head))(config)
        if family == "qwen3_vl_moe":  # HF initialises expert weights to empty memory in some versions
            for p in model.parameters():
                if not torch.isfinite(p).all():
                    torch.nn.init.normal_(p, std=0.02)
    return model.to(device=device, dtype=dtype).eval().requires_grad_(False)


def tiny_prompt(model, grids, *, text_lens=None, generator=None, dtype=None):
    """One prompt: text, then per image ``(t, h, w)`` in ``grids`` a vision-start token, the image's
    placeholder tokens and a vision-end token, then text. Returns ``(input_ids [L], pixel_values,
    image_grid_thw)`` on the host (pixels are ``None`` for a text-only prompt)."""
    g = generator or torch.Generator().manual_seed(0)
    text_lens = text_lens or [5] * (len(grids) + 1)
    parts = [_random_text(text_lens[0], g)]
    pixels = []
    for i, (t, h, w) in enumerate(grids):
        parts += [_placeholders(IMAGE, t * h * w // MERGE ** 2), _random_text(text_lens[i + 1], g)]
        pixels.append(torch.randn(t * h * w, 3 * TEMPORAL * PATCH * PATCH, generator=g))
    ids = torch.cat(parts)
    if not grids:
        return ids, None, None
    pv = torch.cat(pixels)
    if dtype is not None:
        pv = pv.to(dtype)
    return ids, pv, torch.tensor(grids, dtype=torch.int64)


def tiny_request(model, images=(), videos=(), *, text_lens=None, seconds=None, generator=None, dtype=None):
    """One request with ``images`` and then ``videos`` (``(t, h, w)`` grids), text around each: ``(request,
    hf)``, where ``request`` is a :class:`slabstage.hf.Request` (items from the model's vision tower) and ``hf``
    the keyword arguments HF's ``generate`` takes for the same prompt (``input_ids`` and the pixels, grids and
    token types). A Qwen3-VL video's frames are parted by two text tokens (its timestamps), as its processor
    does. ``seconds``: Qwen2.5-VL's ``second_per_grid_ts``, one per video. A text-only model takes neither
    images nor videos (``text_lens[0]`` tokens of text)."""
    from .media import media_items
    from .mrope import mm_token_type_ids
    from .pack import Request

    g = generator or torch.Generator().manual_seed(0)
    text_lens = list(text_lens or [5] * (len(images) + len(videos) + 1))
    parts = [_random_text(text_lens[0], g)]
    frames = model.config.model_type.startswith("qwen3")
    for k, (t, h, w) in enumerate(images):
        parts += [_placeholders(IMAGE, t * h * w // MERGE ** 2), _random_text(text_lens[k + 1], g)]
    for k, (t, h, w) in enumerate(videos):
        if frames:
            parts += [torch.cat([_random_text(2, g), _placeholders(VIDEO, h * w // MERGE ** 2)]) for _ in range(t)]
        else:
            parts.append(_placeholders(VIDEO, t * h * w // MERGE ** 2))
        parts.append(_random_text(text_lens[len(images) + k + 1], g))
    ids = torch.cat(parts)
    hf = dict(input_ids=ids[None])
    if not images and not videos:
        return Request(ids), hf
    device = next(model.parameters()).device
    dtype = dtype or next(model.parameters()).dtype
    pixels = (lambda grids: torch.randn(sum(t * h * w for t, h, w in grids), 3 * TEMPORAL * PATCH * PATCH,
                                        generator=g).to(device, dtype) if grids else None)
    grid = (lambda grids: torch.tensor(grids, dtype=torch.int64) if grids else None)
    igrid, vgrid = grid(images), grid(videos)
    pv, pvv = pixels(images), pixels(videos)
    items = media_items(model, pixel_values=pv, image_grid_thw=igrid, pixel_values_videos=pvv, video_grid_thw=vgrid)
    hf.update(mm_token_type_ids=mm_token_type_ids(model, ids[None]))
    for name, value in (("pixel_values", pv), ("image_grid_thw", igrid), ("pixel_values_videos", pvv),
                        ("video_grid_thw", vgrid), ("second_per_grid_ts", seconds)):
        if value is not None:
            hf[name] = value
    return Request(ids, items, image_grid_thw=igrid, video_grid_thw=vgrid, second_per_grid_ts=seconds), hf
