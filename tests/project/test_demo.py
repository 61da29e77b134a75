"""``python -m slabstage demo``: it runs, checks every batch against an independent merge and says what it did."""

import os
import random
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from slabstage import __main__ as cli
from slabstage import demo
from slabstage.demo import run as demo_run
from slabstage.models import ToyMultimodalModel

HAS_CUDA = torch.cuda.is_available()
ROOT = Path(__file__).resolve().parents[2]


def test_demo_runs_every_variant_on_cpu(capsys):
    assert demo.main(["--steps", "3", "--device", "cpu", "--max-tokens", "48", "--seed", "1"]) == 0
    out = capsys.readouterr().out
    for variant in ("plain", "deepstack", "hc"):
        assert f"{variant}: 3/3 batches match the plain-torch merge and its eager forward" in out
    assert "declares input_embeds_hidden_size=768" in out and "declares input_embeds_hidden_size=1024" in out
    if not HAS_CUDA:  # conftest sets the interpreter; on a GPU machine CPU tensors take the PyTorch reference
        assert "staging: the Triton kernels under Triton's interpreter (TRITON_INTERPRET=1)" in out
    else:
        assert "staging: the PyTorch reference" in out
    assert out.count("log: slabstage: running prefill eagerly (") == 3  # the runner's log line, shown inline
    assert "demo: OK: all 9 batches match the plain-torch merge and its eager forward, bit for bit" in out


def test_cpu_shows_no_replay_columns_or_times(capsys):
    assert demo.main(["--variant", "deepstack", "--steps", "2", "--device", "cpu", "--max-tokens", "32"]) == 0
    out = capsys.readouterr().out
    assert "graphs: none, CUDA graphs need a GPU" in out
    header = next(line for line in out.splitlines() if line.strip().startswith("# tokens"))
    assert header.split() == ["#", "tokens", "seqs", "images", "media", "slab", "output"]
    for word in ("stage us", "replay", "run us", "graph ", "kind", "capture:"):
        assert word not in out


