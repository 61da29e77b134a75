"""`python -m slabstage demo` on CPU: it runs, checks every batch and says what it did."""

import pytest

from slabstage import __main__ as cli
from slabstage import demo


def test_demo_runs_every_variant_on_cpu(capsys):
    assert demo.main(["--steps", "3", "--device", "cpu", "--max-tokens", "48", "--seed", "1"]) == 0
    out = capsys.readouterr().out
    for variant in ("plain", "deepstack", "hc"):
        assert f"{variant}: 3/3 batches bit-identical to eager" in out
    assert "declares input_embeds_hidden_size=768" in out and "declares input_embeds_hidden_size=1024" in out
    assert out.count("log: slabstage: running prefill eagerly (") == 3  # the runner's log line, shown inline
    assert "stage us" in out and "replay us" in out and "eager us" in out
    assert "demo: OK: all 9 batches bit-identical to eager" in out


def test_demo_covers_every_kind_of_batch(capsys):
    assert demo.main(["--variant", "deepstack", "--steps", "6", "--device", "cpu", "--max-tokens", "64"]) == 0
    out = capsys.readouterr().out
    for kind in ("between", "exact", "pad>ratio", "beyond"):
        assert f" {kind} " in out


def test_quiet_prints_the_summary_only(capsys):
    assert demo.main(["--variant", "plain", "--steps", "2", "--device", "cpu", "--max-tokens", "32", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "plain: 2/2 batches bit-identical" in out and "stage us" not in out


def test_a_mismatch_fails_the_demo(capsys, monkeypatch):
    monkeypatch.setattr(demo, "outputs_match", lambda out, ref: False)
    assert demo.main(["--variant", "hc", "--steps", "2", "--device", "cpu", "--max-tokens", "32"]) == 1
    out = capsys.readouterr().out
    assert "NO" in out and "demo: FAILED: 2 of 2 batches differ" in out


def test_help_lists_the_options(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["demo", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for option in ("--variant", "--steps", "--max-tokens", "--device", "--dtype", "--seed", "--quiet"):
        assert option in out


def test_bad_arguments_are_refused(capsys):
    with pytest.raises(SystemExit) as info:
        demo.main(["--steps", "0"])
    assert info.value.code == 2
    with pytest.raises(SystemExit):
        demo.main(["--variant", "wide"])


def test_plan_sizes_cycles_through_the_kinds():
    import random

    buckets = [1, 2, 4, 8, 16, 32, 48]
    plan = demo.plan_sizes(12, buckets, 64, 1.5, random.Random(0))
    assert len(plan) == 12
    assert {kind for kind, _ in plan} == {"between", "exact", "pad>ratio", "beyond"}
    for kind, n in plan:
        assert demo._kind(n, buckets, 1.5) == kind and 1 <= n <= 64


@pytest.mark.cuda
def test_demo_replays_graphs_on_cuda(capsys):
    assert demo.main(["--steps", "8", "--device", "cuda", "--max-tokens", "512"]) == 0
    out = capsys.readouterr().out
    assert "log: slabstage: captured" in out and "graph " in out
    for variant in ("plain", "deepstack", "hc"):
        assert f"{variant}: 8/8 batches bit-identical to eager" in out
    assert "0 replayed" not in out
