"""The README's "Measured" table, from the suites' saved JSON: ``python bench/report.py`` writes it to
``headline.md`` beside the results, and with ``--readme README.md`` between the README's markers, so that every
figure the README quotes is a suite's (``tests/project/test_bench_report.py`` holds the README to it).

Each row names the suite's case it quotes; a case missing from the result set shows as such, never as an
older figure.
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["BEGIN", "END", "headline", "readme_block", "write_readme"]

BEGIN = "<!-- measured: written by `python bench/report.py --readme README.md` from bench/results -->"
END = "<!-- /measured -->"
SUITES = ("prefill", "generate", "encoder_cache")
PLOT = "![Prefill step, time to first token and decode tokens/s against Hugging Face]({})"
MISSING = "not in this result set"


def _load(results: Path) -> dict:
    """suite -> its pytest-benchmark document, for the suites the table quotes that have one."""
    docs = {}
    for suite in SUITES:
        path = Path(results) / f"{suite}.json"
        if path.is_file():
            docs[suite] = json.loads(path.read_text())
    return docs


def _times(*xs: float, unit: str = "µs") -> str:
    return " / ".join(f"{x:.1f}" for x in xs) + f" {unit}"


def _x(*xs: float) -> str:
    return " / ".join(f"{x:.2f}x" for x in xs)


def _rows(case) -> list[tuple]:
    """``(what, slabstage, reference, ratio)`` rows; ``case(suite, name)`` is a benchmark's ``extra_info``."""
    rows = []

    def row(what: str, cells) -> None:
        try:
            rows.append((what, *cells()))
        except KeyError:
            rows.append((what, MISSING, "", ""))

    def prefill():
        a, b = case("prefill", "test_prefill[packed_16x1024]"), case("prefill", "test_prefill[packed_4x1024]")
        return (_times(a["replay_ms"], b["replay_ms"], unit="ms"),
                f"HF one request at a time {_times(a['hf_per_request_ms'], b['hf_per_request_ms'], unit='ms')}; "
                f"dense `[T, T]` mask forward {_times(a['dense_ms'], b['dense_ms'], unit='ms')}",
                f"{_x(a['speedup_vs_hf'], b['speedup_vs_hf'])} HF; {_x(a['speedup_vs_dense'], b['speedup_vs_dense'])} "
                f"the mask path")

    def chunks():
        c = case("prefill", "test_prefill[chunked_16384]")
        diff = c["chunks_vs_whole_max_abs_diff"]
        return (_times(c["four_chunks_ms"], unit="ms"), f"one 16384-token step {_times(c['one_step_ms'], unit='ms')}",
                f"{_x(c['chunked_ratio'])} the time; " + ("equal hidden states" if diff == 0 else
                                                           f"hidden states within {diff:.2g}"))

    def generate():
        a, b = case("generate", "test_generate[qwen3_vl]"), case("generate", "test_generate[qwen2_7b]")
        return (f"TTFT {_times(a['ttft_ms'], b['ttft_ms'], unit='ms')}; decode {a['decode_tok_s']:.0f} / "
                f"{b['decode_tok_s']:.0f} tokens/s",
                f"HF `generate`: {_times(a['hf_ttft_ms'], b['hf_ttft_ms'], unit='ms')}; {a['hf_decode_tok_s']:.0f} / "
                f"{b['hf_decode_tok_s']:.0f} tokens/s",
                f"TTFT {_x(a['ttft_speedup'], b['ttft_speedup'])}; "
                f"decode {_x(a['decode_speedup'], b['decode_speedup'])}")

    def ab(*names, faster=False):
        cases = [case("encoder_cache", n) for n in names]
        ratio = _x(*(c["ratio"] for c in cases))  # (a "faster" case's ratio is the reference's time over ours)
        return (_times(*(c["ours_us"] for c in cases)),
                f"{cases[0]['reference_impl']} {_times(*(c['reference_us'] for c in cases))}",
                ratio + " faster" if faster else ratio)

    def replay():
        def per(table, what):  # "16 entries; one entry", each at 256 / 2048 / 8192 rows
            fmt = _x if what == "ratio" else _times
            return "; ".join(fmt(*(case("encoder_cache", f"test_replay[{table}-{i}-{n}]")[what]
                                   for n in (256, 2048, 8192))) for i in (16, 1))
        return (f"{per('on the device', 'ours_us')} (in the rounds against the copied-in table: "
                f"{per('copied in', 'ours_us')})",
                "LightLLM's kernel (as many images) and the forward in one graph, its image table already on the "
                f"device: {per('on the device', 'reference_us')}. The same, its image table copied in before each "
                f"replay: {per('copied in', 'reference_us')}",
                f"{per('on the device', 'ratio')}. Against the copied-in table: {per('copied in', 'ratio')}")

    row("prefill, Qwen2-7B-shaped, 4 layers, bf16, KV cache written: 16 x 1024 / 4 x 1024 tokens packed, replay",
        prefill)
    row("chunked prefill: one 16384-token prompt in four 4096-token chunks", chunks)
    row("`generate`, 8 requests, 64 new tokens: mid-size Qwen3-VL (an image each) / Qwen2-7B-shaped (1024-token "
        "prompts)", generate)
    row("`run()` host time, 256 tokens: 16 cached encoder outputs / 16 DeepStack entries of 4 blocks",
        lambda: ab("test_run_host[entries]", "test_run_host[deepstack_entries]"))
    row("staging 8192 x 4096 from 16 cached entries: latency / device time",
        lambda: ab("test_stage[latency]", "test_stage[device]"))
    row("Qwen3-VL-like merge from the encoder cache, 4096 tokens, 2320 media rows, k = 3: latency / device time",
        lambda: ab("test_merge[latency]", "test_merge[device]", faster=True))
    row("16 host-tier cache entries staged at 8192 x 4096, device time", lambda: ab("test_host_tier"))
    row("staging inside a graph replay, 256 / 2048 / 8192 x 4096, device time: media in 16 entries / in one",
        replay)
    return rows


