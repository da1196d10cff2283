"""The per-request ledger: which positions are settled, what went unscored, what was dropped."""

import gc

from undercurrent.v1 import undercurrent_pb2 as pb

from common.capture_spec import ExtractionPoint, Scope, TokenSelector
from engine_service.request.active import HeldScores
from engine_service.request.probe_points import ExpectedRows
from engine_service.request.ledger import MessageState, RequestLedger

CLOSED, OPEN = pb.FAILURE_POLICY_FAIL_CLOSED, pb.FAILURE_POLICY_FAIL_OPEN


def ledger(**policies) -> RequestLedger:
    return RequestLedger(prompt_len=10, policies=policies or {"p": CLOSED})


def sent(led: RequestLedger, replica: str, step: int, rows: dict[int, int], now: float = 0.0):
    message = led.queued(replica, rows, now)
    led.sent(message, step)
    return message


def test_positions_settle_only_when_every_row_is_acknowledged():
    led = ledger()
    first = sent(led, "r", 1, {10: 2, 11: 2})
    second = sent(led, "r", 2, {12: 2})
    assert (led.first_unsettled(), led.releasable_through(), led.in_flight()) == (10, -1, 6)
    assert led.acknowledged(first) == 4
    assert (led.first_unsettled(), led.releasable_through()) == (12, 11)
    assert led.acknowledged(second) == 2
    assert (led.first_unsettled(), led.releasable_through(), led.unprobed_tokens()) == (13, 12, 0)
    assert led.acknowledged(second) == 0  # a duplicate ack settles nothing more


def test_the_ack_of_part_0_of_a_split_step_does_not_settle_rows_in_part_1():
    led = ledger()
    # One engine step, too big for one message: layers 0..1 in part 0, layer 2 in part 1,
    # both carrying position 12.
    part_0 = sent(led, "r", 1, {12: 2})
    part_1 = sent(led, "r", 2, {12: 1})
    led.acknowledged(part_0)
    assert led.releasable_through() == -1 and led.first_unsettled() == 12
    led.acknowledged(part_1)
    assert led.releasable_through() == 12


def test_an_ack_settles_its_messages_whatever_sits_between_them():
    led = ledger()
    # Re-homed from "a" to "b" and back: the replicas' messages interleave in the ledger.
    a1 = sent(led, "a", 1, {10: 1})
    b1 = sent(led, "b", 1, {11: 1})
    a2 = sent(led, "a", 2, {12: 1})
    b2 = sent(led, "b", 2, {13: 1})
    queued = led.queued("a", {14: 1}, 0.0)  # not sent yet
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
    sent(led, "r", 1, {10: 1})  # the replica's previous session; its steps restart at 1
    current = sent(led, "r", 1, {11: 1})
    assert led.acknowledged(current) == 1
    assert led.in_flight() == 1 and led.first_unsettled() == 10


def test_a_router_error_about_a_step_leaves_its_rows_unscored_and_a_late_ack_changes_nothing():
    led = ledger()
    first = sent(led, "r", 1, {10: 1})
    second = sent(led, "r", 2, {11: 1})
    failure = led.step_failed("r", 2, "router error: INTERNAL: boom", probe=None)
    assert failure.fail_closed and failure.rows == 1 and not failure.dropped
    assert led.acknowledged(first) + led.acknowledged(second) == 1
    assert (led.releasable_through(), led.first_unsettled(), led.unprobed_tokens()) == (10, 11, 1)
    assert led.fail_closed_failure().reason == "router error: INTERNAL: boom"
    assert led.dropped_records == 0
    assert led.step_failed("r", 9, "unknown step", None) is None


def test_an_error_after_the_ack_is_out_of_order_and_changes_nothing():
    led = ledger()
    led.acknowledged(sent(led, "r", 1, {10: 1, 11: 1}))
    assert led.step_failed("r", 1, "late error", None) is None
    assert (led.releasable_through(), led.unprobed_tokens(), led.failures) == (11, 0, [])


