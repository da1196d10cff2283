"""The per-request ledger: which rows each binding had scored, which gated
tokens may be shown, what went unscored, what was dropped."""

import gc

from undercurrent.v1 import types_pb2 as types_pb

from common.capture_spec import ExtractionPoint, Scope, TokenSelector
from engine_service.request.gate import HeldScores
from engine_service.request.ledger import LedgerBinding, MessageState, RequestLedger
from engine_service.request.probe_points import ExpectedRows

R0, R1, M0 = "probe.residual_stream.0", "probe.residual_stream.1", "probe.mlp_out.0"
EVERY = TokenSelector()
GENERATED = TokenSelector(Scope.GENERATED)


def binding(probe="p", closed=True, points=(R0,), tokens=GENERATED, stateful=False) -> LedgerBinding:
    return LedgerBinding(probe, closed, stateful, tuple(points), tokens)


def ledger(*bindings: LedgerBinding, prompt_tokens: int = 10) -> RequestLedger:
    """A ledger over these bindings (one fail_closed binding of R0 at generated
    tokens by default); capture owes each point the bindings read, at the tokens
    they read it."""
    bindings = bindings or (binding(),)
    names = sorted({point for b in bindings for point in b.points})
    selectors = {name: {b.tokens for b in bindings if name in b.points} for name in names}
    points = [ExtractionPoint(name, "residual_stream", (0,), (*selectors[name],)[0] if len(selectors[name]) == 1
                              else EVERY) for name in names]
    return RequestLedger(prompt_tokens, bindings, points)


def rows(**positions: list[int]) -> dict[str, list[int]]:
    """Rows by point, named as the point's last parts: rows(r0=[10, 11], r1=[10])."""
    names = {"r0": R0, "r1": R1, "m0": M0}
    return {names[key]: value for key, value in positions.items()}


def sent(led: RequestLedger, replica: str, step: int, points: dict[str, list[int]], now: float = 0.0):
    message = led.queued(replica, points, now)
    led.sent(message, step)
    return message


def test_positions_settle_only_when_every_row_is_acknowledged_and_every_stage_computed_them():
    led = ledger()
    first = sent(led, "r", 1, rows(r0=[10, 11]))
    second = sent(led, "r", 2, rows(r0=[12]))
    led.computed_below(13)
    assert (led.first_unscored(), led.releasable_through(), led.in_flight()) == (10, 9, 3)
    assert led.acknowledged(first) == 2
    assert (led.first_unscored(), led.releasable_through()) == (12, 11)
    assert led.acknowledged(second) == 1
    assert (led.first_unscored(), led.releasable_through(), led.unprobed_tokens()) == (13, 12, 0)
    assert led.acknowledged(second) == 0  # a duplicate ack settles nothing more


def test_a_position_no_stage_finished_is_never_releasable_whatever_was_scored_there():
    """Pipeline parallelism: the first stage's rows at position p arrive, are
    scored and acknowledged before the last stage computed p. Until every stage
    computed p (the next token came), p holds: the last stage may still owe rows."""
    early, late = binding("early", points=(R0,)), binding("late", points=(R1,))
    led = ledger(early, late)
    led.computed_below(12)
    led.acknowledged(sent(led, "r", 1, rows(r0=[10, 11], r1=[10, 11])))
    assert led.releasable_through() == 11
    led.acknowledged(sent(led, "r", 2, rows(r0=[12])))  # stage 0 computed 12; stage 1 not yet
    assert led.releasable_through() == 11
    led.computed_below(13)  # the token sampled from 12 came: stage 1 owes its row at 12
    assert (led.releasable_through(), led.first_unscored()) == (11, 12)
    led.acknowledged(sent(led, "r", 3, rows(r1=[12])))
    assert led.releasable_through() == 12


def test_the_ack_of_part_0_of_a_split_step_does_not_settle_rows_in_part_1():
    led = ledger(binding(points=(R0, R1)), prompt_tokens=12)
    # One engine step, too big for one message: layer 0 in part 0, layer 1 in part 1.
    part_0 = sent(led, "r", 1, rows(r0=[12]))
    part_1 = sent(led, "r", 2, rows(r1=[12]))
    led.computed_below(13)
    led.acknowledged(part_0)
    assert led.releasable_through() == 11 and led.first_unscored() == 12
    led.acknowledged(part_1)
    assert led.releasable_through() == 12


