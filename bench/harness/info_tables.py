"""Tables of the figures a benchmark keeps in its ``extra_info`` when its own timing is a worker process's wall
time (a capture in a fresh process, say), so that a row of that timing would say nothing.

- ``metric == "capture"`` with ``bytes_all`` (bench_graph_runner.py's ``test_capture``): the ladder's capture
  cost against the largest bucket alone;
- ``metric == "replay"`` (bench_replay.py): per case, the capture and its check; per case and size, replay
  against eager; and where a replay step's wall time goes (its kernels against the rest);
- ``metric == "figures"`` (bench_prefill.py, bench_generate.py, bench_tp.py): each benchmark's scalar figures;
- ``metric == "ab"`` (bench_encoder_cache.py): ours against its reference, medians of alternated rounds, the
  ratio and the target.
"""

from __future__ import annotations

from .tables import fmt_us

__all__ = ["info_tables"]


def info_tables(data: dict) -> tuple[list[str], set[str]]:
    """The markdown lines of these tables, and the metrics they stand for (not to be tabulated again)."""
    lines, covered = [], set()
    capture = _capture_lines(data)
    if capture:
        lines += capture
        covered.add("capture")
    infos = [b.get("extra_info") or {} for b in data.get("benchmarks", [])]
    for metric, table in (("replay", _replay_lines), ("figures", _figures_lines), ("first_call", _figures_lines),
                          ("ab", _ab_lines)):
        found = table([i for i in infos if i.get("metric") == metric])
        if found:
            lines += found
            covered.add(metric)
    return lines, covered


def _figures_lines(infos: list[dict]) -> list[str]:
    """Per benchmark, its scalar figures (a worker's or a whole comparison's, its timing being wall time)."""
    out = []
    for i in infos:
        out += [f"## {i.get('impl') or i.get('case')}", "", "| figure | value |", "| --- | ---: |"]
        for key, value in i.items():
            if key not in ("suite", "metric", "impl", "case") and isinstance(value, (int, float, str, bool)):
                out.append(f"| {key} | {round(value, 3) if isinstance(value, float) else value} |")
        out.append("")
    return out


def _ab_lines(infos: list[dict]) -> list[str]:
    """A/B comparisons (bench_encoder_cache.py): ours against its reference, rounds alternated in one loop."""
    if not infos:
        return []
    out = ["## Against the reference (medians, rounds alternated; ratio: ours / reference, or how many times "
           "faster where the target is >=)", "",
           "| case | tokens | ours | µs | reference | µs | ratio | target | met |",
           "| --- | ---: | --- | ---: | --- | ---: | ---: | ---: | --- |"]
    for i in infos:
        out.append(f"| {i.get('case')} | {i.get('tokens', '')} | {i.get('impl')} | {fmt_us(i['ours_us'])} | "
                   f"{i.get('reference_impl')} | {fmt_us(i['reference_us'])} | {i['ratio']:.3f} | {i['target']} | "
                   f"{'yes' if i['met'] else 'no'} |")
    return (out + [""] + _ab_host_lines([i for i in infos if "ours_host_us" in i])
            + _ab_profile_lines([i for i in infos if i.get("profile")]))


def _ab_host_lines(infos: list[dict]) -> list[str]:
    """How much of each side's latency the host took (median time until its call returned)."""
    if not infos:
        return []
    out = ["## The host's part of each latency (median µs until the call returned; the rest is waiting for the "
           "device)", "", *_head(["case", "tokens", "ours: host / latency", "reference: host / latency"], "lrrr")]
    for i in infos:
        out.append(_row([i.get("case"), i.get("tokens", ""),
                         f"{fmt_us(i['ours_host_us'])} / {fmt_us(i['ours_us'])}",
                         f"{fmt_us(i['reference_host_us'])} / {fmt_us(i['reference_us'])}"]))
    return out + [""]


def _ab_profile_lines(infos: list[dict]) -> list[str]:
    """Where each side's device time goes (torch.profiler): its kernels one by one and their span."""
    if not infos:
        return []
    out = ["## Where the device time goes (torch.profiler, medians; span: first kernel's start to the last one's "
           "end)", "", *_head(["case", "tokens", "side", "span", "kernels (µs each)"], "lrlrl")]
    for i in infos:
        for side, p in i["profile"].items():
            kernels = "; ".join(f"{name.replace('|', '/')} {us:.1f}" for name, us in (p.get("by_kernel") or {}).items())
            name = i.get("impl") if side == "ours" else i.get("reference_impl") if side == "reference" else side
            out.append(_row([i.get("case"), i.get("tokens", ""), name or side, fmt_us(p.get("span_us", 0.0)),
                             kernels or "–"]))
    return out + [""]


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


def _row(cells) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def _head(cells, align: str) -> list[str]:
    """A table's header: ``align`` has an ``l`` (text) or ``r`` (a figure) per column."""
    return [_row(cells), _row("---" if a == "l" else "---:" for a in align)]


