"""What each part of a replay's parameter-record path costs the device.

The case of ``bench/bench_encoder_cache.py::test_replay``: a runner whose forward is almost nothing, 256 and
2048 rows x 4096 bf16, half the rows media in 16 cache entries or in one, against LightLLM's kernel (as many
images) and the same forward captured in one graph, its image table on the device. The package's path is run in
variants, each its own buffers and runner captured in this process (their stagers patched before capture):

  main      the package as it is: the record copied in on a side stream once the last graph's kernel has
            read the one before (an event-record node on a branch of the graph), the kernel's programs
            counting themselves (the ticket: the last one clears H_LIVE);
  noticket  records without a ticket: no atomics, H_LIVE never cleared (a bare replay would stage the last
            record again: a variant for measuring only);
  nobranch  graphs without the branch: the next copy waits for an event recorded after the whole graph;
  both      noticket and nobranch;
  instream  the record copied on the replay's own stream right before ``graph.replay()``, no events;
  memset    no ticket: a memset node on the graph's branch clears H_LIVE after the kernel, before the event;
  waitnode  main, but the graph begins with a node that waits for the copy's event (an external event-wait
            node), in place of the replay's stream waiting for it before ``graph.replay()`` (three driver
            calls a replay, not four);
  devdone   main, but program 0 reports the step into a device word rather than the ring's pinned one (a
            store across PCIe in every launch; the ring then never waits: the probe syncs every round).


Each variant's rows are first checked against LightLLM's (``equal``). Device time of ``run()`` (CUDA events
around it, behind a 256 MiB L2 flush and a 2 ms device sleep: the suites' method), medians of ``--rounds``,
every case alternated round by round. Prints a table; ``--json`` keeps it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import types

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VARIANTS = ("main", "noticket", "nobranch", "both", "instream", "memset", "devdone", "waitnode")


def _patch(stager, variant: str) -> None:
    """Make ``stager`` (before the capture) take ``variant``'s path."""
    from slabstage.staging import driver
    from slabstage.staging.stager import capture_stream
    lib, index = driver.calls(), stager._index
    if variant in ("noticket", "both", "memset"):
        stager._ticket = 0
    if variant == "devdone":
        ring, word = stager.ring, torch.zeros(2, dtype=torch.int64, device=stager.dst.device)
        stager._held_events.append(word)  # (kept with the stager)
        ring.done_addr = word.data_ptr()

        def take():
            step = ring.step + 1
            return step, (step % ring.k) * ring.slot_words
        ring.take = take
    if variant in ("main", "noticket", "devdone"):
        return
    # what the first record() would make: the graphs' events and the copy stream
    stager._events = (driver.Event(index), driver.Event(index))
    stager._held_events.extend(stager._events)
    stager._copy_stream = torch.cuda.Stream(stager.dst.device)
    stager._copy_raw = stager._copy_stream.cuda_stream
    if variant == "memset":
        from slabstage.kernels.layout import H_LIVE

        def record(self, pad_to):  # the branch: H_LIVE cleared, then the event (end_record() joins it)
            self._kernel(max(self._grid(pad_to), 1), self.graph_params)
            branch = capture_stream(self.dst.device, "branch")
            branch.wait_stream(torch.cuda.current_stream(index))
            with torch.cuda.stream(branch):
                self.graph_params[H_LIVE:H_LIVE + 1].zero_()
            r = lib.record_external(self._events[0].handle, branch.cuda_stream)
            if r:
                driver.fail(r, "probe: the branch's event", index, True)
        stager.record = types.MethodType(record, stager)
        return
    if variant == "waitnode":
        original_record = stager.record

        def record(self, pad_to):  # an external event-wait node first: the graph waits for the copy itself
            r = lib._wait(torch.cuda.current_stream(index).cuda_stream, self._events[1].handle, 1)
            if r:
                driver.fail(r, "probe: the graph's wait node", index, True)
            original_record(pad_to)

        def replay(self, graph):  # the side copy, no wait on the replay's stream
            _replay_after(self, graph, lambda src, words: (
                lib.wait(self._copy_raw, self._events[0].handle)
                | lib.copy_in(self._graph_base, src, words, self._copy_raw)
                | lib.record(self._events[1].handle, self._copy_raw)))
        stager.record = types.MethodType(record, stager)
        stager.replay = types.MethodType(replay, stager)
        return
    original_replay = stager.replay

    def record(self, pad_to):  # the kernel alone: no branch to join
        self._kernel(max(self._grid(pad_to), 1), self.graph_params)

    def replay(self, graph):
        if variant == "instream":
            _replay_after(self, graph, lambda src, words: lib.copy_in(self._graph_base, src, words, self._where[0]))
            return
        original_replay(graph)
        r = lib.record(self._events[0].handle, self._where[0])  # (the next copy waits for the whole graph)
        if r:
            driver.fail(r, "probe: the event after the graph", index, True)

    stager.record = types.MethodType(record, stager)
    stager.end_record = types.MethodType(lambda self: None, stager)
    stager.replay = types.MethodType(replay, stager)


