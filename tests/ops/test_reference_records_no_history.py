"""The PyTorch reference path stages under no autograd: a table that requires grad leaves the slab without
history.
"""

import torch
import slabstage as ss
from slabstage.staging.reference import stage_embeddings_reference

from builders import ids_and_table  # noqa: I001 - tests/builders.py

V, W, T = 40, 24, 64


def _inputs(n=10, seed=0):
    return ids_and_table(V, W, n, seed)


def test_reference_path_records_no_history():
    ids, table = _inputs()
    table.requires_grad_(True)
    slab = torch.zeros(T, W)
    for _ in range(3):
        stage_embeddings_reference(slab, ids, table, pad_to=12, errors=ss.new_error_word("cpu"))
    assert not slab.requires_grad and slab.grad_fn is None
