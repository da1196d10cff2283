"""The engine runtime's safety logic: a fake vLLM and capture (tests/engine/fakes.py),
a real RouterLink and a real gRPC router double on loopback.

Each test injects one fault and asserts the finish reason, the tokens the
client saw, and the counts in GenerateFinished.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass

import pytest
import vllm.sampling_params  # noqa: F401  (the runtime imports it per request; pay once, not mid-test)
from undercurrent.v1 import engine_pb2 as engine_pb
from undercurrent.v1 import types_pb2 as types_pb

from common.errors import InvalidArgument, Unavailable
from engine_service.request.guards import GuardsFile
from engine_service.link import RouterLinkConfig
from engine_service.service.runtime import EngineRuntime, EngineSettings
from tests.engine_link.helpers import FAST, until
from tools.router_double import PROBE, RouterDouble, abort_reply, of_client as of

from .fakes import FakeCapture, FakeEngine

CLOSED, OPEN = types_pb.FAILURE_POLICY_FAIL_CLOSED, types_pb.FAILURE_POLICY_FAIL_OPEN
PROMPT = [1, 2, 3, 4]


@dataclass
class Stack:
    router: RouterDouble
    capture: FakeCapture
    llm: FakeEngine
    runtime: EngineRuntime
    step_s: float
    stepper: asyncio.Task | None = None

    def start_stepping(self) -> None:
        self.stepper = asyncio.create_task(self.llm.run_steps(self.step_s))


@pytest.fixture
async def stack():
    made: list[Stack] = []

    async def make(
        router_timeout_s: float = 0.5,
        step_s: float = 0.005,
        stepping: bool = True,
        score=None,
        hidden: int = 8,
        abort_lag_steps: int = 0,
        **link,
    ) -> Stack:
        router = await RouterDouble("r", threshold=100.0).start()
        capture = FakeCapture(score or (lambda request_id, position: 0.0), hidden=hidden)
        llm = FakeEngine(capture, abort_lag_steps=abort_lag_steps)
        config = RouterLinkConfig(
            targets=router.address,
            engine_id="engine-test",
            **{**FAST, "router_timeout_s": router_timeout_s, **link},
        )
        runtime = EngineRuntime(
            llm, capture, link_config=config, settings=EngineSettings(router_timeout_s=router_timeout_s)
        )
        await runtime.start()
        await runtime.link.wait_ready(timeout=10)
        made.append(Stack(router, capture, llm, runtime, step_s))
        if stepping:
            made[-1].start_stepping()
        return made[-1]

    yield make
    for s in made:
        # Every request, however it ended, left no state behind.
        await until(lambda: not s.runtime.active and s.runtime.link.live_requests() == 0, timeout=5)
        if s.stepper:
            s.stepper.cancel()
        await s.runtime.close()
        await s.router.kill()


def request(rid: str, policy: int | None = CLOSED, max_tokens: int = 40, gate: bool | None = True, **kw):
    message = engine_pb.GenerateRequest(
        request_id=rid,
        token_ids=engine_pb.TokenIds(ids=PROMPT),
        sampling=engine_pb.SamplingParams(max_tokens=max_tokens),
        gate_tokens=gate,
        **kw,
    )
    if policy is not None:
        message.probes.add(probe=PROBE.name, failure_policy=policy)
    return message


def ran(keys, client_id: str) -> bool:
    """Whether a run of the client's request id is among these run keys."""
    return any(k.rsplit("#", 1)[0] == client_id for k in keys)


class Outcome:
    def __init__(self) -> None:
        self.responses: list[engine_pb.GenerateResponse] = []
        self.changed = asyncio.Event()

    @property
    def tokens(self) -> list[int]:
        chunks = [r.tokens for r in self.responses if r.HasField("tokens")]
        assert [c.first_index for c in chunks] == [
            sum(len(c.token_ids) for c in chunks[:i]) for i in range(len(chunks))
        ], "token chunks are contiguous"
        return [t for c in chunks for t in c.token_ids]

    @property
    def scores(self) -> list[types_pb.ProbeScores]:
        return [r.probe_event.scores for r in self.responses if r.HasField("probe_event")]

    @property
    def scored_positions(self) -> set[int]:
        return {p for s in self.scores for p in s.token_positions}

    @property
    def finished(self) -> engine_pb.GenerateFinished:
        assert self.responses[-1].HasField("finished")
        return self.responses[-1].finished


