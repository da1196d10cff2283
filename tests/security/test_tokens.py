"""Bearer tokens: parsing and rotation, and the one interceptor on real
servers on loopback (unary and streaming methods, the router's ProbeAdmin)."""

from __future__ import annotations

import asyncio
import logging

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from common.grpc_server import SERVICE_FULL_NAMES, start_server
from common.security.auth import Access, bearer_token, current_caller
from common.security.config import ENGINE_SERVICE, PROBE_ADMIN_SERVICE, ServerSecurity
from common.security.tls import ClientTLS, ServerTLS
from common.security.tokens import TokenConfigError, TokenSet, TokensUnusable, anonymous_name, parse_entries
from tests.router.helpers import HIDDEN
from tests.router.test_admin import inline
from tests.security.conftest import ADMIN_TOKEN, CLIENT_TOKEN
from undercurrent.v1 import admin_pb2 as admin_pb
from undercurrent.v1 import engine_pb2 as engine_pb
from undercurrent.v1 import types_pb2 as types_pb
from undercurrent.v1 import admin_pb2_grpc as admin_pb_grpc
from undercurrent.v1 import engine_pb2_grpc as engine_pb_grpc

ALICE = "alice-token-0123456789abcdef"
BOB = "bob-token-0123456789abcdefgh"


# -- token sources ------------------------------------------------------------


def test_entries_name_their_caller_and_bare_tokens_get_a_name_that_hides_them():
    entries = parse_entries(f"# comment\nalice:{ALICE}\n\n{BOB}\n", "f")
    assert entries == {ALICE: "alice", BOB: anonymous_name(BOB)}
    assert BOB not in anonymous_name(BOB) and anonymous_name(BOB).startswith("token-")


@pytest.mark.parametrize("text, message", [
    ("alice:short", "f entry 1: the token has fewer than 16 characters"),
    (f"ok:{ALICE}\nbad name:{BOB}", "f entry 2: caller name 'bad name' must be"),
    (f"x:{ALICE} y", "f entry 1: the token must be printable text without spaces"),
    ("# only a comment\n", "f: no tokens"),
])
def test_bad_token_entries_are_refused_naming_the_entry(text, message):
    with pytest.raises(TokenConfigError, match=f"^{message}"):
        parse_entries(text, "f")


def test_tokens_from_an_environment_variable_are_comma_separated():
    tokens = TokenSet.from_env("client", "T", {"T": f"alice:{ALICE},bob:{BOB}"})
    assert (tokens.caller_of(ALICE), tokens.caller_of(BOB), tokens.caller_of(ALICE[:-1])) == ("alice", "bob", None)


def test_a_token_file_is_reread_when_it_changes_and_a_broken_one_refuses_every_token(tmp_path, caplog):
    path = tmp_path / "tokens"
    path.write_text(f"alice:{ALICE}\n")
    tokens = TokenSet.from_file("client", path)
    assert tokens.caller_of(ALICE) == "alice" and tokens.caller_of(BOB) is None
    path.write_text(f"bob:{BOB}\n")  # in place, within the file system's timestamp granularity
    assert tokens.caller_of(BOB) == "bob" and tokens.caller_of(ALICE) is None
    path.write_text("bob:short\n")
    with pytest.raises(TokensUnusable, match="entry 1: the token has fewer than 16 characters"):
        tokens.caller_of(BOB)
    path.unlink()
    with pytest.raises(TokensUnusable, match="No such file or directory"):
        tokens.caller_of(BOB)
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 2 and all("refusing every client token until it is fixed" in e for e in errors)
    path.write_text(f"alice:{ALICE}\n")
    assert tokens.caller_of(ALICE) == "alice" and tokens.caller_of(BOB) is None


@pytest.mark.parametrize("metadata, expected", [
    ((), (None, "missing_token")),
    ((("authorization", f"Bearer {ALICE}"),), (ALICE, None)),
    ((("authorization", f"bearer {ALICE}"),), (ALICE, None)),
    ((("authorization", f"Basic {ALICE}"),), (None, "malformed_header")),
    ((("authorization", "Bearer "),), (None, "malformed_header")),
    ((("authorization", f"Bearer {ALICE}"), ("authorization", f"Bearer {BOB}")), (None, "malformed_header")),
])
def test_bearer_token_parsing(metadata, expected):
    assert bearer_token(metadata) == expected


