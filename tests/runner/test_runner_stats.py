"""``stats()`` counts runs since the last ``capture()`` or ``reset()``, as its docstring says."""

import pytest
import torch

import slabstage as ss

W, T, V = 16, 40, 29
EMPTY = {"replays": {}, "eager": {}, "padded_rows": 0}


def run_some(runner, device, sizes=(5, 9, 30)):
    g = torch.Generator().manual_seed(3)
    table = torch.randn(V, W, generator=g).to(device)
    for n in sizes:
        runner.run(ss.PrefillBatch(input_ids=torch.randint(0, V, (n,), generator=g).to(device),
                                   positions=torch.arange(n, device=device), table=table))


@pytest.mark.parametrize("eager", [False, True], ids=["default", "enforce_eager"])
def test_stats_start_again_at_capture_and_reset(eager, device, stage_path):
    buf = ss.StagingBuffers.allocate(max_num_tokens=T, max_batch_size=2, embed_width=W, embed_dtype=torch.float32,
                                     device=device)
    runner = ss.PrefillGraphRunner(lambda v: v["input_embeds"] * 2, buf, buckets=[8, 16], progress=False,
                                   enforce_eager=eager, verify="off")  # (no bucket dropped for its timing)
    run_some(runner, device)  # before capture: eager runs
    assert sum(runner.stats()["eager"].values()) == 3
    runner.capture()
    assert runner.stats() == EMPTY
    run_some(runner, device)
    counted = runner.stats()
    assert sum(counted["replays"].values()) + sum(counted["eager"].values()) == 3
    if device.type == "cuda" and not eager:
        assert counted["replays"] == {8: 1, 16: 1} and counted["padded_rows"] == 3 + 7
    runner.reset()
    assert runner.stats() == EMPTY
    run_some(runner, device, sizes=(4,))
    assert sum(runner.stats()["eager"].values()) == 1
    runner.capture()
    assert runner.stats() == EMPTY
