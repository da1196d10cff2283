"""Re-scores a logged abort offline: the stored input rows through the stored
probe version, with the router's own scoring code, so the score and the verdict
can be checked long after the router that decided is gone.

A probe whose score depends on the request's earlier rows (a trajectory, or a
cascade member aggregating over tokens) cannot be replayed from the rows at the
trigger alone: replay refuses it, naming why. For a rule with patience or
min_tokens the replayed verdict is the threshold comparison at the trigger row;
the rows before it that the rule also counted are not in the log.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from common.probe_format.files import ProbeFileError, load_probe_bytes
from common.probe_format.manifest import ManifestError
from common.probe_format.probes import ProjectionPlan
from common.verdict_log.records import ProbeVersion, VerdictRecord

# Scores are float32 dot products of float32 rows; a replay on other hardware or
# with another BLAS may round differently, by a few float32 ulps of the terms.
FLOAT32_TOLERANCE = 1e-5


class ReplayError(Exception):
    """The record cannot be replayed; says why."""


@dataclass(frozen=True)
class Replayed:
    record: VerdictRecord
    score: float
    fired: bool
    note: str = ""  # what the replay could not check

    @property
    def matches(self) -> bool:
        stored = self.record.score
        return (abs(self.score - stored) <= FLOAT32_TOLERANCE * max(1.0, abs(stored))
                and self.fired == (self.record.score >= self.record.threshold))


def replay(record: VerdictRecord, version: ProbeVersion | None) -> Replayed:
    if record.rows is None or not len(record.rows):
        raise ReplayError(f"record {record.id} ({record.kind}) keeps no input rows: the log keeps them for "
                          "aborts, when the router's --verdict-log-max-rows is above 0")
    if version is None:
        raise ReplayError(f"record {record.id}: probe version {record.digest} is not in the log")
    try:
        probe = load_probe_bytes(version.manifest_json, version.weights, source=f"verdict log {version.digest}")
    except (ProbeFileError, ManifestError) as err:
        raise ReplayError(f"record {record.id}: the logged probe version does not load: {err}") from None
    if probe.digest != record.digest:
        raise ReplayError(f"record {record.id}: the logged files digest to {probe.digest}, "
                          f"not the record's {record.digest}")
    if not probe.stateless:
        raise ReplayError(f"record {record.id}: probe {probe.name!r} ({probe.manifest.kind}) scores a row from "
                          "the request's earlier rows too, which the log does not keep")
    keys = list(zip(record.row_positions, record.row_layers))
    trigger = (record.token_position, record.layer)
    if trigger not in keys:
        raise ReplayError(f"record {record.id}: the stored rows do not include the trigger row "
                          f"(token {record.token_position}, layer {record.layer})")
    values = ProjectionPlan((probe,)).apply(np.asarray(record.rows, dtype=np.float32))
    score = float(probe.score(values, None)[keys.index(trigger)])
    m = probe.manifest
    note = (f"the rule's patience {m.patience} and min_tokens {m.min_tokens} also counted earlier rows, "
            "which the log does not keep" if m.patience > 1 or m.min_tokens > 0 else "")
    return Replayed(record, score, score >= m.threshold, note)
