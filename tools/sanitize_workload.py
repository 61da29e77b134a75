"""A short CUDA workload for compute-sanitizer: every staging kernel, the error paths, capture and replay.

    compute-sanitizer --tool memcheck --error-exitcode 1 python tools/sanitize_workload.py
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck --error-exitcode 1 \
        python tools/sanitize_workload.py
    compute-sanitizer --tool racecheck --error-exitcode 1 python tools/sanitize_workload.py

With PyTorch's caching allocator on, tensors are carved out of large segments,
so memcheck sees an access only when it leaves a segment. With
``PYTORCH_NO_CUDA_MEMORY_CACHING=1`` every tensor is its own ``cudaMalloc`` and
an access one element past a table, a media tensor or the slab is reported;
graph capture needs the caching allocator, so the runner then runs eagerly.

It stages a few batches with ``stage_embeddings`` (odd widths, dtype casts,
``repeat`` expansion, a vocab-parallel shard, bad token ids and media indices),
``media_index_from_mask`` (a count mismatch), ``stage_token_inputs`` (host and
device inputs, mrope) and ``plan_stage_batch`` (host inputs, bad ids), each
twice so that both the JIT launch and the cached fast launch run; every result
is compared with the PyTorch reference. Then it captures a toy runner for a few
buckets and replays batches (one past the largest bucket runs eagerly), each
compared with the eager forward. A few seconds natively. Without CUDA it runs
on the CPU under the Triton interpreter, which checks the script, not the
kernels. Prints ``SANITIZE WORKLOAD OK`` last; any mismatch raises.
"""

from __future__ import annotations

import os
import sys
import time

import torch

if not torch.cuda.is_available():  # must be chosen before slabstage defines its kernels
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import slabstage as ss  # noqa: E402
from slabstage import BAD_MEDIA_INDEX, BAD_TOKEN_ID, MEDIA_COUNT_MISMATCH, StagingError  # noqa: E402
from slabstage.kernels.reference import stage_embeddings_reference  # noqa: E402
from slabstage.kernels.stage_batch import plan_stage_batch  # noqa: E402
from slabstage.models import ToyMultimodalModel, make_batch  # noqa: E402

NO_ROW = 2**31 - 1
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
NO_CACHING = os.environ.get("PYTORCH_NO_CUDA_MEMORY_CACHING", "0") not in ("", "0")
G = torch.Generator().manual_seed(0)


def rand(*shape, dtype=torch.float32):
    return torch.randn(*shape, generator=G).to(dtype).to(DEV)


def expect_error(errors: torch.Tensor, codes: int, rows: int, first_row: int | None) -> None:
    try:
        ss.raise_if_errors(errors)
    except StagingError as e:
        got = (e.codes, e.rows, e.first_row)
        assert got == (codes, rows, first_row), f"error word {got}, expected {(codes, rows, first_row)}"
        return
    assert codes == 0, f"no error raised, expected codes {codes}"


# slab dtype, width, table (dtype, width), media (dtype, width), expand, tokens, pad_to, extra arguments
EMBEDDING_CASES = [
    (torch.bfloat16, 4097, (torch.bfloat16, 4097), (torch.bfloat16, 4097), "zeros", 37, 40, {}),
    (torch.float16, 777, (torch.float32, 777), (torch.bfloat16, 777), "zeros", 64, 64, {"text_scale": 27.9}),
    (torch.bfloat16, 1536, (torch.bfloat16, 512), (torch.float32, 512), "repeat", 50, 53, {}),
    (torch.float32, 96, (torch.float32, 32), (torch.float32, 96), "zeros", 129, 131, {}),
    (torch.bfloat16, 1000, (torch.bfloat16, 1000), (torch.bfloat16, 1000), "zeros", 33, 33,
     {"vocab_range": (40, 80), "vocab_size": 160, "media_owner": False}),
]