def _buckets(buckets: list[int]) -> str:
    buckets = sorted(buckets)
    return ", ".join(map(str, buckets)) if len(buckets) <= 4 else f"{buckets[0]}..{buckets[-1]}"


def _dropped(dropped: dict) -> str:
    """``{bucket: reason}`` as ``reason xN (buckets)`` per reason, or ``none``."""
    by_reason: dict[str, list[int]] = {}
    for bucket, why in dropped.items():
        by_reason.setdefault(why, []).append(int(bucket))
    return "; ".join(f"{why} x{len(b)} ({_buckets(b)})" for why, b in sorted(by_reason.items())) or "none"


def _opt_us(x) -> str:
    return fmt_us(x) if x is not None else "–"


def _kernels(profile: dict) -> str:
    """``kernel time (count)`` of one profiled step, or ``–`` where the profile holds no kernel."""
    return f"{fmt_us(profile['kernel_us'])} ({profile['kernels']})" if profile.get("kernels") else "–"


def _replay_lines(cases: list[dict]) -> list[str]:
    """bench_replay.py's tables, one row per case (its ``impl``) or per case and size."""
    if not cases:
        return []
    return [*_replay_capture(cases), *_replay_steps(cases), *_replay_profile(cases),
            "ran as: the bucket the replay step ran in, or why it ran eagerly (a bucket the capture check dropped "
            "runs eagerly). host left: the replay step's wall time less its kernels' device time: staging on the "
            "host, the launch, the copy of the batch's block, the sync.", ""]


def _replay_capture(cases: list[dict]) -> list[str]:
    out = ["## Replay against eager: capture (each case in a fresh process, the largest bucket alone in another)",
           "", *_head(["case", "buckets", "capture s (a bucket)", "capture MiB", "largest bucket alone", "ratio",
                       "dropped by the capture check", "runs: replayed / eager (reason: runs)"], "lrrrrrll")]
    for c in cases:
        ratio = c.get("mib_vs_largest_alone")
        stats = c.get("stats") or {}
        eager = ", ".join(f"{why}: {k}" for why, k in sorted((stats.get("eager") or {}).items())) or "none"
        alone = c.get("largest_alone_mib")
        dropped = (f"capture failed: {c['capture_error'][:160]}" if c.get("capture_error")
                   else _dropped(c.get("dropped") or {}))
        out.append(_row([c["impl"], c["buckets"], f"{c['capture_s']:.2f} ({c['capture_s_per_bucket']:.3f})",
                         f"{c['capture_mib']:.0f}", f"{alone:.0f} MiB" if alone is not None else "–",
                         f"{ratio:.2f}x" if ratio is not None else "–", dropped.replace("|", "/"),
                         f"{sum((stats.get('replays') or {}).values())} / {eager}"]))
    return out + [""]


def _replay_steps(cases: list[dict]) -> list[str]:
    out = [f"## Replay against eager: wall time a step (perf_counter around `run()` and a device sync; "
           f"{cases[0].get('rounds', '?')} rounds, replay and eager alternated)", "",
           *_head(["case", "tokens", "replay min", "replay median", "eager min", "eager median",
                   "replay / eager (median)", "bit-equal (max abs diff)", "ran as"], "lrrrrrrll")]
    for c in cases:
        for s in c.get("sizes", []):
            tokens = f"{s['tokens']}" + (f" (bucket {s['bucket']})" if s.get("bucket") not in (None, s["tokens"])
                                         else "")
            equal = "yes" if s["equal"] else f"no ({s['max_abs_diff']:.3g})"
            ran_as = f"bucket {s['ran_as']}" if isinstance(s["ran_as"], int) else f"eager: {s['ran_as']}"
            out.append(_row([c["impl"], tokens, fmt_us(s["replay_min_us"]), fmt_us(s["replay_median_us"]),
                             fmt_us(s["eager_min_us"]), fmt_us(s["eager_median_us"]), f"{s['ratio_median']:.2f}",
                             equal, ran_as]))
    return out + [""]


def _replay_profile(cases: list[dict]) -> list[str]:
    out = [f"## Where a step's wall time goes (torch.profiler, CUDA activity, median of "
           f"{cases[0].get('profiled_steps', '?')} steps; wall: the median above)", "",
           *_head(["case", "tokens", "replay wall", "its kernels (count)", "its copies", "wall - kernels (host left)",
                   "kernels / wall", "eager wall", "its kernels (count)"], "lrrrrrrrr")]
    for c in cases:
        for s in c.get("sizes", []):
            profile = s.get("profile") or {}
            rp, ep = profile.get("replay") or {}, profile.get("eager") or {}
            share = rp["kernel_us"] / s["replay_median_us"] if rp.get("kernels") else None
            out.append(_row([c["impl"], s["tokens"], fmt_us(s["replay_median_us"]), _kernels(rp),
                             _opt_us(rp.get("copy_us")) if rp.get("kernels") else "–",
                             _opt_us(s.get("host_overhead_us")), f"{share:.0%}" if share is not None else "–",
                             fmt_us(s["eager_median_us"]), _kernels(ep)]))
    return out + [""]
