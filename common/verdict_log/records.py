"""What the verdict log holds: one record per verdict or abort, and each probe
version they name, in full, so a verdict can be replayed offline years later."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # the audit command reads records without the scoring code's imports
    from common.probe_format.probes import Probe

# A record's kind.
ABORT = "abort"  # the binding fired and its abort stopped the request
VERDICT = "verdict"  # the binding fired and did not act (observe, or the request was already stopped)
SHADOW = "shadow"  # a shadow version's rule fired; it never acts
KINDS = (ABORT, VERDICT, SHADOW)

DEFAULT_MAX_ROWS = 64  # input rows kept with an abort


@dataclass(frozen=True)
class ProbeVersion:
    """A probe version as loaded: its manifest JSON and weights (safetensors bytes)."""

    digest: str
    name: str
    version: str
    manifest_json: str
    weights: bytes | None

    @classmethod
    def of(cls, probe: Probe) -> "ProbeVersion | None":
        """The version a loaded probe is; None for one built without files (tests' probes)."""
        if probe.files is None:
            return None
        return cls(probe.digest, probe.name, probe.manifest.version, probe.files.manifest_json,
                   probe.files.weights)


@dataclass
class ShadowOutcome:
    """A request a shadow version scored, at its end: each version's verdict and
    how far apart their scores were on the rows both scored."""

    time: float
    request_id: str
    caller: str
    probe: str
    serving_version: str
    shadow_version: str
    serving_fired: bool
    shadow_fired: bool
    router: str
    rows: int = 0  # rows both scored
    delta_sum: float = 0.0  # of shadow minus serving score
    delta_max: float = 0.0  # the largest |shadow - serving|

    @property
    def agrees(self) -> bool:
        return self.serving_fired == self.shadow_fired


@dataclass
class VerdictRecord:
    kind: str
    request_id: str
    caller: str
    probe: str
    version: str
    digest: str
    role: str
    layer: int
    token_position: int
    score: float
    threshold: float
    router: str
    time: float  # Unix seconds
    # A shadow: the serving version's score of the same row (NaN when it did not score it).
    reference_score: float | None = None
    # An abort: the probe's input rows at the trigger, float32 [n, hidden], with
    # each row's token position and layer.
    rows: np.ndarray | None = None
    row_positions: list[int] = field(default_factory=list)
    row_layers: list[int] = field(default_factory=list)
    id: int | None = None  # the store's, once written
    # Not stored with the record: the version it names, written once per digest.
    probe_version: ProbeVersion | None = field(default=None, repr=False, compare=False)

    @property
    def acted(self) -> bool:
        return self.kind == ABORT
