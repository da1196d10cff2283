"""What the router link tells the engine about one request run.

Every event names the request and its incarnation: the engine acts on it only
if that run is still the live one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from undercurrent.v1 import types_pb2 as types_pb

from engine_service.request.ledger import Failure


@dataclass(frozen=True)
class Scores:
    request_id: str
    incarnation: int
    scores: types_pb.ProbeScores
    replica: str


@dataclass(frozen=True)
class Abort:
    request_id: str
    incarnation: int
    verdict: types_pb.Verdict
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
class StateRestarted:
    """The request moved to another replica, where these fail_open stateful
    bindings start their probe state afresh (counted in the request's finish).
    A fail_closed one ends the request instead (an Unscored event)."""

    request_id: str
    incarnation: int
    probes: tuple[str, ...]
    reason: str


@dataclass(frozen=True)
class Failed:
    """The link could not account for the request's rows (an internal error):
    nothing it says about the request can be trusted any more."""

    request_id: str
    incarnation: int
    reason: str


@dataclass(frozen=True)
class Unavailable:
    """No replica has been reachable for the request since `since` (the link's clock),
    for at least router_timeout_s. Sent once per outage."""

    request_id: str
    incarnation: int
    since: float
    waited_s: float  # since the outage began, when the event was sent


LinkEvent = Union[Scores, Abort, Processed, Unscored, StateRestarted, Failed, Unavailable]
