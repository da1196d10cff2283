"""The ProbeRouter.Session and ProbeAdmin servicers: thin gRPC shells over
`session.SessionState` and `registry.ProbeRegistry`.

A Session has one writer: the handler generator drains an outbox queue that the
reader task (replies to engine messages, in order), the heartbeat task, catalog
updates and drain all put into.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import time
from typing import TYPE_CHECKING, AsyncIterator

from common import tensor_codec
from common.enum_checks import check_enums
from common.errors import InvalidArgument, ResourceExhausted
from common.log_limits import RateLimitedLog
from common.probe_format.files import ProbeFileError, check_inline_size, load_probe_bytes
from common.probe_format.manifest import ManifestError
from router_service.session import SessionState, error
from undercurrent.v1 import admin_pb2 as admin_pb
from undercurrent.v1 import router_session_pb2 as session_pb
from undercurrent.v1 import types_pb2 as types_pb
from undercurrent.v1 import admin_pb2_grpc as admin_pb_grpc
from undercurrent.v1 import router_session_pb2_grpc as session_pb_grpc

if TYPE_CHECKING:
    from router_service.server import Router

log = logging.getLogger(__name__)
_error_log = RateLimitedLog(log)  # at most one traceback per kind of failure per interval

OUTBOX_SIZE = 1024  # replies waiting for the engine to read them; beyond it the reader waits
# A batch with at most this many bytes of rows is scored on the event loop: handing
# it to a scoring thread and back costs two thread wake-ups and the GIL changing
# hands twice (0.3-0.5 ms per batch measured on a 2-core CPU host), as much as
# a quarter of scoring a 2 MiB batch, and on a busy host each hop waits for the
# scheduler (tens of ms were measured), which delays the verdict. A batch this size
# holds the loop for 3-4 ms on one core here. Larger batches go to the scoring
# threads, so other sessions, heartbeats and admin calls keep flowing while numpy
# works (it releases the GIL).
INLINE_SCORING_BYTES = 4 * 1024 * 1024
_session_ids = itertools.count(1)


class LiveSession:
    """One open Session stream: its state, its outbox and its background tasks."""

    def __init__(self, router: "Router", hello: session_pb.SessionHello):
        self.id = next(_session_ids)
        self.engine_id = hello.engine_id
        self.accepts_replies = hello.accepts_replies
        self.router = router
        self.state = SessionState(
            router.registry,
            hello.model,
            router.metrics,
            scores_interval=router.config.scores_interval,
            draining=lambda: router.draining,
            max_requests=router.config.max_requests_per_session,
            verdict_log=router.verdict_log,
            router_id=router.router_id,
        )
        self.outbox: asyncio.Queue[session_pb.SessionResponse | None] = asyncio.Queue(OUTBOX_SIZE)
        self._tasks: set[asyncio.Task] = set()
        self._scoring: concurrent.futures.Future | None = None

    def spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def send_all(self, messages: list[session_pb.SessionResponse]) -> None:
        for message in messages:
            await self.outbox.put(message)

    def send_catalog(self) -> None:
        probes, errors = self.state.catalog()
        self.spawn(self.send_all([*errors, session_pb.SessionResponse(catalog=session_pb.ProbeCatalog(probes=probes))]))

    async def read(self, engine_messages: AsyncIterator[session_pb.SessionRequest]) -> None:
        try:
            async for message in engine_messages:
                await self.send_all(self._as_one(await self._handle(message)))
        except asyncio.CancelledError:
            raise
        except Exception as err:  # the engine's side of the stream broke
            log.info("session read ended", extra={"session": self.id, "reason": repr(err)})
        await self.outbox.put(None)

    def _as_one(self, replies: list[session_pb.SessionResponse]) -> list[session_pb.SessionResponse]:
        """The replies to one engine message (a batch: a score per request, then
        the ack) as one SessionReplies when the engine reads them: each gRPC
        message costs both processes far more CPU than its bytes do."""
        if not self.accepts_replies or len(replies) < 2:
            return replies
        return [session_pb.SessionResponse(replies=session_pb.SessionReplies(messages=replies))]

    async def _handle(self, message: session_pb.SessionRequest) -> list[session_pb.SessionResponse]:
        kind = message.WhichOneof("message")
        # Bindings a forced unload detached: the engine hears of them before this
        # batch's ack whatever scoring does, or it would count their rows scored.
        notices: list[session_pb.SessionResponse] = []
        try:
            if kind == "batch":
                notices = self.state.detach_retired()
                if row_bytes(message.batch) <= INLINE_SCORING_BYTES:
                    return notices + self.state.batch(message.batch)
                self._scoring = self.router.executor.submit(self.state.batch, message.batch)
                return notices + await asyncio.wrap_future(self._scoring)
            if kind == "request_start":
                return self.state.start(message.request_start)
            if kind == "request_end":
                return self.state.end(message.request_end)
            if kind == "heartbeat":
                return [session_pb.SessionResponse(heartbeat=message.heartbeat)]
            if kind == "hello":
                return [error("", "FAILED_PRECONDITION", "hello: the session already said hello; ignored")]
            return [error("", "INVALID_ARGUMENT", "SessionRequest: no message set")]
        except Exception as err:  # a bug must not take the other requests down
            _error_log.log((kind, type(err).__qualname__), logging.ERROR, "error handling engine message",
                           exc_info=err, extra={"session": self.id, "kind": kind})
            if kind == "batch":  # an error per request of the batch, then its ack
                return notices + self.state.batch_failed(message.batch, err)
            about = getattr(message, kind) if kind in ("request_start", "request_end") else None
            return [error(about.request_id if about else "", "INTERNAL",
                          f"{kind}: internal error: {type(err).__name__}: {err}",
                          incarnation=about.incarnation if about else 0)]

    async def heartbeat(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            await self.outbox.put(session_pb.SessionResponse(heartbeat=session_pb.Heartbeat(sent_unix_nanos=time.time_ns())))

    async def stop(self) -> None:
        """Cancels the tasks and waits for a batch still scoring, so state can be freed."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._scoring is not None and not self._scoring.cancelled():
            await asyncio.gather(asyncio.wrap_future(self._scoring), return_exceptions=True)

    async def close(self) -> None:
        """Stops the tasks, frees every request, and leaves the router's sessions."""
        await self.stop()
        freed = self.state.close()
        self.router.session_closed(self)
        log.info("session closed", extra={"session": self.id, "engine_id": self.engine_id,
                                          "requests_freed": freed})