def test_a_failure_of_a_fail_open_binding_counts_but_does_not_hold_tokens():
    led = ledger(strict=CLOSED, lenient=OPEN)
    first = sent(led, "r", 1, {10: 1})
    second = sent(led, "r", 2, {11: 1})
    failure = led.step_failed("r", 2, "bad row for lenient", probe="lenient")
    led.acknowledged(first), led.acknowledged(second)
    assert not failure.fail_closed
    assert led.releasable_through() == 11 and led.unprobed_tokens() == 1
    assert led.fail_closed_failure() is None
    # An error naming no probe concerns every binding, the fail_closed one too.
    sent(led, "r", 3, {12: 1})
    assert led.step_failed("r", 3, "decode error", probe=None).fail_closed
    assert led.releasable_through() == 11


def test_fail_open_only_request_releases_past_failures():
    led = ledger(p=OPEN)
    message = led.queued("r", {10: 1}, 0.0)
    led.dropped(message, "drop_oldest")
    led.acknowledged(sent(led, "r", 1, {11: 1}))
    assert led.releasable_through() == 11
    assert (led.unprobed_tokens(), led.dropped_records, led.fail_closed_failure()) == (1, 1, None)


def test_overflow_drops_count_as_dropped_records_and_unscored():
    led = ledger()
    first = led.queued("r", {10: 3}, 0.0)
    led.queued("r", {11: 3}, 0.0)
    failure = led.dropped(first, "dropped by drop_oldest")
    assert failure.dropped and failure.fail_closed and failure.rows == 3
    assert led.dropped_records == 3 and led.first_unsettled() == 10
    assert led.dropped(first, "twice") is None and led.dropped_records == 3


def test_rows_with_no_replica_are_dropped():
    led = ledger()
    failure = led.not_sent("", {10: 2}, 0.0, "no router replica reachable")
    assert failure.dropped and led.dropped_records == 2 and led.unprobed_tokens() == 1


def test_a_lost_replica_takes_its_unacknowledged_rows_with_it():
    led = ledger()
    led.acknowledged(sent(led, "a", 1, {10: 1}))
    lost = sent(led, "a", 2, {11: 1})
    queued = led.queued("b", {12: 1}, 0.0)
    failure = led.replica_failed("a", "a down")
    assert failure.rows == 1 and not failure.dropped
    assert queued.state is MessageState.QUEUED  # rows bound for another replica stay in flight
    assert led.acknowledged(lost) == 0  # a late ack from the lost session
    assert (led.releasable_through(), led.first_unsettled(), led.unprobed_tokens()) == (10, 11, 2)


def test_a_refused_request_fails_what_is_in_flight_and_everything_after():
    led = ledger()
    sent(led, "r", 1, {10: 1})
    failure = led.refused("router refused request_start: RESOURCE_EXHAUSTED", probe=None)
    assert failure.fail_closed and failure.rows == 1
    later = led.queued("r", {11: 1}, 0.0)
    assert later.state is MessageState.FAILED
    led.sent(later, 2)
    assert led.acknowledged(later) == 0
    assert led.unprobed_tokens() == 2 and led.first_unsettled() == 10
    # Rows at or past the first token the client never got are not its tokens.
    assert led.unprobed_tokens(below=11) == 1


def test_a_refusal_with_nothing_in_flight_is_still_a_failure():
    led = ledger()
    failure = led.refused("probe 'p' is not loaded", probe="p")
    assert failure.fail_closed and failure.rows == 0
    assert led.fail_closed_failure() is failure


def test_rows_unacknowledged_past_the_timeout_expire():
    led = ledger()
    sent(led, "r", 1, {10: 1}, now=1.0)
    second = sent(led, "r", 2, {11: 1}, now=5.0)
    assert led.oldest_in_flight() == 1.0
    failure = led.expire(older_than=4.0, reason="no ack for 3.0 s")
    assert failure.rows == 1 and led.oldest_in_flight() == 5.0
    assert led.expire(older_than=4.0, reason="again") is None
    led.acknowledged(second)
    assert (led.first_unsettled(), led.releasable_through(), led.unprobed_tokens()) == (10, -1, 1)


def test_rows_again_at_a_settled_position_unsettle_it():
    led = ledger()
    led.acknowledged(sent(led, "r", 1, {10: 1, 11: 1}))
    assert led.first_unsettled() == 12
    sent(led, "r", 2, {11: 1})  # recomputed after preemption
    assert (led.first_unsettled(), led.releasable_through()) == (11, 10)
    sent(led, "r", 3, {9: 1})  # a position before every captured one
    assert (led.first_unsettled(), led.releasable_through()) == (9, -1)


