"""One request's probe rows from capture to score: the single answer to "which
positions did a router score, may generated token g be shown, what was lost".

Every captured probe row travels in exactly one message (one part of one
engine step for one replica). A message is QUEUED, then SENT (it got a step
number), then ACKED when the replica acknowledges the step that carried it (the
replica's session knows which messages a cumulative StepAck covers, and names
each one); or it FAILED: dropped by the send queue, lost with its replica, refused
or errored by the router, or left unacknowledged past the router timeout.
FAILED and ACKED are final: a late ack never makes a failed row scored, and an
error about a step that was already acknowledged is out of order and ignored.

A position is *settled* when every row captured at it was acknowledged and
none failed. Token gating shows token g (at position prompt_len + g) only once
every position up to it is settled, or, for failures that concern only
fail_open bindings, resolved (no row still in flight); a computed position
where the probes capture nothing is settled. The finish counts
(`unprobed_tokens`, `dropped_records`) are read from here too.

Rows are also counted against what capture must make: once the model computed
a position (`computed_below`), the ledger expects the probe points' rows there
(`ExpectedRows`), and the position cannot settle before that many arrived. When
the request ends, rows that never arrived are lost (`capture_lost`): a failure
like any other, so a capture that drops rows without a word can neither let a
gated token through nor leave the finish counting nothing.

Plain logic: no gRPC, no event loop; the clock is passed in.
"""

from __future__ import annotations

import bisect
import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from undercurrent.v1 import undercurrent_pb2 as pb

from engine_service.request.probe_points import ExpectedRows


class MessageState(enum.Enum):
    QUEUED = "queued"
    SENT = "sent"
    ACKED = "acked"
    FAILED = "failed"


@dataclass(frozen=True)
class Failure:
    """Why some rows went unscored, and whether a fail_closed binding cares."""

    reason: str
    fail_closed: bool
    rows: int
    dropped: bool  # never reached a router (counted in dropped_records)


_QUEUED, _SENT, _ACKED = MessageState.QUEUED, MessageState.SENT, MessageState.ACKED


# Slots: a decode step makes one Message per request and touches it three times
# (queued, sent, acknowledged), so attribute access is on the hot path. Hashed
# by identity (eq=False): the ledger keeps its live messages as dict keys.
@dataclass(eq=False, slots=True)
class Message:
    """This request's rows in one message to one replica."""

    replica: str
    rows: dict[int, int]  # token position -> rows
    queued_at: float
    num_rows: int = 0  # sum(rows.values()), filled in by RequestLedger.queued
    step: int = 0
    state: MessageState = MessageState.QUEUED


