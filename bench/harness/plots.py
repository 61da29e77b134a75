"""Log-log plots of a suite's benchmark JSON: median time against tokens, one line per implementation, the
copy floor (bytes / ceiling) dotted; one panel per metric and width (bars where a panel has one size). And the
engine figure (:func:`engine_plot`): the prefill and generate suites' figures beside Hugging Face's."""

from __future__ import annotations

from pathlib import Path

from .tables import impl_order, load_rows, machine_line, metric_order

__all__ = ["pyplot", "plot", "engine_plot"]


def pyplot():
    """matplotlib's pyplot on the Agg backend, or None when matplotlib is not installed."""
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
    panels = [(m, w) for m in metric_order(rows) for w in dict.fromkeys(r.width for r in rows if r.metric == m)]
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.5), squeeze=False)
    for ax, (metric, width) in zip(axes[0], panels):
        sub = [r for r in rows if r.metric == metric and r.width == width]
        title = f"{suite}: {metric} time" + (f", width {width}" if width else "")
        if len({r.tokens for r in sub}) < 2:  # one size: bars say more than a single point
            impls = impl_order(sub)
            times = [min(r.median_us for r in sub if r.impl == i) for i in impls]
            ax.barh(impls, times, color=[f"C{k}" for k in range(len(impls))])
            ax.invert_yaxis()
            ax.set_xlabel(f"{metric} time per call (µs, median)")
            ax.set_title(f"{suite}: {metric} time, {sub[0].shape}")
            ax.grid(True, axis="x", alpha=0.3)
            continue
        for impl in impl_order(sub):
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


ENGINE_COLORS = {"slabstage": "#1f77b4", "HF": "#ff7f0e", "dense mask": "#7f7f7f"}
ENGINE_NAMES = {"qwen3_vl": "Qwen3-VL, image", "qwen2_7b": "Qwen2-7B-shaped"}


def _figures(doc, key: str) -> dict:
    """``{case: figures}`` of a suite's JSON (each benchmark's ``extra_info``, keyed by ``key``), or of a
    mapping or list of figures."""
    if isinstance(doc, dict) and "benchmarks" in doc:
        doc = [b.get("extra_info") or {} for b in doc["benchmarks"]]
    return {f[key]: f for f in doc} if isinstance(doc, list) else doc


def _bars(ax, groups: dict, series: list, unit: str, title: str) -> None:
    width = 0.8 / len(series)
    for i, name in enumerate(series):
        xs = [g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))]
        for x, values in zip(xs, groups.values()):
            v = values.get(name)
            if v is not None:
                ax.bar(x, v, width, color=ENGINE_COLORS[name], label=name if x == xs[0] else None)
                ax.annotate(f"{v:.0f}" if v >= 100 else f"{v:.1f}", (x, v), ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(groups)), list(groups), fontsize=8)
    ax.set_ylabel(unit)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)


def engine_plot(results: Path, path: Path, plt) -> Path | None:
    """Prefill step times (replay against HF one request at a time and the dense-mask forward), and generate's
    time to first token and decode tokens/s against HF's, from ``prefill.json`` and ``generate.json`` in
    ``results``; None when either is missing."""
    import json

    try:
        prefill = _figures(json.loads((results / "prefill.json").read_text()), "case")
        generate = _figures(json.loads((results / "generate.json").read_text()), "model")
    except (OSError, ValueError):
        return None
    packed = [c for c in ("packed_16x1024", "packed_4x1024") if c in prefill]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    _bars(axes[0], {f"{c.split('_')[1]} packed": {"slabstage": prefill[c]["replay_ms"],
                                                  "HF": prefill[c]["hf_per_request_ms"],
                                                  "dense mask": prefill[c]["dense_ms"]} for c in packed},
          ["slabstage", "HF", "dense mask"], "ms (lower is better)", "prefill step, KV cache written")
    names = {ENGINE_NAMES.get(m, m): g for m, g in generate.items()}
    _bars(axes[1], {m: {"slabstage": g["ttft_ms"], "HF": g["hf_ttft_ms"]} for m, g in names.items()},
          ["slabstage", "HF"], "ms (lower is better)", "generate: time to first token, 8 requests")
    _bars(axes[2], {m: {"slabstage": g["decode_tok_s"], "HF": g["hf_decode_tok_s"]} for m, g in names.items()},
          ["slabstage", "HF"], "tokens/s (higher is better)", "generate: decode at batch 8")
    fig.suptitle("Qwen2-7B-shaped (4 layers) and mid-size Qwen3-VL, bf16", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