async def run(runtime: EngineRuntime, message: engine_pb.GenerateRequest, outcome: Outcome | None = None) -> Outcome:
    outcome = outcome or Outcome()
    async for response in runtime.generate(message):
        outcome.responses.append(response)
        outcome.changed.set()
    return outcome


async def wait_for(outcome: Outcome, predicate, timeout: float = 10.0) -> None:
    async with asyncio.timeout(timeout):
        while not predicate():
            outcome.changed.clear()
            await outcome.changed.wait()


# -- item 1: a router outage never releases gated tokens --------------------------


async def test_a_silent_router_ends_fail_closed_within_the_timeout_and_shows_no_unscored_token(stack):
    s = await stack(router_timeout_s=0.4, heartbeat_timeout_s=5.0)
    progress = Outcome()
    running = asyncio.create_task(run(s.runtime, request("closed", max_tokens=2000), progress))
    await wait_for(progress, lambda: len(progress.tokens) >= 5)
    s.router.silent = True  # the stream stays open; nothing comes back
    silenced = time.monotonic()
    outcome = await running
    ended = time.monotonic() - silenced
    finished = outcome.finished
    assert finished.finish_reason == types_pb.FINISH_REASON_ROUTER_UNAVAILABLE, finished
    assert ended < 0.4 + 1.0, ended  # the router timeout, far before the 5 s heartbeat timeout
    assert s.runtime.routers_up() == 1  # the replica itself is not (yet) down
    assert "acknowledged no rows for 0.4 s" in finished.message and "(fail_closed)" in finished.message
    verdict = finished.verdict
    # Only tokens whose rows were all acknowledged were shown: up to the first unsettled position.
    assert len(outcome.tokens) == verdict.token_position - len(PROMPT)
    assert max(outcome.scored_positions) >= verdict.token_position - 1
    assert finished.generated_tokens > len(outcome.tokens) and finished.unprobed_tokens > 0
    assert ran(s.llm.aborted, "closed")


async def test_a_silent_router_lets_fail_open_finish_and_counts_what_it_missed(stack, caplog):
    s = await stack(router_timeout_s=0.3, heartbeat_timeout_s=5.0, step_s=0.01)
    progress = Outcome()
    running = asyncio.create_task(run(s.runtime, request("open", OPEN, max_tokens=80), progress))
    await wait_for(progress, lambda: len(progress.tokens) >= 5)
    shown = len(progress.tokens)
    s.router.silent = True
    # Tokens keep coming while the router is silent: each as its rows expire.
    await wait_for(progress, lambda: len(progress.tokens) >= shown + 10)
    assert not progress.responses[-1].HasField("finished")
    outcome = await running
    finished = outcome.finished
    assert finished.finish_reason == types_pb.FINISH_REASON_LENGTH, finished
    assert len(outcome.tokens) == 80
    captured = of(s.capture.captured, "open")
    missed = len(captured - outcome.scored_positions)
    assert missed > 10
    # A position whose scores arrived but whose ack was cut off counts as unprobed too.
    assert missed <= finished.unprobed_tokens <= missed + 1
    assert "tokens unprobed (fail_open)" in finished.message
    # Said once at WARNING, not at every step whose rows expire.
    said = [r for r in caplog.records
            if "continues with unprobed rows (fail_open)" in r.getMessage() and "open#" in r.getMessage() and r.levelno == logging.WARNING]
    assert len(said) == 1


# -- item 3: router-side failures are never a clean fail_closed finish --------------


async def test_a_batch_level_router_error_ends_fail_closed_and_counts_for_fail_open(stack):
    s = await stack(stepping=False)
    s.router.fail_steps = {4}
    closed = asyncio.create_task(run(s.runtime, request("closed", max_tokens=30)))
    opened = asyncio.create_task(run(s.runtime, request("open", OPEN, max_tokens=30)))
    await until(lambda: len(s.llm.running) == 2)
    s.start_stepping()
    closed, opened = await closed, await opened
    assert closed.finished.finish_reason == types_pb.FINISH_REASON_ROUTER_UNAVAILABLE
    assert "INTERNAL: scoring the batch failed" in closed.finished.message
    [failed] = [b for b in s.router.batches if b.step == 4]
    positions = {
        int(p)
        for block in failed.blocks
        for r, p in zip(block.request_index, block.token_positions)
        if failed.request_ids[r].rsplit("#", 1)[0] == "closed"
    }
    assert positions and len(closed.tokens) == min(positions) - len(PROMPT)
    assert opened.finished.finish_reason == types_pb.FINISH_REASON_LENGTH
    assert len(opened.tokens) == 30
    assert opened.finished.unprobed_tokens == len(positions)  # the same step's rows


