"""A simulated world around the engine's real request path, for the gating
invariant's model-based test (test_gating_invariant.py).

What is real: the EngineRuntime (generate, the producer, settle, finish, the
drain's delivery, the link's event handling), the RouterLink with its
per-replica send queue, step ledger and session listener code, every request's
RequestLedger, RequestRun and ClientStream, and on the router side the real
SessionState and ProbeRegistry scoring real probes.

What is simulated, step by step and under the test's control: vLLM (a model of
two pipeline stages: stage 0 computes layer 0, stage 1 layer 1 and the final
norm and samples the next token; a preempted request recomputes from position
0; vLLM's outputs reach the engine when the test says), capture (the rows of
each stage's computation, shipped by both of its tensor-parallel ranks and
through the driver's real merge and exactly-once filter, with faults: rows lost
without a word, rows a worker dropped and reported, NaN rows), the network
between the engine and each router replica (messages move when the test
transmits or delivers them; a replica can be killed, restarted, drained or
blackholed), and time (the link's clock; the router timeout counts on it).

The world also keeps the ground truth the invariants are checked against:
which rows of which run each router scored, in which session, with which
probe version (`Truth`).
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np
from undercurrent.v1 import router_session_pb2 as session_pb
from undercurrent.v1 import types_pb2 as types_pb

from common.activations import Block, from_batch, session_request_bytes
from common.capture_spec import ExtractionPoint, TokenSelector
from engine_service.capture.driver.merge import DeliveredPositions, merge_blocks
from engine_service.link.send_queue import QueuedBatch
from engine_service.link.session import ReplicaSession
from engine_service.request.probe_points import point_name
from router_service.metrics import RouterMetrics
from common.probe_format.files import encode_safetensors, load_probe_bytes
from common.probe_format.probes import Probe
from router_service.registry import ProbeRegistry
from router_service.session import SessionState

HIDDEN = 4
MODEL = types_pb.ModelInfo(model="sim", num_layers=2, hidden_size=HIDDEN, dtype="float32",
                     tensor_types=[types_pb.TENSOR_TYPE_RESIDUAL_STREAM, types_pb.TENSOR_TYPE_FINAL_NORM])
STAGE_LAYERS = {0: (("residual_stream", 0),), 1: (("residual_stream", 1), ("final_norm", None))}
STAGES = len(STAGE_LAYERS)
TP_RANKS = 2  # both ranks of a stage ship their rows; the driver's dedup keeps one


def make_probe(name: str, version: str, tensor_type: str, layers: list[int], scope: str, threshold: float,
               action: str, weight: float, min_tokens: int = 0, hidden: int = HIDDEN) -> Probe:
    """A linear probe of a row's first element, times `weight`, built as a router loads one."""
    manifest = dict(name=name, version=version, kind="linear", tensor_type=tensor_type, layers=layers,
                    hidden_size=hidden, dtype="float32", threshold=threshold, action=action,
                    tokens={"scope": scope}, rule={"min_tokens": min_tokens})
    weights = np.zeros(hidden, np.float32)
    weights[0] = weight
    data = encode_safetensors({"weight": weights, "bias": np.zeros(1, np.float32)}, "float32")
    return load_probe_bytes(json.dumps(manifest), data)


def catalog_probes() -> dict[str, Probe]:
    """The probes of the world. "guard" spans both stages and keeps state (min_tokens);
    "guard@v2" is another version of it; "early" reads stage 0 only, "late" the final
    norm of stage 1; "observer" is loaded on some replicas only; "wide" is
    incompatible with the model (a router-wide notice where it is loaded)."""
    return {
        "guard": make_probe("guard", "1", "residual_stream", [0, 1], "generated", 0.8, "abort", 1.0, min_tokens=2),
        "guard@v2": make_probe("guard", "2", "residual_stream", [0, 1], "generated", 0.8, "abort", 0.9, min_tokens=2),
        "early": make_probe("early", "1", "residual_stream", [0], "all", 0.95, "observe", 1.0),
        "late": make_probe("late", "1", "final_norm", [], "generated", 0.9, "abort", 1.0),
        "observer": make_probe("observer", "1", "residual_stream", [1], "generated", 0.5, "observe", 1.0),
        "wide": make_probe("wide", "1", "residual_stream", [0], "all", 0.5, "observe", 1.0, hidden=HIDDEN * 2),
    }


