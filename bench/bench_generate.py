"""Generation through slabstage (``slabstage.hf.Generator``) against HF's ``generate`` on the same model and prompts.

Two models, random bf16 weights on one GPU, greedy, 8 requests, 64 new tokens each (no EOS):
- ``qwen3_vl``: the mid-size Qwen3-VL of bench_hf.py (hidden 2048, 4 layers, 16/8 heads, 3 DeepStack levels),
  each request text, one image of grid (1, 32, 56) (448 placeholder rows, pixels through the vision tower),
  text; prompt lengths differ a little (40 + 3k text tokens);
- ``qwen2_7b``: the Qwen2-7B-shaped 4-layer decoder (hidden 3584, 28/4 heads, head dim 128), 8 x 1024 tokens.

Time to first token (TTFT): from the pixels (the vision encoder runs inside the timed span, both sides, one
tower call over the 8 images) to the first new id of every request: ``generate(max_new_tokens=1)``.
Decode: ``8 * 63 / (T(64) - T(1))`` tokens a second, both sides at batch 8. HF runs the 8 prompts as one
batch (left-padded where lengths differ), sdpa. The vision encoder's own time and its share of each TTFT are
reported. Medians of ``ROUNDS`` rounds. Every request's ids are also compared with HF's (bf16: the first
differing position is reported, not asserted). Our side is a ``Generator`` made (and captured) once, outside the
times. One test a model (``test_generate[model]``), the figures in ``extra_info`` (``metric="figures"``; the
test's own timing is the whole comparison's wall time); ``python bench/run.py --suite generate``. Skips without
CUDA or transformers.
"""

from __future__ import annotations

import statistics
import time

import pytest
import torch

pytest.importorskip("transformers")
if not torch.cuda.is_available():
    pytest.skip("generation benchmarks need a CUDA device", allow_module_level=True)

import slabstage.hf as sshf  # noqa: E402
from slabstage.hf.generate import Generator  # noqa: E402
from slabstage.hf.tiny import IMAGE, PATCH, TEMPORAL, VISION_END, VISION_START, tiny_model  # noqa: E402

MODELS = {
    "qwen3_vl": dict(family="qwen3_vl", hidden=2048, layers=4, heads=16, kv_heads=8, intermediate=6144,
                     vocab=32000, deepstack=3),
    "qwen2_7b": dict(family="qwen2", hidden=3584, layers=4, heads=28, kv_heads=4, intermediate=18944, vocab=32000),
}
GRID = (1, 32, 56)
REQUESTS, NEW, PROMPT = 8, 64, 1024
ROUNDS = 3
DEVICE, DTYPE = "cuda", torch.bfloat16


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _prompts(model, name: str, g):
    """``[(ids, pixels or None)]``: the 8 prompts."""
    out = []
    for k in range(REQUESTS):
        if name == "qwen2_7b":
            out.append((torch.randint(0, 30000, (PROMPT,), generator=g), None))
            continue
        rows = GRID[0] * GRID[1] * GRID[2] // 4
        text = [torch.randint(0, 80, (n,), generator=g) for n in (20 + 3 * k, 20)]
        ids = torch.cat([text[0], torch.tensor([VISION_START]), torch.full((rows,), IMAGE), torch.tensor([VISION_END]),
                         text[1]])
        pixels = torch.randn(GRID[0] * GRID[1] * GRID[2], 3 * TEMPORAL * PATCH * PATCH, generator=g)
        out.append((ids, pixels.to(DEVICE, DTYPE)))
    return out


def _ours(model, gen, prompts, new: int):
    """Encoder (media_items) and generation, timed together; returns (seconds, ids)."""
    grid = torch.tensor([GRID])
    _sync()
    start = time.perf_counter()
    if prompts[0][1] is None:
        requests = [sshf.Request(ids) for ids, _ in prompts]
    else:  # the vision tower once over the 8 images, as HF runs it; one item each
        items = _items(model, prompts)
        requests = [sshf.Request(ids, [item], image_grid_thw=grid) for (ids, _), item in zip(prompts, items)]
    out = gen.generate(requests, max_new_tokens=new, eos_token_id=[])
    _sync()
    return time.perf_counter() - start, out


def _items(model, prompts):
    return sshf.media_items(model, pixel_values=torch.cat([p for _, p in prompts]),
                            image_grid_thw=torch.tensor([GRID] * len(prompts)))