def test_an_ack_settles_its_messages_whatever_sits_between_them():
    led = ledger()
    led.computed_below(15)
    # Re-homed from "a" to "b" and back: the replicas' messages interleave in the ledger.
    a1 = sent(led, "a", 1, rows(r0=[10]))
    b1 = sent(led, "b", 1, rows(r0=[11]))
    a2 = sent(led, "a", 2, rows(r0=[12]))
    b2 = sent(led, "b", 2, rows(r0=[13]))
    queued = led.queued("a", rows(r0=[14]), 0.0)  # not sent yet
    assert led.acknowledged(a1) == 1
    assert led.acknowledged(b1) + led.acknowledged(b2) == 2  # b's, the second behind a's step 2
    assert (led.releasable_through(), led.in_flight()) == (11, 2)
    assert led.acknowledged(queued) == 0  # never sent: no ack can cover it
    assert led.acknowledged(a2) == 1
    assert (led.releasable_through(), led.in_flight(), queued.state) == (13, 1, MessageState.QUEUED)
    led.sent(queued, 3)
    assert led.acknowledged(queued) == 1
    assert (led.releasable_through(), led.in_flight()) == (14, 0)


def test_an_ack_leaves_a_message_left_sent_by_an_earlier_session_of_the_replica_in_flight():
    led = ledger()
    sent(led, "r", 1, rows(r0=[10]))  # the replica's previous session; its steps restart at 1
    current = sent(led, "r", 1, rows(r0=[11]))
    assert led.acknowledged(current) == 1
    assert led.in_flight() == 1 and led.first_unscored() == 10


def test_a_router_error_about_a_step_leaves_its_rows_unscored_and_a_late_ack_changes_nothing():
    led = ledger()
    led.computed_below(12)
    first = sent(led, "r", 1, rows(r0=[10]))
    second = sent(led, "r", 2, rows(r0=[11]))
    failure = led.step_failed("r", 2, "router error: INTERNAL: boom", probe=None)
    assert (failure.fail_closed, failure.rows, failure.dropped, failure.bindings) == (True, 1, False, ("p",))
    assert led.acknowledged(first) + led.acknowledged(second) == 1
    assert (led.releasable_through(), led.first_unscored(), led.unprobed_tokens()) == (10, 11, 1)
    assert led.fail_closed_failure().reason == "router error: INTERNAL: boom"
    assert led.dropped_records == 0
    assert led.step_failed("r", 9, "unknown step", None) is None


def test_an_error_after_the_ack_is_out_of_order_and_changes_nothing():
    led = ledger()
    led.computed_below(12)
    led.acknowledged(sent(led, "r", 1, rows(r0=[10, 11])))
    assert led.step_failed("r", 1, "late error", None) is None
    assert (led.releasable_through(), led.unprobed_tokens(), led.failures) == (11, 0, [])


def test_an_error_naming_a_fail_open_binding_fails_its_rows_alone():
    strict, lenient = binding("strict"), binding("lenient", closed=False)
    led = ledger(strict, lenient)
    led.computed_below(12)
    first = sent(led, "r", 1, rows(r0=[10]))
    second = sent(led, "r", 2, rows(r0=[11]))
    failure = led.step_failed("r", 2, "bad row for lenient", probe="lenient")
    assert (failure.fail_closed, failure.bindings, failure.rows) == (False, ("lenient",), 1)
    led.acknowledged(first), led.acknowledged(second)
    assert led.releasable_through() == 11 and led.unprobed_tokens() == 1
    assert led.fail_closed_failure() is None
    assert (led.outcome_at("strict", 11), led.outcome_at("lenient", 11)) == (True, False)
    assert led.report() == [(2, 0, 0, ""), (1, 1, 0, "bad row for lenient")]
    # An error naming no probe concerns every binding, the fail_closed one too.
    led.computed_below(13)
    sent(led, "r", 3, rows(r0=[12]))
    assert led.step_failed("r", 3, "decode error", probe=None).fail_closed
    assert led.releasable_through() == 11


def test_an_error_naming_a_fail_closed_binding_holds_its_position_for_good():
    strict, lenient = binding("strict"), binding("lenient", closed=False)
    led = ledger(strict, lenient)
    led.computed_below(12)
    message = sent(led, "r", 1, rows(r0=[10, 11]))
    failure = led.step_failed("r", 1, "strict failed", probe="strict")
    assert (failure.fail_closed, failure.bindings) == (True, ("strict",))
    led.acknowledged(message)
    assert (led.releasable_through(), led.first_unscored()) == (9, 10)
    assert (led.outcome_at("strict", 10), led.outcome_at("lenient", 10)) == (False, True)


def test_a_refused_fail_open_binding_never_loosens_the_fail_closed_one():
    """The home replica lacks the fail_open observer: its refusal marks the
    observer's rows unprobed; the guard's rows still hold every token until
    they are scored."""
    guard, observer = binding("guard"), binding("observer", closed=False)
    led = ledger(guard, observer)
    led.computed_below(12)
    first = sent(led, "r", 1, rows(r0=[10]))
    refusal = led.refused("r", "probe 'observer' is not loaded", probe="observer")
    assert (refusal.fail_closed, refusal.bindings, refusal.rows) == (False, ("observer",), 1)
    later = sent(led, "r", 2, rows(r0=[11]))
    assert led.releasable_through() == 9  # the guard's rows are in flight
    led.acknowledged(first)
    assert led.releasable_through() == 10
    led.acknowledged(later)
    assert led.releasable_through() == 11 and led.fail_closed_failure() is None
    assert led.report() == [(2, 0, 0, ""), (0, 2, 0, "probe 'observer' is not loaded")]


