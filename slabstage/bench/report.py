"""Turn pytest-benchmark JSON from ``bench/`` into markdown tables and log-log plots.

For ``<results>/<suite>.json`` it writes ``<suite>.md``: one table per metric
(device time, host time), rows = shapes, columns = implementations, each cell the
median in microseconds and, for device time, the share of the measured copy
ceiling; a line says on what machine. With matplotlib it also writes
``<suite>.png``: median time against tokens, log-log, one line per implementation,
the copy floor (bytes / ceiling) dashed; one panel per metric and width.

The suites put what the report needs in each benchmark's ``extra_info``: ``impl``,
``shape``, ``tokens``, ``width``, ``metric``, and for device time ``fraction_of_ceiling``
and ``floor_us`` (see bench/conftest.py).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from . import default_results_dir, find_bench_dir

__all__ = ["Row", "load_rows", "markdown", "plot", "write_reports", "main"]

METRIC_TITLES = {
    "device": "Device time (median µs per call, CUDA events; in brackets: % of the copy ceiling)",
    "host": "Host time (median µs of CPU time per call, no sync)",
}


@dataclass(frozen=True)
class Row:
    metric: str
    impl: str
    shape: str
    tokens: int | None
    width: int | None
    median_us: float
    fraction: float | None  # of the copy ceiling
    floor_us: float | None


def load_rows(data: dict) -> list[Row]:
    """One :class:`Row` per benchmark of a pytest-benchmark JSON document."""
    rows = []
    for b in data.get("benchmarks", []):
        info = b.get("extra_info") or {}
        median = (b.get("stats") or {}).get("median")
        if median is None:
            continue
        rows.append(Row(
            metric=str(info.get("metric", "time")),
            impl=str(info.get("impl") or b.get("param") or b.get("name")),
            shape=str(info.get("shape") or b.get("param") or b.get("name")),
            tokens=info.get("tokens"),
            width=info.get("width"),
            median_us=float(median) * 1e6,
            fraction=info.get("fraction_of_ceiling"),
            floor_us=info.get("floor_us"),
        ))
    return rows


def _metric_order(rows: list[Row]) -> list[str]:
    seen = list(dict.fromkeys(r.metric for r in rows))
    return [m for m in METRIC_TITLES if m in seen] + [m for m in seen if m not in METRIC_TITLES]


def _us(x: float) -> str:
    if x < 1:
        return f"{x:.2f} µs"
    return f"{x:.1f} µs" if x < 1000 else f"{x:,.0f} µs"


def _impl_order(rows: list[Row]) -> list[str]:
    seen = list(dict.fromkeys(r.impl for r in rows))
    ours = [i for i in seen if i.startswith("slabstage")]
    last = [i for i in seen if i.startswith("copy")]
    return ours + [i for i in seen if i not in ours and i not in last] + last


def _shape_order(rows: list[Row]) -> list[str]:
    key = {}
    for r in rows:
        key.setdefault(r.shape, (r.width or 0, r.tokens or 0, r.shape))
    return sorted(key, key=key.get)


def machine_line(data: dict) -> str:
    """GPU (or CPU), driver and CUDA, torch, triton, the copy ceiling, the date."""
    mi = data.get("machine_info") or {}
    ss = mi.get("slabstage") or {}
    parts = []
    if ss.get("gpu"):
        gpu = f"GPU: {ss['gpu']}"
        details = [f"{ss['sm_count']} SMs" if ss.get("sm_count") else None,
                   f"{ss['memory_gib']} GiB" if ss.get("memory_gib") else None]
        details = [d for d in details if d]
        parts.append(gpu + (f" ({', '.join(details)})" if details else ""))
        driver = " ".join(x for x in (ss.get("driver"), ss.get("cuda_driver_api") and
                                      f"(CUDA {ss['cuda_driver_api']})") if x)
        if driver:
            parts.append(f"driver {driver}")
        if ss.get("cuda_runtime"):
            parts.append(f"CUDA runtime {ss['cuda_runtime']}")
    else:
        cpu = (mi.get("cpu") or {}).get("brand_raw") or mi.get("processor") or mi.get("machine") or "unknown"
        parts.append(f"no GPU (CPU: {cpu})")
    if ss.get("torch"):
        parts.append(f"torch {ss['torch']}")
    if ss.get("triton"):
        parts.append(f"triton {ss['triton']}")
    if ss.get("copy_ceiling_gbps"):
        parts.append(f"D2D copy ceiling {ss['copy_ceiling_gbps']:.0f} GB/s (read + write)")
    when = data.get("datetime")
    if when:
        try:
            parts.append(datetime.fromisoformat(when).strftime("%Y-%m-%d %H:%M %Z").strip())
        except ValueError:
            parts.append(when)
    return " · ".join(parts)


def _cell(r: Row | None) -> str:
    if r is None:
        return "–"
    text = _us(r.median_us)
    if r.fraction is not None:
        text += f" ({100 * r.fraction:.0f}%)" if r.fraction >= 0.01 else " (<1%)"
    return text


def markdown(suite: str, data: dict) -> str:
    """The suite's tables as markdown."""
    rows = load_rows(data)
    out = [f"# {suite}", "", machine_line(data), ""]
    if not ((data.get("machine_info") or {}).get("slabstage") or {}).get("gpu"):
        out += ["A CPU run: host time covers the whole computation (the PyTorch reference path); "
                "device time and the copy ceiling need a GPU.", ""]
    if not rows:
        return "\n".join(out + ["No timed benchmarks in this file.", ""])
    detailed = _capture_lines(data)
    for metric in _metric_order(rows):
        if metric == "capture" and detailed:  # (its timing is a subprocess's wall time: the table below says it)
            continue
        sub = [r for r in rows if r.metric == metric]
        impls, shapes = _impl_order(sub), _shape_order(sub)
        cell = {(r.shape, r.impl): r for r in sub}
        floor = any(r.floor_us for r in sub)
        ratio = "slabstage" in impls and len([i for i in impls if _is_peer(i)]) > 0
        head = ["shape", *impls] + (["floor"] if floor else []) + (["best peer / slabstage"] if ratio else [])
        out += [f"## {METRIC_TITLES.get(metric, metric)}", "",
                "| " + " | ".join(head) + " |",
                "| --- |" + " ---: |" * (len(head) - 1)]
        for shape in shapes:
            line = [shape] + [_cell(cell.get((shape, i))) for i in impls]
            if floor:
                floors = [r.floor_us for r in sub if r.shape == shape and r.floor_us]
                line.append(_us(min(floors)) if floors else "–")
            if ratio:
                ours = cell.get((shape, "slabstage"))
                peers = [cell[(shape, i)].median_us for i in impls if _is_peer(i) and (shape, i) in cell]
                line.append(f"{min(peers) / ours.median_us:.2f}x" if ours and peers else "–")
            out.append("| " + " | ".join(line) + " |")
        out.append("")
    out += detailed
    if any(r.floor_us for r in rows):
        out += ["floor: the bytes a call must move (read + written; for staging, each source row read "
                "once and each slab row written once) at the measured device-to-device copy ceiling. "
                "best peer / slabstage: the fastest peer's time over slabstage's.", ""]
    return "\n".join(out)