def _encoder(model, prompts):
    """The vision tower's time alone (0 for a text model)."""
    if prompts[0][1] is None:
        return 0.0
    _sync()
    start = time.perf_counter()
    _items(model, prompts)
    _sync()
    return time.perf_counter() - start


def _hf(model, prompts, new: int):
    """HF's batched greedy generate on the same prompts (left padding), vision encoder inside; (seconds, ids)."""
    L = max(ids.shape[0] for ids, _ in prompts)
    ids = torch.zeros(len(prompts), L, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for k, (p, _) in enumerate(prompts):
        ids[k, L - p.shape[0]:] = p
        mask[k, L - p.shape[0]:] = 1
    kw = dict(input_ids=ids.to(DEVICE), attention_mask=mask.to(DEVICE))
    if prompts[0][1] is not None:
        kw.update(pixel_values=torch.cat([p for _, p in prompts]),
                  image_grid_thw=torch.tensor([GRID] * len(prompts)).to(DEVICE),
                  mm_token_type_ids=sshf.mm_token_type_ids(model, ids).to(DEVICE))
    _sync()
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(**kw, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
    _sync()
    return time.perf_counter() - start, out[:, L:].tolist()


def run(name: str, rounds: int) -> dict:
    cfg = dict(MODELS[name])
    model = tiny_model(cfg.pop("family"), **cfg, dtype=DTYPE, device=DEVICE)
    model.generation_config.eos_token_id = None
    prompts = _prompts(model, name, torch.Generator().manual_seed(0))
    budget = sum(ids.shape[0] for ids, _ in prompts)
    start = time.perf_counter()
    gen = Generator(model, max_running=REQUESTS, max_context=max(ids.shape[0] for ids, _ in prompts) + NEW,
                    token_budget=budget, buckets=[budget])
    capture_s = time.perf_counter() - start
    with torch.no_grad():
        for _ in range(2):  # warm-up: kernels compiled, allocator settled
            _ours(model, gen, prompts, 2)
            _hf(model, prompts, 2)
        t = {"ours1": [], "ours": [], "hf1": [], "hf": [], "enc": []}
        for _ in range(rounds):
            t["ours1"].append(_ours(model, gen, prompts, 1)[0])
            ours_s, ours = _ours(model, gen, prompts, NEW)
            t["ours"].append(ours_s)
            t["hf1"].append(_hf(model, prompts, 1)[0])
            hf_s, ref = _hf(model, prompts, NEW)
            t["hf"].append(hf_s)
            t["enc"].append(_encoder(model, prompts))
    med = {k: statistics.median(v) for k, v in t.items()}
    decode = lambda total, first: REQUESTS * (NEW - 1) / (total - first)  # noqa: E731
    first = [next((i for i, (a, b) in enumerate(zip(o, r)) if a != b), None) for o, r in zip(ours, ref)]
    result = dict(
        model=name, requests=REQUESTS, new_tokens=NEW, prompt_tokens=[ids.shape[0] for ids, _ in prompts],
        capture_s=round(capture_s, 2),
        ttft_ms=round(med["ours1"] * 1e3, 2), hf_ttft_ms=round(med["hf1"] * 1e3, 2),
        ttft_speedup=round(med["hf1"] / med["ours1"], 2),
        decode_tok_s=round(decode(med["ours"], med["ours1"]), 1),
        hf_decode_tok_s=round(decode(med["hf"], med["hf1"]), 1),
        decode_speedup=round(decode(med["ours"], med["ours1"]) / decode(med["hf"], med["hf1"]), 2),
        encoder_ms=round(med["enc"] * 1e3, 2),
        encoder_share_of_ttft=round(med["enc"] / med["ours1"], 3),
        encoder_share_of_hf_ttft=round(med["enc"] / med["hf1"], 3),
        total_ms=round(med["ours"] * 1e3, 1), hf_total_ms=round(med["hf"] * 1e3, 1),
        first_differing_token=first,
        targets=dict(ttft_speedup=1.5, decode_speedup=3.0),
        torch=torch.__version__, device=torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE,
    )
    return result


@pytest.mark.parametrize("name", list(MODELS))
def test_generate(benchmark, name):
    result = {}
    benchmark._timer = time.perf_counter
    benchmark.pedantic(lambda: result.update(run(name, ROUNDS)), rounds=1, iterations=1)
    benchmark.extra_info.update(suite="generate", metric="figures", impl=name, **result)
