"""The PNGs a training run leaves next to its probe: score histogram and calibration."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; no display on servers
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def score_histogram(path: Path, scores: np.ndarray, labels: np.ndarray, threshold: float,
                    title: str) -> Path:
    fig, ax = plt.subplots(figsize=(6, 4))
    bins = np.histogram_bin_edges(scores, bins=30)
    ax.hist(scores[labels == 0], bins=bins, alpha=0.6, label=f"label 0 ({(labels == 0).sum()})")
    ax.hist(scores[labels == 1], bins=bins, alpha=0.6, label=f"label 1 ({(labels == 1).sum()})")
    ax.axvline(threshold, color="black", linestyle="--", label=f"threshold {threshold:.4g}")
    ax.set_xlabel("example score (highest scored row, as the router fires)")
    ax.set_ylabel("held-out examples")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def calibration_plot(path: Path, scores: np.ndarray, labels: np.ndarray, title: str,
                     probabilities: bool, bins: int = 10) -> Path:
    """Share of positives per score bin (equal-count bins) on held-out examples;
    with probability scores, the diagonal is perfect calibration."""
    order = np.argsort(scores, kind="stable")
    groups = [g for g in np.array_split(order, min(bins, scores.size)) if g.size]
    mean_score = [scores[g].mean() for g in groups]
    positive_rate = [labels[g].mean() for g in groups]
    fig, ax = plt.subplots(figsize=(5, 5))
    ax.plot(mean_score, positive_rate, marker="o", label="held-out examples")
    if probabilities:
        ax.plot([0, 1], [0, 1], color="grey", linestyle=":", label="perfectly calibrated")
        ax.set_xlim(0, 1)
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("mean example score in bin")
    ax.set_ylabel("share of label 1 in bin")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
