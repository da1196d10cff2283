"""--max-tokens-ahead: the allowance rule, its wire between the engine service and
vLLM's engine core (real ZeroMQ sockets), and the scheduler's hold around a
stand-in for vLLM's scheduler. tests/processes/test_tokens_ahead.py runs it in vLLM."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest
import zmq

from engine_service.engine_core import tokens_ahead
from engine_service.engine_core.tokens_ahead import AllowancePublisher, AllowanceTable, allowance
from engine_service.engine_core.tokens_ahead_scheduler import _HoldsRequestsAhead


def test_allowance_counts_from_the_first_unsettled_position_or_the_prompt():
    assert allowance(settled_below=0, prompt_tokens=7, tokens_ahead=2) == 9
    assert allowance(settled_below=12, prompt_tokens=7, tokens_ahead=2) == 14


def test_the_table_holds_a_request_at_its_allowance_and_never_lowers_it():
    table = AllowanceTable()
    # Unheard of: its prompt plus the bound.
    assert not table.held("a#1", bound=1, prompt_tokens=5, computed=5)
    assert table.held("a#1", bound=1, prompt_tokens=5, computed=6)
    table.update({"a#1": 9})
    assert not table.held("a#1", 1, 5, 8) and table.held("a#1", 1, 5, 9)
    table.update({"a#1": 7})  # a stale value never takes back an allowance
    assert not table.held("a#1", 1, 5, 8)
    table.update({"a#1": None})  # ended: back to the first allowance, so held until vLLM ends it
    assert table.held("a#1", 1, 5, 8) and len(table) == 0


def receiver(address: str) -> zmq.Socket:
    socket = zmq.Context.instance().socket(zmq.PULL)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(address)
    return socket


async def received(socket: zmq.Socket, timeout_s: float = 5.0) -> dict:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while loop.time() < deadline:
        try:
            return tokens_ahead.decode(socket.recv(flags=zmq.NOBLOCK))
        except zmq.Again:
            await asyncio.sleep(0.005)
    raise AssertionError("no allowance message arrived")


async def test_allowances_of_one_turn_travel_as_one_message_of_their_latest_values():
    publisher = AllowancePublisher(tokens_ahead=2)
    socket = receiver(publisher.address)
    try:
        publisher.allow("a#1", settled_below=0, prompt_tokens=5)
        publisher.allow("a#1", settled_below=9, prompt_tokens=5)
        publisher.allow("b#2", settled_below=3, prompt_tokens=4)
        assert await received(socket) == {"a#1": 11, "b#2": 6}
        publisher.allow("a#1", settled_below=8, prompt_tokens=5)  # no higher: nothing sent
        publisher.forget("b#2")
        publisher.forget("never-sent#3")
        assert await received(socket) == {"b#2": None}
        with pytest.raises(zmq.Again):
            socket.recv(flags=zmq.NOBLOCK)
    finally:
        publisher.close()
        socket.close()


async def test_a_send_the_engine_core_cannot_take_yet_is_retried_with_the_latest_value():
    publisher = AllowancePublisher(tokens_ahead=1)
    try:
        publisher.allow("a#1", settled_below=6, prompt_tokens=5)  # nobody connected: ZeroMQ refuses
        await asyncio.sleep(0.05)
        assert publisher.retries > 0
        publisher.allow("a#1", settled_below=8, prompt_tokens=5)
        socket = receiver(publisher.address)
        assert await received(socket) == {"a#1": 9}
        socket.close()
    finally:
        publisher.close()


# -- the hold, around a stand-in for vLLM's scheduler ------------------------------


@dataclass(eq=False)
class Request:
    request_id: str
    num_prompt_tokens: int
    num_computed_tokens: int
    bound: int | None = None

    @property
    def sampling_params(self):
        return _Params({} if self.bound is None else
                       {tokens_ahead.EXTRA_ARGS_KEY: [f"{self.request_id}#1", self.bound]})


@dataclass
class _Params:
    extra_args: dict


@dataclass
class StandIn:
    """vLLM's Scheduler as the mixin uses it: running and waiting requests, and a
    schedule() that records what it saw and may preempt the last running
    request and admit a waiting one."""

    running: list = field(default_factory=list)
    waiting: list = field(default_factory=list)
    requests: dict = field(default_factory=dict)
    seen: list = field(default_factory=list)
    preempt_last: bool = False

    def add_request(self, request) -> None:
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def schedule(self):
        self.seen.append([r.request_id for r in self.running])
        if self.preempt_last:
            self.running.pop()
        self.running.extend(self.waiting)
        self.waiting.clear()
        return "output"

    def get_request_counts(self):
        return len(self.running), len(self.waiting)

    def _free_request(self, request):
        self.requests.pop(request.request_id)

    def shutdown(self) -> None:
        pass


class Holding(_HoldsRequestsAhead, StandIn):
    pass


@pytest.fixture
def scheduler(monkeypatch):
    publisher = AllowancePublisher(tokens_ahead=1)
    monkeypatch.setenv(tokens_ahead.ADDRESS_ENV, publisher.address)
    held = Holding()
    yield held, publisher
    held.shutdown()
    publisher.close()


def started(scheduler: Holding, *requests: Request) -> None:
    for request in requests:
        scheduler.add_request(request)
    scheduler.schedule()
    scheduler.seen.clear()


async def test_requests_at_their_allowance_sit_out_a_schedule_and_keep_their_places(scheduler):
    held, publisher = scheduler
    a, b, c = Request("a", 5, 0, bound=1), Request("b", 5, 0), Request("c", 5, 0, bound=1)
    started(held, a, b, c)
    a.num_computed_tokens, b.num_computed_tokens, c.num_computed_tokens = 6, 6, 5
    held.add_request(Request("d", 3, 0))
    assert held.schedule() == "output"
    # a reached its prompt plus one; c has not; b is not bounded; d was admitted.
    assert held.seen == [["b", "c"]]
    assert [r.request_id for r in held.running] == ["a", "b", "c", "d"]
    publisher.allow("a#1", settled_below=6, prompt_tokens=5)
    await asyncio.sleep(0.05)
    held.schedule()
    assert held.seen[-1] == ["a", "b", "c", "d"]


async def test_a_preempted_request_leaves_and_the_held_one_keeps_its_place(scheduler):
    held, _ = scheduler
    a, b, c = Request("a", 5, 0), Request("b", 5, 0, bound=2), Request("c", 5, 0)
    started(held, a, b, c)
    b.num_computed_tokens = 7
    held.preempt_last = True
    held.schedule()
    assert held.seen == [["a", "c"]]
    assert [r.request_id for r in held.running] == ["a", "b"]


async def test_with_every_request_held_the_scheduler_waits_for_an_allowance_then_runs(scheduler):
    held, publisher = scheduler
    a = Request("a", 5, 0, bound=1)
    started(held, a)
    a.num_computed_tokens = 6
    loop = asyncio.get_running_loop()
    began = loop.time()
    held.schedule()
    assert held.seen == [[]] and loop.time() - began >= 0.004  # waited, then scheduled nothing
    publisher.allow("a#1", settled_below=6, prompt_tokens=5)
    await asyncio.sleep(0.05)
    held.schedule()
    assert held.seen[-1] == ["a"]
    held._free_request(a)
    assert held._bounded == {}
