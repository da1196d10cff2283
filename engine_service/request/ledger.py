"""One request's probe rows from capture to score, per binding: the single
answer to "which rows did each binding have scored, may generated token g be
shown, what was lost".

Every captured probe row travels in exactly one message (one part of one
engine step for one replica). A message is QUEUED, then SENT (it got a step
number), then ACKED when the replica acknowledges the step that carried it; or
it FAILED: dropped by the send queue, lost with its replica, refused or errored
by the router for every binding, or left unacknowledged past the router
timeout. FAILED and ACKED are final: a late ack never makes a failed row
scored. A router may also refuse or fail one binding (its probe is missing,
another version, unloading, an error naming the probe): the message is still
acknowledged for the other bindings, and that binding's rows in it go unscored.

Bindings that read the same rows (the same probe points under the same token
selector) share a `_ReadSet`: per position, the rows capture owes it, those that
arrived, those in flight and those that failed for all of its bindings. A
binding's rows at a position are *scored* when its read set's rows there were
all acknowledged, none failed, and none was lost for that binding alone.

The gating invariant is decided here (`releasable_through`): a gated token at
position p is shown only when every stage computed p (`computed_below`), every
fail_closed binding had every row it reads at p scored, and every fail_open
binding's rows there are resolved (scored or failed: a fail_open abort still
lands before its token is shown). A failure of a fail_open binding marks only
its own rows unprobed; it never loosens another binding.

Rows are also counted against what capture must make: once the model computed a
position, each read set expects its rows there, and when the request ends rows
that never arrived are lost (`capture_lost`), a failure like any other.

Plain logic: no gRPC, no event loop; the clock is passed in.
"""

from __future__ import annotations

import bisect
import enum
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import InitVar, dataclass, field

import numpy as np

from common.capture_spec import ExtractionPoint, TokenSelector
from engine_service.request.probe_points import ExpectedRows

# An index of one of the request's bindings.
BindingIndex = int


class MessageState(enum.Enum):
    QUEUED = "queued"
    SENT = "sent"
    ACKED = "acked"
    FAILED = "failed"


_QUEUED, _SENT, _ACKED, _FAILED = MessageState.QUEUED, MessageState.SENT, MessageState.ACKED, MessageState.FAILED


@dataclass(frozen=True)
class LedgerBinding:
    """What the ledger needs of one binding: the probe version it was pinned to
    reads `points` (probe point names) at the positions `tokens` picks."""

    probe: str
    fail_closed: bool
    stateful: bool
    points: tuple[str, ...]
    tokens: TokenSelector


@dataclass(frozen=True)
class Failure:
    """Why some rows went unscored, for which bindings, and whether a
    fail_closed binding is among them."""

    reason: str
    bindings: tuple[str, ...]  # probe names
    fail_closed: bool
    rows: int  # captured rows concerned (0 for a failure with nothing in flight)
    dropped: bool  # never reached a router (counted in dropped_records)


# Slots: a decode step makes one Message per request and touches it three times
# (queued, sent, acknowledged). Hashed by identity: live messages are dict keys.
@dataclass(eq=False, slots=True)
class Message:
    """This request's rows in one message to one replica."""

    replica: str
    rows: list[dict[int, int] | None]  # per read set: token position -> rows it reads
    queued_at: float
    num_rows: int  # captured rows in the message (a row read by several sets counts once)
    step: int = 0
    state: MessageState = MessageState.QUEUED
    # Bindings whose rows in it the router will not score although it acks it.
    lost_for: set[BindingIndex] | None = None
    counted_dropped: bool = False  # its rows are in dropped_records


