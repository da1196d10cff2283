"""What the fault tests share: Prometheus scraping, the observe probe, requests,
waiting for router state to settle, and the count checks every fault test makes."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from common.probe_format.files import write_probe
from tools import stack
from undercurrent.v1 import engine_pb2 as engine_pb
from undercurrent.v1 import types_pb2 as types_pb

WATCH = "fault_watch"
WATCH_LAYER = 1

# The engine's --router-timeout for this package (a failure ends a request
# within it plus stack.END_SLACK_S). A healthy router can wait seconds for a CPU
# on a loaded 2-core machine: before any fault was injected, 1.5 s ended a
# request at a load average of 14, 3 s once in CI (the engine generated 260
# tokens while the router scored 97), and 5 s once in CI (a router just started
# scored 2 rows while the engine generated 525).
ROUTER_TIMEOUT_S = 10.0
# The engine's --router-heartbeat-timeout here: far past the router timeout, so
# a router that is silent but connected is found by the router timeout's
# watchdog (rows unacknowledged), never first by the session's heartbeat check.
HEARTBEAT_TIMEOUT_S = 30.0
# Router state (live requests, sessions) is back to its resting value this
# soon after the fault ends (the engine's session loss or RequestEnd reaches
# the router in one round trip; 5 s covers a loaded machine).
ROUTER_SETTLE_S = 5.0


def write_watch_probe(directory: Path, hidden: int = 128) -> None:
    """Observes every generated token's layer-1 residual norm; never fires."""
    write_probe(directory / WATCH, {
        "name": WATCH, "version": "1", "kind": "norm", "tensor_type": "residual_stream",
        "layers": [WATCH_LAYER], "hidden_size": hidden, "dtype": "float32", "threshold": 1e9,
        "action": "observe", "tokens": {"scope": "generated"},
    })


def request(rid: str, policy: int, max_tokens: int, probe: str = WATCH, gate: bool = False,
            action: int = types_pb.PROBE_ACTION_UNSPECIFIED) -> engine_pb.GenerateRequest:
    message = engine_pb.GenerateRequest(
        request_id=rid, text=f"request {rid} says hello",
        sampling=engine_pb.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
        gate_tokens=gate,
    )
    message.probes.add(probe=probe, failure_policy=policy, action=action)
    return message


def fed_positions(outcome: stack.Outcome) -> int:
    """Generated tokens fed back through the model (all but the last): the rows
    a generated-scope probe is owed."""
    return max(0, outcome.finished.generated_tokens - 1)


def assert_true_counts(outcome: stack.Outcome) -> None:
    """Every fed row was scored once or counted unprobed, no more and no less.

    A request that ran to its end fed all tokens but the last. One the engine
    stopped may also have fed its last token: the abort can land after the step
    that fed it, so either count is true there."""
    scored = stack.scored_positions(outcome)
    assert len(scored) == len(set(scored)), "a position was scored twice"
    # The watch probe reads one row a token: the binding's report counts the same
    # rows scored and unprobed as the client saw scored and unprobed.
    [report] = outcome.finished.bindings
    assert (report.rows_scored, report.rows_unprobed) == (len(scored), outcome.finished.unprobed_tokens), (
        report, len(scored), outcome.finished.unprobed_tokens)
    accounted = len(scored) + outcome.finished.unprobed_tokens
    fed = fed_positions(outcome)
    allowed = {fed} if outcome.reason in ("LENGTH", "STOP") else {fed, fed + 1}
    assert accounted in allowed, (
        f"{len(scored)} scored + {outcome.finished.unprobed_tokens} unprobed != "
        f"{fed} fed ({outcome.finished})")





async def metrics(port: int) -> dict[str, float]:
    return await asyncio.to_thread(stack.scrape, port)


async def wait_router_state(port: int, sessions: int, live_requests: int = 0,
                            timeout: float = ROUTER_SETTLE_S) -> float:
    """Waits until the router's metrics show `sessions` open sessions and
    `live_requests` requests with state; returns how long that took."""
    started = time.monotonic()
    seen = {}
    while time.monotonic() - started < timeout:
        seen = await metrics(port)
        if (seen.get("undercurrent_router_sessions") == sessions
                and seen.get("undercurrent_router_live_requests") == live_requests):
            return time.monotonic() - started
        await asyncio.sleep(0.1)
    raise AssertionError(
        f"router state not back to sessions={sessions} live_requests={live_requests} in "
        f"{timeout} s: sessions={seen.get('undercurrent_router_sessions')} "
        f"live_requests={seen.get('undercurrent_router_live_requests')}")


def engine_dropped(values: dict[str, float], reason: str) -> float:
    return values.get(f'undercurrent_router_link_dropped_records_total{{reason="{reason}"}}', 0.0)


async def wait_tokens(progress: stack.Outcome, count: int, timeout: float = 60) -> None:
    """Waits until the client received `count` tokens (and at least one score)."""
    deadline = time.monotonic() + timeout
    while len(progress.tokens) < count or not progress.scores:
        assert progress.finished is None, f"finished early: {progress.finished}"
        assert time.monotonic() < deadline, f"only {len(progress.tokens)} tokens arrived"
        await asyncio.sleep(0.02)
