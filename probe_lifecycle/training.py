"""Probe training on a captured dataset: the fits, the split and the calibration.

Plain numpy and scikit-learn, no files and no gRPC. Held-out scores are computed
with the router's own probe code (`common.probe_format.probes`) from the probe as it
will be loaded, and reduced per example the way the router's decision rule
fires (any scored row at or above the threshold), so the threshold picked here
is the one that holds live.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import roc_auc_score

from probe_lifecycle.dataset import Features
from common.probe_format.probes import Probe, ProjectionPlan

KINDS = ("logistic", "mean_difference", "trajectory")
AGGREGATIONS = ("ema", "rolling_mean", "max_rolling_mean")


class TrainingError(ValueError):
    """Data or options a probe cannot be trained from; names the option or field."""


@dataclass(frozen=True)
class Split:
    """Example indexes (into Features.ids) for fitting and for held-out evaluation."""

    train: np.ndarray
    held_out: np.ndarray


def split_by_example(features: Features, held_out: float, seed: int) -> Split:
    """A stratified split of examples (never of rows: one prompt's tokens stay together).

    Examples without rows (nothing captured in the selected tokens) are left out.
    """
    if not 0 < held_out < 1:
        raise TrainingError(f"--held-out: {held_out} is not in (0, 1)")
    has_rows = np.zeros(len(features.ids), dtype=bool)
    has_rows[features.example] = True
    rng = np.random.default_rng(seed)
    train, test = [], []
    for label in (0, 1):
        members = np.flatnonzero(has_rows & (features.labels == label))
        if members.size < 2:
            raise TrainingError(
                f"label: {members.size} example(s) with label {label} have rows; "
                "need at least 2 per class to train and evaluate"
            )
        members = rng.permutation(members)
        count = min(max(1, round(members.size * held_out)), members.size - 1)
        test.append(members[:count])
        train.append(members[count:])
    return Split(np.sort(np.concatenate(train)), np.sort(np.concatenate(test)))


def rows_of(features: Features, examples: np.ndarray) -> np.ndarray:
    return np.isin(features.example, examples)


def fit_logistic(x: np.ndarray, y: np.ndarray, c: float, seed: int) -> dict[str, np.ndarray]:
    """Logistic regression on standardised rows; the router folds mean/std back in."""
    mean = x.mean(axis=0)
    std = x.std(axis=0)
    std = np.where(std > 1e-6, std, 1.0)
    model = LogisticRegression(C=c, max_iter=5000, random_state=seed)
    model.fit((x - mean) / std, y)
    return {
        "weight": model.coef_[0].astype(np.float32),
        "bias": model.intercept_.astype(np.float32),
        "mean": mean.astype(np.float32),
        "std": std.astype(np.float32),
    }


def fit_mean_difference(x: np.ndarray, y: np.ndarray) -> dict[str, np.ndarray]:
    """The direction between the class means, centred on their midpoint."""
    positive, negative = x[y == 1].mean(axis=0), x[y == 0].mean(axis=0)
    direction = positive - negative
    if not np.linalg.norm(direction) > 0:
        raise TrainingError("the class means are identical; there is no direction to learn")
    return {"direction": direction.astype(np.float32),
            "center": ((positive + negative) / 2).astype(np.float32)}


def example_scores(probe: Probe, features: Features, examples: np.ndarray) -> np.ndarray:
    """Each example's highest score as the router computes it, rows in position order."""
    plan = ProjectionPlan((probe,))
    order = np.lexsort((features.position, features.example))  # by example, then position
    starts = np.searchsorted(features.example[order], examples, side="left")
    ends = np.searchsorted(features.example[order], examples, side="right")
    out = np.empty(examples.size)
    for i, (start, end) in enumerate(zip(starts, ends)):
        rows = features.rows[order[start:end]]
        values = plan.apply(np.ascontiguousarray(rows, dtype=np.float32))
        out[i] = probe.score(values, probe.new_state()).max()
    return out


def threshold_for_fpr(negative_scores: np.ndarray, target_fpr: float) -> float:
    """The lowest threshold at which at most target_fpr of the negatives reach it
    (the router fires at score >= threshold)."""
    if not 0 <= target_fpr < 1:
        raise TrainingError(f"--target-fpr: {target_fpr} is not in [0, 1)")
    ordered = np.sort(negative_scores)[::-1]
    allowed = int(np.floor(target_fpr * ordered.size + 1e-9))
    # Just above the (allowed+1)-th highest negative, so exactly `allowed` reach it.
    return float(np.nextafter(np.float32(ordered[allowed]), np.float32(np.inf)))


@dataclass(frozen=True)
class Evaluation:
    auroc: float
    threshold: float
    target_fpr: float
    fpr: float
    tpr: float
    positives: int
    negatives: int

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def evaluate(scores: np.ndarray, labels: np.ndarray, target_fpr: float) -> Evaluation:
    negatives, positives = scores[labels == 0], scores[labels == 1]
    threshold = threshold_for_fpr(negatives, target_fpr)
    return Evaluation(
        auroc=float(roc_auc_score(labels, scores)),
        threshold=threshold,
        target_fpr=target_fpr,
        fpr=float((negatives >= threshold).mean()),
        tpr=float((positives >= threshold).mean()),
        positives=int(positives.size),
        negatives=int(negatives.size),
    )
