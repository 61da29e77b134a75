"""Log-log plots of a suite's benchmark JSON: median time against tokens, one line per implementation, the
copy floor (bytes / ceiling) dotted; one panel per metric and width (bars where a panel has one size)."""

from __future__ import annotations

from pathlib import Path

from .tables import impl_order, load_rows, machine_line, metric_order

__all__ = ["pyplot", "plot"]


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
