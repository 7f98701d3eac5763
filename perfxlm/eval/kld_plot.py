"""PNG of per-token KL divergences, one curve per model under test."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from perfxlm.bench.plots import pyplot, save_figure


def plot_kld(series: Mapping[str, np.ndarray], path: str, title: str | None = None) -> str:
    """Left: each model's share of tokens above a KLD (log scale: the tail is what differs between
    formats). Right: mean KLD per model with its standard error."""
    plt = pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.4), gridspec_kw={"width_ratios": [3, 2]})
    floor = 1e-6  # KLDs at or below it (rounding can make them slightly negative) plot at the floor
    for label, values in series.items():
        v = np.sort(np.clip(np.asarray(values, dtype=float), floor, None))
        above = 1.0 - np.arange(v.size) / max(v.size, 1)
        ax1.step(v, above, where="post", label=label)
    ax1.set_xscale("log")
    ax1.set_yscale("log")
    ax1.set_xlabel("KL divergence of a token (nats)")
    ax1.set_ylabel("fraction of tokens at or above")
    ax1.grid(True, which="both", alpha=0.3)
    ax1.legend(fontsize=8)
    labels = list(series)
    means = [float(np.mean(series[k])) for k in labels]
    errors = [float(np.std(series[k]) / np.sqrt(max(len(series[k]) - 1, 1))) for k in labels]
    ax2.barh(range(len(labels)), means, xerr=errors, color="tab:blue", alpha=0.8)
    ax2.set_yticks(range(len(labels)))
    ax2.set_yticklabels(labels, fontsize=8)
    ax2.invert_yaxis()
    ax2.set_xlabel("mean KLD (nats)")
    ax2.grid(True, axis="x", alpha=0.3)
    for i, m in enumerate(means):
        ax2.text(m, i, f" {m:.5f}", va="center", fontsize=8)
    return save_figure(fig, path, title)
