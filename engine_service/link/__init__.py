"""The engine's link to its probe routers.

config (settings), assignment (rendezvous hashing, backoff), batching (one
step -> replicas -> messages), send_queue (the bounded queue and overflow
policies), session (one replica's stream, queue and step ledger), events (what
the engine is told), metrics, and link (the RouterLink that joins them and
keeps each request's RequestLedger current). Where the routers are (addresses,
DNS) is common.router_targets: the lifecycle tools find the replicas by the
same rule.
"""

from engine_service.link.config import RouterLinkConfig
from engine_service.link.events import (
    Abort,
    Failed,
    LinkEvent,
    Processed,
    Scores,
    StateRestarted,
    Unavailable,
    Unscored,
)
from engine_service.link.link import RouterLink
from engine_service.link.send_queue import OverflowPolicy

__all__ = [
    "Abort",
    "Failed",
    "LinkEvent",
    "OverflowPolicy",
    "Processed",
    "RouterLink",
    "RouterLinkConfig",
    "Scores",
    "StateRestarted",
    "Unavailable",
    "Unscored",
]