async def test_rejected_rows_end_fail_closed_before_any_token_is_shown(stack):
    s = await stack()
    s.router.bad_rows = {"closed", "open"}
    closed = await run(s.runtime, request("closed", max_tokens=30))
    assert closed.finished.finish_reason == types_pb.FINISH_REASON_ROUTER_UNAVAILABLE
    assert "INVALID_ARGUMENT: rows: NaN or Inf" in closed.finished.message
    assert closed.tokens == [] and closed.finished.verdict.token_position == 0
    opened = await run(s.runtime, request("open", OPEN, max_tokens=30))
    assert opened.finished.finish_reason == types_pb.FINISH_REASON_LENGTH
    assert opened.finished.unprobed_tokens == len(of(s.capture.captured, "open")) == len(PROMPT) + 29


async def test_a_refused_request_start_ends_fail_closed(stack):
    s = await stack()
    s.router.refuse = {"closed", "open"}
    closed = await run(s.runtime, request("closed", max_tokens=30))
    assert closed.finished.finish_reason == types_pb.FINISH_REASON_ROUTER_UNAVAILABLE
    assert "RESOURCE_EXHAUSTED: too many requests" in closed.finished.message
    assert closed.tokens == []
    opened = await run(s.runtime, request("open", OPEN, max_tokens=30))
    assert opened.finished.finish_reason == types_pb.FINISH_REASON_LENGTH
    assert opened.finished.unprobed_tokens == len(of(s.capture.captured, "open"))


async def test_a_killed_router_ends_fail_closed_at_its_first_unacknowledged_position(stack):
    s = await stack(router_timeout_s=5.0)
    progress = Outcome()
    running = asyncio.create_task(run(s.runtime, request("closed", max_tokens=2000), progress))
    await wait_for(progress, lambda: len(progress.tokens) >= 5)
    await s.router.kill()
    outcome = await running
    finished = outcome.finished
    assert finished.finish_reason == types_pb.FINISH_REASON_ROUTER_UNAVAILABLE, finished
    assert len(outcome.tokens) == finished.verdict.token_position - len(PROMPT)
    assert finished.generated_tokens > len(outcome.tokens)


async def test_send_queue_overflow_ends_fail_closed_and_counts_for_fail_open(stack):
    # Rows of 256 KiB and a router that stops reading: flow control stalls the
    # writer, the 2-batch queue overflows, drop_oldest evicts.
    s = await stack(router_timeout_s=5.0, hidden=65536, queue_max_batches=2, step_s=0.01)
    s.router.reading.clear()
    closed = await asyncio.wait_for(run(s.runtime, request("closed", max_tokens=400)), 30)
    assert closed.finished.finish_reason == types_pb.FINISH_REASON_ROUTER_UNAVAILABLE
    assert "rows dropped before reaching a router (drop_oldest)" in closed.finished.message
    assert closed.finished.dropped_records > 0
    assert len(closed.tokens) == max(0, closed.finished.verdict.token_position - len(PROMPT))
    opened = await asyncio.wait_for(run(s.runtime, request("open", OPEN, max_tokens=60)), 30)
    assert opened.finished.finish_reason == types_pb.FINISH_REASON_LENGTH and len(opened.tokens) == 60
    finished = opened.finished
    assert finished.dropped_records > 0 and finished.unprobed_tokens >= finished.dropped_records
    s.router.reading.set()


# -- item 6: events of another run or another replica are ignored ---------------------


