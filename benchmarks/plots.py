"""The report's PNG plots, drawn with matplotlib (Agg: no display needed) from the sections' JSON.

Each function takes a section's parsed JSON and a path, draws one figure and returns the path, or None
when the data holds nothing to draw. Colours follow the system, so a system looks the same in every plot.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # before pyplot: files only, on machines without a screen
import matplotlib.pyplot as plt

COLOURS = {"Tandem": "#1f77b4", "disaggregated": "#1f77b4", "colocated": "#ff7f0e", "HF generate": "#7f7f7f",
           "vLLM": "#2ca02c", "llama.cpp": "#d62728", "disaggregated-nocache": "#9467bd",
           "colocated-nocache": "#8c564b"}


def _colour(name: str) -> str:
    return next((c for key, c in COLOURS.items() if name.startswith(key)), "#17becf")


def _save(fig: Any, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def offline_throughput(rows: list[dict[str, Any]], roofline_batch: float | None, path: Path) -> Path | None:
    """Bars: output tokens/s per system on the offline workload; a dashed line at the batched roofline."""
    rows = [r for r in rows if r.get("tokens_per_s")]
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(8, 3.4))
    labels = [f"{r['system']}\n{r['dtype']}" for r in rows]
    ax.barh(labels, [r["tokens_per_s"] for r in rows], color=[_colour(r["system"]) for r in rows])
    for i, r in enumerate(rows):
        ax.text(r["tokens_per_s"], i, f" {r['tokens_per_s']:.0f}", va="center", fontsize=8)
    ax.invert_yaxis()
    if roofline_batch:
        ax.axvline(roofline_batch, linestyle="--", color="black", linewidth=1)
        ax.text(roofline_batch, len(rows) - 0.6, "compute roofline,\nbatched decode ", fontsize=7, ha="right",
                va="bottom")
        ax.set_xlim(0, roofline_batch * 1.05)
    ax.set_xlabel("output tokens/s (higher is better)")
    ax.set_title("Offline throughput, same prompts", fontsize=10)
    return _save(fig, path)


def speculative_speedup(rows: list[dict[str, Any]], path: Path) -> Path | None:
    """Grouped bars: decode speed-up over plain decoding, per configuration and prompt category."""
    rows = [r for r in rows if r.get("speculative")]
    if not rows:
        return None
    categories = sorted({r["category"] for r in rows}, reverse=True)
    configs = list(dict.fromkeys(r["config"] for r in rows))
    fig, ax = plt.subplots(figsize=(6, 3))
    width = 0.8 / len(configs)
    for j, config in enumerate(configs):
        values = [next((r["speedup"] for r in rows if r["config"] == config and r["category"] == c), 0.0)
                  for c in categories]
        xs = [i + j * width for i in range(len(categories))]
        ax.bar(xs, values, width, label=config)
        for x, v in zip(xs, values, strict=True):
            ax.text(x, v, f"{v:.2f}x", ha="center", va="bottom", fontsize=7)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([i + width * (len(configs) - 1) / 2 for i in range(len(categories))], categories)
    ax.set_ylabel("decode speed-up (x)")
    ax.set_title("Speculative decoding at batch 1", fontsize=10)
    ax.legend(fontsize=7)
    return _save(fig, path)


def kv_transfer_bandwidth(rows: list[dict[str, Any]], path: Path) -> Path | None:
    """Lines: GB/s against transfer size, one line per case (raw process-group send is the ceiling)."""
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(6, 3.2))
    for case in dict.fromkeys(r["case"] for r in rows):
        points = sorted((r["bytes"] / 1e6, r["gb_s"]) for r in rows if r["case"] == case)
        ax.plot(*zip(*points, strict=True), marker="o", label=case,
                linestyle="--" if case.startswith("raw") else "-", color="black" if case.startswith("raw") else None)
    ax.set_xscale("log")
    ax.set_xlabel("KV bytes per transfer (MB)")
    ax.set_ylabel("GB/s")
    ax.set_title("KV transfer (gloo over loopback)", fontsize=10)
    ax.legend(fontsize=7)
    return _save(fig, path)


def serving_latency(data: dict[str, Any], path: Path) -> Path | None:
    """CDFs of TTFT and TPOT per system (and per request kind when the workload mixes kinds)."""
    systems = [s for s in data.get("systems", []) if s.get("records")]
    if rates := data.get("rates"):  # a rate sweep: the highest rate, where the systems part
        systems = [s for s in systems if s.get("rate") in (None, max(rates))]
    if not systems:
        return None
    kinds = sorted({r["kind"] for s in systems for r in s["records"]})
    styles = ["-", "--", ":", "-."]
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.2))
    for metric, ax, unit in (("ttft_s", axes[0], "TTFT (ms)"), ("tpot_s", axes[1], "TPOT (ms)")):
        for s in systems:
            for k, kind in enumerate(kinds):
                values = sorted(1e3 * r[metric] for r in s["records"]
                                if r["ok"] and r["kind"] == kind and r.get(metric) is not None)
                if not values:
                    continue
                label = s["system"] + (f" ({kind})" if len(kinds) > 1 else "")
                ax.step(values, [(i + 1) / len(values) for i in range(len(values))], where="post", label=label,
                        color=_colour(s["system"]), linestyle=styles[k % len(styles)])
        ax.set_xscale("log")
        ax.set_xlabel(unit + ", log scale")
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=7)
    name = data.get("workload", {}).get("name", "serving")
    fig.suptitle(f"{name} workload: latency distributions", fontsize=10)
    return _save(fig, path)


def rss_over_time(series: dict[str, list[tuple[float, float]]], marker_min: float | None, path: Path) -> Path | None:
    """Lines: each process's RSS (MiB) over the soak (minutes); a dashed line where a node was killed."""
    if not any(series.values()):
        return None
    fig, ax = plt.subplots(figsize=(8, 3.6))
    for name, points in series.items():
        ax.plot([t for t, _ in points], [m for _, m in points], label=name)
    if marker_min is not None:
        ax.axvline(marker_min, color="grey", linestyle="--", linewidth=1)
    ax.set_xlabel("minutes")
    ax.set_ylabel("RSS (MiB)")
    ax.set_title("RSS of every process" + (" (dashed: node killed)" if marker_min is not None else ""))
    ax.legend(fontsize=7, ncol=2)
    return _save(fig, path)
