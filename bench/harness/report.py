"""``python bench/report.py``: turn pytest-benchmark JSON from ``bench/`` into markdown tables and log-log plots.

For ``<results>/<suite>.json`` it writes ``<suite>.md``: one table per metric
(device time, host time), rows = shapes, columns = implementations, each cell the
median in microseconds and, for device time, the share of the measured copy
ceiling (:mod:`.tables`); the tables of figures a benchmark keeps in its
``extra_info`` (:mod:`.info_tables`); a line says on what machine. With matplotlib
it also writes ``<suite>.png``: median time against tokens, log-log, one line per
implementation, the copy floor (bytes / ceiling) dotted; one panel per metric and
width (:mod:`.plots`); and where ``prefill.json`` and ``generate.json`` are there, ``engine.png``: the prefill
step, time to first token and decode tokens/s against Hugging Face's. ``headline.md`` is the README's "Measured"
table (:mod:`.headline`); ``--readme README.md`` writes it into the README as well.

The suites put what the report needs in each benchmark's ``extra_info``: ``impl``,
``shape``, ``tokens``, ``width``, ``metric``, and for device time ``fraction_of_ceiling``
and ``floor_us`` (see bench/conftest.py).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from . import RESULTS_DIR
from .headline import SUITES as HEADLINE_SUITES
from .headline import headline, write_readme
from .info_tables import info_tables
from .plots import engine_plot, plot, pyplot
from .tables import Row, load_rows, machine_line, metric_tables

__all__ = ["Row", "load_rows", "markdown", "plot", "write_reports", "main"]


def markdown(suite: str, data: dict) -> str:
    """The suite's tables as markdown."""
    rows = load_rows(data)
    out = [f"# {suite}", "", machine_line(data), ""]
    if not ((data.get("machine_info") or {}).get("slabstage") or {}).get("gpu"):
        out += ["A CPU run: host time covers the whole computation (the PyTorch reference path); "
                "device time and the copy ceiling need a GPU.", ""]
    if not rows:
        return "\n".join(out + ["No timed benchmarks in this file.", ""])
    detailed, covered = info_tables(data)
    out += metric_tables(rows, skip=covered)  # (a covered metric's timing is a worker's wall time)
    out += detailed
    if any(r.floor_us for r in rows):
        out += ["floor: the bytes a call must move (read + written; for staging, each source row read "
                "once and each slab row written once) at the measured device-to-device copy ceiling. "
                "best peer / slabstage: the fastest peer's time over slabstage's.", ""]
    return "\n".join(out)


def write_reports(results: Path, out: Path | None = None, *, plots: bool = True, log=print) -> list[Path]:
    """Write ``<suite>.md`` (and ``<suite>.png``) for each ``<suite>.json`` in ``results``."""
    results = Path(results)
    out = Path(out) if out is not None else results
    out.mkdir(parents=True, exist_ok=True)
    plt = pyplot() if plots else None
    if plots and plt is None:
        log("bench report: matplotlib is not installed: writing tables only "
            "(pip install 'slabstage[bench]', or pip install matplotlib, for the plots)")
    written = []
    for src in sorted(results.glob("*.json")):
        try:
            data = json.loads(src.read_text())
        except (OSError, json.JSONDecodeError) as e:
            log(f"bench report: skipping {src}: {e}")
            continue
        if not isinstance(data, dict) or "benchmarks" not in data:
            log(f"bench report: skipping {src}: not a pytest-benchmark JSON file")
            continue
        suite = src.stem
        md = out / f"{suite}.md"
        md.write_text(markdown(suite, data))
        written.append(md)
        if plt is not None:
            png = plot(suite, data, out / f"{suite}.png", plt)
            if png is not None:
                written.append(png)
    if any((results / f"{s}.json").is_file() for s in HEADLINE_SUITES):  # the README's table
        md = out / "headline.md"
        md.write_text(headline(results, plot="engine.png"))
        written.append(md)
    if plt is not None:  # the engine figure, from the prefill and generate suites
        png = engine_plot(results, out / "engine.png", plt)
        if png is not None:
            written.append(png)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python bench/report.py",
                                     description="Markdown tables and plots from the saved benchmark JSON.")
    parser.add_argument("--results", type=Path, default=None, help="folder of <suite>.json (default: bench/results)")
    parser.add_argument("--out", type=Path, default=None, help="where to write (default: the results folder)")
    parser.add_argument("--no-plots", action="store_true", help="tables only")
    parser.add_argument("--quiet", action="store_true", help="print nothing but errors")
    parser.add_argument("--readme", type=Path, default=None,
                        help="also write the headline table into this README, between its markers")
    args = parser.parse_args(argv)
    results = args.results or RESULTS_DIR
    if not results.is_dir():
        print(f"bench report: no results folder {results}; run `python bench/run.py` first",
              file=sys.stderr)
        return 2
    log = (lambda *_: None) if args.quiet else print
    written = write_reports(results, args.out, plots=not args.no_plots, log=log)
    if not written:
        print(f"bench report: no benchmark JSON in {results}", file=sys.stderr)
        return 1
    if args.readme is not None:
        write_readme(args.readme, results)
        written.append(args.readme)
    for path in written:
        log(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