def test_a_refusal_holds_for_its_replica_until_the_request_is_homed_there_again():
    led = ledger(binding("guard"), binding("observer", closed=False))
    led.computed_below(13)
    led.refused("a", "observer missing on a", probe="observer")
    on_a = sent(led, "a", 1, rows(r0=[10]))
    on_b = sent(led, "b", 1, rows(r0=[11]))  # re-homed to b, which has it
    led.homed("a")  # a request_start again on a: its earlier refusal no longer holds
    again_on_a = sent(led, "a", 2, rows(r0=[12]))
    for message in (on_a, on_b, again_on_a):
        led.acknowledged(message)
    assert [led.outcome_at("observer", p) for p in (10, 11, 12)] == [False, True, True]


def test_a_refused_request_fails_what_is_in_flight_and_everything_after():
    led = ledger()
    led.computed_below(12)
    sent(led, "r", 1, rows(r0=[10]))
    failure = led.refused("r", "router refused request_start: RESOURCE_EXHAUSTED", probe=None)
    assert failure.fail_closed and failure.rows == 1
    later = led.queued("r", rows(r0=[11]), 0.0)
    assert later.state is MessageState.FAILED
    led.sent(later, 2)
    assert led.acknowledged(later) == 0
    assert led.unprobed_tokens() == 2 and led.first_unscored() == 10
    # Rows at or past the first token the client never got are not its tokens.
    assert led.unprobed_tokens(below=11) == 1


def test_a_refused_request_fails_every_binding_not_only_those_with_rows_in_flight():
    """The home refuses the whole request while only a fail_open binding's rows
    (prompt rows) are in flight: the fail_closed binding, reading generated
    tokens only, is refused too."""
    observer = binding("observer", closed=True, points=(R1,))
    early = binding("early", closed=False, points=(R0,), tokens=EVERY)
    led = ledger(observer, early)
    sent(led, "r", 1, rows(r0=[0, 1]))
    failure = led.refused("r", "router is draining", probe=None)
    assert (failure.bindings, failure.fail_closed, failure.rows) == (("observer", "early"), True, 2)
    assert led.fail_closed_failure() is failure


def test_a_refusal_with_nothing_in_flight_is_still_a_failure():
    led = ledger()
    failure = led.refused("r", "probe 'p' is not loaded", probe="p")
    assert failure.fail_closed and failure.rows == 0 and failure.bindings == ("p",)
    assert led.fail_closed_failure() is failure


def test_fail_open_only_request_releases_past_failures():
    led = ledger(binding(closed=False))
    led.computed_below(12)
    message = led.queued("r", rows(r0=[10]), 0.0)
    led.dropped(message, "drop_oldest")
    led.acknowledged(sent(led, "r", 1, rows(r0=[11])))
    assert led.releasable_through() == 11
    assert (led.unprobed_tokens(), led.dropped_records, led.fail_closed_failure()) == (1, 1, None)


def test_overflow_drops_count_each_captured_row_once_as_dropped():
    # Two bindings read R0, one of them R1 too: a dropped row is one record, however many read it.
    led = ledger(binding("a", points=(R0,)), binding("b", points=(R0, R1)))
    first = led.queued("r", rows(r0=[10, 11], r1=[10]), 0.0)
    led.queued("r", rows(r0=[12]), 0.0)
    failure = led.dropped(first, "dropped by drop_oldest")
    assert (failure.dropped, failure.fail_closed, failure.rows, failure.bindings) == (True, True, 3, ("a", "b"))
    assert led.dropped_records == 3 and led.first_unscored() == 10
    assert led.dropped(first, "twice") is None and led.dropped_records == 3


def test_rows_with_no_replica_are_dropped():
    led = ledger()
    failure = led.not_sent(rows(r0=[10, 10]), 0.0, "no router replica reachable")
    assert failure.dropped and led.dropped_records == 2 and led.unprobed_tokens() == 1


def test_a_lost_replica_takes_its_unacknowledged_rows_with_it():
    led = ledger()
    led.computed_below(13)
    led.acknowledged(sent(led, "a", 1, rows(r0=[10])))
    lost = sent(led, "a", 2, rows(r0=[11]))
    queued = led.queued("b", rows(r0=[12]), 0.0)
    failure = led.replica_failed("a", "a down")
    assert failure.rows == 1 and not failure.dropped
    assert queued.state is MessageState.QUEUED  # rows bound for another replica stay in flight
    assert led.acknowledged(lost) == 0  # a late ack from the lost session
    assert (led.releasable_through(), led.first_unscored(), led.unprobed_tokens()) == (10, 11, 2)