async def test_a_late_verdict_of_an_earlier_run_does_not_touch_a_new_run_of_the_same_id(stack):
    s = await stack(step_s=0.01)
    first = await run(s.runtime, request("same", max_tokens=5))
    assert first.finished.finish_reason == types_pb.FINISH_REASON_LENGTH
    [old_key] = s.router.incarnations
    old = s.router.incarnations[old_key]
    # Scores reach the client under its own id, not the run's key, with the router named.
    assert {(sc.request_id, sc.router) for sc in first.scores} == {("same", s.router.address)}

    progress = Outcome()
    second = asyncio.create_task(run(s.runtime, request("same", max_tokens=60), progress))
    await until(lambda: len(s.router.incarnations) == 2)
    [key] = set(s.router.incarnations) - {old_key}  # the new run's key differs from the old one's
    s.router.push(abort_reply(old_key, old, reason="late"))
    s.router.push(abort_reply(key, old, reason="late"))
    await wait_for(progress, lambda: len(progress.tokens) >= 10)  # it went on
    ignored = s.runtime.metrics.registry.get_sample_value
    assert ignored("undercurrent_router_link_ignored_messages_total", {"reason": "unknown_request"}) == 1
    assert ignored("undercurrent_router_link_ignored_messages_total", {"reason": "stale_incarnation"}) == 1
    current = s.router.incarnations[key]
    s.router.push(abort_reply(key, current, reason="now", token_position=50))
    outcome = await second
    assert outcome.finished.finish_reason == types_pb.FINISH_REASON_PROBE_ABORT
    assert outcome.finished.verdict.reason == "now"
    assert outcome.finished.verdict.request_id == "same"
    assert len(outcome.tokens) <= 50 - len(PROMPT)


async def test_a_verdict_and_its_ack_in_one_message_show_no_gated_token_at_or_after_the_trigger(stack):
    """The router double sends a step's scores, its abort and its ack as one
    SessionReplies: the ack is handled right after the abort, before any task
    runs, and must not release the triggering token."""
    trigger = len(PROMPT) + 6
    s = await stack(step_s=0.01, score=lambda request_id, position: 500.0 if position == trigger else 0.0)
    outcome = await run(s.runtime, request("gated", max_tokens=40))
    assert outcome.finished.finish_reason == types_pb.FINISH_REASON_PROBE_ABORT
    assert outcome.finished.verdict.token_position == trigger
    assert len(outcome.tokens) == trigger - len(PROMPT)  # tokens 0..5: every one before the trigger


async def test_tokens_generated_after_a_verdict_before_the_abort_lands_are_never_shown(stack):
    """vLLM goes on generating until its abort lands; those tokens reach the
    runtime after the verdict closed the gate, and acks of their rows (or of
    the trigger's) arrive too. None of them is shown, and none takes the place
    of a token the verdict withheld."""
    trigger = len(PROMPT) + 6
    s = await stack(step_s=0.01, abort_lag_steps=4,
                    score=lambda request_id, position: 500.0 if position == trigger else 0.0)
    outcome = await run(s.runtime, request("gated-lag", max_tokens=40))
    assert outcome.finished.finish_reason == types_pb.FINISH_REASON_PROBE_ABORT
    assert outcome.finished.verdict.token_position == trigger
    assert outcome.finished.generated_tokens >= trigger - len(PROMPT) + 4  # tokens past the trigger were made
    assert outcome.tokens == [100 + g for g in range(trigger - len(PROMPT))]


async def test_a_gated_token_whose_rows_capture_lost_without_a_word_is_never_shown(stack):
    """Capture loses every row of one position and reports nothing (a capture
    bug). Rows of later positions arrive and are acknowledged; the gate must
    still stop at the lost position, and the fail_closed request must end
    there, counting the rows as dropped, instead of showing the token unscored."""
    lost = len(PROMPT) + 5
    s = await stack()
    s.capture.silently_lost.add(lost)
    outcome = await run(s.runtime, request("lost-rows", max_tokens=12))
    finished = outcome.finished
    assert finished.finish_reason == types_pb.FINISH_REASON_ROUTER_UNAVAILABLE
    assert finished.verdict.token_position == lost
    assert "capture delivered no rows or too few at 1 position(s), 1 rows missing" in finished.message
    assert outcome.tokens == [100 + g for g in range(lost - len(PROMPT))]
    assert (finished.unprobed_tokens, finished.dropped_records) == (1, 1)
    assert s.runtime.metrics.registry.get_sample_value(
        "undercurrent_engine_dropped_records_total", {"queue": "capture_lost"}) == 1


async def test_rows_capture_lost_without_a_word_are_counted_for_a_fail_open_request(stack):
    lost = len(PROMPT) + 3
    s = await stack()
    s.capture.silently_lost.add(lost)
    outcome = await run(s.runtime, request("lost-open", OPEN, max_tokens=12))
    finished = outcome.finished
    assert finished.finish_reason == types_pb.FINISH_REASON_LENGTH and len(outcome.tokens) == 12
    assert (finished.unprobed_tokens, finished.dropped_records) == (1, 1)
    assert finished.message.startswith("1 tokens unprobed (fail_open): capture delivered no rows")