# -- the interceptor on an EngineService server ---------------------------------


class RecordingEngine(engine_pb_grpc.EngineServiceServicer):
    """Records the authenticated caller of every call it serves (the servicer
    stands in for the engine; server, TLS and interceptor are the real ones)."""

    def __init__(self):
        self.served: list[tuple[str, str]] = []

    async def Generate(self, request, context):
        self.served.append(("Generate", current_caller()))
        for index in range(3):
            await asyncio.sleep(0)
            yield engine_pb.GenerateResponse(tokens=engine_pb.TokenChunk(first_index=index, token_ids=[index]))

    async def GetModelInfo(self, request, context):
        self.served.append(("GetModelInfo", current_caller()))
        return engine_pb.GetModelInfoResponse(model=types_pb.ModelInfo(model="m"))


@pytest.fixture
async def engine_server(pki):
    servicer = RecordingEngine()
    registry = CollectorRegistry()
    files = pki.files("engine")
    security = ServerSecurity(
        ServerTLS(files, require_client_cert=False),
        {ENGINE_SERVICE: Access(tokens=TokenSet.of("client", {ALICE: "alice", BOB: "bob"}))},
    )
    handle = await start_server(
        [(engine_pb_grpc.add_EngineServiceServicer_to_server, servicer, SERVICE_FULL_NAMES["EngineService"])],
        "127.0.0.1", 0, security=security, metrics_registry=registry)
    await handle.set_serving(True)
    # Clients of the engine need no certificate of their own: only the CA.
    credentials = grpc.ssl_channel_credentials(files.ca.read_bytes())
    channel = grpc.aio.secure_channel(f"localhost:{handle.port}", credentials)
    yield servicer, engine_pb_grpc.EngineServiceStub(channel), channel, registry
    await channel.close()
    await handle.server.stop(None)


def bearer(token):
    return (("authorization", f"Bearer {token}"),)


async def code_of(call) -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        result = call()
        if hasattr(result, "__aiter__"):
            async for _ in result:
                pass
        else:
            await result
    return refused.value.code(), refused.value.details()


async def test_unary_and_streaming_calls_without_a_valid_token_are_refused_and_never_served(
    engine_server, caplog
):
    servicer, stub, _, registry = engine_server
    caplog.set_level(logging.WARNING, logger="common.security.auth")
    request = engine_pb.GenerateRequest(text="x")
    refusals = [
        await code_of(lambda: stub.Generate(request)),
        await code_of(lambda: stub.Generate(request, metadata=bearer(ADMIN_TOKEN))),
        await code_of(lambda: stub.GetModelInfo(engine_pb.GetModelInfoRequest(), metadata=bearer(ALICE + "x"))),
        await code_of(lambda: stub.GetModelInfo(engine_pb.GetModelInfoRequest(),
                                                metadata=(("authorization", f"Basic {ALICE}"),))),
    ]
    assert [code for code, _ in refusals] == [grpc.StatusCode.UNAUTHENTICATED] * 4
    assert "send 'authorization: Bearer <token>'" in refusals[0][1]
    assert "not valid for this service" in refusals[1][1]
    assert servicer.served == []

    def refused(reason):
        return registry.get_sample_value("undercurrent_auth_refused_total",
                                         {"service": ENGINE_SERVICE, "reason": reason})

    assert (refused("missing_token"), refused("wrong_token"), refused("malformed_header")) == (1, 2, 1)
    # Logs name the peer and the reason, never a token.
    assert "refused /undercurrent.v1.EngineService/Generate from ipv4:127.0.0.1:" in caplog.text
    assert all(token not in caplog.text for token in (ALICE, ADMIN_TOKEN, "Basic"))