def test_rows_unacknowledged_past_the_timeout_expire():
    led = ledger()
    led.computed_below(12)
    sent(led, "r", 1, rows(r0=[10]), now=1.0)
    second = sent(led, "r", 2, rows(r0=[11]), now=5.0)
    assert led.oldest_in_flight() == 1.0
    failure = led.expire(older_than=4.0, reason="no ack for 3.0 s")
    assert failure.rows == 1 and led.oldest_in_flight() == 5.0
    assert led.expire(older_than=4.0, reason="again") is None
    led.acknowledged(second)
    assert (led.first_unscored(), led.releasable_through(), led.unprobed_tokens()) == (10, 9, 1)


def test_rows_expired_in_the_queue_and_then_discarded_count_as_dropped_once():
    led = ledger()
    waiting = led.queued("r", rows(r0=[10]), 0.0)  # the writer never got to it
    led.expire(older_than=1.0, reason="router timeout")
    assert (waiting.state, led.dropped_records) == (MessageState.FAILED, 0)  # it may still go out
    assert led.dropped(waiting, "replica_down") is None  # it never will: counted, not failed again
    assert led.dropped(waiting, "replica_down") is None and led.dropped_records == 1
    sent_late = sent(led, "r", 1, rows(r0=[11]))
    led.expire(older_than=1.0, reason="router timeout")
    assert led.dropped(sent_late, "replica_down") is None and led.dropped_records == 1  # it reached a router


def test_rows_again_at_a_settled_position_unsettle_it():
    led = ledger(binding(tokens=EVERY), prompt_tokens=4)
    led.computed_below(12)
    led.acknowledged(sent(led, "r", 1, rows(r0=list(range(12)))))
    assert led.releasable_through() == 11
    sent(led, "r", 2, rows(r0=[11]))  # recomputed after preemption
    assert (led.first_unscored(), led.releasable_through()) == (11, 10)
    sent(led, "r", 3, rows(r0=[3]))  # earlier still
    assert (led.first_unscored(), led.releasable_through()) == (3, 2)


def test_nothing_captured():
    led = ledger()  # a failure now would stop the first generated token
    assert (led.first_unscored(), led.releasable_through(), led.unprobed_tokens()) == (10, -1, 0)
    assert led.oldest_in_flight() is None and led.in_flight() == 0


def test_a_bindings_rows_are_scored_acknowledged_failed_or_still_in_flight():
    led = ledger()
    first = sent(led, "r", 1, rows(r0=[10, 10]))
    sent(led, "r", 2, rows(r0=[11]))
    assert [led.outcome_at("p", p) for p in (9, 10, 11)] == [None, None, None]
    led.acknowledged(first)
    led.replica_failed("r", "lost")
    assert [led.outcome_at("p", p) for p in (10, 11)] == [True, False]
    assert led.outcome_at("not-bound", 10) is False


def test_rows_of_a_layer_a_binding_does_not_read_never_hold_or_count_for_it():
    """A probe reads its own layers: rows of another point are not its rows."""
    led = ledger(binding("early", points=(R0,)), binding("late", points=(R1,), closed=False))
    led.computed_below(11)
    led.acknowledged(sent(led, "r", 1, rows(r0=[10])))
    led.dropped(led.queued("r", rows(r1=[10]), 0.0), "dropped")
    assert (led.outcome_at("early", 10), led.outcome_at("late", 10)) == (True, False)
    assert led.releasable_through() == 10  # late is fail_open: resolved, not scored
    assert led.report() == [(1, 0, 0, ""), (0, 1, 0, "dropped")]


# -- stateful bindings moving between replicas -----------------------------------


def test_a_fail_closed_stateful_binding_whose_state_held_rows_fails_when_the_request_moves():
    led = ledger(binding("guard", stateful=True), binding("plain"))
    assert led.rehomed("b", "a down") == (None, [])  # no state anywhere yet
    led.acknowledged(sent(led, "a", 1, rows(r0=[10])))
    assert led.holds_state_on("a") and not led.holds_state_on("b")
    failure, restarted = led.rehomed("b", "a down")
    assert (failure.fail_closed, failure.bindings, restarted) == (True, ("guard",), [])
    assert failure.reason == ("the state of stateful probe(s) 'guard' was lost when the request moved "
                              "to b (a down)")
    assert led.fail_closed_failure() is failure and not led.holds_state_on("a")


def test_a_stateful_bindings_state_is_lost_with_its_routers_session_even_back_at_the_same_address():
    """A router restarted at the address it had holds none of the state its
    lost session held: the request coming back there has lost it too."""
    led = ledger(binding("guard", stateful=True), binding("trend", closed=False, stateful=True))
    led.acknowledged(sent(led, "a", 1, rows(r0=[10])))
    led.replica_failed("a", "killed")
    failure, restarted = led.rehomed("a", "a up")
    assert (failure.bindings, restarted) == (("guard",), ["trend"])
    assert failure.reason == ("the state of stateful probe(s) 'guard' was lost when the request moved "
                              "to a (a up)")
    assert not led.holds_state_on("a")
    sent(led, "a", 2, rows(r0=[11]))  # the new session's state: kept while that session lives
    assert led.holds_state_on("a") and led.rehomed("a", "a up") == (None, [])