@dataclass
class Scored:
    """One row a router scored for one binding of one run."""

    session: int  # the router session that scored it (its state is that session's)
    point: str
    position: int


@dataclass
class Truth:
    """What really happened, as the world saw it."""

    # (run key, probe, digest) -> rows the router scored for that binding
    scored: dict[tuple[str, str, str], list[Scored]] = field(default_factory=lambda: defaultdict(list))
    # run key -> probe rows the engine sent to a router (read by it or not)
    sent: Counter = field(default_factory=Counter)
    # run key -> (session, incarnation) of every request_start a router took
    started: dict[str, set[tuple[int, int]]] = field(default_factory=lambda: defaultdict(set))
    # verdicts the routers really sent: (run key, incarnation, position)
    verdicts: set[tuple[str, int, int]] = field(default_factory=set)


class SimRouter:
    """One router replica: a real registry and, per engine session, a real SessionState."""

    sessions = 0  # session numbers are unique in the world

    def __init__(self, address: str, probes: list[Probe], truth: Truth) -> None:
        self.address = address
        self.registry = ProbeRegistry()
        for probe in probes:
            self.registry.load(probe)
        self.truth = truth
        self.state: SessionState | None = None
        self.session = 0
        self.outbox: list[session_pb.SessionResponse] = []
        # Reads nothing and answers nothing; the connection stays, and what the
        # engine sends waits in it (TCP loses nothing) until the router reads again.
        self.blackholed = False
        self.unread: list[session_pb.SessionRequest] = []
        self.draining = False  # refuses new requests (it said so with a Drain message)
        self.registry.subscribe(self._catalog_changed)

    def set_blackholed(self, on: bool) -> None:
        self.blackholed = on
        if not on:
            unread, self.unread = self.unread, []
            for message in unread:
                self.handle(message)

    def receive(self, message: session_pb.SessionRequest) -> None:
        if self.blackholed:
            self.unread.append(message)
        else:
            self.handle(message)

    def open(self) -> session_pb.RouterHello:
        SimRouter.sessions += 1
        self.unread = []
        self.session = SimRouter.sessions
        self.state = SessionState(self.registry, MODEL, RouterMetrics(), draining=lambda: self.draining)
        self.outbox = []
        probes, errors = self.state.catalog()
        self.outbox.extend(errors)
        return session_pb.RouterHello(router_id=self.address, probes=probes)

    def drain(self) -> None:
        self.draining = True
        if self.state is not None:
            self.outbox.append(session_pb.SessionResponse(drain=session_pb.Drain(reason="rolling restart")))

    def close(self) -> None:
        if self.state is not None:
            self.state.close()
        self.state = None
        self.outbox = []
        self.unread = []

    def _catalog_changed(self) -> None:
        if self.state is not None:
            probes, errors = self.state.catalog()
            self.outbox.extend([*errors, session_pb.SessionResponse(catalog=session_pb.ProbeCatalog(probes=probes))])

    def handle(self, message: session_pb.SessionRequest) -> None:
        """As the router's Session servicer: one engine message, its replies queued."""
        kind = message.WhichOneof("message")
        state = self.state
        if kind == "request_start":
            start = message.request_start
            replies = state.start(start)
            if start.request_id in state.requests:
                self.truth.started[start.request_id].add((self.session, start.incarnation))
        elif kind == "request_end":
            replies = state.end(message.request_end)
        elif kind == "batch":
            replies = state.detach_retired()
            bound = {key: [state._grid.probes[c] for c in request.orders]
                     for key, request in state.requests.items()}
            scored = state.batch(message.batch)
            self._record(message.batch, bound, {key: state.requests[key].prompt_tokens for key in bound}, scored)
            replies += scored
        else:
            replies = []
        self.outbox.extend(replies)

    def _record(self, batch: types_pb.ActivationBatch, bound: dict[str, list[Probe]], prompts: dict[str, int],
                replies: list[session_pb.SessionResponse]) -> None:
        """The truth of one batch: rows received, and per binding the rows scored (none
        for a request the batch's errors name; for a binding an error names, none of its)."""
        failed: dict[str, set[str] | None] = {}
        for reply in replies:
            if reply.HasField("error") and reply.error.request_id:
                if reply.error.probe and failed.get(reply.error.request_id, set()) is not None:
                    failed.setdefault(reply.error.request_id, set()).add(reply.error.probe)
                else:
                    failed[reply.error.request_id] = None
            if reply.HasField("abort"):
                verdict = reply.abort.verdict
                self.truth.verdicts.add((verdict.request_id, reply.abort.incarnation, verdict.token_position))
        for block in from_batch(batch):
            layer = None if block.tensor_type == types_pb.TENSOR_TYPE_FINAL_NORM else block.layer
            point = point_name("final_norm" if layer is None else "residual_stream", layer)
            for key, position in zip(block.request_ids, block.token_positions.tolist()):
                if key not in bound or failed.get(key, set()) is None:
                    continue
                for probe in bound[key]:
                    m = probe.manifest
                    if probe.name in failed.get(key, ()) or not m.reads(block.tensor_type, block.layer):
                        continue
                    if m.tokens.mask(np.array([position]), prompts[key])[0]:
                        self.truth.scored[(key, probe.name, probe.digest)].append(
                            Scored(self.session, point, position))


