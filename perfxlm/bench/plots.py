"""PNG figures for the benchmarks (matplotlib with the Agg backend: no display needed)."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any


def pyplot():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def ensure_dir(path: str) -> None:
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)


def save_figure(fig, path: str, title: str | None = None) -> str:
    """Title, lay out, write `path` (its folder made if missing) and free the figure."""
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    ensure_dir(path)
    fig.savefig(path, dpi=110)
    pyplot().close(fig)
    return path


def plot_sweep(rows: Sequence[Mapping[str, Any]], path: str, title: str | None = None) -> str:
    """Throughput, decode step time and prefill time against batch size, one panel each."""
    plt = pyplot()
    batches = [r["batch_size"] for r in rows]
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(14, 4.2))
    ax1.plot(batches, [r["throughput_tok_s"] for r in rows], "o-", color="tab:blue", label="generated tokens/s")
    ax1.plot(batches, [r.get("decode_tok_s", float("nan")) for r in rows], "s--", color="tab:cyan",
             label="decode tokens/s (batch / step time)")
    ax1.set_ylabel("tokens/s")
    ax1.set_title("throughput")
    ax1.legend(fontsize=8)
    ax2.plot(batches, [r["decode_ms"] for r in rows], "o-", color="tab:red")
    ax2.set_ylabel("ms")
    ax2.set_title("decode step time")
    ax3.plot(batches, [r["prefill_ms"] for r in rows], "o-", color="tab:gray")
    ax3.set_ylabel("ms")
    ax3.set_title("prefill time (whole batch)")
    for ax in (ax1, ax2, ax3):
        ax.set_xlabel("batch size")
        ax.set_xscale("log", base=2)
        ax.set_xticks(batches)
        ax.set_xticklabels([str(b) for b in batches])
        ax.set_ylim(0, ax.get_ylim()[1] * 1.08)
        ax.grid(True, alpha=0.3)
    return save_figure(fig, path, title)


def plot_latency_cdfs(series: Mapping[str, Sequence[float]], path: str, title: str | None = None) -> str:
    """Empirical CDFs of TTFT, TPOT, ITL and E2EL (ms), one panel each."""
    import numpy as np

    plt = pyplot()
    names = [("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2EL")]
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, (key, label) in zip(axes.flat, names):
        values = np.sort(np.asarray(series.get(key) or [], dtype=float))
        if values.size:
            ax.step(values, np.arange(1, values.size + 1) / values.size, where="post")
            for p, style in ((50, ":"), (99, "--")):
                ax.axvline(np.percentile(values, p), color="gray", linestyle=style, linewidth=0.8,
                           label=f"p{p} {np.percentile(values, p):.1f} ms")
            ax.legend(fontsize=8, loc="lower right")
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
        ax.set_xlabel(f"{label} (ms)")
        ax.set_ylabel("fraction of requests" if key != "itl" else "fraction of chunks")
        ax.set_ylim(0, 1.02)
        ax.grid(True, alpha=0.3)
        ax.set_title(label)
    return save_figure(fig, path, title)