def _machine(docs: dict) -> str:
    """One line: the GPU, driver and CUDA, the versions, the dates of the result sets quoted."""
    infos = [(d.get("machine_info") or {}).get("slabstage") or {} for d in docs.values()]
    dates = sorted({str(d.get("datetime", ""))[:10] for d in docs.values()} - {""})

    def one(key):
        return " and ".join(sorted({str(i[key]) for i in infos if i.get(key)}))
    parts = [f"One {one('gpu') or 'machine without a GPU'}"
             + (f" (driver {one('driver')}, CUDA {one('cuda_runtime')})" if one("driver") else "")]
    parts += [f"{name} {one(key)}" for name, key in (("torch", "torch"), ("triton", "triton"), ("Python", "python"),
                                                     ("transformers", "transformers")) if one(key)]
    parts.append(" to ".join(dict.fromkeys((dates[0], dates[-1]))) if dates else "undated")
    return ", ".join(parts) + "."


def headline(results: Path, plot: str = "bench/results/engine.png") -> str:
    """The block the README's "Measured" section holds: the machine line, the table, the plot (``plot``: its
    path from where the block is written)."""
    docs = _load(results)
    index = {(s, b.get("name")): b.get("extra_info") or {} for s, d in docs.items() for b in d.get("benchmarks", [])}

    def case(suite, name):
        return index[(suite, name)]
    lines = [_machine(docs), "", "| what | slabstage | reference | ratio |", "| --- | ---: | --- | ---: |"]
    lines += [f"| {' | '.join(r)} |" for r in _rows(case)]
    return "\n".join(lines + ["", PLOT.format(plot)]) + "\n"


def readme_block(text: str) -> str:
    """What lies between the README's markers."""
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise ValueError(f"the README has no block between {BEGIN!r} and {END!r}")
    return text[start + len(BEGIN):end].strip("\n") + "\n"


def write_readme(readme: Path, results: Path) -> None:
    """Rewrite the README's block from ``results``."""
    text = Path(readme).read_text()
    readme_block(text)  # (raises without the markers)
    start, end = text.find(BEGIN) + len(BEGIN), text.find(END)
    Path(readme).write_text(text[:start] + "\n" + headline(results) + text[end:])
