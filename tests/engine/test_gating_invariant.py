"""The gating invariant, proven as an invariant: a model-based test (hypothesis'
stateful testing) drives the engine's real request path through a simulated
world (tests/engine/gating_world.py: pipeline stages, TP ranks, preemption,
request ids reused, capture faults, router
replicas with different probe sets and versions, a network that delays,
blackholes, kills and restarts them, version reloads, canary and shadow
versions promoted and rolled back, forced unloads, router-wide notices,
exceptions in handlers, send-queue overflow, shutdown)
and checks after every step:

I1  every token released to a gated client at position p was computed there by
    every stage, and every fail_closed binding had every row it reads at p
    scored by a router with the version the request was bound to (a stateful
    one by one router session holding all its earlier rows); the one exception
    is the last token of a request that finished cleanly, whose position no
    stage computes;
I2  a fail_closed binding that cannot be scored ends the request: no row stays
    in flight past the router timeout, no live request carries a fail_closed
    failure, and none stays without a replica past the router timeout;
I3  per binding, rows scored + rows counted unprobed = rows fed, and no row is
    counted scored that no router scored with the bound version;
I4  every captured probe row is sent to a router once or counted in
    dropped_records;
I5  a router's message acts only on a request it was given, in its current
    incarnation (stale messages are injected and must change nothing);
I6  every request ends with exactly one GenerateFinished, its last event;
I7  the operator's guards hold: every request of the guarded caller runs gated
    with the guard bound fail_closed (so I1 holds every token it is shown until
    the guard's bound version scored it), both guards reported operator-set,
    unless it tried to weaken one, which is refused naming the field.

`make test` runs a fixed, derandomized budget (GATING_EXAMPLES, default 1000
examples of up to 60 steps, about 2 minutes on 2 cores); a long random run:
    GATING_RANDOM=1 GATING_EXAMPLES=5000 GATING_STEPS=120 \
        python -m pytest tests/engine/test_gating_invariant.py --timeout 0
"""

from __future__ import annotations

import asyncio
import json
import os
from dataclasses import dataclass, field

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from undercurrent.v1 import engine_pb2 as engine_pb
from undercurrent.v1 import router_session_pb2 as session_pb
from undercurrent.v1 import types_pb2 as types_pb

from common.errors import InvalidArgument
from engine_service.link import RouterLink, RouterLinkConfig
from engine_service.link.events import Abort, Scores, Unscored
from engine_service.link.send_queue import QueuedBatch
from engine_service.request import guards as operator_guards
from engine_service.request.probe_points import binding_points
from engine_service.request.run import RequestRun
from engine_service.service.runtime import EngineRuntime, EngineSettings
from router_service.registry import ProbeRegistry
from tests.engine.gating_world import MODEL, STAGES, SimCapture, SimVllm, World, catalog_probes, selects
from tools.router_double import abort_reply

TIMEOUT = 3.0  # the router timeout, on the world's clock
REPLICAS = {
    "r1:1": ["guard", "early", "late", "observer"],
    "r2:1": ["guard", "early", "late"],  # no observer: it refuses that binding
    "r3:1": ["guard", "early", "late", "observer"],
}
PROBES = ("guard", "early", "late", "observer")
REQUEST_IDS = ("a", "b", "c", "d", "e")
CANARY, SHADOW = types_pb.PROBE_ROLE_CANARY, types_pb.PROBE_ROLE_SHADOW
CLOSED, OPEN = types_pb.FAILURE_POLICY_FAIL_CLOSED, types_pb.FAILURE_POLICY_FAIL_OPEN
SUCCESS = (types_pb.FINISH_REASON_STOP, types_pb.FINISH_REASON_LENGTH)
# The operator guards every request of the caller OPERATOR with the stateful
# guard (fail_closed, gating) and "early" (fail_open); other callers have none.
OPERATOR = "ops"
GUARDS = operator_guards.parse_policy(json.dumps({"callers": {OPERATOR: [
    {"probe": "guard", "failure_policy": "fail_closed", "action": "abort", "gate_tokens": True},
    {"probe": "early", "failure_policy": "fail_open"}]}}), "guards")
REQUEST = st.fixed_dictionaries(dict(
    rid=st.sampled_from(REQUEST_IDS), caller=st.sampled_from(("", OPERATOR)),
    bindings=st.lists(st.tuples(st.sampled_from(PROBES), st.sampled_from((CLOSED, OPEN))),
                      max_size=3, unique_by=lambda b: b[0]),
    gate=st.sampled_from((None, False, True)), max_tokens=st.integers(1, 8), prompt_tokens=st.integers(1, 3)))