async def test_valid_tokens_are_served_as_their_caller_on_unary_and_streaming_calls(engine_server):
    servicer, stub, _, registry = engine_server
    responses = [r async for r in stub.Generate(engine_pb.GenerateRequest(text="x"), metadata=bearer(ALICE))]
    assert [r.tokens.token_ids[0] for r in responses] == [0, 1, 2]
    assert (await stub.GetModelInfo(engine_pb.GetModelInfoRequest(), metadata=bearer(BOB))).model.model == "m"
    assert servicer.served == [("Generate", "alice"), ("GetModelInfo", "bob")]
    assert registry.get_sample_value("undercurrent_auth_refused_total",
                                     {"service": ENGINE_SERVICE, "reason": "wrong_token"}) is None


async def test_health_needs_no_token_and_reflection_is_off_unless_enabled(engine_server):
    _, _, channel, _ = engine_server
    reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    call = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
    with pytest.raises(grpc.aio.AioRpcError) as off:
        async for _ in call:
            pass
    assert off.value.code() == grpc.StatusCode.UNIMPLEMENTED


# -- ProbeAdmin on a router -----------------------------------------------------------


async def test_probe_admin_needs_an_admin_token_and_a_refused_call_changes_nothing(secure_router, pki):
    router, _ = await secure_router()
    channel = grpc.aio.secure_channel(f"127.0.0.1:{router.port}", ClientTLS(pki.files("engine")).credentials())
    admin = admin_pb_grpc.ProbeAdminServiceStub(channel)
    load = admin_pb.LoadProbeRequest(inline=inline("sneaky", np.ones(HIDDEN)))
    refusals = [
        await code_of(lambda: admin.LoadProbe(load)),
        await code_of(lambda: admin.UnloadProbe(admin_pb.UnloadProbeRequest(name="p", force=True),
                                                metadata=bearer(CLIENT_TOKEN))),
        await code_of(lambda: admin.ListProbes(admin_pb.ListProbesRequest(), metadata=bearer(ADMIN_TOKEN[:-1]))),
    ]
    assert [code for code, _ in refusals] == [grpc.StatusCode.UNAUTHENTICATED] * 3
    assert [p.name for p in router.registry.probes()] == ["p"]
    listed = await admin.ListProbes(admin_pb.ListProbesRequest(), metadata=bearer(ADMIN_TOKEN))
    assert [p.name for p in listed.probes] == ["p"]
    assert (await admin.UnloadProbe(admin_pb.UnloadProbeRequest(name="p", force=True),
                                    metadata=bearer(ADMIN_TOKEN))).unloaded
    assert router.metrics.registry.get_sample_value(
        "undercurrent_auth_refused_total", {"service": PROBE_ADMIN_SERVICE, "reason": "wrong_token"}) == 2
    await channel.close()


async def test_tools_take_tls_and_tokens_from_the_environment(secure_router, pki):
    from undercurrent_client import AsyncProbeAdminClient, RpcError
    from undercurrent_client.connection import from_env

    router, _ = await secure_router()
    client = pki.files("engine")
    environ = {"UNDERCURRENT_TLS_CA": str(client.ca), "UNDERCURRENT_TLS_CERT": str(client.cert),
               "UNDERCURRENT_TLS_KEY": str(client.key), "UNDERCURRENT_TOKEN": CLIENT_TOKEN,
               "UNDERCURRENT_ADMIN_TOKEN": ADMIN_TOKEN}
    address = f"127.0.0.1:{router.port}"

    async def list_with(environ: dict) -> list[str] | grpc.StatusCode:
        async with AsyncProbeAdminClient(from_env(address, admin=True, environ=environ),
                                         timeout=5) as admin:
            try:
                return [p.name for p in await admin.list()]
            except RpcError as err:
                return err.code

    assert await list_with(environ) == ["p"]
    assert await list_with({**environ, "UNDERCURRENT_ADMIN_TOKEN": ""}) == grpc.StatusCode.UNAUTHENTICATED
    assert await list_with({}) == grpc.StatusCode.UNAVAILABLE
    assert from_env(address, environ=environ).token == CLIENT_TOKEN
    assert from_env(address, environ={"UNDERCURRENT_TOKEN": CLIENT_TOKEN}).token is None
