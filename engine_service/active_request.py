"""Per-request bookkeeping on the engine: what the client is owed and why a
request ended. Plain logic, no vLLM or gRPC, so the rules are testable alone.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from undercurrent.v1 import undercurrent_pb2 as pb


@dataclass
class BoundProbe:
    """A probe binding resolved against the routers' catalog."""

    name: str
    info: pb.ProbeInfo
    failure_policy: int  # pb.FAILURE_POLICY_FAIL_CLOSED or pb.FAILURE_POLICY_FAIL_OPEN
    action: int  # pb.PROBE_ACTION_OBSERVE or pb.PROBE_ACTION_ABORT


@dataclass
class TokenGate:
    """Holds generated tokens until routers acknowledged the step that fed them.

    Generated token g sits at position prompt_len + g; its activations exist
    only once it is fed back in the next step. Releasing token g only after
    every row up to its position was acknowledged means a client never sees a
    token at or after the one that triggered an abort.
    """

    prompt_len: int
    held: list[int] = field(default_factory=list)
    first_held_index: int = 0
    acked_position: int = -1

    def hold(self, token_ids: list[int]) -> None:
        self.held.extend(token_ids)

    def acknowledge(self, position: int) -> None:
        self.acked_position = max(self.acked_position, position)

    def releasable(self) -> tuple[int, list[int]]:
        """(first index, tokens) that may be shown now; removes them from the gate."""
        count = 0
        while count < len(self.held):
            position = self.prompt_len + self.first_held_index + count
            if position > self.acked_position:
                break
            count += 1
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
    prompt_len: int
    probes: list[BoundProbe]
    gate: TokenGate | None
    events: asyncio.Queue  # pb.GenerateResponse items for the client stream
    generated: int = 0
    finish_reason: int = pb.FINISH_REASON_UNSPECIFIED  # set when we end it
    verdict: pb.Verdict | None = None
    message: str = ""
    unprobed_tokens: int = 0
    dropped_client_records: int = 0
    dropped_router_records: int = 0
    state_resets: int = 0
    # Highest token position handed to the router link; the end of the request
    # waits until the router acknowledged it.
    sent_position: int = -1
    # Highest token position a router reported a score for.
    scored_position: int = -1

    def fail_closed(self) -> bool:
        return any(p.failure_policy == pb.FAILURE_POLICY_FAIL_CLOSED for p in self.probes)

    def end(self, reason: int, verdict: pb.Verdict | None = None, message: str = "") -> bool:
        """Records the first reason the engine stopped this request; False if already ended."""
        if self.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
            return False
        self.finish_reason, self.verdict, self.message = reason, verdict, message
        return True