def test_nothing_captured():
    led = ledger()
    assert (led.first_unsettled(), led.releasable_through(), led.unprobed_tokens()) == (0, -1, 0)
    assert led.oldest_in_flight() is None and led.in_flight() == 0


def test_a_position_is_scored_acknowledged_failed_or_still_in_flight():
    led = ledger()
    first = sent(led, "r", 1, {10: 2})
    sent(led, "r", 2, {11: 1})
    assert [led.outcome_at(p) for p in (9, 10, 11)] == [None, None, None]
    led.acknowledged(first)
    led.replica_failed("r", "lost")
    assert [led.outcome_at(p) for p in (10, 11)] == [True, False]


def scores(positions: list[int]) -> pb.ProbeScores:
    return pb.ProbeScores(request_id="q", probe="p", token_positions=positions,
                          scores=[float(p) for p in positions])


def test_scores_are_shown_only_where_the_ledger_counts_rows_scored():
    """A router lost between a step's scores and its ack: those scores are
    withheld, so shown scores plus unprobed positions equal the positions fed."""
    led = ledger()
    held = HeldScores()
    first = sent(led, "r", 1, {10: 1, 11: 1})
    sent(led, "r", 2, {12: 1})
    assert held.add(scores([10, 11]), led) == []  # not acknowledged yet: held
    assert held.release(led) == []
    led.acknowledged(first)
    assert held.add(scores([12]), led) == []  # its ack never comes
    assert [list(s.token_positions) for s in held.release(led)] == [[10, 11]]
    assert [list(s.token_positions) for s in held.release(led)] == []
    led.replica_failed("r", "router lost before acknowledging")
    assert held.release(led) == [] and held.held == []
    assert 2 + led.unprobed_tokens() == 3


def test_a_message_is_split_at_the_settled_positions_and_the_end_withholds_the_rest():
    led = ledger()
    held = HeldScores()
    first = sent(led, "r", 1, {10: 1})
    sent(led, "s", 1, {11: 1})  # re-homed to another replica, whose ack never comes
    second = sent(led, "r", 2, {12: 1})
    held.add(scores([10, 11, 12]), led)
    led.acknowledged(first)
    shown = held.release(led)
    assert [(list(s.token_positions), list(s.scores)) for s in shown] == [([10], [10.0])]
    assert shown[0].probe == "p" and shown[0].request_id == "q"
    led.acknowledged(second)
    # The request ends: position 12 belongs to a token the client never received,
    # position 11 is still in flight: both withheld.
    shown = held.release(led, below=12)
    assert shown == [] and held.held == []


def test_scores_already_settled_are_shown_as_they_arrive_and_the_rest_wait_for_the_ledger():
    led = ledger()
    held = HeldScores()
    first = sent(led, "r", 1, {10: 1})
    second = sent(led, "r", 2, {11: 1})
    led.acknowledged(first)
    shown = held.add(scores([10, 11]), led)
    assert [list(s.token_positions) for s in shown] == [[10]]
    assert [list(s.token_positions) for s in held.held] == [[11]]
    led.acknowledged(second)
    assert [list(s.token_positions) for s in held.release(led)] == [[11]] and held.held == []


def test_a_message_per_binding_is_read_once_while_the_ledger_waits():
    """A router sends one message per binding and step, before the step's ack:
    each is read as it arrives, not every held one again (quadratic in bindings)."""

    class CountingLedger(RequestLedger):
        reads = 0

        def outcome_at(self, position: int):
            CountingLedger.reads += 1
            return super().outcome_at(position)

    led = CountingLedger(4, {f"p{i}": OPEN for i in range(1000)})
    step = sent(led, "r", 1, {10: 1000})
    held = HeldScores()
    for i in range(1000):
        assert held.add(pb.ProbeScores(request_id="q", probe=f"p{i}", token_positions=[10], scores=[0.5]), led) == []
    assert CountingLedger.reads == 1000  # one read per message (reading all held each time: 500,500)
    led.acknowledged(step)
    assert len(held.release(led)) == 1000 and CountingLedger.reads == 2000


# -- rows counted against what capture must make ------------------------------------


def expecting(prompt_len=4, **policies) -> RequestLedger:
    """Two probe points read every token (2 rows a position), one only generated tokens."""
    points = [ExtractionPoint(f"probe.residual_stream.{layer}", "residual_stream", (layer,)) for layer in (0, 1)]
    points.append(ExtractionPoint("probe.mlp_out.0", "mlp_out", (0,), TokenSelector(Scope.GENERATED)))
    return RequestLedger(prompt_len, policies or {"p": CLOSED}, ExpectedRows(points, prompt_len))