def rolling_out(registry: ProbeRegistry, name: str) -> bool:
    """Whether the probe has a canary or shadow beside its serving version."""
    return any(c.probe.name == name for c in registry.candidates())


@dataclass
class Client:
    """One Generate call as its client saw it."""

    message: engine_pb.GenerateRequest
    caller: str
    responses: list[engine_pb.GenerateResponse] = field(default_factory=list)
    error: Exception | None = None
    run: RequestRun | None = None  # the engine's run, once started
    task: asyncio.Task | None = None
    checked: bool = False  # its finish was checked (when first seen)

    @property
    def finished(self) -> list[engine_pb.GenerateFinished]:
        return [r.finished for r in self.responses if r.HasField("finished")]

    @property
    def tokens(self) -> list[int]:
        return [t for r in self.responses if r.HasField("tokens") for t in r.tokens.token_ids]


class GatingMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self.loop)
        self.world = World(REPLICAS, seed=0)
        self.capture = SimCapture(self.world)
        self.llm = SimVllm(self.world, self.capture)
        # Runs settle when the world answers, not on the wall clock: the link's
        # router timeout is on the world's clock.
        self.runtime = EngineRuntime(self.llm, self.capture, settings=EngineSettings(router_timeout_s=1e9),
                                     guards=GUARDS)
        self.world.runtime = self.runtime
        config = RouterLinkConfig(targets=",".join(REPLICAS), engine_id="sim", router_timeout_s=TIMEOUT,
                                  queue_max_batches=6)
        self.link = RouterLink(config, MODEL, self._on_event, registry=self.runtime.metrics.registry,
                               clock=lambda: self.world.now, session_factory=self.world.session_factory)
        self.runtime.link = self.link
        self.link._set_members(list(REPLICAS))
        for replica in self.world.sessions.values():
            replica.connect()
        self.clients: list[Client] = []
        self.exploding: set[str] = set()  # run keys whose next link event makes the handler raise
        self.stale_reasons = "injected stale verdict"
        self.closed = False

    # -- plumbing ---------------------------------------------------------------

    def _on_event(self, event) -> None:
        """The link's events reach the runtime's real handler; I5 is checked on the way."""
        if isinstance(event, (Scores, Abort)):
            run = self.runtime.runs.get(event.request_id)
            session = self.world.routers[event.replica].session
            assert (session, event.incarnation) in self.world.truth.started[event.request_id], (
                f"I5: {type(event).__name__} for {event.request_id} from {event.replica}, which was not given it")
            assert run is None or run.incarnation == event.incarnation, f"I5: {event} reached another run"
        if event.request_id in self.exploding and isinstance(event, (Unscored, Abort)):
            self.exploding.discard(event.request_id)
            raise RuntimeError("injected handler fault")
        self.runtime._on_link_event(event)

    def run_loop(self, action=None) -> None:
        """Runs `action` (a coroutine, or a plain function: the engine's callbacks
        expect to run on its event loop) on the loop, then lets every task it woke run."""
        async def settle():
            if asyncio.iscoroutine(action):
                await action
            elif action is not None:
                action()
            for _ in range(30):
                await asyncio.sleep(0)
        self.loop.run_until_complete(settle())

    def live_keys(self) -> list[str]:
        return sorted(k for k, r in self.llm.requests.items() if not r.finished)

    # -- the engine's clients ---------------------------------------------------------

    @precondition(lambda self: not self.closed)
    @rule(data=st.data(), stages=st.lists(st.integers(0, STAGES - 1), max_size=4), emit=st.booleans(),
          network=st.booleans())
    def engine_step(self, data, stages, emit, network):
        """A step of the whole engine: some stages compute for every running
        request, outputs reach the engine, a drain, and (if the network moves) every
        replica's messages and replies cross."""
        def engine():
            for key in self.live_keys():
                for stage in stages:
                    self.llm.compute(key, stage)
                if emit:
                    self.llm.emit(key)
        self.run_loop(engine)
        self.run_loop(self.runtime._drain_once())
        if network:
            def network_moves():
                for replica in self.world.sessions.values():
                    replica.transmit(100)
                    replica.deliver(100)
            self.run_loop(network_moves)

    @initialize(requests=st.lists(REQUEST, min_size=1, max_size=4, unique_by=lambda r: (r["caller"], r["rid"])))
    def first_requests(self, requests):
        """Every example starts with requests running, so its faults meet traffic."""
        for request in requests:
            self.start_request(**request)

    @precondition(lambda self: not self.closed)
    @rule(request=REQUEST)
    def another_request(self, request):
        self.start_request(**request)

    def start_request(self, rid, caller, bindings, gate, max_tokens, prompt_tokens):
        message = engine_pb.GenerateRequest(request_id=rid, token_ids=engine_pb.TokenIds(ids=list(range(1, prompt_tokens + 1))),
                                     sampling=engine_pb.SamplingParams(max_tokens=max_tokens), gate_tokens=gate)
        for probe, policy in bindings:
            message.probes.add(probe=probe, failure_policy=policy)
        client = Client(message, caller)

        async def consume():
            try:
                async for response in self.runtime.generate(message, caller=caller):
                    if response.HasField("started"):
                        client.run = self.runtime._by_client[(caller, rid)]
                    client.responses.append(response)
            except Exception as err:  # refused: NotFound, FailedPrecondition, AlreadyExists, InvalidArgument
                client.error = err

        client.task = self.loop.create_task(consume())
        self.clients.append(client)
        self.run_loop()

    @precondition(lambda self: not self.closed)
    @rule(data=st.data())
    def client_aborts(self, data):
        running = [c for c in self.clients if c.run is not None and not c.finished]
        if running:
            client = data.draw(st.sampled_from(running))
            self.run_loop(self.runtime.abort(client.message.request_id, caller=client.caller))

    # -- vLLM and capture ---------------------------------------------------------------

    @rule(data=st.data(), stage=st.integers(0, STAGES - 1))
    def compute(self, data, stage):
        keys = self.live_keys()
        if keys:
            key = data.draw(st.sampled_from(keys))
            self.run_loop(lambda: self.llm.compute(key, stage))

    @rule(data=st.data())
    def emit(self, data):
        keys = self.live_keys()
        if keys:
            key = data.draw(st.sampled_from(keys))
            self.run_loop(lambda: self.llm.emit(key))

    @rule(data=st.data())
    def preempt(self, data):
        keys = self.live_keys()
        if keys:
            self.llm.preempt(data.draw(st.sampled_from(keys)))

    @rule()
    def drain(self):
        self.run_loop(self.runtime._drain_once())

    @rule(data=st.data(), kind=st.sampled_from(("lose", "drop", "nan")), ahead=st.integers(0, 3))
    def capture_fault(self, data, kind, ahead):
        keys = self.live_keys()
        if keys:
            key = data.draw(st.sampled_from(keys))
            request = self.llm.requests[key]
            self.capture.faults[(key, request.computed[0] + ahead)] = kind

    # -- the network and the routers -------------------------------------------------

    @rule(replica=st.sampled_from(sorted(REPLICAS)), count=st.integers(1, 6))
    def transmit(self, replica, count):
        self.run_loop(lambda: self.world.sessions[replica].transmit(count))

    @rule(replica=st.sampled_from(sorted(REPLICAS)), count=st.integers(1, 8))
    def deliver(self, replica, count):
        self.run_loop(lambda: self.world.sessions[replica].deliver(count))

    @rule(seconds=st.sampled_from((0.5, 1.0, 2.0, TIMEOUT + 0.1)))
    def time_passes(self, seconds):
        self.world.now += seconds
        self.run_loop(lambda: self.link._check_timeouts(self.world.now, TIMEOUT))
        self.check_nothing_waits_past_the_timeout()

    @rule(replica=st.sampled_from(sorted(REPLICAS)))
    def kill(self, replica):
        self.run_loop(lambda: self.world.sessions[replica].lose("killed"))

    @rule(replica=st.sampled_from(sorted(REPLICAS)))
    def restart(self, replica):
        session = self.world.sessions[replica]
        if not session.up and not self.closed:
            self.run_loop(session.connect)

    @rule(replica=st.sampled_from(sorted(REPLICAS)))
    def router_drains(self, replica):
        self.world.routers[replica].drain()

    @rule(replica=st.sampled_from(sorted(REPLICAS)), on=st.booleans())
    def blackhole(self, replica, on):
        self.world.routers[replica].set_blackholed(on)

    @rule(replica=st.sampled_from(sorted(REPLICAS)), version=st.sampled_from(("guard", "guard@v2")))
    def reload_guard(self, replica, version):
        registry = self.world.routers[replica].registry
        if not rolling_out(registry, "guard"):  # refused meanwhile: promote or roll back first
            registry.load(catalog_probes()[version], replace=True)

    @rule(replica=st.sampled_from(sorted(REPLICAS)), probe=st.sampled_from(PROBES))
    def force_unload(self, replica, probe):
        registry = self.world.routers[replica].registry
        if any(p.name == probe for p in registry.probes()) and not rolling_out(registry, probe):
            registry.unload(probe, force=True)

    @rule(replica=st.sampled_from(sorted(REPLICAS)), role=st.sampled_from((CANARY, SHADOW)),
          share=st.sampled_from((0.5, 1.0)))
    def guard_rollout(self, replica, role, share):
        """The guard's other version beside its serving one on one replica: a canary
        (engines pin it for the requests its hash takes) or a shadow."""
        registry = self.world.routers[replica].registry
        serving = next((p for p in registry.probes() if p.name == "guard"), None)
        if serving is not None and not serving.unloading:
            other = "guard@v2" if serving.manifest.version == "1" else "guard"
            registry.load(catalog_probes()[other], replace=True, role=role, share=share if role == CANARY else 0.0)

    @rule(replica=st.sampled_from(sorted(REPLICAS)), promote=st.booleans())
    def guard_rollout_ends(self, replica, promote):
        registry = self.world.routers[replica].registry
        if rolling_out(registry, "guard"):
            registry.promote("guard") if promote else registry.roll_back("guard")

    @rule(replica=st.sampled_from(sorted(REPLICAS)))
    def incompatible_probe_loaded(self, replica):
        """A router-wide notice (request_id and step empty) on every session of the replica."""
        self.world.routers[replica].registry.load(catalog_probes()["wide"], replace=True)

    @rule(data=st.data(), replica=st.sampled_from(sorted(REPLICAS)))
    def stale_verdict(self, data, replica):
        """A verdict about a run this replica never had, or an earlier incarnation."""
        keys = [c.run.key for c in self.clients if c.run is not None]
        if keys:
            key = data.draw(st.sampled_from(keys))
            incarnation = int(key.rsplit("#", 1)[1]) + data.draw(st.sampled_from((-1, 1)))
            self.world.routers[replica].outbox.append(
                abort_reply(key, incarnation, token_position=0, reason=self.stale_reasons))

    @rule(data=st.data(), where=st.sampled_from(("link", "run")))
    def handler_fails(self, data, where):
        """The next verdict or failure the link hands a run makes the handler raise:
        the link's callback itself, or the run's own handling of it."""
        keys = sorted(self.runtime.runs)
        if not keys:
            return
        key = data.draw(st.sampled_from(keys))
        if where == "link":
            self.exploding.add(key)
            return
        run = self.runtime.runs[key]
        handle = run.link_event

        def failing(event):
            if isinstance(event, (Unscored, Abort)):
                run.link_event = handle
                raise RuntimeError("injected fault in the run")
            return handle(event)
        run.link_event = failing

    @precondition(lambda self: not self.closed)
    @rule(now=st.integers(0, 9))
    def engine_shuts_down(self, now):
        """The engine closes while requests run (once in ten draws): every client
        still gets its finish."""
        if now == 0:
            self.closed = True
            self.run_loop(self.close_while_the_world_runs())

    async def close_while_the_world_runs(self) -> None:
        """The engine's close, while vLLM goes on (its aborts land), the routers
        answer and time passes: the close waits for every run to finish."""
        closing = asyncio.ensure_future(self.runtime.close())
        while not closing.done():
            self.world_moves()
            await self.runtime._drain_once()
            self.world_moves()
            self.world.now += TIMEOUT / 2
            self.link._check_timeouts(self.world.now, TIMEOUT)
            for _ in range(10):
                await asyncio.sleep(0)
        await closing

    def world_moves(self) -> None:
        """Every stage computes, vLLM's outputs reach the engine, every message crosses."""
        for key in self.live_keys():
            for stage in range(STAGES):
                self.llm.compute(key, stage)
            self.llm.emit(key)
        for replica in self.world.sessions.values():
            replica.transmit(1000)
            replica.deliver(1000)

    # -- the invariants ------------------------------------------------------------------

    @invariant()
    def gated_tokens_were_scored_by_every_fail_closed_binding(self):
        for client in self.clients:
            run = client.run
            if run is None or run.gate is None:
                continue
            finished = client.finished
            clean = bool(finished) and finished[0].finish_reason in SUCCESS
            request = self.llm.requests.get(run.key)
            last = run.prompt_tokens + len(client.tokens) - 1
            for index in range(len(client.tokens)):
                position = run.prompt_tokens + index
                if clean and position == last:
                    continue  # no stage computes the last token of a finished request
                assert request is not None and request.reached[STAGES - 1] > position, (
                    f"I1: {run.key} showed token {index} (position {position}) no stage-{STAGES - 1} computed")
                for binding, info in zip(run.bindings, run.infos):
                    if binding.failure_policy == CLOSED:
                        self.assert_scored(run, binding, info, position)

    def assert_scored(self, run: RequestRun, binding: session_pb.SessionBinding, info: types_pb.ProbeInfo, position: int) -> None:
        scored = self.world.truth.scored[(run.key, binding.probe, binding.digest)]
        if not selects(info.tokens, position, run.prompt_tokens):
            return
        for point in binding_points(info):
            assert any(s.point == point and s.position == position for s in scored), (
                f"I1: {run.key} showed position {position}, whose row {point} fail_closed probe "
                f"{binding.probe} ({binding.digest}) never scored; scored: "
                f"{sorted((s.point, s.position) for s in scored)}")
        if info.stateful:
            sessions = {s.session for s in scored if s.position <= position}
            assert len(sessions) == 1, (
                f"I1: stateful probe {binding.probe} scored {run.key} up to {position} in sessions {sessions}")

    @invariant()
    def operator_guards_hold(self):
        for client in self.clients:
            if client.caller != OPERATOR:
                continue
            weakened = self.weakened_field(client.message)
            if weakened is not None:
                assert client.run is None and isinstance(client.error, InvalidArgument), (
                    f"I7: a request weakening {weakened} was not refused: {client.error!r}")
                assert str(client.error).startswith(f"{weakened}: "), f"I7: the refusal names another field: {client.error}"
            elif client.run is not None:
                bound = {b.probe: b.failure_policy for b in client.run.bindings}
                assert client.run.gate is not None and bound.get("guard") == CLOSED, (
                    f"I7: {client.run.key} of the guarded caller runs {'gated' if client.run.gate else 'ungated'} "
                    f"with bindings {bound}")
                assert client.run.operator_probes == {"guard", "early"}, client.run.operator_probes

    @staticmethod
    def weakened_field(message: engine_pb.GenerateRequest) -> str | None:
        """The field by which a request of the guarded caller weakens a guard, if it does."""
        for i, binding in enumerate(message.probes):
            if binding.probe == "guard" and binding.failure_policy == OPEN:
                return f"probes[{i}].failure_policy"
        return "gate_tokens" if message.HasField("gate_tokens") and not message.gate_tokens else None

    def check_nothing_waits_past_the_timeout(self) -> None:
        """I2, right after the link's watchdog ran."""
        now = self.world.now
        for key, request in self.link._requests.items():
            oldest = request.ledger.oldest_in_flight()
            assert oldest is None or now - oldest < TIMEOUT, f"I2: {key} has rows in flight since {oldest} at {now}"
            run = self.runtime.runs.get(key)
            since = request.unavailable_since
            if run is not None and not run.ended and run.ledger.has_fail_closed() and since is not None:
                assert now - since < TIMEOUT, f"I2: fail_closed {key} without a replica since {since} at {now}"

    @invariant()
    def a_fail_closed_failure_ends_the_request(self):
        for run in self.runtime.runs.values():
            if run.ledger is not None and run.ledger.fail_closed_failure() is not None:
                assert run.ended, f"I2: {run.key} goes on after {run.ledger.fail_closed_failure()}"

    @invariant()
    def finishes_are_one_last_and_honest(self):
        for client in self.clients:
            finished = client.finished
            assert len(finished) <= 1, f"I6: {len(finished)} finishes"
            if finished:
                assert client.responses[-1].HasField("finished"), "I6: an event after the finish"
                if not client.checked:
                    client.checked = True
                    self.check_finish(client, finished[0])

    def check_finish(self, client: Client, finished: engine_pb.GenerateFinished) -> None:
        run = client.run
        verdict = finished.verdict
        if finished.finish_reason == types_pb.FINISH_REASON_PROBE_ABORT:
            assert verdict.reason != self.stale_reasons, f"I5: {run.key} ended by a stale verdict"
        assert finished.gated == (run.gate is not None), f"{run.key}: gated {finished.gated}"
        guarded = {"guard", "early"} if client.caller == OPERATOR else set()
        assert {b.probe for b in finished.bindings if b.operator_set} == guarded, (
            f"I7: {run.key} reports operator-set {[b.probe for b in finished.bindings if b.operator_set]}")
        if run.ledger is None:
            return
        below = run.prompt_tokens + run.generated
        for binding, info, report in zip(run.bindings, run.infos, finished.bindings):
            fed = self.rows_fed(run, info, below)
            assert report.rows_scored + report.rows_unprobed == fed, (
                f"I3: {run.key} {binding.probe}: {report.rows_scored} scored + {report.rows_unprobed} unprobed "
                f"!= {fed} fed")
            truly = {(s.point, s.position) for s in self.world.truth.scored[(run.key, binding.probe, binding.digest)]
                     if s.position < below}
            assert report.rows_scored <= len(truly), (
                f"I3: {run.key} {binding.probe} counts {report.rows_scored} rows scored, routers scored {len(truly)}")
        sent = self.world.truth.sent[run.key]
        queued = sum(message.num_rows for replica in self.world.sessions.values() for item in replica.queue.items
                     if isinstance(item, QueuedBatch) for request, message in item.entries
                     if request.request_id == run.key)
        # Captured, each (point, position) once however often it was recomputed: rows a
        # drain handed the engine while the run was live, rows a worker reported
        # dropping, and rows made where the engine knows the model computed that it
        # never got (lost without a word, or still in capture when it ended).
        known = self.known_computed(run)
        captured = len(set(self.capture.delivered[run.key]) | set(self.capture.reported[run.key])
                       | {row for row in self.capture.made[run.key] if row[1] < known})
        assert captured == sent + queued + run.ledger.dropped_records, (
            f"I4: {run.key} captured {captured} probe rows: sent {sent}, still queued {queued}, "
            f"dropped {run.ledger.dropped_records}")

    @staticmethod
    def known_computed(run: RequestRun) -> int:
        """Every stage computed the positions below this, as the engine can know:
        each token the engine received was sampled from the position before it."""
        return run.prompt_tokens + run.generated - 1 if run.generated else 0

    def rows_fed(self, run: RequestRun, info: types_pb.ProbeInfo, below: int) -> int:
        """Rows the binding reads that the model computed where the engine knows it
        did, and elsewhere below `below` the rows that reached the engine."""
        points = set(binding_points(info))
        known = self.known_computed(run)

        def reads(point: str, position: int) -> bool:
            return point in points and selects(info.tokens, position, run.prompt_tokens)

        return (sum(1 for point, position in self.capture.made[run.key] if reads(point, position) and position < known)
                + sum(1 for point, position in self.capture.delivered[run.key]
                      if reads(point, position) and known <= position < below))

    # -- the end ---------------------------------------------------------------------

    def teardown(self):
        """Everything runs to its end: every request must finish (liveness), and
        the engine's shutdown still gives every client its finish."""
        try:
            for _ in range(0 if self.closed else 40):
                if all(c.task.done() for c in self.clients):
                    break
                self.run_loop(self.world_moves)
                self.run_loop(self.runtime._drain_once())
                self.run_loop(self.world_moves)
                self.world.now += TIMEOUT / 2
                self.run_loop(lambda: self.link._check_timeouts(self.world.now, TIMEOUT))
                self.check_nothing_waits_past_the_timeout()
            stuck = [c.message.request_id for c in self.clients if not c.task.done()]
            assert not stuck, f"liveness: requests {stuck} never finished"
            self.gated_tokens_were_scored_by_every_fail_closed_binding()
            self.finishes_are_one_last_and_honest()
            self.operator_guards_hold()
            for client in self.clients:
                assert client.error is not None or len(client.finished) == 1, "I6: a request without its finish"
        finally:
            if not self.closed:
                self.closed = True
                self.run_loop(self.close_while_the_world_runs())
            pending = asyncio.all_tasks(self.loop)
            for task in pending:
                task.cancel()
            self.loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            self.loop.close()


EXAMPLES = int(os.environ.get("GATING_EXAMPLES", "1000"))
STEPS = int(os.environ.get("GATING_STEPS", "60"))
RANDOM = os.environ.get("GATING_RANDOM", "") not in ("", "0")
GatingMachine.TestCase.settings = settings(
    max_examples=EXAMPLES, stateful_step_count=STEPS, deadline=None, derandomize=not RANDOM, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestGatingInvariant = GatingMachine.TestCase