class _ReadSet:
    """Per position, the rows some bindings read alike: owed by capture
    (`expected`), arrived, in flight (`outstanding`), failed for all of them.

    Every record is a dict of ints keyed by position (no object per position, so
    long requests cost the garbage collector nothing). `_settled` and
    `_resolved` count the leading positions of `order` that are settled (every
    row acknowledged) and resolved (none in flight or owed): questions start
    after them, so a long request costs O(1) per ack."""

    def __init__(self, points: tuple[str, ...], tokens: TokenSelector, prompt_tokens: int,
                 bindings: list[BindingIndex]) -> None:
        self.points = frozenset(points)
        self.tokens = tokens
        self.prompt_tokens = prompt_tokens
        self.bindings = bindings
        self.fail_closed = False  # any binding of the set is fail_closed
        self.reads_every_position = tokens == TokenSelector()
        self.expected_rows = ExpectedRows([tokens] * len(points), prompt_tokens)
        self.expected: dict[int, int] = {}
        self.arrived: dict[int, int] = {}
        self.outstanding: dict[int, int] = {}
        self.failed: dict[int, int] = {}
        self.order: list[int] = []
        self._settled = 0
        self._resolved = 0

    def add(self, position: int, rows: int) -> None:
        """Rows arrived at `position` and are in flight."""
        if position not in self.arrived:
            self._new(position)
        elif self._settled or self._resolved:
            self._reopen(position)
        self.arrived[position] += rows
        self.outstanding[position] += rows

    def expect(self, start: int, stop: int) -> None:
        for position, count in enumerate(self.expected_rows.between(start, stop), start):
            if not count:
                continue
            if position not in self.arrived:
                self._new(position)
            else:
                self._reopen(position)
            self.expected[position] = count

    def settled(self, position: int) -> bool:
        return not (self.outstanding.get(position, 0) or self.failed.get(position, 0)
                    or self.arrived.get(position, 0) < self.expected.get(position, 0))

    def resolved(self, position: int) -> bool:
        return not (self.outstanding.get(position, 0)
                    or self.arrived.get(position, 0) < self.expected.get(position, 0))

    def first_unsettled(self) -> int | None:
        order = self.order
        while self._settled < len(order) and self.settled(order[self._settled]):
            self._settled += 1
        return order[self._settled] if self._settled < len(order) else None

    def first_unresolved(self) -> int | None:
        order = self.order
        while self._resolved < len(order) and self.resolved(order[self._resolved]):
            self._resolved += 1
        return order[self._resolved] if self._resolved < len(order) else None

    def picked(self, positions: Sequence[int]) -> list[int]:
        """The positions (one per row) that these bindings read."""
        array = np.asarray(positions, dtype=np.int64)
        return array[self.tokens.mask(array, self.prompt_tokens)].tolist()

    def missing(self) -> dict[int, tuple[int, int]]:
        """Positions whose owed rows have not all arrived: position -> (arrived, expected)."""
        start = min(self._settled, self._resolved)
        return {p: (self.arrived[p], self.expected[p]) for p in self.order[start:]
                if self.arrived[p] < self.expected[p]}

    def declare_missing_lost(self) -> dict[int, tuple[int, int]]:
        """Rows owed and never arrived fail: returns them as missing() did."""
        missing = self.missing()
        for position, (arrived, expected) in missing.items():
            self.failed[position] += expected - arrived
            self.arrived[position] = expected
            self._reopen(position)
        return missing

    def _new(self, position: int) -> None:
        for record in (self.expected, self.arrived, self.outstanding, self.failed):
            record[position] = 0
        if not self.order or position > self.order[-1]:
            self.order.append(position)
        else:
            bisect.insort(self.order, position)
            self._reopen(position)

    def _reopen(self, position: int) -> None:
        """Rows again at (or before) a position counted settled or resolved."""
        index = bisect.bisect_left(self.order, position)
        self._settled = min(self._settled, index)
        self._resolved = min(self._resolved, index)