def test_expected_rows_follow_each_points_token_selector():
    assert expecting().expected.between(2, 7) == [2, 2, 3, 3, 3]  # prompt 2..3, generated 4..6
    picked = [ExtractionPoint("probe.attn_out.1", "attn_out", (1,), TokenSelector(Scope.GENERATED, (0, 2))),
              ExtractionPoint("probe.final_norm", "final_norm", (), TokenSelector(Scope.PROMPT, (-1,))),
              ExtractionPoint("probe.mlp_out.1", "mlp_out", (1,))]
    # prompt of 4: the last prompt token (3), generated tokens 0 and 2 (positions 4, 6), every token once
    assert ExpectedRows(picked, 4).between(2, 8) == [1, 2, 2, 1, 2, 1]


def test_a_computed_position_waits_for_every_row_capture_owes_it():
    led = expecting()
    led.computed_below(6)  # prompt 0..3 and generated positions 4, 5 were computed
    led.acknowledged(sent(led, "r", 1, {0: 2, 1: 2, 2: 2, 3: 2, 5: 3}))  # position 4's rows have not come
    assert (led.releasable_through(), led.first_unsettled(), led.outcome_at(4)) == (3, 4, None)
    led.acknowledged(sent(led, "r", 2, {4: 2}))  # two of its three rows
    assert (led.releasable_through(), led.first_unsettled()) == (3, 4)
    led.acknowledged(sent(led, "r", 3, {4: 1}))
    assert (led.releasable_through(), led.first_unsettled(), led.outcome_at(4)) == (5, 6, True)
    assert led.capture_lost() is None and led.unprobed_tokens() == 0


def test_rows_that_arrived_before_their_position_was_known_computed_still_count():
    led = expecting()
    led.acknowledged(sent(led, "r", 1, {0: 2, 1: 2, 2: 2, 3: 2, 4: 3}))
    assert led.releasable_through() == 4
    led.computed_below(5)
    assert led.releasable_through() == 4 and led.first_unsettled() == 5
    led.computed_below(6)  # position 5 computed, its rows not here yet
    assert led.releasable_through() == 4 and led.first_unsettled() == 5


def test_rows_capture_never_delivered_fail_closed_at_their_position_and_count_as_dropped():
    led = expecting()
    led.computed_below(8)
    led.acknowledged(sent(led, "r", 1, {0: 2, 1: 2, 2: 2, 3: 2, 4: 3, 6: 3, 7: 3}))  # position 5: nothing
    assert led.releasable_through() == 4  # never past the position capture lost
    failure = led.capture_lost()
    assert failure.fail_closed and failure.dropped and failure.rows == 3
    assert failure.reason == ("capture delivered no rows or too few at 1 position(s), 3 rows missing: "
                              "position (rows arrived of expected) 5 (0 of 3)")
    assert led.fail_closed_failure() is failure
    assert (led.first_unsettled(), led.releasable_through(), led.outcome_at(5)) == (5, 4, False)
    assert (led.unprobed_tokens(), led.dropped_records) == (1, 3)
    assert led.capture_lost() is None  # counted once


def test_lost_rows_of_a_fail_open_request_are_counted_and_do_not_hold_tokens():
    led = expecting(p=OPEN)
    led.computed_below(7)
    led.acknowledged(sent(led, "r", 1, {0: 2, 1: 2, 2: 2, 3: 2, 4: 1, 6: 3}))  # position 4: 1 of 3; 5: none
    failure = led.capture_lost(reported_dropped=1)  # a worker reported one of them
    assert not failure.fail_closed and failure.rows == 5
    assert led.releasable_through() == 6 and led.fail_closed_failure() is None
    assert (led.unprobed_tokens(), led.dropped_records) == (2, 4)