@dataclass
class RequestLedger:
    """Per-request row accounting; `policies` maps each bound probe to its
    failure policy (pb.FAILURE_POLICY_FAIL_CLOSED or pb.FAILURE_POLICY_FAIL_OPEN)."""

    prompt_len: int
    policies: Mapping[str, int]
    # What capture must deliver; None: rows are taken as they come (no check).
    expected: ExpectedRows | None = None
    dropped_records: int = field(default=0, init=False)
    failures: list[Failure] = field(default_factory=list, init=False)
    # Per captured position, each one a key of all five records: dicts of ints,
    # which the garbage collector does not track, so the records of many long
    # requests cost a full collection nothing (an object per position did).
    # rows queued or sent, neither acknowledged nor failed
    _outstanding: dict[int, int] = field(default_factory=dict, init=False)
    _failed: dict[int, int] = field(default_factory=dict, init=False)  # rows failed
    # a failure there concerns a fail_closed binding
    _blocking: dict[int, bool] = field(default_factory=dict, init=False)
    # rows capture must make there (0: no expectation)
    _expected: dict[int, int] = field(default_factory=dict, init=False)
    # rows queued there, or declared lost by capture_lost
    _arrived: dict[int, int] = field(default_factory=dict, init=False)
    _order: list[int] = field(default_factory=list, init=False)  # captured positions, ascending
    # QUEUED or SENT, oldest first; a dict so an acknowledged or failed one leaves in O(1).
    _live: dict[Message, None] = field(default_factory=dict, init=False)
    _refusal: str | None = field(default=None, init=False)
    _refusal_closes: bool = field(default=False, init=False)
    # _order[:_clean] are settled (all rows acknowledged, none failed): the
    # questions below start after them, so a long request costs O(1) per ack.
    _clean: int = field(default=0, init=False)
    _computed: int = field(default=0, init=False)  # positions below it have their expectation

    # -- policy -------------------------------------------------------------

    def closes(self, probe: str | None) -> bool:
        """Does a failure concerning `probe` (None: every binding) fall under fail_closed?"""
        closed = pb.FAILURE_POLICY_FAIL_CLOSED
        if probe and probe in self.policies:
            return self.policies[probe] == closed
        return any(policy == closed for policy in self.policies.values())

    # -- rows moving forward ---------------------------------------------------

    def queued(self, replica: str, rows: dict[int, int], now: float) -> Message:
        """Captured rows placed on `replica`'s send queue as one message, which
        keeps `rows` (token position -> rows): the caller hands the dict over."""
        message = Message(replica, rows, now, sum(rows.values()))
        outstanding, arrived, last_clean = self._outstanding, self._arrived, self._last_clean()
        for position, count in rows.items():
            if position not in outstanding:
                self._add_position(position)
            outstanding[position] += count
            arrived[position] += count
            if position <= last_clean:  # rows again at (or before) a settled position
                self._clean = bisect.bisect_left(self._order, position)
                last_clean = self._last_clean()
        self._live[message] = None
        if self._refusal is not None:
            # The router refused the request: nothing it is sent will be scored.
            self._fail([message], self._refusal, self._refusal_closes, dropped=False)
        return message

    def computed_below(self, bound: int) -> None:
        """The model computed every position below `bound`: from now on each one
        waits for the rows the probe points make there."""
        if self.expected is None or bound <= self._computed:
            return
        start, self._computed = self._computed, bound
        for position, count in enumerate(self.expected.between(start, bound), start):
            if not count:
                continue
            if position not in self._expected:
                self._add_position(position)
            elif position <= self._last_clean():  # settled before its expectation was known
                self._clean = bisect.bisect_left(self._order, position)
            self._expected[position] = count

    def sent(self, message: Message, step: int) -> None:
        """The message went out as `step` of its replica's session."""
        if message.state is not _QUEUED:
            return
        message.step, message.state = step, _SENT

    def acknowledged(self, message: Message) -> int:
        """The replica acknowledged the step that carried `message`: its rows are
        scored. Returns the rows that became acknowledged: none when the message
        already failed (a late ack never makes a failed row scored)."""
        if message.state is not _SENT:
            return 0
        message.state = _ACKED
        del self._live[message]
        outstanding = self._outstanding
        for position, count in message.rows.items():
            outstanding[position] -= count
        return message.num_rows

    # -- rows failing ----------------------------------------------------------

    def not_sent(self, replica: str, rows: dict[int, int], now: float, reason: str) -> Failure:
        """Captured rows that never made it into a message (no replica, too large)."""
        message = self.queued(replica, rows, now)
        if message.state is MessageState.FAILED:  # already counted under the refusal
            return self.failures[-1]
        return self._fail([message], reason, self.closes(None), dropped=True)

    def dropped(self, message: Message, reason: str) -> Failure | None:
        """A queued (or being written) message the link gave up on: overflow, replica down."""
        return self._fail([message], reason, self.closes(None), dropped=True)

    def step_failed(self, replica: str, step: int, reason: str, probe: str | None) -> Failure | None:
        """The router reported an error about the rows it got in `step`."""
        # Routers send a step's errors before its ack: only a message still SENT counts.
        found = [m for m in self._live if m.state is _SENT and m.step == step and m.replica == replica]
        if not found:
            return None
        return self._fail(found, reason, self.closes(probe), dropped=False)

    def replica_failed(self, replica: str, reason: str, probe: str | None = None) -> Failure | None:
        """Every row sent to `replica` and not yet acknowledged is unscored
        (the replica was lost, or reported an error naming no step)."""
        lost = [m for m in self._live if m.replica == replica and m.state is MessageState.SENT]
        return self._fail(lost, reason, self.closes(probe), dropped=False)

    def refused(self, reason: str, probe: str | None) -> Failure | None:
        """The router refused the request (request_start error): what is in flight
        and everything captured later goes unscored."""
        closes = self.closes(probe)
        if self._refusal is None or (closes and not self._refusal_closes):
            self._refusal, self._refusal_closes = reason, closes
        failure = self._fail(list(self._live), reason, closes, dropped=False)
        if failure is None:  # nothing in flight: still a failure to act on
            failure = Failure(reason, closes, 0, dropped=False)
            self.failures.append(failure)
        return failure

    def outage(self, reason: str) -> Failure:
        """No router was reachable for the request: a failure even with no row in flight."""
        failure = Failure(reason, self.closes(None), 0, dropped=False)
        self.failures.append(failure)
        return failure

    def expire(self, older_than: float, reason: str) -> Failure | None:
        """Rows queued before `older_than` and still unacknowledged go unscored."""
        stale = [m for m in self._live if m.queued_at <= older_than]
        return self._fail(stale, reason, self.closes(None), dropped=False)

    def capture_lost(self, reported_dropped: int = 0) -> Failure | None:
        """Call when the request's last rows were drained: rows expected at a
        computed position that never arrived were lost before reaching any
        queue. They fail under every binding's policy and count as dropped,
        less `reported_dropped`: rows a worker already reported dropping for
        this request, which the finish counts on their own."""
        lost: dict[int, tuple[int, int]] = {}  # position -> (arrived, expected)
        closes = self.closes(None)
        for position in self._order[self._clean :]:
            arrived, expected = self._arrived[position], self._expected[position]
            if arrived < expected:
                lost[position] = (arrived, expected)
                self._arrived[position] = expected
                self._failed[position] += expected - arrived
                self._blocking[position] = self._blocking[position] or closes
        if not lost:
            return None
        rows = sum(expected - arrived for arrived, expected in lost.values())
        first = [f"{p} ({a} of {e})" for p, (a, e) in list(lost.items())[:4]]
        reason = (
            f"capture delivered no rows or too few at {len(lost)} position(s), {rows} rows missing: "
            f"position (rows arrived of expected) {', '.join(first)}{' ...' if len(lost) > 4 else ''}"
        )
        self.dropped_records += max(0, rows - reported_dropped)
        failure = Failure(reason, closes, rows, dropped=True)
        self.failures.append(failure)
        return failure

    def _fail(
        self, messages: Iterable[Message], reason: str, closes: bool, dropped: bool
    ) -> Failure | None:
        rows = 0
        for message in messages:
            if message.state not in (MessageState.QUEUED, MessageState.SENT):
                continue
            del self._live[message]
            message.state = MessageState.FAILED
            for position, count in message.rows.items():
                self._outstanding[position] -= count
                self._failed[position] += count
                self._blocking[position] = self._blocking[position] or closes
            rows += message.num_rows
        if not rows:
            return None
        if dropped:
            self.dropped_records += rows
        failure = Failure(reason, closes, rows, dropped)
        self.failures.append(failure)
        return failure

    # -- questions -------------------------------------------------------------

    def first_unsettled(self) -> int:
        """The first position with a row not yet scored (in flight, failed, or
        owed by capture and not arrived); one past the last captured position
        when all are settled, 0 before any."""
        self._advance_clean()
        for position in self._order[self._clean :]:
            if self._open(position):
                return position
        return self._order[-1] + 1 if self._order else 0

    def releasable_through(self) -> int:
        """The last position a gated token may be shown at: every captured row up
        to it is acknowledged, or failed only for fail_open bindings, and every
        computed position up to it where the probes capture nothing counts as
        settled (a probe of the prompt alone holds no generated token once the
        prompt is scored). -1 if none."""
        self._advance_clean()
        through = self._last_clean()
        for position in self._order[self._clean :]:
            if self._holds_release(position):
                return max(through, min(position, self._computed) - 1)
            through = position
        return max(through, self._computed - 1)

    def settled_below(self) -> int:
        """The first position that holds a gated token back (as for
        releasable_through); when none does, the first position whose
        expectation is not yet known (`computed_below`), or one past the last
        captured one. How far decoding may run ahead is counted from here
        (`engine_service.engine_core.tokens_ahead`)."""
        self._advance_clean()
        for position in self._order[self._clean :]:
            if self._holds_release(position):
                return position
        return max(self._computed, self._order[-1] + 1 if self._order else 0)

    def owed_by_capture(self) -> bool:
        """Whether a computed position still waits for rows capture must make there."""
        return any(self._arrived[p] < self._expected[p] for p in self._order[self._clean :])

    def outcome_at(self, position: int) -> bool | None:
        """True once every row captured at `position` was acknowledged, False once
        one of them failed, None while rows are in flight (or none was captured)."""
        if position not in self._outstanding:
            return None
        if self._failed[position]:
            return False
        if self._outstanding[position] or self._arrived[position] < self._expected[position]:
            return None
        return True

    def in_flight(self) -> int:
        """Rows queued or sent and not yet acknowledged or failed."""
        return sum(m.num_rows for m in self._live)

    def oldest_in_flight(self) -> float | None:
        """When the oldest row still waiting for its ack was queued."""
        return next(iter(self._live)).queued_at if self._live else None

    def unprobed_tokens(self, below: int | None = None) -> int:
        """Positions with a row that no router scored (failed, never acknowledged,
        or owed by capture and never arrived).

        `below` excludes positions at or past it: rows vLLM computed after the
        engine stopped a request belong to tokens the client never received."""
        return sum(1 for position in self._order
                   if (below is None or position < below) and self._open(position))

    def fail_closed_failure(self) -> Failure | None:
        """The first failure a fail_closed binding cannot accept."""
        return next((f for f in self.failures if f.fail_closed), None)

    def _advance_clean(self) -> None:
        while self._clean < len(self._order):
            if self._open(self._order[self._clean]):
                return
            self._clean += 1

    def _last_clean(self) -> int:
        return self._order[self._clean - 1] if self._clean else -1

    def _holds_release(self, position: int) -> bool:
        """Rows in flight, a failure a fail_closed binding cannot accept, or rows owed by capture."""
        return bool(self._outstanding[position] or self._blocking[position]
                    or self._arrived[position] < self._expected[position])

    def _open(self, position: int) -> bool:
        """Not settled: rows in flight, failed, or not yet arrived."""
        return bool(self._outstanding[position] or self._failed[position]
                    or self._arrived[position] < self._expected[position])

    def _add_position(self, position: int) -> None:
        """A position seen for the first time: zero in every record, and in order."""
        for record in (self._outstanding, self._failed, self._expected, self._arrived):
            record[position] = 0
        self._blocking[position] = False
        if not self._order or position > self._order[-1]:
            self._order.append(position)
        else:
            bisect.insort(self._order, position)