def test_a_stateful_bindings_state_is_on_a_replica_from_the_first_row_sent_there_not_its_ack():
    """A router scores a row as it reads it; the ack may come after the request
    moved. Counting the state from the ack, a move in between (a draining
    replica) would start the state afresh elsewhere unseen, the rows at one
    position scored partly in each: a silent reset."""
    led = ledger(binding("guard", stateful=True), binding("trend", closed=False, stateful=True))
    on_a = sent(led, "a", 1, rows(r0=[10]))
    assert led.holds_state_on("a")  # so a draining `a` keeps the request
    failure, restarted = led.rehomed("b", "a draining")
    assert (failure.bindings, restarted) == (("guard",), ["trend"])
    sent(led, "b", 1, rows(r0=[11]))
    led.acknowledged(on_a)  # the late ack from `a` does not bring the state back there
    assert led.holds_state_on("b") and not led.holds_state_on("a")


def test_a_binding_the_router_will_not_score_holds_no_state_there():
    led = ledger(binding("guard", stateful=True))
    led.refused("a", "not loaded", "guard")
    sent(led, "a", 1, rows(r0=[10]))
    assert not led.holds_state_on("a")


def test_a_fail_closed_failure_stops_at_the_first_position_a_later_stage_still_owes():
    """PP: stage 0's row at 10 was scored on `a` before stage 1 computed 10. The
    state is lost when the request moves: the failure stops the token at 10, which
    the new replica would score without the state."""
    led = ledger(binding("guard", points=(R0, R1), stateful=True))
    led.acknowledged(sent(led, "a", 1, rows(r0=[10])))
    failure, _ = led.rehomed("b", "a down")
    assert failure.fail_closed and led.first_unscored() == 10


def test_a_fail_open_stateful_binding_restarts_counted_and_said():
    led = ledger(binding("trend", closed=False, stateful=True))
    led.computed_below(12)
    led.acknowledged(sent(led, "a", 1, rows(r0=[10])))
    assert led.rehomed("a", "same replica") == (None, [])  # the state is where it goes
    failure, restarted = led.rehomed("b", "a draining")
    assert (failure, restarted) == (None, ["trend"])
    led.acknowledged(sent(led, "b", 1, rows(r0=[11])))
    [(scored, unprobed, restarts, why)] = led.report()
    assert (scored, unprobed, restarts) == (2, 0, 1)
    assert why == "probe state restarted on b (a draining); rows scored on a were not seen there"


# -- held scores ---------------------------------------------------------------------


RECEIVED = 1000  # the tokens received so far reach past every position of these tests


def scores(positions: list[int], probe: str = "p") -> types_pb.ProbeScores:
    return types_pb.ProbeScores(request_id="q", probe=probe, token_positions=positions,
                          scores=[float(p) for p in positions])


def test_scores_are_shown_only_where_the_ledger_counts_the_bindings_rows_scored():
    """A router lost between a step's scores and its ack: those scores are
    withheld, so shown scores plus unprobed positions equal the positions fed."""
    led = ledger()
    held = HeldScores()
    first = sent(led, "r", 1, rows(r0=[10, 11]))
    sent(led, "r", 2, rows(r0=[12]))
    assert held.add(scores([10, 11]), led, RECEIVED) == []  # not acknowledged yet: held
    assert held.release(led, RECEIVED) == []
    led.acknowledged(first)
    assert held.add(scores([12]), led, RECEIVED) == []  # its ack never comes
    assert [list(s.token_positions) for s in held.release(led, RECEIVED)] == [[10, 11]]
    assert [list(s.token_positions) for s in held.release(led, RECEIVED)] == []
    led.replica_failed("r", "router lost before acknowledging")
    assert held.release(led, RECEIVED) == [] and held.held == []
    assert 2 + led.unprobed_tokens() == 3


def test_a_bindings_scores_are_withheld_where_its_own_rows_were_lost():
    led = ledger(binding("guard"), binding("observer", closed=False))
    held = HeldScores()
    message = sent(led, "r", 1, rows(r0=[10]))
    led.step_failed("r", 1, "observer failed", probe="observer")
    led.acknowledged(message)
    shown = held.add(scores([10], "guard"), led, RECEIVED) + held.add(scores([10], "observer"), led, RECEIVED)
    assert [s.probe for s in shown] == ["guard"] and held.held == []