def test_a_probe_of_the_prompt_alone_holds_no_generated_token_once_the_prompt_is_scored():
    prompt_only = [ExtractionPoint("probe.final_norm", "final_norm", (), TokenSelector(Scope.PROMPT))]
    led = RequestLedger(4, {"p": CLOSED}, ExpectedRows(prompt_only, 4))
    led.computed_below(5)  # the prompt and generated token 0's position (4)
    assert led.releasable_through() == -1  # the prompt's rows have not come
    message = sent(led, "r", 1, {0: 1, 1: 1, 2: 1, 3: 1})
    assert led.releasable_through() == -1
    led.acknowledged(message)
    assert led.releasable_through() == 4  # position 4 owes nothing and was computed
    led.computed_below(40)
    assert (led.releasable_through(), led.first_unsettled(), led.unprobed_tokens()) == (39, 4, 0)


def test_a_fail_closed_failure_in_the_prompt_holds_every_generated_token():
    prompt_only = [ExtractionPoint("probe.final_norm", "final_norm", (), TokenSelector(Scope.PROMPT))]
    led = RequestLedger(4, {"p": CLOSED}, ExpectedRows(prompt_only, 4))
    led.computed_below(40)
    led.acknowledged(sent(led, "r", 1, {0: 1, 1: 1}))
    led.dropped(led.queued("r", {2: 1, 3: 1}, 0.0), "send queue full")
    assert led.releasable_through() == 1
    led.computed_below(400)
    assert led.releasable_through() == 1


def test_generated_positions_between_selected_ones_wait_only_for_those_before_them():
    sparse = [ExtractionPoint("probe.mlp_out.1", "mlp_out", (1,), TokenSelector(Scope.GENERATED, (0, 5)))]
    led = RequestLedger(4, {"p": CLOSED}, ExpectedRows(sparse, 4))  # rows at positions 4 and 9
    assert led.releasable_through() == -1
    led.computed_below(4)
    assert led.releasable_through() == 3  # the prompt owes nothing
    led.computed_below(12)
    assert led.releasable_through() == 3  # position 4 owes a row
    led.acknowledged(sent(led, "r", 1, {4: 1}))
    assert led.releasable_through() == 8  # position 9 owes a row
    led.acknowledged(sent(led, "r", 2, {9: 1}))
    assert led.releasable_through() == 11  # computed, nothing more owed


def test_a_long_requests_positions_add_nothing_for_the_garbage_collector_to_walk():
    """Full collections walk every tracked object, on the event loop; a request's
    per-position records must not add one per position."""
    led = ledger()
    gc.collect()
    before = len(gc.get_objects())
    for step in range(1, 5001):
        led.acknowledged(sent(led, "r", step, {10 + step: 3}))
    gc.collect()
    assert len(gc.get_objects()) - before < 50
    assert (led.first_unsettled(), led.releasable_through(), led.in_flight()) == (5011, 5010, 0)


def test_decoding_may_run_ahead_from_the_first_position_that_holds_a_gated_token():
    led = expecting()  # prompt of 4: positions 0..3 owe 2 rows, generated ones 3
    assert led.settled_below() == 0
    led.computed_below(6)
    first = sent(led, "r", 1, {0: 2, 1: 2, 2: 2, 3: 2, 4: 3})
    assert led.settled_below() == 0  # in flight
    led.acknowledged(first)
    assert led.settled_below() == 5  # position 5 is owed its rows
    led.acknowledged(sent(led, "r", 2, {5: 3}))
    assert led.settled_below() == 6  # position 6's expectation comes with the next token
    led.computed_below(7)
    assert led.settled_below() == 6
    failed = sent(led, "r", 3, {6: 3})
    led.step_failed("r", 3, "boom", probe=None)  # fail_closed: holds for good
    assert (failed.state, led.settled_below()) == (MessageState.FAILED, 6)


def test_a_fail_open_failure_lets_decoding_go_on():
    led = expecting(p=OPEN)
    led.computed_below(5)
    led.queued("r", {0: 2, 1: 2, 2: 2, 3: 2, 4: 3}, 0.0)
    led.expire(1.0, "router timeout")
    assert led.settled_below() == 5


def test_positions_no_probe_point_picks_count_as_settled_once_computed():
    points = [ExtractionPoint("probe.final_norm", "final_norm", (), TokenSelector(Scope.PROMPT, (-1,)))]
    led = RequestLedger(4, {"p": CLOSED}, ExpectedRows(points, 4))  # rows only at position 3
    led.computed_below(9)
    assert led.settled_below() == 3
    led.acknowledged(sent(led, "r", 1, {3: 1}))
    assert led.settled_below() == 9  # the computed positions after it owe nothing
