"""How far a probed request may decode ahead of its scored rows (`--max-tokens-ahead`).

Without a bound, vLLM decodes a probed request as fast as it can while its rows
travel to a router and back: a verdict lands as many tokens after its trigger
as vLLM generated meanwhile, and a router that stops answering lets a request
run to its end (only gated tokens are held back; the compute is spent). With a
bound of N, vLLM's scheduler skips the request while it has computed N or more
positions past the first one whose rows are not settled (or past its prompt),
and takes it up again once the router catches up. So a probe's abort lands at
most N tokens after the triggering token, and a silent router stops the request
N tokens past what it scored, whatever the load.

Two processes share the rule. The engine service knows the ledger and sends
each bounded request's allowance (the positions it may have computed) over a
ZeroMQ PUSH socket; `engine_service.engine_core.tokens_ahead_scheduler` runs inside vLLM's
engine core, reads them before every schedule and holds back the requests at
their allowance. A request carries its key and bound in its sampling params, so
its first allowance (its prompt plus N) holds before any message arrives.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
import weakref
from pathlib import Path

import zmq

# The engine core finds the service's socket here (it inherits the environment).
ADDRESS_ENV = "UNDERCURRENT_TOKENS_AHEAD_ADDRESS"
# SamplingParams.extra_args key: [request key, bound] of a bounded request.
EXTRA_ARGS_KEY = "undercurrent_tokens_ahead"
SCHEDULER_CLS = "engine_service.engine_core.tokens_ahead_scheduler.TokensAheadScheduler"
# Allowance messages ZeroMQ queues for an engine core that does not read (a hung
# or dead core); past it sends are retried, never waited for.
SEND_HIGH_WATER_MARK = 1024
RETRY_S = 0.005


def allowance(settled_below: int, prompt_tokens: int, tokens_ahead: int) -> int:
    """Positions a request may have computed: `tokens_ahead` past the first
    unsettled one, and never fewer than its prompt plus `tokens_ahead` (the
    prompt's rows are captured in the step that computes them)."""
    return max(settled_below, prompt_tokens) + tokens_ahead


def encode(allowances: dict[str, int | None]) -> bytes:
    """key -> allowance; None: the request ended (the scheduler forgets it)."""
    return json.dumps(allowances, separators=(",", ":")).encode()


def decode(message: bytes) -> dict[str, int | None]:
    return json.loads(message)


class AllowanceTable:
    """The engine core's view: each bounded request's allowance, only ever raised."""

    def __init__(self) -> None:
        self._allowances: dict[str, int] = {}

    def update(self, allowances: dict[str, int | None]) -> None:
        for key, value in allowances.items():
            if value is None:
                self._allowances.pop(key, None)
            elif value > self._allowances.get(key, -1):
                self._allowances[key] = value

    def held(self, key: str, bound: int, prompt_tokens: int, computed: int) -> bool:
        """Whether a request that has computed `computed` positions must wait.
        A request the table has not heard of (or forgot, once ended) keeps its
        first allowance, so an ended request vLLM has not yet aborted stays held."""
        limit = self._allowances.get(key, allowance(0, prompt_tokens, bound))
        return computed >= limit

    def __len__(self) -> int:
        return len(self._allowances)


class AllowancePublisher:
    """The engine service's side: a PUSH socket bound in a private directory.

    Allowances are coalesced per event-loop turn into one message; a send that
    would block (the engine core not reading) is retried shortly, so the event
    loop never waits on the engine core and no update is lost: each message
    carries absolute values, and a retried key sends its latest."""

    def __init__(self, tokens_ahead: int) -> None:
        self.tokens_ahead = tokens_ahead
        self._directory = Path(tempfile.mkdtemp(prefix="undercurrent-ahead-"))  # mode 0700
        self.address = f"ipc://{self._directory / 'allowances'}"
        self._socket = zmq.Context.instance().socket(zmq.PUSH)
        self._socket.setsockopt(zmq.SNDHWM, SEND_HIGH_WATER_MARK)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(self.address)
        self._sent: dict[str, int] = {}
        self._pending: dict[str, int | None] = {}
        self._flush_scheduled = False
        self.retries = 0  # sends ZeroMQ refused for a while (the engine core not reading)
        weakref.finalize(self, shutil.rmtree, self._directory, True)

    def extra_args(self, key: str) -> dict:
        """What a bounded request carries to the scheduler in SamplingParams.extra_args."""
        return {EXTRA_ARGS_KEY: [key, self.tokens_ahead]}

    def allow(self, key: str, settled_below: int, prompt_tokens: int) -> None:
        value = allowance(settled_below, prompt_tokens, self.tokens_ahead)
        if value <= max(self._sent.get(key, -1), self._pending.get(key) or -1):
            return
        self._pending[key] = value
        self._schedule_flush(0)

    def forget(self, key: str) -> None:
        """The request ended: the scheduler drops its entry (it stays held until vLLM ends it)."""
        self._pending.pop(key, None)
        if self._sent.pop(key, None) is not None:
            self._pending[key] = None
            self._schedule_flush(0)

    def close(self) -> None:
        self._socket.close(linger=0)

    def _schedule_flush(self, delay: float) -> None:
        if self._flush_scheduled:
            return
        self._flush_scheduled = True
        asyncio.get_running_loop().call_later(delay, self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        if not self._pending or self._socket.closed:
            return
        try:
            self._socket.send(encode(self._pending), flags=zmq.NOBLOCK)
        except zmq.Again:
            self.retries += 1
            self._schedule_flush(RETRY_S)
            return
        for key, value in self._pending.items():
            if value is not None:
                self._sent[key] = value
        self._pending = {}
