"""The engine's plain logic: client-input checks, probe capture points, the token gate."""

import pytest

from common.canary import canary_takes
from common.capture_spec import Scope
from common.errors import FailedPrecondition, InvalidArgument, NotFound
from engine_service.request import validation as reqs
from engine_service.request.gate import TokenGate
from engine_service.link.assignment import Wanted, choose_home, pin_versions
from engine_service.request import bindings as pins
from engine_service.request.probe_points import check_client_point_names, probe_points
from common.capture_spec import ExtractionPoint
from undercurrent.v1 import engine_pb2 as engine_pb
from undercurrent.v1 import types_pb2 as types_pb

LIMITS = reqs.ModelLimits(vocab_size=512, max_model_len=64)


def test_prompt_checks_name_the_field():
    with pytest.raises(InvalidArgument, match=r"prompt.token_ids: \[512, -1\] outside the vocabulary \[0, 512\)"):
        reqs.prompt_ids(engine_pb.GenerateRequest(token_ids=engine_pb.TokenIds(ids=[3, 512, -1])), None, LIMITS)
    with pytest.raises(InvalidArgument, match="prompt.text: tokenizes to no tokens"):
        reqs.prompt_ids(engine_pb.GenerateRequest(text=" "), lambda text: [], LIMITS)
    with pytest.raises(InvalidArgument, match="64 tokens leave no room"):
        reqs.prompt_ids(engine_pb.GenerateRequest(token_ids=engine_pb.TokenIds(ids=[1] * 64)), None, LIMITS)
    assert reqs.prompt_ids(engine_pb.GenerateRequest(text="ab"), lambda text: [7, 8], LIMITS) == [7, 8]


def test_sampling_defaults_and_limits():
    choice = reqs.sampling_choice(engine_pb.SamplingParams(), prompt_tokens=10, limits=LIMITS)
    assert (choice.max_tokens, choice.temperature, choice.top_p, choice.top_k) == (54, 1.0, 1.0, 0)
    with pytest.raises(InvalidArgument, match="sampling.max_tokens: 55 plus the 10-token prompt"):
        reqs.sampling_choice(engine_pb.SamplingParams(max_tokens=55), 10, LIMITS)
    with pytest.raises(InvalidArgument, match=r"sampling.top_p: 1.5 must be in \(0, 1\]"):
        reqs.sampling_choice(engine_pb.SamplingParams(top_p=1.5), 10, LIMITS)
    with pytest.raises(InvalidArgument, match="sampling.temperature: -1.0 must be >= 0"):
        reqs.sampling_choice(engine_pb.SamplingParams(temperature=-1), 10, LIMITS)
    greedy = reqs.sampling_choice(engine_pb.SamplingParams(temperature=0, max_tokens=3), 10, LIMITS)
    assert greedy.temperature == 0.0 and greedy.max_tokens == 3


def test_request_ids():
    assert reqs.request_id_of(engine_pb.GenerateRequest(request_id="abc")) == "abc"
    generated = {reqs.request_id_of(engine_pb.GenerateRequest()) for _ in range(3)}
    assert len(generated) == 3 and all(r.startswith("req-") for r in generated)
    with pytest.raises(InvalidArgument, match="request_id: 300 characters, at most 256"):
        reqs.request_id_of(engine_pb.GenerateRequest(request_id="x" * 300))


def probe(name, layers, scope=types_pb.TokenSelector.SCOPE_GENERATED, tensor_type=types_pb.TENSOR_TYPE_RESIDUAL_STREAM):
    return types_pb.ProbeInfo(name=name, tensor_type=tensor_type, layers=layers,
                        tokens=types_pb.TokenSelector(scope=scope))


def catalog_of(names: list[str], action=types_pb.PROBE_ACTION_OBSERVE, version="1") -> dict[str, types_pb.ProbeInfo]:
    return {n: types_pb.ProbeInfo(name=n, tensor_type=types_pb.TENSOR_TYPE_RESIDUAL_STREAM, layers=[0], action=action,
                            version=version, digest=f"{n}@{version}") for n in names}


def test_bindings_resolve_policy_and_action_and_pin_the_home_replicas_versions():
    catalog = {**catalog_of(["watch"]), **catalog_of(["guard"], types_pb.PROBE_ACTION_ABORT)}
    asked = [types_pb.ProbeBinding(probe="watch"), types_pb.ProbeBinding(probe="guard", failure_policy=types_pb.FAILURE_POLICY_FAIL_OPEN,
                                                             action=types_pb.PROBE_ACTION_OBSERVE)]
    wanted = pins.wanted(asked, types_pb.FAILURE_POLICY_FAIL_CLOSED)
    assert wanted == [Wanted("watch", None, True), Wanted("guard", None, False)]
    infos = pin_versions("req", {"r1": catalog}, wanted)
    bindings = pins.pinned(asked, infos, types_pb.FAILURE_POLICY_FAIL_CLOSED)
    assert [(b.probe, b.failure_policy, b.action, b.digest) for b in bindings] == [
        ("watch", types_pb.FAILURE_POLICY_FAIL_CLOSED, types_pb.PROBE_ACTION_OBSERVE, "watch@1"),  # the engine's default, the probe's own
        ("guard", types_pb.FAILURE_POLICY_FAIL_OPEN, types_pb.PROBE_ACTION_OBSERVE, "guard@1"),  # the client's choices win
    ]