def _capture_lines(data: dict) -> list[str]:
    """The capture benchmark's cost (its ``extra_info``), when the suite has one."""
    out = []
    for b in data.get("benchmarks", []):
        info = b.get("extra_info") or {}
        if info.get("metric") != "capture" or "bytes_all" not in info:
            continue
        mib = 2**20
        fresh = " (each capture in a fresh process)" if "pool_bytes_all" in info else ""
        out += [f"## Capture cost{fresh}", "",
                "| | ladder | largest bucket alone | ratio |", "| --- | ---: | ---: | ---: |",
                f"| buckets | {info['buckets']} | 1 | |",
                f"| seconds | {info['capture_s']:.2f} ({info['s_per_bucket']:.3f} per bucket) | "
                f"{info['largest_alone_s']:.2f} | |",
                f"| reserved memory growth | {info['bytes_all'] / mib:.0f} MiB | {info['bytes_largest'] / mib:.0f} MiB"
                f" | {info['memory_ratio']:.2f}x |"]
        if "pool_bytes_all" in info:
            out.append(f"| graph pool | {info['pool_bytes_all'] / mib:.0f} MiB | "
                       f"{info['pool_bytes_largest'] / mib:.0f} MiB | {info['pool_ratio']:.2f}x |")
        out.append("")
    return out