class SimReplica(ReplicaSession):
    """The engine's real ReplicaSession, its stream replaced by the world's
    hand: messages cross only when the test transmits or delivers them."""

    world: "World"

    def start(self) -> None:
        """No task: the world connects it."""

    def close(self) -> None:
        self.closing = True

    @property
    def router(self) -> SimRouter:
        return self.world.routers[self.address]

    def connect(self) -> None:
        self._mark_up(self.router.open())

    def transmit(self, count: int) -> None:
        """Up to `count` queued messages leave the engine for the router, which
        reads them at once (blackholed: once it reads again)."""
        for _ in range(count):
            if not self.up or not self.queue:
                return
            item = self.queue.pop()
            if isinstance(item, QueuedBatch):
                step = self.steps.record(item, self.world.now)
                self._listener.batch_sent(self, item, step)
                message = session_pb.SessionRequest.FromString(session_request_bytes(item.batch_bytes, step))
                item.batch_bytes = None
                for block in message.batch.blocks:
                    for index in block.request_index:
                        self.world.truth.sent[message.batch.request_ids[index]] += 1
            else:
                message = item
            if message.WhichOneof("message") != "heartbeat":
                self.router.receive(message)

    def deliver(self, count: int) -> None:
        """Up to `count` of the router's replies reach the engine."""
        outbox = self.router.outbox
        for _ in range(count):
            if not self.up or not outbox or self.router.blackholed:
                return
            self._on_message(outbox.pop(0))

    def lose(self, reason: str) -> None:
        """The stream breaks (the router process died, the network failed)."""
        if self.up:
            self.router.close()
            self.mark_down(reason)


