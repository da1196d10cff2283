"""Stand-ins for vLLM's AsyncLLM and the capture controller, for tests of the
engine runtime's own logic (gating, failure policies, counts, the drain loop)
without a model. The routers they talk to are real gRPC servers (the router
double); capture itself is proven against real vLLM in tests/capture.

One FakeEngine.step() is one engine step: every running request computes its
newest positions (the whole prompt on the first step, then the last sampled
token), whose rows the FakeCapture buffers until the next drain, and samples
one token. A request ends at max_tokens or when aborted; `abort_lag_steps`
lets an aborted request run that many more steps first, as vLLM's abort can
land after outputs of steps already under way reached the request's stream.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np
from undercurrent.v1 import types_pb2 as types_pb

from common.activations import Block
from common.capture_spec import Scope

HIDDEN = 8
MODEL = types_pb.ModelInfo(model="fake", num_layers=2, hidden_size=HIDDEN, dtype="float32")
TENSOR_TYPES = {"residual_stream": types_pb.TENSOR_TYPE_RESIDUAL_STREAM}


class FakeTokenizer:
    def encode(self, text: str) -> list[int]:
        return [ord(c) % 500 for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(f"<{i}>" for i in ids)


class FakeCapture:
    """Buffers the rows of every registered point until drain(), like the workers.

    Row values: element 0 is score(request_id, position) (what the router
    double scores), element 1 the position.
    """

    def __init__(self, score=lambda request_id, position: 0.0, hidden: int = HIDDEN) -> None:
        self.score = score
        self.hidden = hidden  # wide rows fill transport buffers fast
        self.registered: dict[str, tuple[list, int]] = {}
        self.captured: dict[str, set[int]] = defaultdict(set)  # positions, per request
        self.pending: list[Block] = []
        self.backlog_rows_dropped = 0
        self.recomputed_rows_discarded = 0  # duplicates of delivered rows (after a preemption)
        # What the next drain reports as dropped past a worker's backlog bound:
        # positions of rows per (request, point), and the errors that name the bound.
        self.dropped_rows: dict[tuple[str, str], list[int]] = defaultdict(list)
        self.request_errors: dict[str, str] = {}
        self.drains = 0
        self.drain_error: BaseException | None = None  # raised by the next drain()
        self.unregister_error: Exception | None = None
        # Positions whose rows are lost without a word: a capture bug the engine
        # must notice on its own.
        self.silently_lost: set[int] = set()

    async def start(self) -> types_pb.ModelInfo:
        return MODEL

    def model_info(self) -> types_pb.ModelInfo:
        return MODEL

    def validate(self, points, prompt_tokens=None) -> None:
        pass

    async def register(self, request_id: str, points, prompt_tokens: int) -> None:
        self.registered[request_id] = (points, prompt_tokens)

    async def unregister(self, request_id: str) -> None:
        """Stops capture; rows already computed still come with the next drain."""
        self.registered.pop(request_id, None)
        if self.unregister_error is not None:
            raise self.unregister_error

    def computed(self, request_id: str, positions: list[int]) -> None:
        if request_id not in self.registered:
            return
        points, prompt_tokens = self.registered[request_id]
        for point in points:
            chosen = [
                p
                for p in positions
                if (point.tokens.scope is Scope.ALL
                    or (point.tokens.scope is Scope.PROMPT) == (p < prompt_tokens))
                and p not in self.silently_lost
            ]
            if not chosen:
                continue
            self.captured[request_id].update(chosen)
            for layer in point.layers:
                rows = np.zeros((len(chosen), self.hidden), dtype=np.float32)
                rows[:, 0] = [self.score(request_id, p) for p in chosen]
                rows[:, 1] = chosen
                self.pending.append(
                    Block(
                        point.name,
                        TENSOR_TYPES[point.tensor_type],
                        layer,
                        rows,
                        [request_id] * len(chosen),
                        np.asarray(chosen, dtype=np.int64),
                        np.asarray([p >= prompt_tokens for p in chosen]),
                    )
                )

    async def drain(self) -> list[Block]:
        await asyncio.sleep(0)  # a collective_rpc never answers synchronously
        self.drains += 1
        self.backlog_rows_dropped += sum(map(len, self.dropped_rows.values()))  # what pop_dropped_rows returns next
        if self.drain_error is not None:
            error, self.drain_error = self.drain_error, None
            raise error
        blocks, self.pending = self.pending, []
        return blocks

    def pop_request_errors(self) -> dict[str, str]:
        errors, self.request_errors = self.request_errors, {}
        return errors

    def pop_dropped_rows(self) -> dict[tuple[str, str], list[int]]:
        dropped, self.dropped_rows = self.dropped_rows, defaultdict(list)
        return dropped


@dataclass
class _Run:
    request_id: str
    prompt: list[int]
    max_tokens: int
    outputs: asyncio.Queue = field(default_factory=asyncio.Queue)
    generated: int = 0
    steps_until_aborted: int | None = None  # set by a lagging abort


def _output(token_ids: list[int], finished: bool, reason: str | None):
    completion = SimpleNamespace(token_ids=token_ids, text="", finish_reason=reason)
    return SimpleNamespace(outputs=[completion], finished=finished)


class FakeEngine:
    """AsyncLLM's surface the runtime uses; steps run when step() is called."""

    def __init__(self, capture: FakeCapture, max_model_len: int = 8192, abort_lag_steps: int = 0) -> None:
        self.capture = capture
        self.abort_lag_steps = abort_lag_steps
        self.vllm_config = SimpleNamespace(
            model_config=SimpleNamespace(get_vocab_size=lambda: 512, max_model_len=max_model_len)
        )
        self.running: dict[str, _Run] = {}
        self.aborted: list[str] = []

    def get_tokenizer(self) -> FakeTokenizer:
        return FakeTokenizer()

    async def generate(self, prompt, params, request_id: str):
        run = _Run(request_id, list(prompt["prompt_token_ids"]), params.max_tokens)
        self.running[request_id] = run
        while True:
            output = await run.outputs.get()
            yield output
            if output.finished:
                return

    async def abort(self, request_id: str) -> None:
        run = self.running.get(request_id)
        if run is None:
            return
        self.aborted.append(request_id)
        if self.abort_lag_steps:
            run.steps_until_aborted = self.abort_lag_steps
        else:
            self._end_aborted(run)

    def _end_aborted(self, run: _Run) -> None:
        del self.running[run.request_id]
        run.outputs.put_nowait(_output([], True, "abort"))

    def step(self) -> None:
        for run in list(self.running.values()):
            if run.steps_until_aborted is not None:
                if run.steps_until_aborted == 0:
                    self._end_aborted(run)
                    continue
                run.steps_until_aborted -= 1
            prompt_tokens = len(run.prompt)
            if run.generated == 0:
                positions = list(range(prompt_tokens))
            else:
                positions = [prompt_tokens + run.generated - 1]
            self.capture.computed(run.request_id, positions)
            run.generated += 1
            finished = run.generated >= run.max_tokens
            if finished:
                del self.running[run.request_id]
            run.outputs.put_nowait(
                _output([100 + run.generated - 1], finished, "length" if finished else None)
            )

    async def run_steps(self, interval_s: float) -> None:
        """Steps forever (cancel to stop), like vLLM's busy loop."""
        while True:
            self.step()
            await asyncio.sleep(interval_s)
