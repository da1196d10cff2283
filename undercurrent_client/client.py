"""Blocking and asyncio clients of EngineService and ProbeAdminService.

Both kinds share the request builders (requests.py) and the event reader
(events.py); each method is one call plus error translation. Every failed call
raises RpcError with the gRPC status and the server's message.
"""

from __future__ import annotations

from pathlib import Path
from typing import AsyncIterator, Iterator, Self, Sequence

import grpc

from undercurrent.v1 import admin_pb2 as admin_pb
from undercurrent.v1 import engine_pb2 as engine_pb
from undercurrent.v1 import types_pb2 as types_pb
from undercurrent.v1 import admin_pb2_grpc as admin_pb_grpc
from undercurrent.v1 import engine_pb2_grpc as engine_pb_grpc
from undercurrent_client.connection import Connection, connection
from undercurrent_client.errors import RpcError
from undercurrent_client.events import Event, event_of
from undercurrent_client.requests import generate_request, inline_probe


def _load_request(path: str | Path | None, upload: str | Path | None, inline: admin_pb.InlineProbe | None,
                  replace: bool, shadow: bool, canary: float | None) -> admin_pb.LoadProbeRequest:
    sources = [s for s in (path, upload, inline) if s is not None]
    if len(sources) != 1:
        raise ValueError("load: give exactly one of path (on the router), upload (a local probe) "
                         "or inline")
    if shadow and canary is not None:
        raise ValueError("load: a version is a shadow or a canary, not both")
    role = (types_pb.PROBE_ROLE_SHADOW if shadow else types_pb.PROBE_ROLE_CANARY if canary is not None
            else types_pb.PROBE_ROLE_SERVING)
    request = admin_pb.LoadProbeRequest(replace=replace, role=role, canary_share=canary or 0.0)
    if path is not None:
        request.path = str(path)
    else:
        request.inline.CopyFrom(inline or inline_probe(upload))
    return request


def _request(prompt, options) -> engine_pb.GenerateRequest:
    if isinstance(prompt, engine_pb.GenerateRequest):
        if options:
            raise TypeError("pass either a GenerateRequest or a prompt with options, not both")
        return prompt
    return generate_request(prompt, **options)


class _Base:
    def __init__(self, target: str | Connection, timeout: float | None, **options):
        self.connection = connection(target, **options)
        self.timeout = timeout
        self._metadata = self.connection.metadata()


class _BlockingClient(_Base):
    """One blocking channel and stub; unary calls raise RpcError."""

    def __init__(self, stub_class, target: str | Connection, timeout: float | None, **options):
        super().__init__(target, timeout, **options)
        self._channel = self.connection.channel()
        self._stub = stub_class(self._channel)

    def _unary(self, method: str, request):
        try:
            return getattr(self._stub, method)(request, timeout=self.timeout,
                                               metadata=self._metadata)
        except grpc.RpcError as err:
            raise RpcError.from_grpc(method, err) from None

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _AsyncClient(_Base):
    """One asyncio channel and stub; unary calls raise RpcError."""

    def __init__(self, stub_class, target: str | Connection, timeout: float | None, **options):
        super().__init__(target, timeout, **options)
        self._channel = self.connection.aio_channel()
        self._stub = stub_class(self._channel)

    async def _unary(self, method: str, request):
        try:
            return await getattr(self._stub, method)(request, timeout=self.timeout,
                                                     metadata=self._metadata)
        except grpc.RpcError as err:
            raise RpcError.from_grpc(method, err) from None

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


class EngineClient(_BlockingClient):
    """Blocking client of EngineService.

        with EngineClient("127.0.0.1:50051") as engine:
            for event in engine.generate("Hello", max_tokens=16, probes=["toxicity"]):
                ...

    timeout: seconds per call (for generate: the whole stream); None waits forever.
    Connection options (root_certificates, token, ...) are keywords; see Connection.
    """

    def __init__(self, target: str | Connection, timeout: float | None = None, **options):
        super().__init__(engine_pb_grpc.EngineServiceStub, target, timeout, **options)

    def generate(self, prompt: str | Sequence[int] | engine_pb.GenerateRequest,
                 **options) -> Iterator[Event]:
        """Streams typed events: Started, Tokens, ProbeScores, Activations, Finished.
        Takes a GenerateRequest, or a prompt and the keywords of generate_request.
        Closing the iterator early cancels the stream, which aborts the request."""
        request = _request(prompt, options)
        call = self._stub.Generate(request, timeout=self.timeout, metadata=self._metadata)
        try:
            for response in call:
                yield event_of(response)
        except grpc.RpcError as err:
            raise RpcError.from_grpc("Generate", err) from None
        finally:
            call.cancel()

    def abort(self, request_id: str) -> bool:
        """Aborts a running request; False when no such request runs."""
        return self._unary("Abort", engine_pb.AbortRequest(request_id=request_id)).found

    def model_info(self) -> types_pb.ModelInfo:
        return self._unary("GetModelInfo", engine_pb.GetModelInfoRequest()).model


