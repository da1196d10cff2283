"""A small but honest ProbeRouter for the router-link tests and the memory benchmarks.

It speaks the Session protocol the real router speaks: hello answered with its
probes, catalog pushes, scores and aborts for step N before the ack of step N
(as one SessionReplies to an engine that accepts replies),
in-band RequestErrors, echoed and own heartbeats, and drain; it echoes each
request's incarnation. Its one probe rule: a request's score per row is the
row's first element; any score above `threshold` aborts the request (once).
Faults a test can switch on: silence (the stream stays open), withheld acks,
a batch-level INTERNAL error, a per-request INVALID_ARGUMENT, a refused
request_start. It records everything it receives.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from google.rpc import code_pb2
from undercurrent.v1 import router_session_pb2 as session_pb
from undercurrent.v1 import types_pb2 as types_pb
from undercurrent.v1 import router_session_pb2_grpc as session_pb_grpc

from common.activations import from_batch
from common.grpc_server import SERVICE_FULL_NAMES, ServerHandle, start_server
from common.security.config import ServerSecurity

PROBE = types_pb.ProbeInfo(
    name="first_element", kind=types_pb.PROBE_KIND_LINEAR, tensor_type=types_pb.TENSOR_TYPE_RESIDUAL_STREAM, layers=[0],
    version="1", digest="sha256:first-element-v1",
)


@dataclass
class Received:
    """What one request looked like from this router."""

    starts: list[session_pb.RequestStart] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)  # every row's token position, in order
    steps: list[int] = field(default_factory=list)
    ended: bool = False


class RouterDouble(session_pb_grpc.ProbeRouterServiceServicer):
    def __init__(
        self, name: str, probes=(PROBE,), threshold: float = 100.0, heartbeat_s: float = 0.1,
        replies_as_one: bool = True,
    ) -> None:
        self.name = name
        # As the real router: the replies to one engine message go as one
        # SessionReplies to an engine whose hello said accepts_replies.
        self.replies_as_one = replies_as_one
        self.probes = list(probes)
        self.threshold = threshold
        self.heartbeat_s = heartbeat_s
        self.silent = False  # stops every outgoing message, acks and heartbeats included
        # Steps for which no ack is sent (until release_acks()).
        self.withhold_ack = lambda step: False
        self.withheld: list[int] = []
        # Steps answered with an INTERNAL error naming the step and no request
        # (as a router does when scoring a whole batch fails), then the ack.
        self.fail_steps: set[int] = set()
        # Requests whose rows are answered INVALID_ARGUMENT (as for NaN rows).
        self.bad_rows: set[str] = set()
        # request_start of these requests is refused with RESOURCE_EXHAUSTED.
        self.refuse: set[str] = set()
        # (Both name a request by its id, or by the client's id within an engine's
        # run key "<client id>#<incarnation>", as the engine's tests know it.)
        self.incarnations: dict[str, int] = {}
        self.requests: dict[str, Received] = {}
        self.log: list[tuple[str, str]] = []  # (kind, request_id) in arrival order
        self.batches: list[types_pb.ActivationBatch] = []
        self.hellos: list[session_pb.SessionHello] = []
        self.half_closed = 0  # sessions the engine ended gracefully
        self.heartbeats = 0
        # Cleared: stops reading, so HTTP/2 flow control pushes back on the engine.
        self.reading = asyncio.Event()
        # gRPC channel arguments for the server, set before start().
        self.transport_options: list[tuple[str, int]] = []
        self.reading.set()
        self._outboxes: list[asyncio.Queue] = []
        self._aborted: set[str] = set()
        self.handle: ServerHandle | None = None
        self.port = 0
        self.changed = asyncio.Event()

    async def start(self, port: int = 0, security: ServerSecurity | None = None) -> RouterDouble:
        """Listens on port (0: any); security None is plaintext."""
        self.handle = await start_server(
            [
                (
                    session_pb_grpc.add_ProbeRouterServiceServicer_to_server,
                    self,
                    SERVICE_FULL_NAMES["ProbeRouterService"],
                )
            ],
            "127.0.0.1",
            port,
            security=security,
            transport_options=self.transport_options,
        )
        self.port = self.handle.port
        return self

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def kill(self) -> None:
        """Ends every stream abruptly, as a crash would."""
        await self.handle.server.stop(grace=None)

    def push(self, message: session_pb.SessionResponse) -> None:
        for outbox in self._outboxes:
            outbox.put_nowait(message)

    def drain(self, reason: str = "shutting down") -> None:
        self.push(session_pb.SessionResponse(drain=session_pb.Drain(reason=reason)))

    def release_acks(self) -> None:
        """Sends the withheld acks, in step order."""
        self.withhold_ack = lambda step: False
        for step in sorted(self.withheld):
            self.push(session_pb.SessionResponse(ack=session_pb.StepAck(step=step)))
        self.withheld.clear()

    def set_probes(self, probes) -> None:
        self.probes = list(probes)
        self.push(session_pb.SessionResponse(catalog=session_pb.ProbeCatalog(probes=self.probes)))

    async def wait_for(self, predicate, timeout: float = 10.0) -> None:
        async with asyncio.timeout(timeout):
            while not predicate():
                self.changed.clear()
                await self.changed.wait()

    async def Session(self, request_iterator, context):
        outbox: asyncio.Queue = asyncio.Queue()
        self._outboxes.append(outbox)
        reader = asyncio.create_task(self._read(request_iterator, outbox))
        beater = asyncio.create_task(self._beat(outbox))
        try:
            while True:
                message = await outbox.get()
                if message is None:
                    return
                if not self.silent:
                    yield message
        finally:
            self._outboxes.remove(outbox)
            reader.cancel()
            beater.cancel()

    async def _beat(self, outbox: asyncio.Queue) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_s)
            outbox.put_nowait(
                session_pb.SessionResponse(heartbeat=session_pb.Heartbeat(sent_unix_nanos=time.time_ns()))
            )

    async def _read(self, request_iterator, outbox: asyncio.Queue) -> None:
        as_one = False
        async for message in request_iterator:
            await self.reading.wait()
            if message.WhichOneof("message") == "hello":
                as_one = self.replies_as_one and message.hello.accepts_replies
            replies = self._handle(message)
            if as_one and len(replies) > 1:
                replies = [session_pb.SessionResponse(replies=session_pb.SessionReplies(messages=replies))]
            for reply in replies:
                outbox.put_nowait(reply)
            self.changed.set()
        self.half_closed += 1
        outbox.put_nowait(None)  # the engine half-closed: end the stream too

    def _handle(self, message: session_pb.SessionRequest) -> list[session_pb.SessionResponse]:
        kind = message.WhichOneof("message")
        if kind == "hello":
            self.hellos.append(message.hello)
            return [session_pb.SessionResponse(hello=session_pb.RouterHello(router_id=self.name, probes=self.probes))]
        if kind == "heartbeat":
            self.heartbeats += 1
            return [session_pb.SessionResponse(heartbeat=message.heartbeat)]  # the echo
        if kind == "request_start":
            start = message.request_start
            self.requests.setdefault(start.request_id, Received()).starts.append(start)
            self.incarnations[start.request_id] = start.incarnation
            self.log.append(("start", start.request_id))
            if _named(start.request_id, self.refuse):
                return [self._error(start.request_id, code_pb2.RESOURCE_EXHAUSTED, "too many requests")]
            loaded = {p.name: p.digest for p in self.probes}
            return [
                self._error(start.request_id, code_pb2.NOT_FOUND, f"probe {b.probe!r} is not loaded", probe=b.probe)
                if b.probe not in loaded else
                self._error(start.request_id, code_pb2.FAILED_PRECONDITION,
                            f"probe {b.probe!r} is {loaded[b.probe]} here, bound to {b.digest}", probe=b.probe)
                for b in start.bindings
                if loaded.get(b.probe) != b.digest
            ]
        if kind == "request_end":
            self.requests[message.request_end.request_id].ended = True
            self.log.append(("end", message.request_end.request_id))
            return []
        if kind == "batch":
            return self._score(message.batch)
        return []

    def _error(self, request_id: str, code: int, message: str, probe: str = "", step: int = 0):
        return session_pb.SessionResponse(
            error=session_pb.RequestError(
                request_id=request_id,
                incarnation=self.incarnations.get(request_id, 0) if request_id else 0,
                probe=probe,
                code=code,
                message=message,
                step=step,
            )
        )

    def _ack(self, step: int) -> list[session_pb.SessionResponse]:
        if self.withhold_ack(step):
            self.withheld.append(step)
            return []
        return [session_pb.SessionResponse(ack=session_pb.StepAck(step=step))]

    def _score(self, batch: types_pb.ActivationBatch) -> list[session_pb.SessionResponse]:
        self.batches.append(batch)
        if batch.step in self.fail_steps:
            return [self._error("", code_pb2.INTERNAL, "scoring the batch failed", step=batch.step),
                    *self._ack(batch.step)]
        per_request: dict[str, list[tuple[int, float]]] = {}
        for block in from_batch(batch):
            for i, request_id in enumerate(block.request_ids):
                position = int(block.token_positions[i])
                per_request.setdefault(request_id, []).append((position, float(block.rows[i, 0])))
        replies = []
        for request_id, scored in per_request.items():
            received = self.requests[request_id]  # KeyError: a batch before request_start
            received.positions.extend(p for p, _ in scored)
            received.steps.append(batch.step)
            self.log.append(("batch", request_id))
            if _named(request_id, self.bad_rows):
                replies.append(self._error(request_id, code_pb2.INVALID_ARGUMENT,
                                           "rows: NaN or Inf", step=batch.step))
                continue
            replies.append(scores_reply(request_id, self.incarnations[request_id], probe=PROBE.name,
                                        token_positions=[p for p, _ in scored], scores=[s for _, s in scored]))
            over = [(p, s) for p, s in scored if s > self.threshold]
            if over and request_id not in self._aborted:
                self._aborted.add(request_id)
                position, score = over[0]
                replies.append(abort_reply(request_id, self.incarnations[request_id], probe=PROBE.name,
                                           score=score, token_position=position,
                                           reason="first element over threshold"))
        return replies + self._ack(batch.step)


def scores_reply(request_id: str, incarnation: int, **scores) -> session_pb.SessionResponse:
    """Scores about one run of a request: its id and the incarnation request_start gave."""
    return session_pb.SessionResponse(scores=session_pb.SessionScores(
        probe_scores=types_pb.ProbeScores(request_id=request_id, **scores), incarnation=incarnation))


def abort_reply(request_id: str, incarnation: int, **verdict) -> session_pb.SessionResponse:
    """A verdict about one run of a request: its id and the incarnation request_start gave."""
    return session_pb.SessionResponse(abort=session_pb.SessionAbort(
        verdict=types_pb.Verdict(request_id=request_id, **verdict), incarnation=incarnation))


def _named(request_id: str, names: set[str]) -> bool:
    return request_id in names or request_id.rsplit("#", 1)[0] in names


def of_client(by_key: dict, client_id: str):
    """What a router keeps by the engine's run key ("<client id>#<incarnation>"),
    for the latest run of a client's request id."""
    keys = [key for key in by_key if key.rsplit("#", 1)[0] == client_id]
    assert keys, f"no run of {client_id!r} among {sorted(by_key)}"
    return by_key[max(keys, key=lambda key: int(key.rsplit("#", 1)[1]))]