@dataclass
class RequestLedger:
    """Per-request row accounting over the request's bindings.

    `points` are the probe points capture makes for the request (what it owes,
    counted once per row however many bindings read it); each binding names the
    points it reads."""

    prompt_tokens: int
    bindings: InitVar[Sequence[LedgerBinding]]
    points: Sequence[ExtractionPoint] = ()
    dropped_records: int = field(default=0, init=False)
    # Of dropped_records: rows owed and never delivered that no worker reported dropping.
    capture_lost_rows: int = field(default=0, init=False)
    failures: list[Failure] = field(default_factory=list, init=False)

    def __post_init__(self, bindings: Sequence[LedgerBinding]) -> None:
        # Per binding, as parallel lists: a request may bind a thousand probes, and
        # an object per binding would be one more for the garbage collector to walk.
        self._probes = [b.probe for b in bindings]
        self._closed = [b.fail_closed for b in bindings]
        self._stateful = [b.stateful for b in bindings]
        self._sets: list[_ReadSet] = []
        self._set_of: list[int] = []  # binding -> its read set
        by_reads: dict[tuple, int] = {}
        for index, binding in enumerate(bindings):
            key = (tuple(sorted(binding.points)), binding.tokens)
            if key not in by_reads:
                by_reads[key] = len(self._sets)
                self._sets.append(_ReadSet(key[0], binding.tokens, self.prompt_tokens, []))
            read_set = self._sets[by_reads[key]]
            read_set.bindings.append(index)
            read_set.fail_closed |= binding.fail_closed
            self._set_of.append(by_reads[key])
        self._index = {probe: index for index, probe in enumerate(self._probes)}
        # Sets that read each point, and whether a set reads every position a point's rows may hold.
        self._readers: dict[str, list[int]] = {}
        for s, read_set in enumerate(self._sets):
            for point in read_set.points:
                self._readers.setdefault(point, []).append(s)
        # What capture owes, counted once per row: positions -> rows.
        self._capture = ExpectedRows([p.tokens for p in self.points], self.prompt_tokens) if self.points else None
        self._capture_expected: dict[int, int] = {}
        self._capture_arrived: dict[int, int] = {}
        # Rows a worker reported dropping (past its backlog bound) that never arrived
        # since, as (point, position): a preempted request may report the same row
        # again, or deliver it when recomputed. Those counted are kept, so none is
        # counted twice.
        self._capture_reported: set[tuple[str, int]] = set()
        self._capture_reported_counted: set[tuple[str, int]] = set()
        # point -> the highest position a row of it arrived at. The driver drops a
        # recomputed row at or below it (engine_service.capture.driver.merge), so a
        # report of dropping one loses nothing.
        self._arrived_through: dict[str, int] = {}
        self._computed = 0  # positions below it have their expectations
        # Rows of a binding acknowledged but never scored for it (refused, errored):
        # binding -> position -> rows.
        self._lost: list[dict[int, int]] = [{} for _ in bindings]
        # Per replica: the bindings it refused (None: the whole request).
        self._refused: dict[str, set[BindingIndex] | None] = {}
        # QUEUED or SENT, oldest first; a dict so an acknowledged or failed one leaves in O(1).
        self._live: dict[Message, None] = {}
        # Per binding: the replica whose probe state holds rows of this request
        # (set when a row it reads is sent there), and whether that replica's
        # session was lost since: a router back at the same address starts afresh.
        self._state_on: list[str | None] = [None] * len(bindings)
        self._state_lost = [False] * len(bindings)
        self._restarts = [0] * len(bindings)
        self._notes: list[str] = [""] * len(bindings)

    # -- policy -------------------------------------------------------------

    def binding_index(self, probe: str) -> BindingIndex | None:
        return self._index.get(probe)

    def has_fail_closed(self) -> bool:
        return any(self._closed)

    # -- rows moving forward ---------------------------------------------------

    def queued(self, replica: str, rows: dict[str, Sequence[int]], now: float) -> Message:
        """Captured rows (probe point name -> the position of each row) placed on
        `replica`'s send queue as one message."""
        per_set: list[dict[int, int] | None] = [None] * len(self._sets)
        num_rows = 0
        arrived = self._capture_arrived
        for point, positions in rows.items():
            num_rows += len(positions)
            for position in positions:
                arrived[position] = arrived.get(position, 0) + 1
            if positions:
                through = self._arrived_through
                through[point] = max(through.get(point, -1), max(positions))
            if self._capture_reported:
                self._capture_reported.difference_update((point, position) for position in positions)
            for s in self._readers.get(point, ()):
                read_set = self._sets[s]
                counts = per_set[s]
                if counts is None:
                    counts = per_set[s] = {}
                picked = positions if read_set.reads_every_position else read_set.picked(positions)
                for position in picked:
                    counts[position] = counts.get(position, 0) + 1
        for s, counts in enumerate(per_set):
            if counts:
                read_set = self._sets[s]
                for position, count in counts.items():
                    read_set.add(position, count)
            elif counts is not None:
                per_set[s] = None
        message = Message(replica, per_set, now, num_rows)
        self._live[message] = None
        refused = self._refused.get(replica, set())
        if refused is None:  # the router refused the request: nothing it is sent is scored
            self._fail([message], "the router refused the request", dropped=False, record=False)
        elif refused:
            message.lost_for = set(refused)
        return message

    def computed_below(self, bound: int) -> None:
        """The model computed every position below `bound` on every stage: from now
        on each one waits for the rows its read sets owe there."""
        if bound <= self._computed:
            return
        start, self._computed = self._computed, bound
        for read_set in self._sets:
            read_set.expect(start, bound)
        if self._capture is not None:
            for position, count in enumerate(self._capture.between(start, bound), start):
                if count:
                    self._capture_expected[position] = count

    def sent(self, message: Message, step: int) -> None:
        """The message went out as `step` of its replica's session. From now on
        the replica may score its rows, whatever becomes of its ack: a stateful
        binding's state holds rows of this request there (a request moved away
        before the ack would otherwise restart that state unseen, its rows
        scored partly in each)."""
        if message.state is not _QUEUED:
            return
        message.step, message.state = step, _SENT
        lost_for = message.lost_for or ()
        for s, counts in enumerate(message.rows):
            if counts:
                for b in self._sets[s].bindings:
                    if self._stateful[b] and b not in lost_for:
                        self._state_on[b] = message.replica

    def acknowledged(self, message: Message) -> int:
        """The replica acknowledged the step that carried `message`: its rows are
        scored, except for the bindings it was lost for. Returns the message's
        rows; none when it had failed (a late ack never makes a failed row scored)."""
        if message.state is not _SENT:
            return 0
        message.state = _ACKED
        del self._live[message]
        lost_for = message.lost_for or ()
        for s, counts in enumerate(message.rows):
            if not counts:
                continue
            read_set = self._sets[s]
            outstanding = read_set.outstanding
            for position, count in counts.items():
                outstanding[position] -= count
            for b in read_set.bindings:
                if b in lost_for:
                    lost = self._lost[b]
                    for position, count in counts.items():
                        lost[position] = lost.get(position, 0) + count
        return message.num_rows

    # -- rows failing ----------------------------------------------------------

    def not_sent(self, rows: dict[str, Sequence[int]], now: float, reason: str) -> Failure | None:
        """Captured rows that never made it into a message (no replica, too large)."""
        message = self.queued("", rows, now)
        return self._fail([message], reason, dropped=True)

    def dropped(self, message: Message, reason: str) -> Failure | None:
        """A queued (or being written) message the link gave up on: overflow, replica
        down. One that had already failed while it waited in the queue (the router
        timeout) is not failed again, but its rows never reached a router: counted."""
        if message.state is _FAILED and not message.step and not message.counted_dropped:
            message.counted_dropped = True
            self.dropped_records += message.num_rows
            return None
        return self._fail([message], reason, dropped=True)

    def step_failed(self, replica: str, step: int, reason: str, probe: str | None) -> Failure | None:
        """The router reported an error about the rows it got in `step`: for one
        binding (`probe`) or, naming none of the request's, for all of them."""
        # Routers send a step's errors before its ack: only a message still SENT counts.
        found = [m for m in self._live if m.state is _SENT and m.step == step and m.replica == replica]
        binding = self._index.get(probe) if probe else None
        if binding is not None:
            return self._lose_for(binding, found, reason)
        return self._fail(found, reason, dropped=False)

    def replica_failed(self, replica: str, reason: str) -> Failure | None:
        """Every row sent to `replica` and not yet acknowledged is unscored (the
        replica was lost), and a stateful binding's state there is gone with it."""
        for b, holder in enumerate(self._state_on):
            if holder == replica:
                self._state_lost[b] = True
        lost = [m for m in self._live if m.replica == replica and m.state is _SENT]
        return self._fail(lost, reason, dropped=False)

    def refused(self, replica: str, reason: str, probe: str | None, home: bool = True) -> Failure | None:
        """The router refused a binding (`probe`), or the whole request: its rows
        in flight to that replica and all it is sent later go unscored for it.
        From the request's home that is a failure even with nothing in flight; from
        a former home (`home` False, the request moved on) it concerns only the
        rows still in flight there."""
        binding = self._index.get(probe) if probe else None
        live = [m for m in self._live if m.replica == replica]
        if binding is not None:
            refused = self._refused.setdefault(replica, set())
            if refused is not None:
                refused.add(binding)
            failure = self._lose_for(binding, live, reason)
            if failure is None and home:  # nothing in flight: still a failure to act on
                failure = self._record(Failure(reason, (probe,), self._closed[binding], 0, False))
            return failure
        self._refused[replica] = None
        failure = self._fail(live, reason, dropped=False, record=False)
        if home:  # every binding is refused, whichever had rows in flight
            return self._record(Failure(reason, tuple(self._probes), self.has_fail_closed(),
                                        failure.rows if failure else 0, False))
        return self._record(failure) if failure else None

    def outage(self, reason: str) -> Failure:
        """No router was reachable for the request: a failure even with no row in flight."""
        return self._record(Failure(reason, tuple(self._probes),
                                    self.has_fail_closed(), 0, False))

    def expire(self, older_than: float, reason: str) -> Failure | None:
        """Rows queued before `older_than` and still unacknowledged go unscored."""
        stale = [m for m in self._live if m.queued_at <= older_than]
        return self._fail(stale, reason, dropped=False)

    def homed(self, replica: str) -> None:
        """A request_start went to `replica`: what it refused before no longer holds."""
        self._refused.pop(replica, None)

    def rehomed(self, new_replica: str, reason: str) -> tuple[Failure | None, list[str]]:
        """The request moved to `new_replica`: a stateful binding whose state holds
        rows on another replica, or on a session of `new_replica` that was lost,
        starts afresh there. Returns the failure for the fail_closed ones (their
        guarantee is gone), and the probes of the fail_open ones, counted as
        restarted."""
        closed, restarted = [], []
        for b, holder in enumerate(self._state_on):
            if holder is None or (holder == new_replica and not self._state_lost[b]):
                continue
            self._state_on[b], self._state_lost[b] = None, False
            if self._closed[b]:
                closed.append(b)
            else:
                self._restarts[b] += 1
                self._notes[b] = self._notes[b] or (
                    f"probe state restarted on {new_replica} ({reason}); rows scored on {holder} were not seen there")
                restarted.append(self._probes[b])
        failure = None
        if closed:
            names = self._names(closed)
            failure = self._record(Failure(
                f"the state of stateful probe(s) {', '.join(map(repr, names))} was lost when the request "
                f"moved to {new_replica} ({reason})", names, True, 0, False))
        return failure, restarted

    def holds_state_on(self, replica: str) -> bool:
        """Whether a stateful binding's state holds rows of this request on `replica`."""
        return replica in self._state_on

    def capture_dropped(self, point: str, positions: Sequence[int]) -> None:
        """A worker reported dropping rows of a probe point at these positions:
        each row counts as dropped once, whether or not a binding was owed it,
        unless it arrives after all, or had arrived before (either way, recomputed
        after a preemption)."""
        through = self._arrived_through.get(point, -1)
        self._capture_reported.update((point, position) for position in positions if position > through)

    def capture_lost(self) -> Failure | None:
        """Call when the request's last rows were drained: rows owed at a computed
        position that never arrived were lost before reaching any queue. They fail
        for the bindings that read them and count as dropped, and so do rows a
        worker reported dropping where nothing was owed yet."""
        lost_bindings: set[BindingIndex] = set()
        lost_positions: dict[int, tuple[int, int]] = {}
        for read_set in self._sets:
            missing = read_set.declare_missing_lost()
            if missing:
                lost_bindings.update(read_set.bindings)
            for position, counts in missing.items():
                lost_positions.setdefault(position, counts)
        physical = {p: (self._capture_arrived.get(p, 0), expected)
                    for p, expected in self._capture_expected.items()
                    if self._capture_arrived.get(p, 0) < expected}
        rows = sum(e - a for a, e in physical.values())
        for position, (arrived, expected) in physical.items():
            self._capture_arrived[position] = expected
        # Reported rows at positions that owed them are among the missing ones;
        # those where nothing was owed are counted on their own.
        newly = self._capture_reported - self._capture_reported_counted
        self._capture_reported_counted |= newly
        self._capture_reported = set()
        reported = Counter(p for _point, p in newly)
        unowed = sum(count for p, count in reported.items() if p not in self._capture_expected)
        self.dropped_records += unowed
        self.capture_lost_rows += max(0, rows - sum(min(count, physical[p][1] - physical[p][0])
                                                    for p, count in reported.items() if p in physical))
        if not lost_bindings and not rows:
            return None
        counted = physical or lost_positions
        shown = sorted(counted)
        first = [f"{p} ({counted[p][0]} of {counted[p][1]})" for p in shown[:4]]
        reason = (
            f"capture delivered no rows or too few at {len(shown)} position(s), {rows} rows missing: "
            f"position (rows arrived of expected) {', '.join(first)}{' ...' if len(shown) > 4 else ''}"
        )
        self.dropped_records += rows
        names = self._names(sorted(lost_bindings))
        return self._record(Failure(reason, names, any(self._closed[b] for b in lost_bindings),
                                    rows, dropped=True))

    def _lose_for(self, binding: BindingIndex, messages: Iterable[Message], reason: str) -> Failure | None:
        """Rows of one binding in these messages will not be scored, though the
        messages may still be acknowledged for the others."""
        s = self._set_of[binding]
        rows = 0
        for message in messages:
            if message.state not in (_QUEUED, _SENT) or not message.rows[s]:
                continue
            if message.lost_for is None:
                message.lost_for = set()
            if binding not in message.lost_for:
                message.lost_for.add(binding)
                rows += sum(message.rows[s].values())
        if not rows:
            return None
        return self._record(Failure(reason, (self._probes[binding],), self._closed[binding], rows, dropped=False))

    def _fail(self, messages: Iterable[Message], reason: str, dropped: bool,
              record: bool = True) -> Failure | None:
        rows = 0
        concerned: set[BindingIndex] = set()
        for message in messages:
            if message.state not in (_QUEUED, _SENT):
                continue
            del self._live[message]
            message.state = _FAILED
            message.counted_dropped = dropped
            for s, counts in enumerate(message.rows):
                if not counts:
                    continue
                read_set = self._sets[s]
                for position, count in counts.items():
                    read_set.outstanding[position] -= count
                    read_set.failed[position] += count
                concerned.update(read_set.bindings)
            rows += message.num_rows
        if not rows:
            return None
        if dropped:
            self.dropped_records += rows
        failure = Failure(reason, self._names(sorted(concerned)),
                          any(self._closed[b] for b in concerned), rows, dropped)
        return self._record(failure) if record else failure

    def _record(self, failure: Failure) -> Failure:
        self.failures.append(failure)
        for name in failure.bindings:
            b = self._index[name]
            if not self._notes[b]:
                self._notes[b] = failure.reason
        return failure

    def _names(self, bindings: Iterable[BindingIndex]) -> tuple[str, ...]:
        return tuple(self._probes[b] for b in bindings)

    # -- questions -------------------------------------------------------------

    def releasable_through(self) -> int:
        """The last position a gated token may be shown at (-1 if none): every
        stage computed it and every position up to it is clear: each fail_closed
        binding had every row it reads scored, each fail_open binding's rows are
        resolved (scored or failed, none in flight or owed)."""
        return min(self._holding_from(), self._computed) - 1

    def settled_below(self) -> int:
        """The first position that holds a gated token back (as for
        releasable_through, but not capped at what the model computed): how far
        decoding may run ahead is counted from here
        (`engine_service.engine_core.tokens_ahead`). When nothing holds, one past
        what is known: the computed positions and every captured one."""
        holding = self._holding_from()
        if holding != _NEVER:
            return holding
        last = max((read_set.order[-1] for read_set in self._sets if read_set.order), default=-1)
        return max(self._computed, last + 1)

    def first_unscored(self) -> int:
        """The first position where a fail_closed binding has a row not scored (in
        flight, failed, lost, or owed): where a fail_closed failure stops the
        client's tokens. At the latest the first position not every stage
        computed: rows a later stage owes there were never scored before the
        failure, whatever a router scores afterwards."""
        first = min(self._first_closed_loss(), max(self._computed, self.prompt_tokens))
        for read_set in self._sets:
            if read_set.fail_closed:
                position = read_set.first_unsettled()
                if position is not None:
                    first = min(first, position)
        return first

    def _holding_from(self) -> int:
        first = _NEVER
        for read_set in self._sets:
            position = read_set.first_unsettled() if read_set.fail_closed else read_set.first_unresolved()
            if position is not None:
                first = min(first, position)
        return min(first, self._first_closed_loss())

    def _first_closed_loss(self) -> int:
        return min((min(lost) for b, lost in enumerate(self._lost)
                    if lost and self._closed[b]), default=_NEVER)

    def owed_by_capture(self) -> bool:
        """Whether a computed position still waits for rows capture must make there."""
        return any(read_set.missing() for read_set in self._sets)

    def outcome_at(self, probe: str, position: int) -> bool | None:
        """For the binding of `probe`: True once every row it reads at `position`
        was scored, False once one of them will never be, None while rows are in
        flight or owed (or none arrived yet)."""
        binding = self._index.get(probe)
        if binding is None:
            return False
        read_set = self._sets[self._set_of[binding]]
        if position not in read_set.arrived:
            return None
        if read_set.failed[position] or self._lost[binding].get(position, 0):
            return False
        return True if read_set.settled(position) else None

    def in_flight(self) -> int:
        """Rows queued or sent and not yet acknowledged or failed."""
        return sum(m.num_rows for m in self._live)

    def oldest_in_flight(self) -> float | None:
        """When the oldest row still waiting for its ack was queued."""
        return next(iter(self._live)).queued_at if self._live else None

    def unprobed_tokens(self, below: int | None = None) -> int:
        """Positions where some binding has a row no router scored (failed, lost,
        never acknowledged, or owed by capture and never arrived).

        `below` excludes positions at or past it: rows vLLM computed after the
        engine stopped a request belong to tokens the client never received."""
        unprobed: set[int] = set()
        for read_set in self._sets:
            unprobed.update(p for p in read_set.order if not read_set.settled(p))
        for lost in self._lost:
            unprobed.update(p for p, rows in lost.items() if rows)
        return sum(1 for p in unprobed if below is None or p < below)

    def report(self, below: int | None = None) -> list[tuple[int, int, int, str]]:
        """Per binding, in order: (rows scored, rows unprobed, state restarts,
        why), over positions below `below`. Scored plus unprobed is every row the
        binding read there."""
        out = []
        for b in range(len(self._probes)):
            read_set = self._sets[self._set_of[b]]
            lost = self._lost[b]
            scored = unprobed = 0
            for position in read_set.order:
                if below is not None and position >= below:
                    break
                arrived = read_set.arrived[position]
                ok = max(0, arrived - read_set.outstanding[position] - read_set.failed[position]
                         - lost.get(position, 0))
                scored += ok
                unprobed += max(arrived, read_set.expected[position]) - ok
            note = self._notes[b] if (unprobed or self._restarts[b]) else ""
            out.append((scored, unprobed, self._restarts[b], note))
        return out

    def fail_closed_failure(self) -> Failure | None:
        """The first failure a fail_closed binding cannot accept."""
        return next((f for f in self.failures if f.fail_closed), None)


_NEVER = 1 << 62