def stage_embeddings_cases() -> int:
    launches = 0
    for slab_dtype, W, (t_dtype, t_w), (m_dtype, m_w), expand, n, pad_to, extra in EMBEDDING_CASES:
        V, M = (40 if "vocab_range" in extra else 50), 9
        table, media = rand(V, t_w, dtype=t_dtype), rand(M, m_w, dtype=m_dtype)
        vocab = extra.get("vocab_size", V)
        ids = torch.randint(0, vocab, (n,), generator=G)
        index = torch.full((n,), -1, dtype=torch.int64)
        index[3:3 + M - 2] = torch.arange(M - 2)  # two media rows unused
        bad_rows = [1, n - 1, n // 2]
        ids[bad_rows] = torch.tensor([-1, vocab, 2**40])  # bad token ids on text rows
        index[n - 5] = M  # and a media index past the media rows
        ids, index = ids.to(DEV), index.to(DEV)
        for _ in range(2):  # the first call compiles and caches, the second takes the fast launch
            slab = torch.full((pad_to + 3, W), 7.0, dtype=slab_dtype, device=DEV)
            errors = ss.new_error_word(DEV)
            ss.stage_embeddings(slab, ids, table, media=media, media_index=index, pad_to=pad_to, expand=expand,
                                errors=errors, **extra)
            want = torch.full_like(slab, 7.0)
            ref_errors = ss.new_error_word(DEV)
            start, end = extra.get("vocab_range", (0, V))
            stage_embeddings_reference(want, ids, table, media, index, pad_to=pad_to, expand=expand,
                                       text_scale=extra.get("text_scale"), vocab_start=start, vocab_end=end,
                                       vocab_size=vocab, media_owner=extra.get("media_owner", True),
                                       errors=ref_errors)
            assert torch.equal(slab, want), f"stage_embeddings {W} wide ({slab_dtype}) differs from the reference"
            assert torch.equal(errors, ref_errors)
            expect_error(errors, BAD_TOKEN_ID | BAD_MEDIA_INDEX, 4, 1)
            launches += 1
    return launches


def media_index_from_mask_case() -> None:
    mask = torch.zeros(2500, dtype=torch.bool)
    mask[100:700] = True
    mask[2000:2100] = True
    mask = mask.to(DEV)
    errors = ss.new_error_word(DEV)
    index = ss.media_index_from_mask(mask, 650, errors=errors)  # 700 placeholders, 650 media rows
    want = torch.where(mask, torch.cumsum(mask.int(), 0) - 1, -1).to(torch.int32)
    assert torch.equal(index, want)
    assert errors.tolist() == [MEDIA_COUNT_MISMATCH, 0, NO_ROW, 700]
    table, media = rand(30, 64), rand(650, 64)
    slab = torch.zeros(2500, 64, device=DEV)
    ids = torch.randint(0, 30, (2500,), generator=G).to(DEV)
    ss.stage_embeddings(slab, ids, table, media=media, media_index=index, errors=errors)
    expect_error(errors, MEDIA_COUNT_MISMATCH | BAD_MEDIA_INDEX, 50, 2050)
    spans = ss.media_index_from_spans([(5, 10, 0), (40, 3, 10)], 50, device=DEV, num_media_rows=13)
    assert spans.tolist() == [-1] * 5 + list(range(10)) + [-1] * 25 + [10, 11, 12] + [-1] * 7


def token_input_cases() -> None:
    buffers = ss.StagingBuffers.allocate(max_num_tokens=300, max_batch_size=5, embed_width=48,
                                         embed_dtype=torch.bfloat16, device=DEV, cache_loc_dtype=torch.int32,
                                         mrope=True)
    for n, host in ((257, True), (257, False), (1, True), (300, False)):
        where = torch.device("cpu") if host else DEV
        ids = torch.randint(0, 99, (n,), generator=G).to(where)
        positions = torch.arange(n).to(where)
        loc = torch.randint(0, 10**6, (n,), generator=G).to(where)
        mrope = torch.randint(0, 500, (3, n), generator=G).to(where)
        seq_lens = torch.tensor([n], dtype=torch.int32).to(where)
        ss.stage_token_inputs(buffers, input_ids=ids, positions=positions, out_cache_loc=loc,
                              mrope_positions=mrope, seq_lens=seq_lens, extend_start_loc=seq_lens * 0,
                              pad_to=min(300, n + 20))
        assert torch.equal(buffers.input_ids[:n].cpu(), ids.cpu())
        assert torch.equal(buffers.mrope_positions[:, :n].cpu(), mrope.cpu())
        assert not buffers.positions[n:min(300, n + 20)].any()
        assert buffers.num_tokens_non_padded.item() == n
    # the fused batch launch, host inputs, bad ids
    table, media = rand(60, 48, dtype=torch.bfloat16), rand(4, 48, dtype=torch.float32)
    for _ in range(2):
        n = 70
        ids = torch.randint(0, 60, (n,), generator=G)
        ids[[2, 69]] = torch.tensor([60, -3])
        index = torch.full((n,), -1, dtype=torch.int32)
        index[10:14] = torch.arange(4, dtype=torch.int32)
        plan_stage_batch(buffers, input_ids=ids, positions=torch.arange(n), table=table, media=media,
                         media_index=index, seq_lens=torch.tensor([30, 40], dtype=torch.int32),
                         extend_start_loc=torch.tensor([0, 30], dtype=torch.int32), pad_to=96)()
        want = torch.zeros(96, 48, dtype=torch.bfloat16, device=DEV)
        stage_embeddings_reference(want, ids.to(DEV), table, media, index.to(DEV), pad_to=96, expand="zeros",
                                   text_scale=None, vocab_start=0, vocab_end=60, vocab_size=60, media_owner=True,
                                   errors=ss.new_error_word(DEV))
        assert torch.equal(buffers.input_embeds[:96], want)
        assert torch.equal(buffers.input_ids[:n].cpu(), ids)
        expect_error(buffers.errors, BAD_TOKEN_ID, 2, 2)


def runner_case() -> tuple[int, int]:
    model = ToyMultimodalModel("hc", hidden_size=64, num_layers=2, num_heads=4, hc_mult=3, device=DEV,
                               dtype=torch.bfloat16)
    buffers = ss.StagingBuffers.allocate(max_num_tokens=64, max_batch_size=4, embed_width=model.embed_width,
                                         embed_dtype=model.dtype, device=DEV)
    runner = ss.PrefillGraphRunner(model, buffers, buckets=[4, 16, 48], progress=False,
                                   enforce_eager=NO_CACHING).capture()
    g = torch.Generator().manual_seed(1)
    replayed = 0
    for k, n in enumerate((3, 16, 40, 11, 60, 47)):
        batch = make_batch(model, n, media_fraction=0.4, num_seqs=min(3, n), generator=g,
                           device=DEV if k % 2 else None)
        bad_row = None
        if k == 3:  # a bad token id on the first text row
            index = batch.media_index.cpu() if batch.media_index is not None else torch.full((n,), -1)
            bad_row = int((index < 0).nonzero()[0])
            batch.input_ids[bad_row] = model.vocab_size
        for _ in range(2):  # the first batch of a configuration takes the full path, the second the cached one
            out = runner.run(batch, clone=True)
            bucket = runner.last_bucket
            replayed += bucket is not None
            ref = model(buffers.registry.views(bucket or n))[:n]
            assert torch.equal(out, ref), f"{n} tokens (bucket {bucket}): replay != eager"
            if bad_row is None:
                expect_error(buffers.errors, 0, 0, None)
            else:
                expect_error(buffers.errors, BAD_TOKEN_ID, 1, bad_row)  # read and reset
    assert NO_CACHING or DEV.type != "cuda" or runner.stager.cached_launches >= 4, runner.stager.cached_launches
    return replayed, len(runner.graphs)


def main() -> None:
    start = time.perf_counter()
    where = torch.cuda.get_device_name() if DEV.type == "cuda" else "CPU (Triton interpreter: no CUDA here)"
    print(f"slabstage sanitize workload on {where}" + (", no caching allocator (runner eager)" if NO_CACHING else ""))
    launches = stage_embeddings_cases()
    media_index_from_mask_case()
    token_input_cases()
    replayed, graphs = runner_case()
    if DEV.type == "cuda":
        torch.cuda.synchronize()
    print(f"stage_embeddings launches: {launches}; runner: {graphs} graphs, {replayed} replays; "
          f"{time.perf_counter() - start:.1f} s")
    print("SANITIZE WORKLOAD OK")


if __name__ == "__main__":
    main()
