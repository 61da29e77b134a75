"""What a graph's shape costs its launch: host time, latency and device time of one step by graph shape.

    python tools/probe_graph_launch.py [--nodes 1 100 500] [--rounds 300] [--json out.json]

Plain PyTorch, no slabstage: each graph is a small "staging" kernel, then ``nodes`` small kernels (the
forward), captured four ways:
  line    a straight line of kernel nodes (the runner's graphs until 2026-12-05: fetch, staging kernel, forward);
  inline  the same with an event-record node right after the staging kernel, on the capture stream
          (``torch.cuda.Event(external=True)``): still a straight line;
  fork    the event recorded on a second stream forked after the staging kernel and joined at the end: the
          graph is no longer a straight line of nodes (the runner's graphs now);
  memcpy  a straight line whose first node copies the 4.8 KB record from pinned memory into a device buffer (a
          captured ``copy_``: a memcpy node), then the staging stand-in: what a record carried by the graph's own
          copy costs the device, beside the fetch kernel the runner's graphs began with (replayed bare only);
and each step replayed three ways:
  bare    ``graph.replay()`` alone;
  same    a copy of a 4.8 KB record from pinned memory into a device buffer queued on the replay's own stream,
          then ``graph.replay()`` (no stream waits for another);
  copy    what moving the parameter record's copy off the graph would add to every step: a side stream waits
          for the last replay's event, copies the record and records an event that the replay's stream waits
          for, then ``graph.replay()`` (``line`` has no event to wait for, so its side stream waits for
          nothing).
CUDA 12.6 and later launch straight-line graphs in constant time; this measures whether ``inline`` keeps that
and what ``fork`` costs as the forward grows. For each case: host time (perf_counter around the step and the
two event records that time it, after a sync), latency (the same, up to a sync) and device time (those CUDA
events around the step), medians of
``--rounds``, the cases alternated round by round; the host time also in its two parts, the calls before
``graph.replay()`` (and the first event record) and ``graph.replay()`` (and the second), so a replay launched
behind another stream's event is timed apart from the calls that queue it. Prints a table; ``--json`` keeps
it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

RECORD_BYTES = 4800
SHAPES = ("line", "inline", "fork", "memcpy")
STEPS = ("bare", "same", "copy")


def capture(shape: str, nodes: int, x: torch.Tensor, read: torch.cuda.Event | None, host: torch.Tensor,
            device: torch.Tensor):
    """One graph of the given shape: (for ``memcpy``, the record's copy), a staging stand-in, then ``nodes``
    kernels."""
    graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with torch.cuda.graph(graph):
        if shape == "memcpy":
            device.copy_(host, non_blocking=True)
        x[0].add_(1)  # the staging kernel's stand-in: the record has been read once it ends
        main = torch.cuda.current_stream()
        if shape == "inline":
            read.record(main)
        elif shape == "fork":
            side.wait_stream(main)
            with torch.cuda.stream(side):
                read.record(side)
        for _ in range(nodes):
            x[1:].add_(1)
        if shape == "fork":
            main.wait_stream(side)
    return graph


class Step:
    """One case: a graph and how a step launches it."""

    def __init__(self, shape: str, how: str, nodes: int) -> None:
        self.x = torch.zeros(1024, device="cuda")
        self.read = torch.cuda.Event(external=True) if shape in ("inline", "fork") else None
        self.host = torch.zeros(RECORD_BYTES // 8, dtype=torch.int64).pin_memory()
        self.device = torch.zeros_like(self.host, device="cuda")
        self.graph = capture(shape, nodes, self.x, self.read, self.host, self.device)
        self.how, self.side = how, torch.cuda.Stream()
        self.copied = torch.cuda.Event()
        self.graph.replay()
        torch.cuda.synchronize()

    def __call__(self) -> float:
        """Queue the step; the host clock just before ``graph.replay()``."""
        if self.how == "copy":
            main = torch.cuda.current_stream()
            if self.read is not None:
                self.side.wait_event(self.read)
            with torch.cuda.stream(self.side):
                self.device.copy_(self.host, non_blocking=True)
                self.copied.record(self.side)
            main.wait_event(self.copied)
        elif self.how == "same":
            self.device.copy_(self.host, non_blocking=True)
        mid = time.perf_counter()
        self.graph.replay()
        return mid


def measure(step: Step) -> tuple[float, float, float, float, float]:
    """(host, its part before ``graph.replay()``, its part from it, latency, device) of one step in µs."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    start.record()
    mid = step()
    end.record()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    return ((t1 - t0) * 1e6, (mid - t0) * 1e6, (t1 - mid) * 1e6, (t2 - t0) * 1e6,
            start.elapsed_time(end) * 1e3)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[1, 100, 500], help="kernels in each forward")
    parser.add_argument("--rounds", type=int, default=300, help="timed rounds a case (medians)")
    parser.add_argument("--json", help="write the table to this file as JSON")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("probe_graph_launch.py needs a CUDA device")
    rows = []
    for nodes in args.nodes:
        steps = {}
        for shape, how in ((shape, how) for shape in SHAPES for how in STEPS if shape != "memcpy" or how == "bare"):
            try:
                steps[(shape, how)] = Step(shape, how, nodes)
            except RuntimeError as e:  # (a torch that refuses the captured copy: the case is left out, said why)
                print(f"{shape} {how}, {nodes} kernels: not captured: {e}")
        for step in steps.values():  # warm-up
            for _ in range(20):
                measure(step)
        times: dict = {key: [] for key in steps}
        for _ in range(args.rounds):
            for key, step in steps.items():
                times[key].append(measure(step))
        for (shape, how), t in times.items():
            host, before, replay, latency, device = (statistics.median(v) for v in zip(*t))
            rows.append(dict(nodes=nodes, shape=shape, step=how, host_us=host, before_replay_us=before,
                             replay_us=replay, latency_us=latency, device_us=device))
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    print(f"{'nodes':>5} {'shape':>6} {'step':>4} {'host µs':>8} {'before':>7} {'replay':>7} {'latency µs':>10} "
          f"{'device µs':>9}")
    for r in rows:
        print(f"{r['nodes']:>5} {r['shape']:>6} {r['step']:>4} {r['host_us']:>8.1f} {r['before_replay_us']:>7.1f} "
              f"{r['replay_us']:>7.1f} {r['latency_us']:>10.1f} {r['device_us']:>9.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, cuda=torch.version.cuda,
                           rounds=args.rounds, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