class AsyncEngineClient(_AsyncClient):
    """asyncio client of EngineService; the same methods as EngineClient, awaited.

        async with AsyncEngineClient("127.0.0.1:50051") as engine:
            async for event in engine.generate("Hello", max_tokens=16):
                ...
    """

    def __init__(self, target: str | Connection, timeout: float | None = None, **options):
        super().__init__(engine_pb_grpc.EngineServiceStub, target, timeout, **options)

    async def generate(self, prompt: str | Sequence[int] | engine_pb.GenerateRequest,
                       **options) -> AsyncIterator[Event]:
        """Streams typed events; leaving the loop early cancels the stream, which
        aborts the request."""
        request = _request(prompt, options)
        call = self._stub.Generate(request, timeout=self.timeout, metadata=self._metadata)
        try:
            async for response in call:
                yield event_of(response)
        except grpc.RpcError as err:
            raise RpcError.from_grpc("Generate", err) from None
        finally:
            call.cancel()

    async def abort(self, request_id: str) -> bool:
        return (await self._unary("Abort", engine_pb.AbortRequest(request_id=request_id))).found

    async def model_info(self) -> types_pb.ModelInfo:
        return (await self._unary("GetModelInfo", engine_pb.GetModelInfoRequest())).model


class ProbeAdminClient(_BlockingClient):
    """Blocking client of ProbeAdminService on one router replica.

    load(path=...) loads a probe from the router's file system; load(upload=...)
    sends a local probe directory or .safetensors file inline. shadow=True loads
    it as a shadow of the serving version of its name, canary=SHARE as a canary
    taking that share of new requests; promote and roll_back end the rollout.
    """

    def __init__(self, target: str | Connection, timeout: float | None = 30.0, **options):
        super().__init__(admin_pb_grpc.ProbeAdminServiceStub, target, timeout, **options)

    def load(self, path: str | Path | None = None, *, upload: str | Path | None = None,
             inline: admin_pb.InlineProbe | None = None, replace: bool = False, shadow: bool = False,
             canary: float | None = None) -> types_pb.ProbeInfo:
        return self._unary("LoadProbe", _load_request(path, upload, inline, replace, shadow, canary)).probe

    def promote(self, name: str) -> types_pb.ProbeInfo:
        """The canary or shadow serves new requests; returns the new serving version."""
        return self._unary("PromoteProbe", admin_pb.PromoteProbeRequest(name=name)).probe

    def roll_back(self, name: str) -> types_pb.ProbeInfo:
        """Drops the canary or shadow for new requests; returns the serving version."""
        return self._unary("RollBackProbe", admin_pb.RollBackProbeRequest(name=name)).probe

    def list(self) -> list[types_pb.ProbeInfo]:
        return list(self._unary("ListProbes", admin_pb.ListProbesRequest()).probes)

    def unload(self, name: str, force: bool = False) -> bool:
        """True when the probe is gone; False when it waits for running requests."""
        return self._unary("UnloadProbe", admin_pb.UnloadProbeRequest(name=name, force=force)).unloaded


class AsyncProbeAdminClient(_AsyncClient):
    """asyncio client of ProbeAdminService; the same methods as ProbeAdminClient, awaited."""

    def __init__(self, target: str | Connection, timeout: float | None = 30.0, **options):
        super().__init__(admin_pb_grpc.ProbeAdminServiceStub, target, timeout, **options)

    async def load(self, path: str | Path | None = None, *, upload: str | Path | None = None,
                   inline: admin_pb.InlineProbe | None = None, replace: bool = False, shadow: bool = False,
                   canary: float | None = None) -> types_pb.ProbeInfo:
        request = _load_request(path, upload, inline, replace, shadow, canary)
        return (await self._unary("LoadProbe", request)).probe

    async def promote(self, name: str) -> types_pb.ProbeInfo:
        return (await self._unary("PromoteProbe", admin_pb.PromoteProbeRequest(name=name))).probe

    async def roll_back(self, name: str) -> types_pb.ProbeInfo:
        return (await self._unary("RollBackProbe", admin_pb.RollBackProbeRequest(name=name))).probe

    async def list(self) -> list[types_pb.ProbeInfo]:
        return list((await self._unary("ListProbes", admin_pb.ListProbesRequest())).probes)

    async def unload(self, name: str, force: bool = False) -> bool:
        return (await self._unary("UnloadProbe",
                                  admin_pb.UnloadProbeRequest(name=name, force=force))).unloaded
