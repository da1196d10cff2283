"""vLLM's scheduler, holding back probed requests that ran too far ahead of scoring.

Runs inside vLLM's engine core process (`--max-tokens-ahead`; the rule and the
wire are in `engine_service.engine_core.tokens_ahead`). Before each schedule it reads the
allowances the engine service sent and takes the requests at their allowance
out of the running list for that one call, so vLLM schedules the others as if
the held ones had no token budget left; they keep their KV cache blocks and
their place, and are scheduled again once their router catches up. A request
already computed in full is never recomputed; one preempted and resumed
recomputes its tokens in one step, which may pass its allowance by one.

vLLM picks Scheduler or AsyncScheduler from its configuration once the engine
core starts; `TokensAheadScheduler` builds the holding subclass of that one.
"""

from __future__ import annotations

import os

import zmq

from engine_service.engine_core.tokens_ahead import ADDRESS_ENV, EXTRA_ARGS_KEY, AllowanceTable, decode

# While every running request is held and none waits, the engine core would
# otherwise run empty steps back to back: wait this long for an allowance first
# (aborts and new requests wait at most as long).
HELD_WAIT_MS = 5


class _HoldsRequestsAhead:
    """Mixed into vLLM's Scheduler or AsyncScheduler."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._allowances = AllowanceTable()
        # vLLM request id -> (key, bound) of the running bounded requests.
        self._bounded: dict[str, tuple[str, int]] = {}
        self._inbox = zmq.Context.instance().socket(zmq.PULL)
        self._inbox.setsockopt(zmq.LINGER, 0)
        self._inbox.connect(os.environ[ADDRESS_ENV])

    def add_request(self, request) -> None:
        super().add_request(request)
        extra = request.sampling_params.extra_args if request.sampling_params else None
        if extra and EXTRA_ARGS_KEY in extra:
            key, bound = extra[EXTRA_ARGS_KEY]
            self._bounded[request.request_id] = (key, int(bound))

    def schedule(self, *args, **kwargs):
        self._read_allowances(0)
        if not self._bounded:
            return super().schedule(*args, **kwargs)
        held = self._held()
        if held and len(held) == len(self.running) and not self.get_request_counts()[1]:
            self._read_allowances(HELD_WAIT_MS)
            held = self._held()
        if not held:
            return super().schedule(*args, **kwargs)
        running = self.running
        place = {id(request): i for i, request in enumerate(running)}
        held_ids = {id(request) for request in held}
        self.running = [request for request in running if id(request) not in held_ids]
        try:
            return super().schedule(*args, **kwargs)
        finally:
            # Back in their places; requests vLLM added keep theirs at the end.
            merged = held + self.running
            merged.sort(key=lambda request: place.get(id(request), len(place)))
            self.running = merged

    def _held(self) -> list:
        held = []
        for request in self.running:
            bounded = self._bounded.get(request.request_id)
            if bounded is not None and self._allowances.held(
                bounded[0], bounded[1], request.num_prompt_tokens, request.num_computed_tokens
            ):
                held.append(request)
        return held

    def _read_allowances(self, wait_ms: int) -> None:
        if wait_ms and not self._inbox.poll(wait_ms, zmq.POLLIN):
            return
        while True:
            try:
                message = self._inbox.recv(flags=zmq.NOBLOCK)
            except zmq.Again:
                break
            self._allowances.update(decode(message))

    def _free_request(self, request, *args, **kwargs):
        self._bounded.pop(request.request_id, None)
        return super()._free_request(request, *args, **kwargs)

    def shutdown(self) -> None:
        self._inbox.close(linger=0)
        super().shutdown()


class TokensAheadScheduler:
    """What `scheduler_cls` names: builds the holding subclass of the scheduler
    vLLM would have used (AsyncScheduler when async scheduling is on)."""

    def __new__(cls, vllm_config, *args, **kwargs):
        if vllm_config.scheduler_config.async_scheduling:
            return _AsyncHolding(vllm_config, *args, **kwargs)
        return _Holding(vllm_config, *args, **kwargs)


def _holding(base: type) -> type:
    return type(f"TokensAhead{base.__name__}", (_HoldsRequestsAhead, base), {})


def _subclasses():
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler

    return _holding(Scheduler), _holding(AsyncScheduler)


_Holding, _AsyncHolding = _subclasses()
