"""Draw bench/results/engine/engine.png from the engine suites' committed JSON.

``python bench/plot_engine.py [--results DIR] [--out FILE]``: prefill step times (slabstage's replay against
HF's forward one request at a time and the dense-mask forward), and ``generate``'s time to first token and
decode tokens/s against HF's ``generate``. Needs matplotlib.
"""
import argparse
import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "engine"
COLORS = {"slabstage": "#1f77b4", "HF": "#ff7f0e", "dense mask": "#7f7f7f"}


def _bars(ax, groups, series, unit, title):
    width = 0.8 / len(series)
    for i, name in enumerate(series):
        xs = [g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))]
        vals = [values.get(name) for values in groups.values()]
        for x, v in zip(xs, vals):
            if v is not None:
                ax.bar(x, v, width, color=COLORS[name], label=name if x == xs[0] else None)
                ax.annotate(f"{v:.0f}" if v >= 100 else f"{v:.1f}", (x, v), ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(groups)), list(groups), fontsize=8)
    ax.set_ylabel(unit)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)


def plot(results=RESULTS, out=None):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = Path(results)
    prefill = json.loads((results / "prefill.json").read_text())
    generate = {g["model"]: g for g in json.loads((results / "generate.json").read_text())}
    names = {"qwen3_vl": "Qwen3-VL, image", "qwen2_7b": "Qwen2-7B-shaped"}
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    _bars(axes[0], {f"{c.split('_')[1]} packed": {"slabstage": prefill[c]["replay_ms"],
                                                  "HF": prefill[c]["hf_per_request_ms"],
                                                  "dense mask": prefill[c]["dense_ms"]}
                    for c in ("packed_16x1024", "packed_4x1024")},
          ["slabstage", "HF", "dense mask"], "ms (lower is better)", "prefill step, KV cache written")
    _bars(axes[1], {names.get(m, m): {"slabstage": g["ttft_ms"], "HF": g["hf_ttft_ms"]} for m, g in generate.items()},
          ["slabstage", "HF"], "ms (lower is better)", "generate: time to first token, 8 requests")
    _bars(axes[2], {names.get(m, m): {"slabstage": g["decode_tok_s"], "HF": g["hf_decode_tok_s"]}
                    for m, g in generate.items()},
          ["slabstage", "HF"], "tokens/s (higher is better)", "generate: decode at batch 8")
    fig.suptitle("Qwen2-7B-shaped (4 layers) and mid-size Qwen3-VL, bf16, one H200", fontsize=10)
    fig.tight_layout()
    out = Path(out) if out else results / "engine.png"
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", default=RESULTS, help="folder with prefill.json and generate.json")
    parser.add_argument("--out", default=None, help="PNG to write (default: RESULTS/engine.png)")
    args = parser.parse_args(argv)
    print(plot(args.results, args.out))


if __name__ == "__main__":
    main()