# -- item 5: the drain loop never dies silently -------------------------------------------


async def test_a_failed_delivery_ends_the_requests_it_concerned_and_the_loop_goes_on(stack, monkeypatch):
    s = await stack()
    original = s.runtime._deliver
    failures = []

    def deliver_once_broken(blocks):
        if not failures:
            failures.append(blocks)
            raise RuntimeError("delivery bug")
        original(blocks)

    monkeypatch.setattr(s.runtime, "_deliver", deliver_once_broken)
    broken = await run(s.runtime, request("broken", OPEN, max_tokens=20))
    assert broken.finished.finish_reason == types_pb.FINISH_REASON_ERROR
    assert "delivering its activations failed: RuntimeError: delivery bug" in broken.finished.message
    after = await run(s.runtime, request("after", max_tokens=20))
    assert after.finished.finish_reason == types_pb.FINISH_REASON_LENGTH
    assert after.finished.unprobed_tokens == 0 and len(after.tokens) == 20
    assert s.runtime.metrics.registry.get_sample_value("undercurrent_engine_drain_failures_total") == 1
    assert s.runtime.health(routers_optional=False) == (True, "")


async def test_rows_a_worker_dropped_past_its_backlog_bound_are_counted_in_the_requests_finish(stack):
    """A worker past --capture-backlog-bytes reports the rows it dropped per
    request and point: the request ends with the error, and
    finished.dropped_records and the engine's metric count exactly those rows
    (rows of a client point here; probe rows it drops never reach the ledger,
    which counts them as lost, once: tests/engine/test_request_ledger.py)."""
    s = await stack()
    progress = Outcome()
    running = asyncio.create_task(run(s.runtime, request("starved", OPEN, max_tokens=5000), progress))
    await wait_for(progress, lambda: len(progress.tokens) >= 3)
    [key] = s.runtime.runs
    s.capture.request_errors[key] = "capture: rank 0 dropped 7 rows of this request (--capture-backlog-bytes)"
    s.capture.dropped_rows[(key, "rows_for_the_client")] = list(range(7))
    outcome = await running
    finished = outcome.finished
    assert finished.finish_reason == types_pb.FINISH_REASON_ERROR
    assert "--capture-backlog-bytes" in finished.message
    assert finished.dropped_records == 7
    assert s.runtime.metrics.registry.get_sample_value(
        "undercurrent_engine_dropped_records_total", {"queue": "capture_backlog"}) == 7


async def test_recomputed_rows_the_capture_discards_are_counted_and_lose_nothing(stack):
    """Duplicates of delivered rows (vLLM recomputing after a preemption; the
    real count is tests/capture/test_exactly_once.py) show in their own metric,
    never as dropped records or unprobed tokens."""
    s = await stack()
    s.capture.recomputed_rows_discarded = 9
    outcome = await run(s.runtime, request("recomputed", max_tokens=8))
    assert outcome.finished.finish_reason == types_pb.FINISH_REASON_LENGTH and len(outcome.tokens) == 8
    assert (outcome.finished.unprobed_tokens, outcome.finished.dropped_records) == (0, 0)
    sample = s.runtime.metrics.registry.get_sample_value
    assert sample("undercurrent_engine_recomputed_rows_discarded_total") == 9
    s.capture.recomputed_rows_discarded = 12
    await until(lambda: sample("undercurrent_engine_recomputed_rows_discarded_total") == 12, timeout=5)


class LoopKiller(BaseException):
    """Escapes the per-iteration guard, as only a BaseException can."""


async def test_a_stopped_drain_loop_ends_every_request_and_the_engine_stops_serving(stack):
    s = await stack()
    progress = Outcome()
    running = asyncio.create_task(run(s.runtime, request("victim", max_tokens=5000), progress))
    await wait_for(progress, lambda: len(progress.tokens) >= 3)
    s.capture.drain_error = LoopKiller("worker gone")
    outcome = await asyncio.wait_for(running, 10)
    assert outcome.finished.finish_reason == types_pb.FINISH_REASON_ERROR
    assert "the capture drain loop stopped: LoopKiller: worker gone" in outcome.finished.message
    serving, why = s.runtime.health(routers_optional=True)
    assert not serving and "LoopKiller" in why
    with pytest.raises(Unavailable, match="cannot capture"):
        await run(s.runtime, request("refused"))


