"""Operator-set bindings: the policy file, which guards a caller gets, how a
request's own bindings merge with them, and which requests are refused."""

from __future__ import annotations

import json
import os
import time

import pytest

from common.errors import InvalidArgument, Unavailable
from engine_service.request import guards
from engine_service.request.guards import ABORT, CLOSED, OBSERVE, OPEN, UNSET_ACTION, Guard, GuardConfigError
from undercurrent.v1 import engine_pb2 as engine_pb

POLICY = {
    "default": [{"probe": "guard", "failure_policy": "fail_closed", "action": "abort", "gate_tokens": True}],
    "callers": {
        "batch": [{"probe": "watch", "failure_policy": "fail_open"},
                  {"probe": "guard", "failure_policy": "fail_open", "action": "observe"}],
    },
}


def policy(data=POLICY) -> guards.GuardPolicy:
    return guards.parse_policy(json.dumps(data), "guards.json")


def request(*bindings: tuple, gate: bool | None = None) -> engine_pb.GenerateRequest:
    message = engine_pb.GenerateRequest(text="hello")
    for probe, *rest in bindings:
        message.probes.add(probe=probe, failure_policy=rest[0] if rest else 0, action=rest[1] if len(rest) > 1 else 0)
    if gate is not None:
        message.gate_tokens = gate
    return message


def in_force(guarded: guards.Guarded) -> list[tuple]:
    return [(b.probe, b.failure_policy, b.action) for b in guarded.request.probes]


# -- the file ---------------------------------------------------------------------


def test_every_caller_gets_the_default_and_a_named_caller_its_own_on_top_the_stronger_of_two():
    parsed = policy()
    assert parsed.for_caller("anyone") == (Guard("guard", CLOSED, ABORT, True),)
    # "batch" lists guard again, weaker: the default's stronger terms stay.
    assert parsed.for_caller("batch") == (Guard("guard", CLOSED, ABORT, True), Guard("watch", OPEN, UNSET_ACTION))


def test_a_guard_defaults_to_fail_closed_the_probes_own_action_and_no_gating():
    assert policy({"default": [{"probe": "p"}]}).for_caller("x") == (Guard("p", CLOSED, UNSET_ACTION, False),)
    assert policy({}).for_caller("x") == ()


@pytest.mark.parametrize("data, message", [
    ("[]", "guards.json: must be a JSON object"),
    ('{"default": [], "extra": 1}', "guards.json: unknown key(s) ['extra']"),
    ('{"default": {"probe": "p"}}', "guards.json: default: must be a list of guards"),
    ('{"default": [{"probe": ""}]}', "guards.json: default[0].probe: must name a probe"),
    ('{"default": [{"probe": "p", "failure_policy": "closed"}]}',
     "guards.json: default[0].failure_policy: 'closed' is not one of fail_closed, fail_open"),
    ('{"callers": {"demo": [{"probe": "p", "action": "stop"}]}}',
     "guards.json: callers.demo[0].action: 'stop' is not one of abort, observe"),
    ('{"default": [{"probe": "p", "gate_tokens": "yes"}]}',
     "guards.json: default[0].gate_tokens: must be true or false"),
    ('{"default": [{"probe": "p", "gated": true}]}', "guards.json: default[0]: unknown key(s) ['gated']"),
    ('{"default": [{"probe": "p"}, {"probe": "p"}]}', "guards.json: default: probe(s) ['p'] listed twice"),
    ('{"default": [', "guards.json: not JSON"),
])
def test_a_bad_file_is_refused_naming_the_entry_and_the_reason(data, message):
    with pytest.raises(GuardConfigError) as err:
        guards.parse_policy(data, "guards.json")
    assert str(err.value).startswith(message), err.value


# -- merging a request with its caller's guards ------------------------------------


def test_a_request_naming_no_probe_gets_the_guards_and_their_gating():
    guarded = guards.apply(policy().for_caller("anyone"), request())
    assert in_force(guarded) == [("guard", CLOSED, ABORT)]
    assert guarded.request.gate_tokens and guarded.operator_probes == {"guard"}
    assert guarded.request.text == "hello"