def test_a_probe_bound_twice_or_unnamed_is_refused_naming_the_binding():
    with pytest.raises(InvalidArgument, match=r"probes\[1\]\.probe: 'watch' is bound twice \(also probes\[0\]\)"):
        pins.wanted([types_pb.ProbeBinding(probe="watch"), types_pb.ProbeBinding(probe="watch")], 0)
    with pytest.raises(InvalidArgument, match=r"probes\[0\]\.probe: empty"):
        pins.wanted([types_pb.ProbeBinding()], 0)


def test_a_request_lives_on_a_replica_that_serves_its_bindings_at_their_versions():
    both = {**catalog_of(["guard"]), **catalog_of(["observer"])}
    catalogs = {"a": both, "b": catalog_of(["guard"]), "c": catalog_of(["guard"], version="2")}
    guard, observer = Wanted("guard", None, True), Wanted("observer", None, False)
    # Only "a" serves both: every request lives there, whatever its id.
    assert {choose_home(f"req-{i}", catalogs, [guard, observer]) for i in range(50)} == {"a"}
    # The guard alone: spread over the replicas, by id.
    assert {choose_home(f"req-{i}", catalogs, [guard]) for i in range(50)} == {"a", "b", "c"}
    # Pinned to version 1: never the replica that has version 2.
    pinned = Wanted("guard", "guard@1", True)
    assert {choose_home(f"req-{i}", catalogs, [pinned]) for i in range(50)} == {"a", "b"}
    # No replica serves both: the one that serves every fail_closed binding; failing that, any.
    assert {choose_home(f"req-{i}", {"b": catalogs["b"], "d": catalog_of(["observer"])}, [guard, observer])
            for i in range(20)} == {"b"}
    # An unloading version serves no new request.
    unloading = {"guard": types_pb.ProbeInfo(name="guard", digest="guard@1", unloading=True)}
    assert {choose_home(f"req-{i}", {"a": both, "u": unloading}, [guard]) for i in range(50)} == {"a"}


def test_pinning_names_a_probe_no_replica_serves_and_fail_closed_probes_no_replica_serves_together():
    catalogs = {"a": catalog_of(["guard"]), "b": catalog_of(["other_guard", "observer"])}
    with pytest.raises(NotFound, match=r"probes\[1\]\.probe: 'gone' is not loaded in any reachable router "
                                       r"\(loaded: guard, observer, other_guard\)"):
        pin_versions("req", catalogs, [Wanted("guard", None, True), Wanted("gone", None, False)])
    with pytest.raises(FailedPrecondition, match=r"no router replica serves every fail_closed probe of the "
                                                 r"request together \(guard, other_guard\): a has guard; b has other_guard"):
        pin_versions("req", catalogs, [Wanted("guard", None, True), Wanted("other_guard", None, True)])
    # A fail_open binding the home lacks is pinned to another replica's version (that home refuses it).
    infos = pin_versions("req", catalogs, [Wanted("guard", None, True), Wanted("observer", None, False)])
    assert [i.digest for i in infos] == ["guard@1", "observer@1"]


def test_a_canary_is_pinned_for_the_requests_its_hash_takes_and_they_live_where_it_is_listed():
    serving = catalog_of(["guard"], types_pb.PROBE_ACTION_ABORT)
    rolling = catalog_of(["guard"], types_pb.PROBE_ACTION_ABORT)
    rolling["guard"].canary.CopyFrom(types_pb.ProbeInfo(name="guard", version="2", digest="guard@2",
                                                        role=types_pb.PROBE_ROLE_CANARY, canary_share=0.25))
    keys = [f"req-{i}" for i in range(200)]
    taken = {k for k in keys if canary_takes(k, 0.25)}
    assert 30 <= len(taken) <= 70  # about a quarter
    pinned = {k: pin_versions(k, {"a": rolling}, [Wanted("guard", None, True)])[0] for k in keys}
    assert {k for k, info in pinned.items() if info.digest == "guard@2"} == taken
    assert {info.digest for k, info in pinned.items() if k not in taken} == {"guard@1"}
    assert all(info.version == "2" for k, info in pinned.items() if k in taken)  # what the finish reports
    # Pinned to the canary, a request lives (or is re-homed) only where the canary is listed;
    # pinned to the serving version, on either replica.
    catalogs = {"a": rolling, "b": serving}
    assert {choose_home(k, catalogs, [Wanted("guard", "guard@2", True)]) for k in keys} == {"a"}
    assert {choose_home(k, catalogs, [Wanted("guard", "guard@1", True)]) for k in keys} == {"a", "b"}
    # A replica without the canary pins no request to it.
    assert {pin_versions(k, {"b": serving}, [Wanted("guard", None, True)])[0].digest for k in keys} == {"guard@1"}


