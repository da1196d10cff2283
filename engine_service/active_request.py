"""Per-request bookkeeping on the engine: what the client is owed and why a
request ended. Plain logic, no vLLM or gRPC, so the rules are testable alone.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from undercurrent.v1 import undercurrent_pb2 as pb

from engine_service.request_ledger import RequestLedger

if TYPE_CHECKING:
    from engine_service.client_stream import ClientStream


@dataclass
class BoundProbe:
    """A probe binding resolved against the routers' catalog."""

    name: str
    info: pb.ProbeInfo
    failure_policy: int  # pb.FAILURE_POLICY_FAIL_CLOSED or pb.FAILURE_POLICY_FAIL_OPEN
    action: int  # pb.PROBE_ACTION_OBSERVE or pb.PROBE_ACTION_ABORT


@dataclass
class TokenGate:
    """Holds generated tokens until every row up to their position is settled.

    Generated token g sits at position prompt_len + g; its activations exist
    only once it is fed back in the next step. The request's ledger says up to
    which position rows are settled; releasing token g only up to there means a
    client never sees a token at or after the one that triggered an abort, nor
    one whose rows a fail_closed binding never had scored.
    """

    prompt_len: int
    held: list[int] = field(default_factory=list)
    first_held_index: int = 0

    def hold(self, token_ids: list[int]) -> None:
        self.held.extend(token_ids)

    def releasable(self, through_position: int) -> tuple[int, list[int]]:
        """(first index, tokens) at positions <= through_position; removes them from the gate."""
        count = max(0, min(len(self.held), through_position - self.prompt_len - self.first_held_index + 1))
        first, released = self.first_held_index, self.held[:count]
        del self.held[:count]
        self.first_held_index += count
        return first, released

    def release_all(self) -> tuple[int, list[int]]:
        first, released = self.first_held_index, list(self.held)
        self.first_held_index += len(self.held)
        self.held.clear()
        return first, released

    def discard_from(self, position: int) -> None:
        """Drops held tokens at or after a triggering position."""
        keep = max(0, position - self.prompt_len - self.first_held_index)
        del self.held[keep:]


@dataclass
class ActiveRequest:
    request_id: str
    # This run of request_id, unique in the engine process: router messages and
    # link events about another run of the same id are not about this one.
    incarnation: int
    prompt_len: int
    probes: list[BoundProbe]
    gate: TokenGate | None
    events: "ClientStream"  # pb.GenerateResponse items for the client stream
    # Where every probe row of this request stands; None without probes.
    ledger: RequestLedger | None = None
    # Set whenever the ledger moved (acks, failures); the end of the request waits on it.
    ledger_changed: asyncio.Event = field(default_factory=asyncio.Event)
    captures: bool = False  # registered extraction points (client or probe)
    generated: int = 0
    finish_reason: int = pb.FINISH_REASON_UNSPECIFIED  # set when we end it
    verdict: pb.Verdict | None = None
    message: str = ""
    # time.monotonic() when its Generate call arrived, and whether a token reached
    # the client stream yet (the engine's latency histograms read both).
    accepted_at: float = field(default_factory=time.monotonic)
    tokens_sent: bool = False

    def fail_closed(self) -> bool:
        return any(p.failure_policy == pb.FAILURE_POLICY_FAIL_CLOSED for p in self.probes)

    def end(self, reason: int, verdict: pb.Verdict | None = None, message: str = "") -> bool:
        """Records the first reason the engine stopped this request; False if already ended."""
        if self.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
            return False
        self.finish_reason, self.verdict, self.message = reason, verdict, message
        return True