def test_a_message_is_split_at_the_settled_positions_and_the_end_withholds_the_rest():
    led = ledger()
    held = HeldScores()
    first = sent(led, "r", 1, rows(r0=[10]))
    sent(led, "s", 1, rows(r0=[11]))  # re-homed to another replica, whose ack never comes
    second = sent(led, "r", 2, rows(r0=[12]))
    held.add(scores([10, 11, 12]), led, RECEIVED)
    led.acknowledged(first)
    shown = held.release(led, RECEIVED)
    assert [(list(s.token_positions), list(s.scores)) for s in shown] == [([10], [10.0])]
    assert shown[0].probe == "p" and shown[0].request_id == "q"
    led.acknowledged(second)
    # The request ends: position 12 belongs to a token the client never received,
    # position 11 is still in flight: both withheld.
    shown = held.release(led, 12, final=True)
    assert shown == [] and held.held == []


def test_a_score_waits_for_its_token_and_ends_withheld_if_the_token_never_came():
    led = ledger()
    held = HeldScores()
    led.acknowledged(sent(led, "r", 1, rows(r0=[10, 11])))
    # The model computed position 11 before the engine received token 1 (at 11).
    shown = held.add(scores([10, 11]), led, received_below=11)
    assert [list(s.token_positions) for s in shown] == [[10]]
    assert [list(s.token_positions) for s in held.release(led, 12)] == [[11]]  # the token came
    held.add(scores([11]), led, received_below=11)
    assert held.release(led, 11, final=True) == [] and held.held == []  # it never did


def test_scores_already_settled_are_shown_as_they_arrive_and_the_rest_wait_for_the_ledger():
    led = ledger()
    held = HeldScores()
    first = sent(led, "r", 1, rows(r0=[10]))
    second = sent(led, "r", 2, rows(r0=[11]))
    led.acknowledged(first)
    shown = held.add(scores([10, 11]), led, RECEIVED)
    assert [list(s.token_positions) for s in shown] == [[10]]
    assert [list(s.token_positions) for s in held.held] == [[11]]
    led.acknowledged(second)
    assert [list(s.token_positions) for s in held.release(led, RECEIVED)] == [[11]] and held.held == []


def test_a_message_per_binding_is_read_once_while_the_ledger_waits():
    """A router sends one message per binding and step, before the step's ack:
    each is read as it arrives, not every held one again (quadratic in bindings)."""

    class CountingLedger(RequestLedger):
        reads = 0

        def outcome_at(self, probe: str, position: int):
            CountingLedger.reads += 1
            return super().outcome_at(probe, position)

    led = CountingLedger(4, [binding(f"p{i}", closed=False) for i in range(1000)])
    step = sent(led, "r", 1, rows(r0=[10]))
    held = HeldScores()
    for i in range(1000):
        assert held.add(types_pb.ProbeScores(request_id="q", probe=f"p{i}", token_positions=[10], scores=[0.5]), led,
                        RECEIVED) == []
    assert CountingLedger.reads == 1000  # one read per message (reading all held each time: 500,500)
    led.acknowledged(step)
    assert len(held.release(led, RECEIVED)) == 1000 and CountingLedger.reads == 2000


# -- rows counted against what capture must make ------------------------------------


def expecting(prompt_tokens=4, closed=True) -> RequestLedger:
    """One binding reading two layers at every token (2 rows a position) and the
    MLP output of generated tokens only (3 rows at generated positions)."""
    generated = TokenSelector(Scope.GENERATED)
    bindings = [binding("every", closed, (R0, R1), tokens=EVERY), binding("generated", closed, (M0,), tokens=generated)]
    points = [ExtractionPoint(R0, "residual_stream", (0,)), ExtractionPoint(R1, "residual_stream", (1,)),
              ExtractionPoint(M0, "mlp_out", (0,), generated)]
    return RequestLedger(prompt_tokens, bindings, points)


def prompt_and(*generated: int, prompt_tokens: int = 4) -> dict[str, list[int]]:
    """The rows capture makes at the prompt and at these generated positions."""
    every = list(range(prompt_tokens)) + list(generated)
    return {R0: every, R1: every, M0: list(generated)}


def test_expected_rows_follow_each_selector():
    assert ExpectedRows([EVERY, EVERY, TokenSelector(Scope.GENERATED)], 4).between(2, 7) == [2, 2, 3, 3, 3]
    picked = [TokenSelector(Scope.GENERATED, (0, 2)), TokenSelector(Scope.PROMPT, (-1,)), EVERY]
    # prompt of 4: the last prompt token (3), generated tokens 0 and 2 (positions 4, 6), every token once
    assert ExpectedRows(picked, 4).between(2, 8) == [1, 2, 2, 1, 2, 1]


def test_a_computed_position_waits_for_every_row_capture_owes_it():
    led = expecting()
    led.computed_below(6)  # prompt 0..3 and generated positions 4, 5 were computed
    led.acknowledged(sent(led, "r", 1, prompt_and(5)))  # position 4's rows have not come
    assert (led.releasable_through(), led.first_unscored(), led.outcome_at("every", 4)) == (3, 4, None)
    led.acknowledged(sent(led, "r", 2, {R0: [4], R1: [4]}))  # two of its three rows
    assert (led.releasable_through(), led.first_unscored()) == (3, 4)
    led.acknowledged(sent(led, "r", 3, {M0: [4]}))
    assert (led.releasable_through(), led.first_unscored(), led.outcome_at("generated", 4)) == (5, 6, True)
    assert led.capture_lost() is None and led.unprobed_tokens() == 0