def _replay_after(stager, graph, queue) -> None:
    """Replay ``graph`` after ``queue(source address, bytes)`` queued the prepared record's copy (a CUresult)."""
    from slabstage.staging import driver
    step, at, words, _ = stager._pending
    stager._order()
    r = queue(stager.ring.base + 8 * at, 8 * words)
    if r:
        driver.fail(r, "probe: the record's copy", stager._index, True)
    graph.replay()
    stager.ring.commit(step)
    stager._pending = (0, 0, 0, False)
    stager._note_reads()


def build(n: int, images: int, variant: str | None):
    """``(run, out)``: one replay step of ``variant``'s runner (None: LightLLM's graph) over fresh buffers, and the
    rows it stages."""
    import slabstage as ss
    from slabstage.staging.stager import Stager
    from bench_encoder_cache import Items, media_index, peer_graph, stage_inputs
    from peer_lightllm import image_ranges
    width, rows = 4096, n // 2
    per = rows // images
    ids, table, _, _ = stage_inputs(n, width, seed=3)
    mi = media_index(n, rows, runs=images).to("cuda")
    items = Items(per, width, count=images)
    if variant is None:
        graph, out = peer_graph(ids, mi, table, items.one, torch.stack(image_ranges([per] * images, 1000, "cuda")))
        return graph.replay, out
    buffers = ss.StagingBuffers.allocate(max_num_tokens=n, max_batch_size=4, embed_width=width,
                                         embed_dtype=torch.bfloat16, device="cuda")
    stager = Stager.for_buffers(buffers, embed=True)
    _patch(stager, variant)
    runner = ss.PrefillGraphRunner(lambda v: v["input_embeds"][:1] * 2, buffers, buckets=[n], progress=False)
    runner.capture()
    if runner.stager is not stager:
        raise RuntimeError("probe: the runner captured with another stager than the patched one")
    batch = ss.PrefillBatch(input_ids=ids, positions=torch.arange(n, device="cuda"), table=table,
                            media=items.cache.get_many(items.keys, [per] * images), media_index=mi)
    runner.run(batch)
    if runner.last_bucket != n:
        raise RuntimeError(f"probe: {variant} did not replay ({runner.last_fallback})")
    return (lambda: runner.run(batch)), buffers.input_embeds[:n]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[256, 2048])
    parser.add_argument("--images", type=int, nargs="+", default=[16, 1])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--rounds", type=int, default=200, help="timed rounds a case (medians)")
    parser.add_argument("--json", help="write the table to this file as JSON")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("probe_replay_record.py needs a CUDA device")
    sys.path[:0] = [os.path.join(ROOT, "bench"), ROOT]
    scratch = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    rows = []
    for n in args.tokens:
        for images in args.images:
            built = {v: build(n, images, v) for v in args.variants}
            built["lightllm"] = build(n, images, None)
            cases = {k: fn for k, (fn, _) in built.items()}
            for fn, out in built.values():  # (each variant stages what LightLLM's kernel does)
                out.fill_(float("nan"))
                fn()
            torch.cuda.synchronize()
            equal = {k: bool(torch.equal(out, built["lightllm"][1])) for k, (_, out) in built.items()}
            times: dict = {k: [] for k in cases}
            for r in range(10 + args.rounds):
                for k, fn in cases.items():
                    scratch.zero_()
                    torch.cuda._sleep(4_000_000)  # (about 2 ms: the host queues the step before it starts)
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    fn()
                    end.record()
                    end.synchronize()
                    if r >= 10:
                        times[k].append(start.elapsed_time(end) * 1e3)
            ref = statistics.median(times["lightllm"])
            for k, t in times.items():
                rows.append(dict(tokens=n, images=images, case=k, device_us=statistics.median(t),
                                 ratio=statistics.median(t) / ref, equal=equal[k]))
    machine = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, cuda=torch.version.cuda)
    print(", ".join(f"{k} {v}" for k, v in machine.items()), f"medians of {args.rounds} rounds")
    print(f"{'tokens':>6} {'images':>6} {'case':>9} {'device µs':>9} {'/ LightLLM':>10} {'equal':>5}")
    for r in rows:
        print(f"{r['tokens']:>6} {r['images']:>6} {r['case']:>9} {r['device_us']:>9.1f} {r['ratio']:>10.2f} "
              f"{'yes' if r['equal'] else 'NO':>5}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(machine, rounds=args.rounds, variants=args.variants, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