def row_bytes(batch: types_pb.ActivationBatch) -> int:
    """The bytes of rows a batch's blocks declare: counting the bytes themselves
    would copy them on the event loop."""
    return sum(tensor_codec.declared_nbytes(block.rows) for block in batch.blocks)


class SessionServicer(session_pb_grpc.ProbeRouterServiceServicer):
    def __init__(self, router: "Router"):
        self.router = router
        self._closing: set[asyncio.Task] = set()  # clean-ups that outlive their cancelled handler

    async def Session(self, request_iterator, context):
        try:
            first = await anext(request_iterator)
        except StopAsyncIteration:
            return
        if first.WhichOneof("message") != "hello":
            raise InvalidArgument(
                f"the first SessionRequest must be hello, got {first.WhichOneof('message')!r}"
            )
        check_enums(first.hello, "hello")
        model = first.hello.model
        if model.hidden_size <= 0 or model.num_layers <= 0:
            raise InvalidArgument(
                f"hello.model: hidden_size {model.hidden_size} and num_layers {model.num_layers} "
                "must both be > 0"
            )
        if len(self.router.sessions) >= self.router.config.max_sessions:
            raise ResourceExhausted(
                f"this router already serves {len(self.router.sessions)} sessions, its --max-sessions; "
                "connect to another replica"
            )
        session = LiveSession(self.router, first.hello)
        probes, errors = session.state.catalog()
        unsubscribe = self.router.registry.subscribe(session.send_catalog)
        self.router.session_opened(session)
        log.info("session opened", extra={"session": session.id, "engine_id": session.engine_id,
                                          "model": model.model, "probes": [p.name for p in probes]})
        session.spawn(session.read(request_iterator))
        session.spawn(session.heartbeat(self.router.config.heartbeat_interval))
        try:
            yield session_pb.SessionResponse(hello=session_pb.RouterHello(router_id=self.router.router_id, probes=probes))
            for message in errors:
                yield message
            if self.router.draining:
                yield self.router.drain_message()
            while (message := await session.outbox.get()) is not None:
                yield message
        finally:
            unsubscribe()
            # An engine that goes away half-closes and cancels, and the two can arrive
            # together: the cancel then lands while the clean-up waits for the session's
            # tasks. Shielded, the clean-up finishes anyway; cut short, the session's
            # requests would stay for the router's life.
            closing = asyncio.get_running_loop().create_task(session.close())
            self._closing.add(closing)
            closing.add_done_callback(self._closing.discard)
            await asyncio.shield(closing)


class AdminServicer(admin_pb_grpc.ProbeAdminServiceServicer):
    def __init__(self, router: "Router"):
        self.router = router

    async def LoadProbe(self, request: admin_pb.LoadProbeRequest, context) -> admin_pb.LoadProbeResponse:
        check_enums(request, "LoadProbeRequest")
        source = request.WhichOneof("source")
        try:
            if source == "path":
                root = self.router.config.probe_root
                if root is None:
                    raise InvalidArgument("path: this router has no --probe-root to load probes from; "
                                          "send the probe inline")
                probe = await asyncio.to_thread(root.load, request.path)
            elif source == "inline":
                check_inline_size(request.inline.manifest_json, request.inline.weights_safetensors,
                                  self.router.config.max_inline_probe_bytes)
                probe = load_probe_bytes(
                    request.inline.manifest_json, request.inline.weights_safetensors or None
                )
            else:
                raise InvalidArgument("LoadProbeRequest: set path or inline")
        except (ProbeFileError, ManifestError) as err:
            raise InvalidArgument(str(err)) from None
        registry = self.router.registry
        loaded = registry.load(probe, replace=request.replace, role=request.role or types_pb.PROBE_ROLE_SERVING,
                               share=request.canary_share)
        return admin_pb.LoadProbeResponse(probe=registry.info(loaded))

    async def ListProbes(self, request, context) -> admin_pb.ListProbesResponse:
        registry = self.router.registry
        return admin_pb.ListProbesResponse(probes=[registry.info(p) for p in registry.probes()]
                                           + [registry.info(c.probe) for c in registry.candidates()])

    async def PromoteProbe(self, request: admin_pb.PromoteProbeRequest, context) -> admin_pb.PromoteProbeResponse:
        registry = self.router.registry
        return admin_pb.PromoteProbeResponse(probe=registry.info(registry.promote(request.name)))

    async def RollBackProbe(self, request: admin_pb.RollBackProbeRequest, context) -> admin_pb.RollBackProbeResponse:
        registry = self.router.registry
        return admin_pb.RollBackProbeResponse(probe=registry.info(registry.roll_back(request.name)))

    async def UnloadProbe(self, request: admin_pb.UnloadProbeRequest, context) -> admin_pb.UnloadProbeResponse:
        return admin_pb.UnloadProbeResponse(unloaded=self.router.registry.unload(request.name, request.force))
