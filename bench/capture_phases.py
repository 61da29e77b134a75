"""Where a capture's time goes: the Qwen2-7B-shaped decoder's default ladder, captured twice in one process.

    python bench/capture_phases.py [--attn sdpa] [--forward prefill_forward] [--verify warn] [--out F.json]

The first capture is what a fresh process pays (the shapes' first-run costs included); the second, in the
same process after ``reset()``, is the capture's own cost. Each phase of a bucket's capture is timed
(the eager forwards with a device sync around them, so that their device time counts where it is spent):
the warm-up and the check's timed eager forward, the forward while capturing, ``capture_end``, the
check's replays, the staging of the capture's batch. Run it twice on one machine, and once with
``CUDA_CACHE_DISABLE=1``, to see what the driver's JIT cache holds between processes.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench_replay, beside this file
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout's slabstage

import bench_replay  # noqa: E402

import slabstage as ss  # noqa: E402
import slabstage.graph_runner.capture as capture  # noqa: E402


class Phases:
    """Seconds and calls per phase, by wrapping the functions a capture calls."""

    def __init__(self) -> None:
        self.seconds, self.calls = collections.Counter(), collections.Counter()

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] += seconds
        self.calls[name] += 1

    def wrap(self, name: str, fn, sync: bool = True):
        def timed(*args, **kwargs):
            synced = sync and not torch.cuda.is_current_stream_capturing()
            if synced:
                torch.cuda.synchronize()
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            if synced:
                torch.cuda.synchronize()
            self.add(name, time.perf_counter() - start)
            return out
        return timed

    def table(self) -> list[dict]:
        return [dict(phase=k, seconds=round(v, 4), calls=self.calls[k], ms_each=round(1e3 * v / self.calls[k], 2))
                for k, v in self.seconds.most_common()]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--attn", default="sdpa", choices=("sdpa", "eager"))
    p.add_argument("--forward", default="prefill_forward", choices=("prefill_forward", "mask", "plain"))
    p.add_argument("--verify", default="warn", choices=("warn", "off"))
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--out", default=None, help="write the figures as JSON here")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("capture_phases.py needs a CUDA device", file=sys.stderr)
        return 2
    phases = Phases()
    start = time.perf_counter()
    forward, new_buffers, _ = bench_replay._case("qwen2_7b", args.attn, args.forward, args.layers,
                                                bench_replay.MAX_TOKENS)
    built = time.perf_counter() - start

    def timed_forward(views):
        name = "forward while capturing" if torch.cuda.is_current_stream_capturing() else "eager forward (synced)"
        return phases.wrap(name, forward)(views)

    capture._check_one = phases.wrap("check: replays and compare", capture._check_one)
    capture._probe = phases.wrap("capture batch built", capture._probe)
    capture.Stager.prepare = phases.wrap("staging: prepare", capture.Stager.prepare)
    capture.Stager.launch = phases.wrap("staging: launch", capture.Stager.launch)
    torch.cuda.CUDAGraph.capture_end = phases.wrap("capture_end", torch.cuda.CUDAGraph.capture_end, sync=False)
    results = dict(machine=dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                                cuda_cache_disabled=os.environ.get("CUDA_CACHE_DISABLE", "0"),
                                date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())),
                   attn=args.attn, forward=args.forward, verify=args.verify, model_build_s=round(built, 2),
                   captures=[])
    for which in ("first in this process", "again after reset()"):
        phases.seconds.clear()
        phases.calls.clear()
        buffers = new_buffers()
        runner = ss.PrefillGraphRunner(timed_forward, buffers, progress=False, verify=args.verify)
        start = time.perf_counter()
        runner.capture()
        seconds = time.perf_counter() - start
        n = len(runner.buckets)
        row = dict(capture=which, seconds=round(seconds, 3), buckets=n, seconds_a_bucket=round(seconds / n, 4),
                   dropped=dict(runner.checks and {b: c["dropped"] for b, c in runner.checks.items() if c["dropped"]}),
                   phases=phases.table())
        results["captures"].append(row)
        print(f"{args.attn} {args.forward} verify={args.verify}, {which}: {seconds:.2f} s for {n} buckets, "
              f"{seconds / n:.3f} s a bucket; dropped {row['dropped'] or 'none'}", flush=True)
        for ph in row["phases"]:
            print(f"   {ph['phase']:28s} {ph['seconds']:8.3f} s  {ph['calls']:4d} calls  {ph['ms_each']:8.2f} ms each",
                  flush=True)
        runner.reset()
        del runner, buffers
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
