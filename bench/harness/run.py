"""``python bench/run.py [options] [pytest args]``: run the suites and save their JSON.

It runs each suite ``bench/bench_<suite>.py`` in its own pytest process with
pytest-benchmark on (``--benchmark-enable --benchmark-only``) and saves its JSON as
``<results>/<suite>.json``; arguments it does not know go to pytest (``-k``,
``--bench-rounds``, ``--benchmark-columns``, ...). Without CUDA it says that the
GPU figures need a GPU, runs the host-time benchmarks at small sizes on the
PyTorch reference path, saves them outside the repository (unless ``--results``
says where) and exits 0.

``python bench/report.py`` then writes the tables and plots (:mod:`.report`).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from . import BENCH_DIR, RESULTS_DIR

def _suites(bench: Path, names: list[str] | None) -> list[Path]:
    found = sorted(bench.glob("bench_*.py"))
    if not names:
        return found
    wanted = {n.removeprefix("bench_").removesuffix(".py") for n in names}
    picked = [p for p in found if p.stem.removeprefix("bench_") in wanted]
    missing = wanted - {p.stem.removeprefix("bench_") for p in picked}
    if missing:
        known = ", ".join(p.stem.removeprefix("bench_") for p in found)
        raise SystemExit(f"no suite named {', '.join(sorted(missing))}; suites: {known}")
    return picked


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python bench/run.py",
                                     description="Run the benchmark suites; other arguments go to pytest.")
    parser.add_argument("--results", type=Path, default=None,
                        help="folder for <suite>.json (default: bench/results; without CUDA: a temp folder)")
    parser.add_argument("--suite", action="append", help="run only this suite (repeatable), e.g. stage_embeddings")
    parser.add_argument("--quiet", action="store_true",
                        help="no pytest output (its progress line included); one line per suite")
    args, pytest_args = parser.parse_known_args(argv)

    suites = _suites(BENCH_DIR, args.suite)
    root = BENCH_DIR.parent
    env = dict(os.environ)
    cuda = _has_cuda()
    if cuda:
        results = args.results or RESULTS_DIR
    else:
        # A CPU run's figures are not the GPU figures bench/results holds; keep them apart.
        results = args.results or Path(tempfile.gettempdir()) / "slabstage-bench-cpu"
        # the reference path is what a CPU engine would run; the interpreter's speed means nothing
        env["TRITON_INTERPRET"] = "0"
        print("bench: no CUDA device: device time, GB/s and % of the copy ceiling need a GPU.\n"
              "  Running the host-time benchmarks at small sizes on the PyTorch reference path instead;\n"
              f"  results go to {results}")
    results.mkdir(parents=True, exist_ok=True)

    extra = list(pytest_args)
    if not any(a.startswith("--benchmark-columns") for a in extra):
        extra.append("--benchmark-columns=min,median,iqr,rounds")
    if args.quiet:
        extra.append("-q")

    failed = []
    for path in suites:
        suite = path.stem.removeprefix("bench_")
        target = results / f"{suite}.json"
        partial = results / f".{suite}.json.partial"
        partial.unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "pytest", str(path.relative_to(root)), "--benchmark-enable",
               "--benchmark-only", f"--benchmark-json={partial}", *extra]
        if not args.quiet:
            print(f"\n== {suite}: {' '.join(cmd[1:])}", flush=True)
        proc = subprocess.run(cmd, cwd=root, env=env, text=True,
                              capture_output=args.quiet)
        if proc.returncode not in (0, 5):  # 5: nothing collected (a -k that picks nothing here)
            failed.append(suite)
            if args.quiet:
                print((proc.stdout or "")[-4000:] + (proc.stderr or "")[-2000:], file=sys.stderr)
        if partial.exists():
            partial.replace(target)
            note = f"saved {target}"
        else:
            note = "no benchmark ran, nothing saved"
        print(f"bench: {suite}: {'FAILED, ' if suite in failed else ''}{note}", flush=True)

    if failed:
        print(f"bench: failed suites: {', '.join(failed)}", file=sys.stderr)
        return 1
    if cuda:
        print("bench: done; `python bench/report.py` writes the tables and plots")
    else:
        print(f"bench: CPU run done; `python bench/report.py --results {results}` "
              "tabulates it. GPU figures need a GPU.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