def test_rows_that_arrived_before_their_position_was_known_computed_still_count():
    led = expecting()
    led.acknowledged(sent(led, "r", 1, prompt_and(4)))
    led.computed_below(5)
    assert led.releasable_through() == 4 and led.first_unscored() == 5
    led.computed_below(6)  # position 5 computed, its rows not here yet
    assert led.releasable_through() == 4 and led.first_unscored() == 5


def test_rows_capture_never_delivered_fail_at_their_position_and_count_once_as_dropped():
    led = expecting()
    led.computed_below(8)
    led.acknowledged(sent(led, "r", 1, prompt_and(4, 6, 7)))  # position 5: nothing
    assert led.releasable_through() == 4  # never past the position capture lost
    failure = led.capture_lost()
    assert (failure.fail_closed, failure.dropped, failure.rows) == (True, True, 3)
    assert failure.bindings == ("every", "generated")
    assert failure.reason == ("capture delivered no rows or too few at 1 position(s), 3 rows missing: "
                              "position (rows arrived of expected) 5 (0 of 3)")
    assert led.fail_closed_failure() is failure
    assert (led.first_unscored(), led.releasable_through(), led.outcome_at("every", 5)) == (5, 4, False)
    assert (led.unprobed_tokens(), led.dropped_records, led.capture_lost_rows) == (1, 3, 3)
    assert led.capture_lost() is None  # counted once
    assert led.report() == [(14, 2, 0, failure.reason), (3, 1, 0, failure.reason)]


def test_rows_a_worker_reported_dropping_count_once_whether_owed_or_not():
    led = expecting()
    led.computed_below(6)
    led.acknowledged(sent(led, "r", 1, prompt_and(4)))  # position 5 is owed 3 rows; none came
    led.capture_dropped(R0, [5, 9])  # a worker reported two of them, and one at 9 (nothing owed there yet)
    led.capture_dropped(R1, [5])
    failure = led.capture_lost()
    assert (failure.rows, led.dropped_records) == (3, 4)
    assert led.capture_lost_rows == 1  # the one row nobody reported
    led.capture_dropped(R1, [9])
    assert led.capture_lost() is None and led.dropped_records == 5


def test_a_row_dropped_again_when_recomputed_counts_once_and_one_delivered_when_recomputed_not_at_all():
    led = expecting()
    led.capture_dropped(R0, [8, 9])  # no stage but the first computed them yet
    # Preempted and recomputed: the row at 8 is dropped again, the one at 9 arrives.
    led.capture_dropped(R0, [8])
    led.acknowledged(sent(led, "r", 1, {R0: [9]}))
    led.capture_lost()
    assert led.dropped_records == 1


def test_a_report_of_dropping_a_recomputed_row_that_had_arrived_counts_nothing():
    led = expecting()
    led.acknowledged(sent(led, "r", 1, {R0: [8, 9]}))
    led.capture_dropped(R0, [9])  # preempted: the recomputed copy was dropped, not the row
    led.capture_dropped(R0, [10])
    led.capture_lost()
    assert led.dropped_records == 1


def test_rows_two_bindings_read_count_once_when_capture_loses_them():
    led = RequestLedger(4, [binding("a", points=(R0,), tokens=EVERY), binding("b", points=(R0,))],
                        [ExtractionPoint(R0, "residual_stream", (0,))])
    led.computed_below(6)
    led.acknowledged(sent(led, "r", 1, {R0: [0, 1, 2, 3, 4]}))  # position 5: nothing
    failure = led.capture_lost()
    assert (failure.rows, led.dropped_records, failure.bindings) == (1, 1, ("a", "b"))


def test_lost_rows_of_a_fail_open_request_are_counted_and_do_not_hold_tokens():
    led = expecting(closed=False)
    led.computed_below(7)
    led.acknowledged(sent(led, "r", 1, {R0: [0, 1, 2, 3, 4, 6], R1: [0, 1, 2, 3, 6], M0: [6]}))
    failure = led.capture_lost()  # position 4: 1 of 3, position 5: none
    assert not failure.fail_closed and failure.rows == 5
    assert led.releasable_through() == 6 and led.fail_closed_failure() is None
    assert (led.unprobed_tokens(), led.dropped_records) == (2, 5)


def test_a_probe_of_the_prompt_alone_holds_no_generated_token_once_the_prompt_is_scored():
    prompt = TokenSelector(Scope.PROMPT)
    led = RequestLedger(4, [binding(points=("probe.final_norm",), tokens=prompt)],
                        [ExtractionPoint("probe.final_norm", "final_norm", (), prompt)])
    led.computed_below(5)  # the prompt and generated token 0's position (4)
    assert led.releasable_through() == -1  # the prompt's rows have not come
    message = sent(led, "r", 1, {"probe.final_norm": [0, 1, 2, 3]})
    assert led.releasable_through() == -1
    led.acknowledged(message)
    assert led.releasable_through() == 4  # position 4 owes nothing and was computed
    led.computed_below(40)
    assert (led.releasable_through(), led.first_unscored(), led.unprobed_tokens()) == (39, 40, 0)


