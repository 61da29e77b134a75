"""Replay against eager for the Qwen2-7B-shaped decoder, each forward in fresh processes, outside pytest.

    python bench/graph_check.py [--attn sdpa] [--layers 4] [--max-tokens 4096] [--variant NAME] [--out FILE.json]

The measurement is the suite ``bench/bench_replay.py``'s (``python -m slabstage.bench run --suite replay``,
which also covers eager attention and Qwen3-VL): its workers, for one attention implementation and the forwards
``plain``, ``mask`` and ``prefill_forward`` (or ``--variant`` alone). This prints a summary line per forward
and size, and writes the figures as one JSON file (``--out``, default ``$OUT/graph_check.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import bench_replay  # the suite beside this file
import torch

VARIANTS = ("plain", "mask", "prefill_forward")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--attn", default="sdpa", choices=("sdpa", "eager"))
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=bench_replay.MAX_TOKENS)
    p.add_argument("--variant", default=None, choices=VARIANTS, help="this forward alone")
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "graph_check.json"))
    args = p.parse_args()
    import transformers
    results = dict(machine=dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                                transformers=transformers.__version__,
                                date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())), variants=[])
    for variant in [args.variant] if args.variant else VARIANTS:
        try:
            r = bench_replay.measure("qwen2_7b", args.attn, variant, layers=args.layers, max_tokens=args.max_tokens)
        except RuntimeError as e:
            results["variants"].append(dict(forward=variant, error=str(e)[-3000:]))
            print(variant, "failed:", str(e)[-800:], flush=True)
            continue
        results["variants"].append(r)
        ratio = r["mib_vs_largest_alone"]
        ratio = f"{ratio:.2f}x" if ratio is not None else "?"
        print(f"{variant:16s} capture {r['capture_s_per_bucket']:.3f} s a bucket ({r['buckets']} buckets), "
              f"{r['capture_mib']:.0f} MiB ({ratio} the largest bucket alone), "
              f"dropped {len(r['dropped'])}: {sorted(set(r['dropped'].values()))}", flush=True)
        for row in r["sizes"]:
            print(f"   {row['tokens']:>5} tokens: replay {row['replay_min_us']:8.0f} eager {row['eager_min_us']:8.0f} "
                  f"us (min) x{row['eager_min_us'] / row['replay_min_us']:.2f} ran as {row['ran_as']} "
                  f"max|d| {row['max_abs_diff']:.2g}", flush=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout's slabstage
    sys.exit(main())
