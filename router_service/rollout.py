"""Rolling a new probe version out beside the serving one, as plain rules.

A candidate version is a canary (it takes a stated share of new requests and
acts on them) or a shadow (it scores the serving version's rows of every new
request and never acts). Which requests a canary takes the engine decides, when
it pins each binding's version: a stable hash of the request id
(common.canary), so every engine of a fleet, and a test, picks the same ones.

A candidate must read exactly the rows the serving version reads (tensor type,
layers, token selector): engines capture the same rows whichever version a
request is pinned to, and a shadow scores the serving version's rows.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np

from common.probe_format.manifest import Manifest
from undercurrent.v1 import types_pb2 as types_pb

CANARY = types_pb.PROBE_ROLE_CANARY
SHADOW = types_pb.PROBE_ROLE_SHADOW
SERVING = types_pb.PROBE_ROLE_SERVING
ROLE_NAMES = {SERVING: "serving", CANARY: "canary", SHADOW: "shadow"}  # as logs and messages name them

# Shadow score minus serving score, per row: symmetric buckets, finer near 0.
DELTA_BUCKETS = (-1.0, -0.5, -0.25, -0.1, -0.05, -0.01, -0.001, 0.0, 0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0)


def check_share(role: int, share: float) -> str | None:
    """Why a LoadProbe's canary_share does not fit its role, or None."""
    if role == CANARY and not 0.0 < share <= 1.0:
        return f"canary_share: {share:g} is not in (0, 1]; say which share of new requests the canary takes"
    if role != CANARY and share:
        return f"canary_share: {share:g} is set, but the probe is not loaded as a canary"
    return None


def reads_differ(serving: Manifest, candidate: Manifest) -> str | None:
    """Why a candidate cannot stand beside the serving version, or None."""
    for field, mine, theirs in (("tensor_type", candidate.tensor_type, serving.tensor_type),
                                ("layers", tuple(sorted(candidate.layers)), tuple(sorted(serving.layers))),
                                ("tokens", candidate.tokens, serving.tokens),
                                ("hidden_size", candidate.hidden_size, serving.hidden_size)):
        if mine != theirs:
            return (f"manifest.{field}: the candidate reads {mine!r}, the serving version {theirs!r}; "
                    "a canary or shadow must read the rows the serving version reads (load a new probe "
                    "name to read other rows)")
    return None


@dataclass(frozen=True)
class Outcome:
    """What a serving version and its shadow did on one request."""

    serving_fired: bool
    shadow_fired: bool

    @property
    def agrees(self) -> bool:
        return self.serving_fired == self.shadow_fired


class Agreement:
    """Per (probe, shadow version): requests by outcome, and the histogram of
    per-row score deltas (shadow minus serving). Fed from scoring threads and the
    event loop; read by the metrics collector."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._outcomes: dict[tuple[str, str, bool, bool], int] = {}
        self._deltas: dict[tuple[str, str], np.ndarray] = {}  # counts per bucket, the last +Inf

    def outcome(self, probe: str, shadow_version: str, outcome: Outcome) -> None:
        key = (probe, shadow_version, outcome.serving_fired, outcome.shadow_fired)
        with self._lock:
            self._outcomes[key] = self._outcomes.get(key, 0) + 1

    def deltas(self, probe: str, shadow_version: str, deltas: np.ndarray) -> None:
        if deltas.size == 0:
            return
        counts = np.bincount(np.searchsorted(DELTA_BUCKETS, deltas), minlength=len(DELTA_BUCKETS) + 1)
        key = (probe, shadow_version)
        with self._lock:
            self._deltas[key] = self._deltas.get(key, 0) + counts

    def outcomes(self) -> dict[tuple[str, str, bool, bool], int]:
        with self._lock:
            return dict(self._outcomes)

    def histograms(self) -> dict[tuple[str, str], np.ndarray]:
        """Counts per DELTA_BUCKETS bucket (value <= bound), the last one past them all."""
        with self._lock:
            return {key: counts.copy() for key, counts in self._deltas.items()}


def paired_deltas(serving: tuple[np.ndarray, np.ndarray, np.ndarray],
                  shadow: tuple[np.ndarray, np.ndarray, np.ndarray]) -> np.ndarray:
    """Shadow minus serving score on the rows both scored; each side is
    (positions, layers, scores) of one request in one batch."""
    def keys(positions: np.ndarray, layers: np.ndarray) -> np.ndarray:
        return positions.astype(np.int64) * (1 << 20) + layers.astype(np.int64)

    _, mine, theirs = np.intersect1d(keys(*shadow[:2]), keys(*serving[:2]), assume_unique=True,
                                     return_indices=True)
    return shadow[2][mine] - serving[2][theirs]