class SimCapture:
    """Capture's controller as the runtime sees it: rows of what the stages
    computed, from every TP rank, buffered until drained, then merged and
    filtered by the driver's real code; faults on request."""

    def __init__(self, world: "World") -> None:
        self.world = world
        self.registered: dict[str, tuple[list[ExtractionPoint], int]] = {}
        self.pending: list[Block] = []
        self.delivered_positions = DeliveredPositions()
        self.ending: set[str] = set()
        self.backlog_rows_dropped = 0
        self.dropped: dict = defaultdict(list)  # (key, point) -> positions reported dropped, for the next drain
        self.errors: dict[str, str] = {}
        # (key, position) -> what happens to the rows computed there: "lose", "drop" or "nan".
        self.faults: dict[tuple[str, int], str] = {}
        # Per run key: every row computed while registered, as (point, position) (those
        # lost without a word too), once however often it was recomputed; those a drain
        # handed the engine while the run was live; rows a worker dropped whose report
        # the engine took while the run was live.
        self.made: dict[str, list[tuple[str, int]]] = defaultdict(list)
        self.delivered: dict[str, list[tuple[str, int]]] = defaultdict(list)
        self.reported: dict[str, list[tuple[str, int]]] = defaultdict(list)

    @property
    def recomputed_rows_discarded(self) -> int:
        return self.delivered_positions.discarded

    async def start(self) -> types_pb.ModelInfo:
        return MODEL

    def model_info(self) -> types_pb.ModelInfo:
        return MODEL

    def validate(self, points, prompt_tokens=None) -> None:
        pass

    async def register(self, key: str, points, prompt_tokens: int) -> None:
        self.registered[key] = (points, prompt_tokens)

    async def unregister(self, key: str) -> None:
        if self.registered.pop(key, None) is not None:
            self.ending.add(key)

    def computed(self, key: str, stage: int, positions: list[int]) -> None:
        """The rows of `stage`'s points at these positions."""
        if key not in self.registered or not positions:
            return
        points, prompt_tokens = self.registered[key]
        for point in points:
            if not any(point.name == point_name(t, layer) for t, layer in STAGE_LAYERS[stage]):
                continue
            chosen = [p for p in positions
                      if point.tokens.mask(np.array([p]), prompt_tokens)[0]]
            kept = []
            for p in chosen:
                first = (point.name, p) not in self.made[key]
                if first:
                    self.made[key].append((point.name, p))
                fault = self.faults.get((key, p))
                if fault == "lose":
                    continue
                if fault == "drop":
                    self.dropped[(key, point.name)].append(p)
                    self.backlog_rows_dropped += 1
                    self.errors.setdefault(key, "capture: rank 0 dropped rows of this request "
                                                "(--capture-backlog-bytes)")
                else:
                    kept.append(p)
            if not kept:
                continue
            rows = np.zeros((len(kept), HIDDEN), np.float32)
            rows[:, 0] = [self.world.value(key, p) for p in kept]
            for i, p in enumerate(kept):
                if self.faults.get((key, p)) == "nan":
                    rows[i, 0] = np.nan
            tensor_type, layer = next((t, layer) for t, layer in STAGE_LAYERS[stage] if point.name == point_name(t, layer))
            for _rank in range(TP_RANKS):
                self.pending.append(Block(
                    point.name,
                    types_pb.TENSOR_TYPE_FINAL_NORM if tensor_type == "final_norm" else types_pb.TENSOR_TYPE_RESIDUAL_STREAM,
                    1 if layer is None else layer,
                    rows.copy(), [key] * len(kept), np.asarray(kept, np.int64),
                    np.asarray([p >= prompt_tokens for p in kept])))

    async def drain(self) -> list[Block]:
        """The driver's drain: every rank's rows merged, TP duplicates and rows an
        earlier drain delivered (recomputed after a preemption) dropped."""
        await asyncio.sleep(0)
        pending, self.pending = self.pending, []
        ending, self.ending = self.ending, set()
        blocks = self.delivered_positions.filter(merge_blocks(pending))
        self.delivered_positions.forget(ending)
        for block in blocks:
            for key, position in zip(block.request_ids, block.token_positions.tolist()):
                if self._live(key):
                    self.delivered[key].append((block.point, position))
        return blocks

    def pop_request_errors(self) -> dict[str, str]:
        errors, self.errors = self.errors, {}
        return errors

    def pop_dropped_rows(self) -> dict:
        dropped, self.dropped = self.dropped, defaultdict(list)
        for (key, point), positions in dropped.items():
            if self._live(key):
                self.reported[key].extend((point, p) for p in positions)
        return dropped

    def _live(self, key: str) -> bool:
        run = self.world.runtime.runs.get(key) if self.world.runtime else None
        return run is not None and not run.finished_sent