async def test_a_failing_unregister_still_finishes_the_stream(stack):
    s = await stack()
    s.capture.unregister_error = RuntimeError("rpc failed")
    outcome = await asyncio.wait_for(run(s.runtime, request("r", OPEN, max_tokens=10)), 10)
    assert outcome.finished.finish_reason == types_pb.FINISH_REASON_ERROR
    assert "engine error after generation: RuntimeError: rpc failed" in outcome.finished.message


# -- item 8: client-only capture gets every row before `finished` --------------------------


async def test_client_only_capture_finishes_after_the_last_rows_arrived(stack):
    s = await stack(step_s=0.002)
    for attempt in range(5):
        message = request(f"client-{attempt}", policy=None, gate=False, max_tokens=8)
        message.extraction_points.add(
            name="resid", tensor_type=types_pb.TENSOR_TYPE_RESIDUAL_STREAM, layers=[1], stream_to_client=True
        )
        outcome = await run(s.runtime, message)
        assert outcome.finished.finish_reason == types_pb.FINISH_REASON_LENGTH
        positions = sorted(
            int(p)
            for r in outcome.responses
            if r.HasField("activations")
            for block in r.activations.blocks
            for p in block.token_positions
        )
        # The prompt and every fed-back token: the last sampled token is never computed.
        assert positions == list(range(len(PROMPT) + 7)), attempt
        # Under the client's own request id, not the run's internal key.
        assert {i for r in outcome.responses if r.HasField("activations")
                for i in r.activations.request_ids} == {f"client-{attempt}"}


async def test_an_abort_before_vllm_runs_the_request_ends_it_and_vllm_never_runs_it(stack):
    """Engine.Abort finds a request as soon as it is accepted; one that lands while
    capture registers it (before vLLM is asked) must still end it."""
    s = await stack()
    registering, release = asyncio.Event(), asyncio.Event()
    register = s.capture.register

    async def slow_register(*args):
        registering.set()
        await release.wait()
        await register(*args)

    s.capture.register = slow_register
    running = asyncio.create_task(run(s.runtime, request("early", OPEN, max_tokens=500, gate=False)))
    await asyncio.wait_for(registering.wait(), 5)
    assert await s.runtime.abort("early")
    release.set()
    outcome = await asyncio.wait_for(running, 10)
    assert outcome.finished.finish_reason == types_pb.FINISH_REASON_CLIENT_ABORT
    assert outcome.tokens == [] and outcome.finished.generated_tokens == 0
    assert not ran(s.llm.running, "early") and not ran(s.llm.aborted[1:], "early")


# -- operator-set bindings ----------------------------------------------------------


async def test_an_operator_guard_binds_gates_and_aborts_a_request_that_names_no_probe(stack, tmp_path):
    """The caller's guard is in force on a request that binds nothing: its tokens
    are gated, it ends at the guard's verdict, and its finish says the binding
    was the operator's."""
    trigger = len(PROMPT) + 6
    s = await stack(step_s=0.01, score=lambda request_id, position: 500.0 if position == trigger else 0.0)
    path = tmp_path / "guards.json"
    path.write_text(json.dumps({"callers": {"demo": [
        {"probe": PROBE.name, "failure_policy": "fail_closed", "action": "abort", "gate_tokens": True}]}}))
    s.runtime.guards = GuardsFile(path)
    outcome = Outcome()
    async for response in s.runtime.generate(request("guarded", policy=None, gate=None), caller="demo"):
        outcome.responses.append(response)
    finished = outcome.finished
    assert finished.finish_reason == types_pb.FINISH_REASON_PROBE_ABORT and finished.gated, finished
    assert finished.verdict.token_position == trigger
    assert len(outcome.tokens) == trigger - len(PROMPT)  # none at or after the trigger
    assert [(b.probe, b.operator_set, b.failure_policy) for b in finished.bindings] == [(PROBE.name, True, CLOSED)]
    # Another caller has no guard: nothing is bound, nothing gated.
    other = await run(s.runtime, request("free", policy=None, gate=None, max_tokens=12))
    assert (other.finished.finish_reason, other.finished.gated, list(other.finished.bindings)) == (
        types_pb.FINISH_REASON_LENGTH, False, [])
    with pytest.raises(InvalidArgument, match=r"^probes\[0\]\.failure_policy: FAIL_OPEN would weaken"):
        async for _ in s.runtime.generate(request("weaker", policy=OPEN), caller="demo"):
            pass
