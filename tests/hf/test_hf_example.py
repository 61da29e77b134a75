"""examples/hf_llama.py: a transformers Llama (random weights) through the graph runner.

Skipped without transformers (the optional extra ``hf``).
"""

import importlib.util
import pathlib

import pytest
import torch

import slabstage as ss

pytest.importorskip("transformers")

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "hf_llama.py"


@pytest.fixture(scope="module")
def hf():
    spec = importlib.util.spec_from_file_location("hf_llama_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def setup(hf, device, dtype, capacity, buckets=None):
    model = hf.build_model(device, dtype, seed=0)
    buffers = ss.StagingBuffers.allocate(max_num_tokens=capacity, max_batch_size=1, embed_width=hf.HIDDEN,
                                         embed_dtype=dtype, device=device)
    forward = hf.make_forward(model)
    runner = ss.PrefillGraphRunner(forward, buffers, buckets=buckets, progress=False)
    return model, buffers, forward, runner


def test_eager_path_on_cpu(hf):
    model, buffers, forward, runner = setup(hf, "cpu", torch.float32, 64)
    runner.capture()  # no CUDA: eager
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for n in (1, 9, 33, 64):
            batch = hf.make_batch(model, n, g)
            out = runner.run(batch, clone=True)
            assert out.shape == (n, hf.HIDDEN) and runner.last_bucket is None
            assert torch.equal(out, forward(buffers.registry.views(n)))
            # the model's own default path (no mask given, sdpa is_causal) agrees to rounding
            plain = model(inputs_embeds=buffers.input_embeds[:n][None], position_ids=batch.positions[None],
                          use_cache=False).last_hidden_state[0]
            assert torch.allclose(out, plain, rtol=1e-5, atol=1e-5)
            # the slab holds the model's embedding rows and the "encoder" rows where the spans put them
            ids = batch.input_ids
            media = batch.media_index if batch.media_index is not None else torch.full((n,), -1)
            want = model.embed_tokens.weight[ids].clone()
            if batch.media is not None:
                want[media >= 0] = batch.media[media[media >= 0]]
            assert torch.equal(buffers.input_embeds[:n], want)


def test_padding_rows_do_not_reach_the_sequence(hf):
    model = hf.build_model("cpu", torch.float32)
    forward = hf.make_forward(model)
    n, pad = 21, 11
    embeds = torch.randn(n + pad, hf.HIDDEN)
    positions = torch.cat([torch.arange(n), torch.zeros(pad, dtype=torch.long)])
    with torch.no_grad():
        alone = forward({"input_embeds": embeds[:n], "positions": positions[:n]})
        padded = forward({"input_embeds": embeds, "positions": positions})[:n]
    assert torch.allclose(padded, alone, rtol=1e-5, atol=1e-5)


def test_example_main_runs_on_cpu(hf, capsys):
    assert hf.main(["--device", "cpu", "--max-tokens", "40"]) == 0
    out = capsys.readouterr().out
    assert "OK: all" in out and "LlamaModel" in out


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_captured_hf_model_replays_like_eager(hf, dtype):
    buckets = [1, 8, 16, 48, 64, 128, 256]
    model, buffers, forward, runner = setup(hf, "cuda", dtype, 256, buckets=buckets)
    runner.max_padding_ratio = 64.0  # every size below replays a graph
    runner.capture()
    assert runner.captured
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n in (1, 5, 8, 13, 16, 17, 40, 48, 63, 64, 100, 128, 129, 200, 256):
            batch = hf.make_batch(model, n, g)
            out = runner.run(batch, clone=True)
            bucket = runner.last_bucket
            assert bucket == next(b for b in buckets if b >= n)
            ref = forward(buffers.registry.views(bucket))[:n]
            assert torch.equal(out, ref), f"{n} tokens, bucket {bucket}: {(out - ref).abs().max().item()}"
            plain = model(inputs_embeds=buffers.input_embeds[:n][None], position_ids=batch.positions[None].cuda(),
                          use_cache=False).last_hidden_state[0]
            # the default HF path (no mask given: is_causal, another SDPA kernel) agrees to rounding;
            # a wrong mask would be off by O(1)
            tol = dict(rtol=5e-2, atol=1e-1) if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-4)
            assert torch.allclose(out.float(), plain.float(), **tol)


@pytest.mark.cuda
def test_example_main_runs_on_cuda(hf, capsys):
    assert hf.main(["--device", "cuda", "--max-tokens", "256"]) == 0
    out = capsys.readouterr().out
    assert "graph" in out and "OK: all" in out