def _is_peer(impl: str) -> bool:
    return not impl.startswith("slabstage") and not impl.startswith("copy")


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def plot(suite: str, data: dict, path: Path, plt) -> Path | None:
    """Write the suite's plot to ``path``; None when no benchmark has a token count."""
    rows = [r for r in load_rows(data) if r.tokens]
    if not rows:
        return None
    panels = [(m, w) for m in _metric_order(rows) for w in dict.fromkeys(r.width for r in rows if r.metric == m)]
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.5), squeeze=False)
    for ax, (metric, width) in zip(axes[0], panels):
        sub = [r for r in rows if r.metric == metric and r.width == width]
        title = f"{suite}: {metric} time" + (f", width {width}" if width else "")
        if len({r.tokens for r in sub}) < 2:  # one size: bars say more than a single point
            impls = _impl_order(sub)
            times = [min(r.median_us for r in sub if r.impl == i) for i in impls]
            ax.barh(impls, times, color=[f"C{k}" for k in range(len(impls))])
            ax.invert_yaxis()
            ax.set_xlabel(f"{metric} time per call (µs, median)")
            ax.set_title(f"{suite}: {metric} time, {sub[0].shape}")
            ax.grid(True, axis="x", alpha=0.3)
            continue
        for impl in _impl_order(sub):
            pts = sorted((r.tokens, r.median_us) for r in sub if r.impl == impl)
            style = "--" if impl.startswith("copy") else "-"
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o", label=impl,
                    linewidth=2.2 if impl == "slabstage" else 1.4)
        floors = {}
        for r in sub:
            if r.floor_us:
                floors[r.tokens] = min(r.floor_us, floors.get(r.tokens, float("inf")))
        if floors:
            xs = sorted(floors)
            ax.plot(xs, [floors[x] for x in xs], ":", color="black", label="copy floor (bytes / ceiling)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tokens")
        ax.set_ylabel(f"{metric} time per call (µs, median)")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(machine_line(data), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_reports(results: Path, out: Path | None = None, *, plots: bool = True, log=print) -> list[Path]:
    """Write ``<suite>.md`` (and ``<suite>.png``) for each ``<suite>.json`` in ``results``."""
    results = Path(results)
    out = Path(out) if out is not None else results
    out.mkdir(parents=True, exist_ok=True)
    plt = _pyplot() if plots else None
    if plots and plt is None:
        log("slabstage.bench report: matplotlib is not installed: writing tables only "
            "(pip install 'slabstage[bench]', or pip install matplotlib, for the plots)")
    written = []
    for src in sorted(results.glob("*.json")):
        try:
            data = json.loads(src.read_text())
        except (OSError, json.JSONDecodeError) as e:
            log(f"slabstage.bench report: skipping {src}: {e}")
            continue
        if not isinstance(data, dict) or "benchmarks" not in data:
            log(f"slabstage.bench report: skipping {src}: not a pytest-benchmark JSON file")
            continue
        suite = src.stem
        md = out / f"{suite}.md"
        md.write_text(markdown(suite, data))
        written.append(md)
        if plt is not None:
            png = plot(suite, data, out / f"{suite}.png", plt)
            if png is not None:
                written.append(png)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m slabstage.bench report",
                                     description="Markdown tables and plots from the saved benchmark JSON.")
    parser.add_argument("--results", type=Path, default=None, help="folder of <suite>.json (default: bench/results)")
    parser.add_argument("--out", type=Path, default=None, help="where to write (default: the results folder)")
    parser.add_argument("--no-plots", action="store_true", help="tables only")
    parser.add_argument("--quiet", action="store_true", help="print nothing but errors")
    args = parser.parse_args(argv)
    if args.results is None and find_bench_dir() is None:
        print("slabstage.bench report: no checkout beside the installed package: pass --results DIR "
              "(the folder `python -m slabstage.bench run` wrote)", file=sys.stderr)
        return 2
    results = args.results or default_results_dir()
    if not results.is_dir():
        print(f"slabstage.bench report: no results folder {results}; run `python -m slabstage.bench run` first",
              file=sys.stderr)
        return 2
    log = (lambda *_: None) if args.quiet else print
    written = write_reports(results, args.out, plots=not args.no_plots, log=log)
    if not written:
        print(f"slabstage.bench report: no benchmark JSON in {results}", file=sys.stderr)
        return 1
    for path in written:
        log(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