class SimTokenizer:
    def encode(self, text: str) -> list[int]:
        return [ord(c) % 500 for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(f"<{i}>" for i in ids)


@dataclass
class SimRequest:
    """One request inside the simulated vLLM: what each stage computed, what was sampled."""

    key: str
    prompt_tokens: int
    max_tokens: int
    outputs: asyncio.Queue = field(default_factory=asyncio.Queue)
    computed: list[int] = field(default_factory=lambda: [0] * STAGES)  # next position per stage
    reached: list[int] = field(default_factory=lambda: [0] * STAGES)  # the furthest, across preemptions
    sampled: int = 0  # tokens sampled (by the last stage)
    emitted: int = 0  # tokens handed to the engine
    abort_after: int | None = None  # emits left before an abort lands
    finished: bool = False


class SimVllm:
    """AsyncLLM's surface the runtime uses, stepped by the test."""

    def __init__(self, world: "World", capture: SimCapture) -> None:
        self.world = world
        self.capture = capture
        self.vllm_config = SimpleNamespace(model_config=SimpleNamespace(get_vocab_size=lambda: 512,
                                                                         max_model_len=4096))
        self.requests: dict[str, SimRequest] = {}
        self.aborted: list[str] = []

    def get_tokenizer(self) -> SimTokenizer:
        return SimTokenizer()

    async def generate(self, prompt, params, request_id: str):
        request = SimRequest(request_id, len(prompt["prompt_token_ids"]), params.max_tokens)
        self.requests[request_id] = request
        while True:
            output = await request.outputs.get()
            yield output
            if output.finished:
                return

    async def abort(self, request_id: str) -> None:
        request = self.requests.get(request_id)
        if request is None or request.finished:
            return
        self.aborted.append(request_id)
        if request.abort_after is None:
            request.abort_after = self.world.abort_lag

    def compute(self, key: str, stage: int) -> None:
        """`stage` computes what it can: the whole prompt, or the next position."""
        request = self.requests.get(key)
        if request is None or request.finished:
            return
        start = request.computed[stage]
        if stage == 0:  # the newest token is fed back unless it was the last one
            fed = min(request.sampled, request.max_tokens - 1)
            limit = request.prompt_tokens if start < request.prompt_tokens else request.prompt_tokens + fed
        else:
            limit = request.computed[stage - 1]
        stop = min(limit, start + max(1, request.prompt_tokens - start)) if start < request.prompt_tokens else min(limit, start + 1)
        if stop <= start:
            return
        positions = list(range(start, stop))
        request.computed[stage] = stop
        request.reached[stage] = max(request.reached[stage], stop)
        self.capture.computed(key, stage, positions)
        if stage == STAGES - 1 and stop >= request.prompt_tokens and request.sampled < request.max_tokens:
            request.sampled = max(request.sampled, stop - request.prompt_tokens + 1)

    def preempt(self, key: str) -> None:
        """vLLM preempts the request: its KV cache is freed and every stage
        recomputes it from position 0 (tokens already sampled stay)."""
        request = self.requests.get(key)
        if request is not None and not request.finished:
            request.computed = [0] * STAGES

    def emit(self, key: str) -> None:
        """vLLM's outputs so far reach the engine (an abort lands after `abort_lag` of them)."""
        request = self.requests.get(key)
        if request is None or request.finished:
            return
        if request.abort_after is not None:
            if request.abort_after == 0:
                self._finish(request, [], "abort")
                return
            request.abort_after -= 1
        tokens = list(range(100 + request.emitted, 100 + request.sampled))
        if not tokens:
            return
        request.emitted = request.sampled
        done = request.emitted >= request.max_tokens
        self._finish(request, tokens, "length") if done else request.outputs.put_nowait(_output(tokens, False, None))

    def _finish(self, request: SimRequest, tokens: list[int], reason: str) -> None:
        request.finished = True
        request.outputs.put_nowait(_output(tokens, True, reason))


def _output(token_ids: list[int], finished: bool, reason: str | None):
    completion = SimpleNamespace(token_ids=token_ids, text="", finish_reason=reason)
    return SimpleNamespace(outputs=[completion], finished=finished)


class World:
    """The routers, the network's hand, the clock, and the ground truth."""

    def __init__(self, replicas: dict[str, list[str]], seed: int) -> None:
        self.truth = Truth()
        self.now = 0.0
        self.abort_lag = 1
        # Each router loads probes of its own (a forced unload retires one router's
        # copy only); every copy of a version has the same digest.
        self.probes = catalog_probes()
        self.routers = {}
        for address, names in replicas.items():
            own = catalog_probes()
            self.routers[address] = SimRouter(address, [own[n] for n in names], self.truth)
        self.rng = np.random.default_rng(seed)
        self._values: dict[tuple[str, int], float] = {}
        self.sessions: dict[str, SimReplica] = {}
        self.runtime = None  # the engine under test, once made

    def value(self, key: str, position: int) -> float:
        """A row's first element (what every probe here reads), the same for every point.
        Mostly below every threshold, so runs live long enough to meet faults."""
        if (key, position) not in self._values:
            self._values[(key, position)] = float(self.rng.choice([0.1, 0.6, 0.92, 0.97], p=[0.4, 0.4, 0.1, 0.1]))
        return self._values[(key, position)]

    def session_factory(self, address, config, hello, listener, metrics) -> SimReplica:
        replica = SimReplica(address, config, hello, listener, metrics)
        replica.world = self
        self.sessions[address] = replica
        return replica


def selects(tokens: types_pb.TokenSelector, position: int, prompt_tokens: int) -> bool:
    return bool(TokenSelector.from_proto(tokens).mask(np.array([position]), prompt_tokens)[0])