def test_a_fail_closed_failure_in_the_prompt_holds_every_generated_token():
    prompt = TokenSelector(Scope.PROMPT)
    led = RequestLedger(4, [binding(points=("probe.final_norm",), tokens=prompt)],
                        [ExtractionPoint("probe.final_norm", "final_norm", (), prompt)])
    led.computed_below(40)
    led.acknowledged(sent(led, "r", 1, {"probe.final_norm": [0, 1]}))
    led.dropped(led.queued("r", {"probe.final_norm": [2, 3]}, 0.0), "send queue full")
    assert led.releasable_through() == 1
    led.computed_below(400)
    assert led.releasable_through() == 1


def test_generated_positions_between_selected_ones_wait_only_for_those_before_them():
    sparse = TokenSelector(Scope.GENERATED, (0, 5))
    led = RequestLedger(4, [binding(points=(M0,), tokens=sparse)], [ExtractionPoint(M0, "mlp_out", (0,), sparse)])
    assert led.releasable_through() == -1
    led.computed_below(4)
    assert led.releasable_through() == 3  # the prompt owes nothing
    led.computed_below(12)
    assert led.releasable_through() == 3  # position 4 owes a row
    led.acknowledged(sent(led, "r", 1, {M0: [4]}))
    assert led.releasable_through() == 8  # position 9 owes a row
    led.acknowledged(sent(led, "r", 2, {M0: [9]}))
    assert led.releasable_through() == 11  # computed, nothing more owed


def test_a_binding_counts_only_the_positions_its_selector_picks_of_a_shared_point():
    """Two bindings read one point captured at every token; one reads only
    generated tokens: prompt rows are not its rows."""
    led = RequestLedger(4, [binding("all", tokens=EVERY), binding("gen", tokens=GENERATED, closed=False)],
                        [ExtractionPoint(R0, "residual_stream", (0,))])
    led.computed_below(6)
    led.dropped(led.queued("r", rows(r0=[0, 1, 2, 3]), 0.0), "prompt dropped")
    led.acknowledged(sent(led, "r", 1, rows(r0=[4, 5])))
    assert led.report() == [(2, 4, 0, "prompt dropped"), (2, 0, 0, "")]


def test_a_long_requests_positions_add_nothing_for_the_garbage_collector_to_walk():
    """Full collections walk every tracked object, on the event loop; a request's
    per-position records must not add one per position."""
    led = ledger()
    gc.collect()
    before = len(gc.get_objects())
    for step in range(1, 5001):
        led.computed_below(10 + step)
        led.acknowledged(sent(led, "r", step, rows(r0=[9 + step] * 3)))
    gc.collect()
    assert len(gc.get_objects()) - before < 50
    assert (led.first_unscored(), led.releasable_through(), led.in_flight()) == (5010, 5009, 0)


def test_decoding_may_run_ahead_from_the_first_position_that_holds_a_gated_token():
    led = expecting()  # prompt of 4: positions 0..3 owe 2 rows, generated ones 3
    assert led.settled_below() == 0
    led.computed_below(6)
    first = sent(led, "r", 1, prompt_and(4))
    assert led.settled_below() == 0  # in flight
    led.acknowledged(first)
    assert led.settled_below() == 5  # position 5 is owed its rows
    led.acknowledged(sent(led, "r", 2, {R0: [5], R1: [5], M0: [5]}))
    assert led.settled_below() == 6  # position 6's expectation comes with the next token
    led.computed_below(7)
    assert led.settled_below() == 6
    failed = sent(led, "r", 3, {R0: [6], R1: [6], M0: [6]})
    led.step_failed("r", 3, "boom", probe=None)  # fail_closed: holds for good
    assert (failed.state, led.settled_below()) == (MessageState.FAILED, 6)


def test_a_fail_open_failure_lets_decoding_go_on():
    led = expecting(closed=False)
    led.computed_below(5)
    led.queued("r", prompt_and(4), 0.0)
    led.expire(1.0, "router timeout")
    assert led.settled_below() == 5


def test_positions_no_probe_point_picks_count_as_settled_once_computed():
    last = TokenSelector(Scope.PROMPT, (-1,))
    led = RequestLedger(4, [binding(points=("probe.final_norm",), tokens=last)],
                        [ExtractionPoint("probe.final_norm", "final_norm", (), last)])  # rows only at position 3
    led.computed_below(9)
    assert led.settled_below() == 3
    led.acknowledged(sent(led, "r", 1, {"probe.final_norm": [3]}))
    assert led.settled_below() == 9  # the computed positions after it owe nothing