def test_quiet_prints_the_summary_only(capsys):
    assert demo.main(["--variant", "plain", "--steps", "2", "--device", "cpu", "--max-tokens", "32", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "plain: 2/2 batches match" in out and "# tokens" not in out and "log:" not in out
    assert "staging: " in out  # what ran is said even when quiet


def test_reference_merge_is_plain_torch_and_ignores_media_index():
    model = ToyMultimodalModel("deepstack", hidden_size=32, num_heads=2, vocab_size=50, seed=3)
    g = torch.Generator().manual_seed(0)
    batch = demo.build_batch(model, 20, num_seqs=2, media_fraction=0.5, g=g)
    ref = demo.reference_merge(model, batch, pad_to=24)
    embeds = ref["input_embeds"]
    assert embeds.shape == (24, model.embed_width) and not embeds[20:].any()
    assert not ref["positions"][20:].any() and torch.equal(ref["positions"][:20], batch.positions)
    media_rows = (batch.input_ids == model.media_token_id).nonzero().flatten().tolist()
    rows = [row for item in batch.media for row in item]  # the items' rows end to end
    assert len(media_rows) == len(rows) > 0
    for k, r in enumerate(media_rows):
        assert torch.equal(embeds[r], rows[k])
    for r in set(range(20)) - set(media_rows):
        H = model.hidden_size
        assert torch.equal(embeds[r, :H], model.embed_tokens.weight[batch.input_ids[r]])
        assert not embeds[r, H:].any()  # DeepStack blocks: zeros on text rows
    batch.media_index = None  # the merge reads the placeholder tokens, not media_index
    assert torch.equal(demo.reference_merge(model, batch, pad_to=24)["input_embeds"], embeds)


def test_build_batch_gives_media_as_a_list_of_one_tensor_per_image():
    model = ToyMultimodalModel("deepstack", hidden_size=32, num_heads=2, vocab_size=50, seed=3)
    batch = demo.build_batch(model, 40, num_seqs=4, media_fraction=0.5, g=torch.Generator().manual_seed(0))
    assert isinstance(batch.media, list) and len(batch.media) == 4  # every sequence holds an image here
    starts = batch.extend_start_loc.tolist()
    ends = [*starts[1:], 40]
    for item, start, end in zip(batch.media, starts, ends):  # one item per image, in token order
        assert isinstance(item, torch.Tensor) and item.dim() == 2 and item.shape[1] == model.media_width
        placeholders = int((batch.input_ids[start:end] == model.media_token_id).sum())
        assert item.shape[0] == placeholders > 0
    no_images = demo.build_batch(model, 10, num_seqs=2, media_fraction=0.0, g=torch.Generator().manual_seed(0))
    assert no_images.media is None and no_images.media_index is None


def test_reference_merge_repeats_for_hyper_connections():
    model = ToyMultimodalModel("hc", hidden_size=16, num_heads=2, hc_mult=3, vocab_size=40)
    batch = demo.build_batch(model, 9, num_seqs=1, media_fraction=0.4, g=torch.Generator().manual_seed(1))
    embeds = demo.reference_merge(model, batch, pad_to=9)["input_embeds"]
    assert torch.equal(embeds[:, :16], embeds[:, 16:32]) and torch.equal(embeds[:, :16], embeds[:, 32:])


def test_build_batch_never_draws_the_placeholder_as_text():
    model = ToyMultimodalModel("plain", hidden_size=16, num_heads=2, vocab_size=3)  # 1 in 3 would collide
    batch = demo.build_batch(model, 60, num_seqs=3, media_fraction=0.0, g=torch.Generator().manual_seed(0))
    assert batch.media is None and not (batch.input_ids == model.media_token_id).any()


def test_a_wrong_staging_fails_the_demo(capsys, monkeypatch):
    """The check is not vacuous: a batch whose media_index points at the wrong media rows is caught."""
    build = demo.build_batch

    def shifted(model, n, **kw):
        batch = build(model, n, **kw)
        if batch.media is not None and sum(item.shape[0] for item in batch.media) > 1:
            index = batch.media_index.clone()
            media = index >= 0
            index[media] = index[media].roll(1)
            batch.media_index = index
        return batch

    monkeypatch.setattr(demo_run, "build_batch", shifted)
    assert demo.main(["--variant", "hc", "--steps", "3", "--device", "cpu", "--max-tokens", "40", "--seed", "2"]) == 1
    out = capsys.readouterr().out
    assert "NO" in out and "demo: FAILED:" in out


def test_an_output_mismatch_fails_the_demo(capsys, monkeypatch):
    monkeypatch.setattr(demo_run, "outputs_match", lambda out, ref: False)
    assert demo.main(["--variant", "plain", "--steps", "2", "--device", "cpu", "--max-tokens", "32"]) == 1
    out = capsys.readouterr().out
    assert "yes   NO" in out and "demo: FAILED: 2 of 2 batches differ" in out


def test_help_lists_the_options(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["demo", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for option in ("--model", "--variant", "--steps", "--max-tokens", "--device", "--dtype", "--seed", "--quiet"):
        assert option in out


def test_bad_arguments_are_refused():
    for argv in (["--steps", "0"], ["--variant", "wide"], ["--model", "gpt2"]):
        with pytest.raises(SystemExit) as info:
            demo.main(argv)
        assert info.value.code == 2


def test_model_qwen3_vl_hands_the_rest_to_the_hf_demo(monkeypatch):
    seen = []
    fake = types.ModuleType("slabstage.hf.demo")
    fake.main = lambda argv: seen.append(argv) or 0
    monkeypatch.setitem(sys.modules, "slabstage.hf.demo", fake)
    assert demo.main(["--model", "qwen3-vl", "--steps", "2", "--help"]) == 0
    assert demo.main(["--seed", "3", "--model", "llama"]) == 0
    assert seen == [["--model", "qwen3-vl", "--steps", "2", "--help"], ["--model", "llama", "--seed", "3"]]


def test_every_hf_family_the_demo_builds_is_a_model_choice():
    from slabstage.hf.tiny import FAMILIES
    assert sorted(m.replace("-", "_").replace(".", "_") for m in demo.HF_MODELS) == sorted(FAMILIES)


def test_model_qwen3_vl_without_transformers_says_what_to_install(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "slabstage.hf.demo", None)  # import fails, as without the hf extra
    assert demo.main(["--model", "qwen3-vl"]) == 2
    assert "pip install 'slabstage[hf]'" in capsys.readouterr().err


def test_plan_sizes_cycles_through_the_kinds():
    buckets = [1, 2, 4, 8, 16, 32, 48]
    plan = demo.plan_sizes(12, buckets, 64, 1.5, random.Random(0))
    assert len(plan) == 12
    assert {kind for kind, _ in plan} == {"between", "exact", "pad>ratio", "beyond"}
    for kind, n in plan:
        assert demo_run._kind(n, buckets, 1.5) == kind and 1 <= n <= 64


def test_the_command_restarts_under_the_interpreter_only_when_needed(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.interpreter_argv(["demo"]) == [sys.executable, "-m", "slabstage", "demo"]
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # an explicit choice is kept
    assert cli.interpreter_argv(["demo"]) is None
    monkeypatch.delenv("TRITON_INTERPRET")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert cli.interpreter_argv(["demo"]) is None


@pytest.mark.skipif(HAS_CUDA, reason="checks the CPU path of the command line")
def test_python_m_slabstage_demo_runs_the_kernels_under_the_interpreter():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "slabstage", "demo", "--variant", "plain", "--steps", "1",
                           "--max-tokens", "16"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "staging: the Triton kernels under Triton's interpreter (TRITON_INTERPRET=1)" in proc.stdout
    assert "demo: OK: all 1 batches match" in proc.stdout


@pytest.mark.cuda
def test_demo_replays_graphs_on_cuda(capsys):
    assert demo.main(["--steps", "8", "--device", "cuda", "--max-tokens", "512"]) == 0
    out = capsys.readouterr().out
    assert "log: slabstage: captured" in out and "graph " in out and "stage us" in out
    assert "staging: the Triton kernels" in out and "interpreter" not in out
    for variant in ("plain", "deepstack", "hc"):
        assert f"{variant}: 8/8 batches match the plain-torch merge" in out
    assert " 0 replayed" not in out
