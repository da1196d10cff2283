"""What a gated request's client may see, and when: the token gate and the
probe scores held until the ledger counts their rows scored. Plain logic."""

from __future__ import annotations

from dataclasses import dataclass, field

from undercurrent.v1 import types_pb2 as types_pb

from engine_service.request.ledger import RequestLedger


@dataclass
class TokenGate:
    """Holds generated tokens until every row up to their position is settled.

    Generated token g sits at position prompt_tokens + g; its activations exist
    only once it is fed back in the next step. The request's ledger says up to
    which position rows are settled; releasing token g only up to there means a
    client never sees a token at or after the one that triggered an abort, nor
    one whose rows a fail_closed binding never had scored.

    A verdict closes the gate at its position for good: vLLM goes on generating
    until its abort lands, and those later tokens (whose rows may well be
    acknowledged by then) are counted but never held, so no token after the
    trigger is shown, under its own index or another's.
    """

    prompt_tokens: int
    held: list[int] = field(default_factory=list)  # generated tokens first_held_index, first_held_index + 1, ...
    first_held_index: int = 0
    closed_at: int | None = None  # generated index from which nothing is held or shown

    def hold(self, first: int, token_ids: list[int]) -> None:
        """Generated tokens first, first + 1, ... as vLLM emits them."""
        if self.closed_at is not None:
            token_ids = token_ids[: max(0, self.closed_at - first)]
        self.held.extend(token_ids)

    def releasable(self, through_position: int) -> tuple[int, list[int]]:
        """(first index, tokens) at positions <= through_position; removes them from the gate."""
        count = max(0, min(len(self.held), through_position - self.prompt_tokens - self.first_held_index + 1))
        first, released = self.first_held_index, self.held[:count]
        del self.held[:count]
        self.first_held_index += count
        return first, released

    def release_all(self) -> tuple[int, list[int]]:
        first, released = self.first_held_index, list(self.held)
        self.first_held_index += len(self.held)
        self.held.clear()
        return first, released

    def close_at(self, position: int) -> None:
        """A verdict at `position`: held tokens there or after are dropped, and
        so is every token generated from there on."""
        index = max(0, position - self.prompt_tokens)
        self.closed_at = index if self.closed_at is None else min(self.closed_at, index)
        del self.held[max(0, self.closed_at - self.first_held_index) :]


@dataclass
class HeldScores:
    """Probe scores wait until the ledger counts their rows as scored.

    A router sends a step's scores just before its StepAck. A router lost in
    between leaves the ledger counting those rows unprobed; showing their scores
    as well would count a position both scored and unprobed. So the client sees
    a score only at a position the ledger settled, never at one it counts
    unprobed, and the scores it sees plus `unprobed_tokens` add up to the rows
    the request fed. A score also waits for the token at its position to reach
    the engine (the model computes a position before the engine has its token),
    so the client never sees a score about a token it will never get.
    """

    held: list[types_pb.ProbeScores] = field(default_factory=list)

    def add(self, scores: types_pb.ProbeScores, ledger: RequestLedger, received_below: int) -> list[types_pb.ProbeScores]:
        """Takes a message from the router: returns the part of it at settled
        positions of tokens the client already has (below `received_below`) and
        holds the rest. Only this message is read: the ledger has not moved since
        the last release(), which the engine calls whenever it or the tokens do,
        so every held message waits as it did then. (Reading them all at each
        message was quadratic in the probes bound: a router sends a message per
        binding and step: 100 bindings cost 11 ms per request and step.)"""
        ready, waiting = _split(scores, ledger, received_below, final=False)
        if waiting is not None:
            self.held.append(waiting)
        return [] if ready is None else [ready]

    def release(self, ledger: RequestLedger, received_below: int, final: bool = False) -> list[types_pb.ProbeScores]:
        """After the ledger or the tokens moved: every held score at a settled
        position below `received_below`, in arrival order; scores at failed
        positions are withheld for good. `final` ends the request: every score
        still held is withheld."""
        shown: list[types_pb.ProbeScores] = []
        still_held: list[types_pb.ProbeScores] = []
        for message in self.held:
            ready, waiting = _split(message, ledger, received_below, final)
            if ready is not None:
                shown.append(ready)
            if waiting is not None:
                still_held.append(waiting)
        self.held = still_held
        return shown


def _split(
    message: types_pb.ProbeScores, ledger: RequestLedger, below: int, final: bool
) -> tuple[types_pb.ProbeScores | None, types_pb.ProbeScores | None]:
    """(the scores to show now, the scores still waiting) of one message.

    A message mostly scores one token (one position, a score per layer read), so
    each distinct position's outcome is read once, and a message whose positions
    all settle alike is returned whole, not rebuilt score by score."""
    probe = message.probe
    outcomes = {position: ledger.outcome_at(probe, position) for position in set(message.token_positions)}
    shown = {position: bool(outcome) and position < below for position, outcome in outcomes.items()}
    if all(shown.values()):
        return (message if shown else None), None
    held = {position: not final and (outcome is None or (outcome and position >= below))
            for position, outcome in outcomes.items()}
    if not any(shown.values()):
        return None, (message if all(held.values()) else _with_scores(message, held))
    return _with_scores(message, shown), _with_scores(message, held)


def _with_scores(message: types_pb.ProbeScores, taken: dict[int, bool]) -> types_pb.ProbeScores | None:
    """The message with the scores at the positions `taken` marks True (itself if all)."""
    pairs = [(p, s) for p, s in zip(message.token_positions, message.scores) if taken[p]]
    if not pairs:
        return None
    if len(pairs) == len(message.token_positions):
        return message
    part = types_pb.ProbeScores()
    part.CopyFrom(message)
    part.ClearField("token_positions")
    part.ClearField("scores")
    part.token_positions.extend(p for p, _ in pairs)
    part.scores.extend(s for _, s in pairs)
    return part
