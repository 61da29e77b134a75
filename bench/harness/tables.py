"""The rows of a pytest-benchmark JSON document and its tables: one per metric, rows = shapes, columns =
implementations, each cell the median in microseconds and, for device time, the share of the copy ceiling.

The suites put what these need in each benchmark's ``extra_info``: ``impl``, ``shape``, ``tokens``,
``width``, ``metric``, and for device time ``fraction_of_ceiling`` and ``floor_us`` (see bench/conftest.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

__all__ = ["METRIC_TITLES", "Row", "load_rows", "metric_order", "impl_order", "fmt_us", "machine_line",
           "metric_tables"]

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
    tests = {}  # param -> the tests that take it: a param two tests share is named with its test
    cases: dict = {}  # (metric, case) -> (test, side) of each benchmark of it: a shared case is told apart
    for b in data.get("benchmarks", []):
        tests.setdefault(b.get("param"), set()).add(str(b.get("name")).split("[")[0])
        info = b.get("extra_info") or {}
        cases.setdefault((info.get("metric"), info.get("case")), []).append((_test(b), _side(info, b)))
    for b in data.get("benchmarks", []):
        info = b.get("extra_info") or {}
        median = (b.get("stats") or {}).get("median")
        if median is None:
            continue
        rows.append(Row(
            metric=str(info.get("metric", "time")),
            impl=str(_side(info, b) or b.get("name")),
            shape=str(info.get("shape") or _case(info, b, cases)
                      or (b.get("param") if len(tests[b.get("param")]) < 2 else None) or b.get("name")),
            tokens=info.get("tokens"),
            width=info.get("width"),
            median_us=float(median) * 1e6,
            fraction=info.get("fraction_of_ceiling"),
            floor_us=info.get("floor_us"),
        ))
    return rows


def _test(b: dict) -> str:
    return str(b.get("name")).split("[")[0]


def _side(info: dict, b: dict):
    """What a benchmark's column is: its ``impl``, else the ``path`` or ``mrope`` it takes, else its param."""
    return info.get("impl") or info.get("path") or info.get("mrope") or b.get("param")


def _case(info: dict, b: dict, cases: dict) -> str | None:
    """A benchmark's ``case`` as its row: with its test's name where tests share the case, and with its token
    count where one test has several benchmarks of that case and side."""
    case = info.get("case")
    if case is None:
        return None
    same = cases[(info.get("metric"), case)]
    row = case if len({t for t, _ in same}) < 2 else f"{case} ({_test(b)})"
    if same.count((_test(b), _side(info, b))) > 1:
        row += f", {info.get('tokens')} tokens"
    return row


def metric_order(rows: list[Row]) -> list[str]:
    seen = list(dict.fromkeys(r.metric for r in rows))
    return [m for m in METRIC_TITLES if m in seen] + [m for m in seen if m not in METRIC_TITLES]


def fmt_us(x: float) -> str:
    if x < 1:
        return f"{x:.2f} µs"
    return f"{x:.1f} µs" if x < 1000 else f"{x:,.0f} µs"


def impl_order(rows: list[Row]) -> list[str]:
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
    text = fmt_us(r.median_us)
    if r.fraction is not None:
        text += f" ({100 * r.fraction:.0f}%)" if r.fraction >= 0.01 else " (<1%)"
    return text


def metric_tables(rows: list[Row], skip: set) -> list[str]:
    """One markdown table per metric of ``rows`` but those in ``skip``, each followed by a blank line."""
    out = []
    for metric in metric_order(rows):
        if metric in skip:
            continue
        sub = [r for r in rows if r.metric == metric]
        impls, shapes = impl_order(sub), _shape_order(sub)
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
                line.append(fmt_us(min(floors)) if floors else "–")
            if ratio:
                ours = cell.get((shape, "slabstage"))
                peers = [cell[(shape, i)].median_us for i in impls if _is_peer(i) and (shape, i) in cell]
                line.append(f"{min(peers) / ours.median_us:.2f}x" if ours and peers else "–")
            out.append("| " + " | ".join(line) + " |")
        out.append("")
    return out


def _is_peer(impl: str) -> bool:
    return not impl.startswith("slabstage") and not impl.startswith("copy")