def test_a_requests_own_bindings_keep_their_order_and_the_guards_it_did_not_name_follow():
    """So an error about one of its bindings names its own index."""
    guarded = guards.apply(policy().for_caller("batch"), request(("b", OPEN), ("watch",), ("a", 0, OBSERVE)))
    assert in_force(guarded) == [("b", OPEN, 0), ("watch", OPEN, 0), ("a", 0, OBSERVE), ("guard", CLOSED, ABORT)]
    assert guarded.operator_probes == {"guard", "watch"}


def test_a_request_may_strengthen_a_guard():
    weak = (Guard("watch", OPEN, OBSERVE),)
    guarded = guards.apply(weak, request(("watch", CLOSED, ABORT), gate=True))
    assert in_force(guarded) == [("watch", CLOSED, ABORT)] and guarded.request.gate_tokens
    # Restating the guard's own terms is no weakening.
    assert in_force(guards.apply(weak, request(("watch", OPEN, OBSERVE)))) == [("watch", OPEN, OBSERVE)]
    assert in_force(guards.apply(policy().for_caller("x"), request(("guard", CLOSED, ABORT), gate=True))) == [
        ("guard", CLOSED, ABORT)]


@pytest.mark.parametrize("guard, mine, field, why", [
    (Guard("guard", CLOSED, ABORT), ("guard", OPEN), "probes[1].failure_policy",
     "FAIL_OPEN would weaken the operator-set binding of 'guard', which is FAIL_CLOSED"),
    (Guard("guard", OPEN, ABORT), ("guard", 0, OBSERVE), "probes[1].action",
     "OBSERVE would weaken the operator-set binding of 'guard', whose action is ABORT"),
    (Guard("guard", CLOSED), ("guard", 0, OBSERVE), "probes[1].action",
     "whose action is the probe's own action"),
])
def test_a_request_weakening_a_guard_is_refused_naming_its_field(guard, mine, field, why):
    with pytest.raises(InvalidArgument) as err:
        guards.apply((guard,), request(("other",), mine))
    assert str(err.value).startswith(f"{field}: ") and why in str(err.value), err.value


def test_a_request_turning_gating_off_under_a_gating_guard_is_refused_and_unset_is_gated():
    gating = policy().for_caller("x")
    with pytest.raises(InvalidArgument, match=r"^gate_tokens: false, but the operator-set binding of 'guard' gates"):
        guards.apply(gating, request(gate=False))
    assert guards.apply(gating, request()).request.gate_tokens
    # A guard that does not gate leaves the request's choice alone.
    assert not guards.apply((Guard("p"),), request(gate=False)).request.gate_tokens
    assert not guards.apply((Guard("p"),), request()).request.HasField("gate_tokens")


def test_no_guards_leave_the_request_as_it_came():
    message = request(("a", OPEN), gate=False)
    guarded = guards.apply((), message)
    assert guarded.request is message and guarded.operator_probes == frozenset()


# -- the file on disk ----------------------------------------------------------------


def _write(path, data, age_s: float = 10.0) -> None:
    """Writes the file and dates it `age_s` back, as a file changed a while ago."""
    path.write_text(json.dumps(data) if not isinstance(data, str) else data)
    then = time.time() - age_s
    os.utime(path, (then, then))


def test_the_file_is_read_again_when_it_changes_and_a_broken_file_refuses_every_request_until_fixed(tmp_path):
    path = tmp_path / "guards.json"
    _write(path, {"default": [{"probe": "one"}]})
    live = guards.GuardsFile(path)
    assert [g.probe for g in live.for_caller("x")] == ["one"]
    _write(path, {"default": [{"probe": "two"}]}, age_s=5.0)
    assert [g.probe for g in live.for_caller("x")] == ["two"]
    _write(path, '{"default": [{"probe": 3}]}', age_s=3.0)
    with pytest.raises(Unavailable, match=r"guards file is unusable .*default\[0\]\.probe: must name a probe"):
        live.for_caller("x")
    path.unlink()
    with pytest.raises(Unavailable):
        live.for_caller("x")
    _write(path, {"default": []})
    assert live.for_caller("x") == ()


def test_a_bad_file_at_start_up_fails_naming_the_flag(tmp_path):
    with pytest.raises(GuardConfigError, match=r"^--guards-file .*missing\.json: No such file"):
        guards.GuardsFile(tmp_path / "missing.json")