def test_open_requests_bindings_give_the_garbage_collector_nothing_to_walk():
    """A request's bindings live while it runs, on the service's event loop: one
    object each would make every full collection walk requests x probes of them
    (517,170 objects and a 57-59 ms full collection were measured at 256 requests
    of 1000 probes with an object per binding)."""
    import gc

    from engine_service.link import RouterLink, RouterLinkConfig
    from engine_service.request.ledger import RequestLedger

    names = [f"probe_{i}" for i in range(200)]
    catalog = catalog_of(names)
    link = RouterLink(RouterLinkConfig(targets="127.0.0.1:1", engine_id="test"), types_pb.ModelInfo(), lambda event: None)
    messages = [engine_pb.GenerateRequest(request_id=f"req-{i}", probes=[types_pb.ProbeBinding(probe=n) for n in names])
                for i in range(20)]
    kept = []
    gc.collect()
    before = len(gc.get_objects())
    for i, message in enumerate(messages):
        infos = [catalog[n] for n in names]
        bindings = pins.pinned(message.probes, infos, types_pb.FAILURE_POLICY_FAIL_OPEN)
        ledger = RequestLedger(1, pins.for_ledger(bindings, infos))
        link.start_request(message.request_id, i + 1, bindings, 1, ledger)
        kept.append((bindings, ledger))
    gc.collect()
    added = len(gc.get_objects()) - before
    assert added < 20 * 40, f"{added} objects for 20 requests of 200 bindings"  # one per binding: over 4,000
    assert [len(b) for b, _ in kept] == [200] * 20


def test_probe_points_capture_each_tensor_and_layer_once():
    points = probe_points([probe("a", [1]), probe("b", [1, 3]), probe("c", [], tensor_type=types_pb.TENSOR_TYPE_FINAL_NORM)])
    assert [(p.name, p.tensor_type, p.layers, p.tokens.scope) for p in points] == [
        ("probe.final_norm", "final_norm", (), Scope.GENERATED),
        ("probe.residual_stream.1", "residual_stream", (1,), Scope.GENERATED),
        ("probe.residual_stream.3", "residual_stream", (3,), Scope.GENERATED),
    ]


def test_probes_with_different_scopes_on_one_layer_capture_every_token():
    points = probe_points([probe("a", [2]), probe("b", [2], scope=types_pb.TokenSelector.SCOPE_PROMPT)])
    assert len(points) == 1 and points[0].tokens.scope == Scope.ALL


def test_probes_whose_selectors_differ_only_in_spelling_share_theirs():
    """An unspecified scope is every token: probes that spell it either way pick
    the same tokens, so the point keeps their selector rather than every token."""
    spelled = [types_pb.TokenSelector(scope=types_pb.TokenSelector.SCOPE_ALL, indexes=[0, 5]),
               types_pb.TokenSelector(indexes=[0, 5])]
    infos = [types_pb.ProbeInfo(name=f"p{i}", tensor_type=types_pb.TENSOR_TYPE_MLP_OUT, layers=[4], tokens=tokens)
             for i, tokens in enumerate(spelled)]
    (point,) = probe_points(infos)
    assert (point.tokens.scope, point.tokens.indexes) == (Scope.ALL, (0, 5))


def test_client_points_may_not_use_the_probe_prefix():
    with pytest.raises(InvalidArgument, match='extraction_points\\[0\\] "probe.x": names starting'):
        check_client_point_names([ExtractionPoint("probe.x", "residual_stream", (1,))])


def test_token_gate_releases_only_through_the_settled_position():
    gate = TokenGate(prompt_tokens=10)
    gate.hold(0, [101, 102, 103])  # generated tokens 0..2 at positions 10..12
    assert gate.releasable(through_position=9) == (0, [])
    assert gate.releasable(through_position=10) == (0, [101])
    gate.hold(3, [104])
    assert gate.releasable(through_position=12) == (1, [102, 103])
    assert gate.releasable(through_position=-1) == (3, [])
    gate.close_at(13)  # a verdict at position 13: token 3 is never shown
    assert gate.release_all() == (3, [])


def test_a_closed_gate_never_shows_a_token_generated_after_its_verdict():
    gate = TokenGate(prompt_tokens=10)
    gate.hold(0, [100, 101, 102, 103, 104])  # tokens 0..4 at positions 10..14
    assert gate.releasable(through_position=11) == (0, [100, 101])
    gate.close_at(13)  # a verdict at position 13 (token 3)
    gate.hold(5, [105, 106])  # vLLM's abort has not landed yet
    # Rows up to position 20 acknowledged: token 2 only; nothing at or after the trigger.
    assert gate.releasable(through_position=20) == (2, [102])
    gate.close_at(15)  # a later verdict moves nothing back
    gate.hold(7, [107])
    assert gate.release_all() == (3, [])


def test_token_gate_release_all_at_a_normal_finish():
    gate = TokenGate(prompt_tokens=4)
    gate.hold(0, [1, 2, 3])
    assert gate.releasable(through_position=5) == (0, [1, 2])
    assert gate.release_all() == (2, [3])
