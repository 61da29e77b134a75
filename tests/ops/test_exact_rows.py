"""Rows staged bit for bit: padding and zero-filled bad rows are +0.0 whatever text_scale's sign, bf16
subnormals keep their value, and slabs staged from several threads at once each get their rows.
"""

import threading
import torch
import slabstage as ss

from builders import ids_and_table  # noqa: I001 - tests/builders.py

V, W, T = 40, 24, 64


def _inputs(n=10, seed=0):
    return ids_and_table(V, W, n, seed)


def test_padding_and_bad_rows_are_plus_zero_whatever_the_scale():
    ids, table = _inputs()
    ids[3] = V + 5  # a bad id: the row is zero-filled
    slab = torch.full((T, W), float("nan"))
    errors = ss.new_error_word("cpu")
    ss.stage_embeddings(slab, ids, table, text_scale=-2.0, pad_to=16, errors=errors)
    zero_rows = torch.cat([slab[3:4], slab[10:16]])
    assert torch.equal(zero_rows.view(torch.int32), torch.zeros_like(zero_rows).view(torch.int32))  # +0.0 bits
    good = torch.tensor([r for r in range(10) if r != 3])
    assert torch.equal(slab[good], table[ids[good]] * -2.0)


def test_staging_from_several_threads():
    ids, table = _inputs(20)
    slabs = [torch.full((T, W), float("nan")) for _ in range(6)]
    failures = []

    def work(slab):
        try:
            ss.stage_embeddings(slab, ids, table, pad_to=24)
        except Exception as e:  # noqa: BLE001 - collected and asserted below
            failures.append(e)

    threads = [threading.Thread(target=work, args=(s,)) for s in slabs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures
    for slab in slabs:
        assert torch.equal(slab[:20], table[ids]) and torch.equal(slab[20:24], torch.zeros(4, W))


def test_bf16_subnormals_are_staged_exactly():
    table = torch.tensor([[9.18e-41, -1e-40, 5e-39, 1.0]] * 4, dtype=torch.float32).to(torch.bfloat16)
    assert table[0, 0].item() != 0.0  # a bf16 subnormal
    slab = torch.full((8, 4), float("nan"))
    ss.stage_embeddings(slab, torch.tensor([0, 1, 2]), table, pad_to=4)
    assert torch.equal(slab[:3], table[:3].float())
