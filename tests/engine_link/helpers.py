"""Shared by the router-link tests: fast timings, an event collector, block builders."""

from __future__ import annotations

import asyncio
import itertools

import numpy as np
from undercurrent.v1 import types_pb2 as types_pb

from common.activations import Block
from engine_service.link import LinkEvent, RouterLink
from engine_service.request import bindings as pins
from engine_service.request.ledger import RequestLedger
from engine_service.request.probe_points import point_name
from tools.router_double import PROBE

FAIL_OPEN = [types_pb.ProbeBinding(probe="first_element", failure_policy=types_pb.FAILURE_POLICY_FAIL_OPEN)]
FAIL_CLOSED = [types_pb.ProbeBinding(probe="first_element", failure_policy=types_pb.FAILURE_POLICY_FAIL_CLOSED)]
MODEL = types_pb.ModelInfo(model="tiny", num_layers=2, hidden_size=8, dtype="float32")
HIDDEN = 8

# Fast timings so failures are detected in tens of milliseconds.
FAST = dict(
    heartbeat_interval_s=0.05,
    heartbeat_timeout_s=1.0,
    reconnect_base_s=0.02,
    reconnect_max_s=0.1,
    router_timeout_s=0.2,
    close_timeout_s=1.0,
)


class EventLog:
    """Collects link events; lets a test await the one it expects."""

    def __init__(self) -> None:
        self.events: list[LinkEvent] = []
        self._changed = asyncio.Event()

    def __call__(self, event: LinkEvent) -> None:
        self.events.append(event)
        self._changed.set()

    def of(self, kind, request_id: str | None = None) -> list:
        return [
            e
            for e in self.events
            if isinstance(e, kind) and (request_id is None or e.request_id == request_id)
        ]

    async def wait_for(self, predicate, timeout: float = 10.0) -> None:
        async with asyncio.timeout(timeout):
            while not predicate():
                self._changed.clear()
                await self._changed.wait()


def step(
    rows_by_request: dict[str, list[int]],
    first: float | dict[str, float] = 0.0,
    layer: int = 0,
    hidden: int = HIDDEN,
) -> Block:
    """One block of (request, position) rows. Each row's first element is `first`
    (or first[request]), which the router double scores; the second is its position."""
    request_ids = [r for r, positions in rows_by_request.items() for _ in positions]
    positions = [p for ps in rows_by_request.values() for p in ps]
    rows = np.zeros((len(positions), hidden), dtype=np.float32)
    rows[:, 0] = [first.get(r, 0.0) for r in request_ids] if isinstance(first, dict) else first
    rows[:, 1] = positions
    return Block(
        point_name("residual_stream", layer),
        types_pb.TENSOR_TYPE_RESIDUAL_STREAM,
        layer,
        rows,
        request_ids,
        np.asarray(positions, dtype=np.int64),
        np.zeros(len(positions), dtype=bool),
    )


_incarnations = itertools.count(1)


def start(
    link: RouterLink,
    request_id: str,
    bindings=None,
    prompt_tokens: int = 1,
    incarnation: int | None = None,
    layers: tuple[int, ...] = (0,),
    caller: str = "",
) -> RequestLedger:
    """Starts a request on the link as the engine does: a fresh incarnation,
    bindings pinned to the router double's probe version (a probe it does not
    have is pinned to no version), reading `layers`, and a ledger the link keeps
    current. Returns the ledger; the test says what the model computed
    (`computed_below`), as the engine does when tokens come."""
    bindings = list(bindings if bindings is not None else FAIL_OPEN)
    infos = [types_pb.ProbeInfo(name=b.probe, tensor_type=PROBE.tensor_type, layers=layers,
                          digest=PROBE.digest if b.probe == PROBE.name else "") for b in bindings]
    pinned = pins.pinned(bindings, infos, types_pb.FAILURE_POLICY_FAIL_CLOSED)
    ledger = RequestLedger(prompt_tokens, pins.for_ledger(pinned, infos))
    incarnation = next(_incarnations) if incarnation is None else incarnation
    link.start_request(request_id, incarnation, pinned, prompt_tokens, ledger, caller=caller)
    return ledger


async def until(predicate, timeout: float = 10.0, interval: float = 0.01) -> None:
    """Polls a condition that no event announces (e.g. a replica's liveness)."""
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(interval)
