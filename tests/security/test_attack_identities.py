"""Attack: use any certificate of the deployment's CA as if it were an engine or
an operator.

A router used to check only that a client certificate chained to its CA: the
operator's certificate opened a Session with no token, received the probe
catalog (thresholds, layers) and pinned a probe against a graceful unload by
binding it. Now Sessions need a certificate whose identity is on the router's
--engine-identities, ProbeAdmin an admin token (and, with --admin-identities,
an operator's certificate too), and development certificates carry only their
role's usages, so one service's certificate cannot act as another's. Router
processes on loopback, the development CA.
"""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from common import devcerts
from tests.router.helpers import HIDDEN, SessionClient
from tests.router.test_admin import inline
from tools.dev_security import DevSecurity
from tools.stack import scrape
from undercurrent.v1 import admin_pb2 as admin_pb
from undercurrent.v1 import admin_pb2_grpc as admin_pb_grpc


def credentials(directory, name: str, ca=None) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials((ca or directory / "ca.pem").read_bytes(),
                                        (directory / f"{name}.key").read_bytes(),
                                        (directory / f"{name}.pem").read_bytes())


def bearer(token: str) -> tuple:
    return (("authorization", f"Bearer {token}"),)


async def test_the_clients_certificate_cannot_open_a_session_see_the_catalog_or_pin_a_probe(
        start_router_process):
    router = await start_router_process()
    dev = DevSecurity.ensure()
    address = router.service.address
    session = SessionClient(0, open_channel=grpc.aio.secure_channel(address, credentials(dev.directory, "client")))
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await session.open()
    await session.close()
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert refused.value.details() == "permission denied: the client certificate's identity may not call this service"
    # Nothing was bound: a graceful unload completes at once.
    async with router.service.channel() as channel:
        unloaded = await admin_pb_grpc.ProbeAdminServiceStub(channel).UnloadProbe(admin_pb.UnloadProbeRequest(name="p"))
    assert unloaded.unloaded
    # The engine's certificate does open one.
    engine = SessionClient(0, open_channel=grpc.aio.secure_channel(address, credentials(dev.directory, "engine")))
    hello = await engine.open()
    await engine.close()
    assert hello.router_id


async def test_an_engine_certificate_cannot_call_probe_admin_without_an_admin_token(start_router_process):
    router = await start_router_process()
    dev = DevSecurity.ensure()
    async with grpc.aio.secure_channel(router.service.address, credentials(dev.directory, "engine")) as channel:
        admin = admin_pb_grpc.ProbeAdminServiceStub(channel)
        calls = {
            "LoadProbe": lambda **kw: admin.LoadProbe(admin_pb.LoadProbeRequest(inline=inline("x", np.ones(HIDDEN))), **kw),
            "ListProbes": lambda **kw: admin.ListProbes(admin_pb.ListProbesRequest(), **kw),
            "UnloadProbe": lambda **kw: admin.UnloadProbe(admin_pb.UnloadProbeRequest(name="p", force=True), **kw),
        }
        for name, call in calls.items():
            for metadata in ((), bearer(dev.client_token)):
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await call(metadata=metadata)
                assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED, (name, metadata)
        # Still there, untouched.
        listed = await admin.ListProbes(admin_pb.ListProbesRequest(), metadata=bearer(dev.admin_token))
    assert [p.name for p in listed.probes] == ["p"]


async def test_with_admin_identities_an_admin_token_needs_an_operators_certificate_too(start_router_process):
    router = await start_router_process("--admin-identities", "client")
    dev = DevSecurity.ensure()
    request = admin_pb.ListProbesRequest()
    async with grpc.aio.secure_channel(router.service.address, credentials(dev.directory, "engine")) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await admin_pb_grpc.ProbeAdminServiceStub(channel).ListProbes(request, metadata=bearer(dev.admin_token))
    async with grpc.aio.secure_channel(router.service.address, credentials(dev.directory, "client")) as channel:
        listed = await admin_pb_grpc.ProbeAdminServiceStub(channel).ListProbes(request, metadata=bearer(dev.admin_token))
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert [p.name for p in listed.probes] == ["p"]
    assert scrape(router.metrics_port)[
        'undercurrent_auth_refused_total{reason="identity_not_allowed",service="undercurrent.v1.ProbeAdminService"}'
    ] == 1


async def test_development_certificates_cannot_act_in_another_role(start_router_process, tmp_path):
    """A router's certificate (server usage only) cannot open a Session on
    another router, and a client's (client usage only) cannot serve as a router."""
    pki = tmp_path / "pki"
    devcerts.generate(pki, {"engine": devcerts.ENGINE, "router": devcerts.ROUTER, "client": devcerts.CLIENT},
                      loopback=("engine", "router"))
    tls = ["--tls-cert", str(pki / "router.pem"), "--tls-key", str(pki / "router.key"),
           "--tls-ca", str(pki / "ca.pem"), "--engine-identities", "engine,router"]
    router = await start_router_process(*tls)
    address = router.service.address
    as_router = SessionClient(0, open_channel=grpc.aio.secure_channel(address, credentials(pki, "router")))
    with pytest.raises(grpc.aio.AioRpcError) as handshake:
        await as_router.open()  # even though its name is on the allowlist here
    await as_router.close()
    engine = SessionClient(0, open_channel=grpc.aio.secure_channel(address, credentials(pki, "engine")))
    await engine.open()
    await engine.close()
    assert handshake.value.code() == grpc.StatusCode.UNAVAILABLE

    impostor = await start_router_process("--tls-cert", str(pki / "client.pem"), "--tls-key", str(pki / "client.key"),
                                          "--tls-ca", str(pki / "ca.pem"), "--engine-identities", "engine")
    dialled = SessionClient(0, open_channel=grpc.aio.secure_channel(
        impostor.service.address, credentials(pki, "engine"), options=[("grpc.ssl_target_name_override", "client")]))
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await dialled.open()
    await dialled.close()
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
