"""What the router link tells the engine about one request run.

Every event names the request and its incarnation: the engine acts on it only
if that run is still the live one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from undercurrent.v1 import undercurrent_pb2 as pb

from engine_service.request.ledger import Failure


@dataclass(frozen=True)
class Scores:
    request_id: str
    incarnation: int
    scores: pb.ProbeScores
    replica: str


@dataclass(frozen=True)
class Abort:
    request_id: str
    incarnation: int
    verdict: pb.Verdict
    replica: str


@dataclass(frozen=True)
class Processed:
    """The owning replica acknowledged more of the request's rows (see its ledger)."""

    request_id: str
    incarnation: int
    replica: str


@dataclass(frozen=True)
class Unscored:
    """Some of the request's rows will never be scored (see failure and the ledger)."""

    request_id: str
    incarnation: int
    failure: Failure


@dataclass(frozen=True)
class StateReset:
    """The request moved to new_replica, whose probes start without its earlier tokens."""

    request_id: str
    incarnation: int
    old_replica: str | None
    new_replica: str
    reason: str


@dataclass(frozen=True)
class Unavailable:
    """No replica has been reachable for the request since `since` (time.monotonic()),
    for at least router_timeout_s. Sent once per outage."""

    request_id: str
    incarnation: int
    since: float


LinkEvent = Union[Scores, Abort, Processed, Unscored, StateReset, Unavailable]
