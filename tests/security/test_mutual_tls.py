"""Mutual TLS between engine and routers, with real routers on loopback.

Every refusal is a failed handshake: the call ends UNAVAILABLE before any
message, and the router never sees a session."""

from __future__ import annotations

import asyncio
import socket
import ssl
from types import SimpleNamespace

import grpc
import numpy as np
import pytest
from cryptography import x509
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common import devcerts

from common.grpc_server import MAX_MESSAGE_BYTES, channel_options
from common.security import client as client_env
from common.security.tls import ChannelFactory, ClientTLS, PemFiles, ServerTLS, TLSConfigError
from engine_service.service.app import link_config
from engine_service.link import RouterLink
from probe_lifecycle.deploy import DeployError, deploy
from tests.router.helpers import HIDDEN, SessionClient, block, kinds, linear_probe
from tests.engine_link.helpers import MODEL
from tests.security.conftest import ADMIN_TOKEN

HANDSHAKE_FAILED = grpc.StatusCode.UNAVAILABLE


def engine_channel(files: PemFiles, router, server_name: str | None = None) -> grpc.aio.Channel:
    return ChannelFactory(ClientTLS(files), server_name)(f"127.0.0.1:{router.port}", channel_options())


async def open_session(router, channel) -> SessionClient:
    client = SessionClient(router, open_channel=channel)
    await client.open()
    return client


async def assert_refused(router, channel) -> str:
    client = SessionClient(router, open_channel=channel)
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await client.open()
    await client.close()
    assert refused.value.code() == HANDSHAKE_FAILED, refused.value
    assert router.sessions == set() and router.live_requests() == 0
    return refused.value.details()


async def test_an_engine_certificate_from_the_ca_opens_a_session(secure_router, pki):
    router, _ = await secure_router()
    client = await open_session(router, engine_channel(pki.files("engine"), router))
    assert len(router.sessions) == 1
    await client.close()


async def test_a_client_certificate_of_another_ca_is_refused(secure_router, pki, rogue):
    router, _ = await secure_router()
    await assert_refused(router, engine_channel(rogue.files("engine", ca=pki.ca_path), router))


async def test_an_expired_client_certificate_is_refused(secure_router, pki):
    router, _ = await secure_router()
    await assert_refused(router, engine_channel(pki.files("engine", expired=True), router))


async def test_a_client_without_a_certificate_is_refused(secure_router, pki):
    router, _ = await secure_router()
    credentials = grpc.ssl_channel_credentials(pki.ca_path.read_bytes())
    await assert_refused(router, grpc.aio.secure_channel(f"127.0.0.1:{router.port}", credentials))


async def test_plaintext_to_a_tls_port_is_refused(secure_router):
    router, _ = await secure_router()
    await assert_refused(router, grpc.aio.insecure_channel(f"127.0.0.1:{router.port}"))


async def test_the_router_certificate_must_name_the_host_the_engine_dialled(secure_router, pki):
    # A replica found through dns:router.test:PORT is dialled at its address; its
    # certificate must carry router.test, not the address.
    router, _ = await secure_router(dns_names=["router.test"], ip_addresses=())
    engine = pki.files("engine")
    client = await open_session(router, engine_channel(engine, router, server_name="router.test"))
    await client.close()
    await assert_refused(router, engine_channel(engine, router, server_name="other.test"))
    await assert_refused(router, engine_channel(engine, router))  # 127.0.0.1 is not in the certificate


async def test_probe_deploy_to_a_dns_name_checks_each_replica_against_that_name(
        secure_router, pki, tmp_path, monkeypatch):
    # `probe_lifecycle deploy --routers dns:NAME:PORT` dials the addresses NAME
    # resolves to, as the engine does; each replica's certificate names NAME only
    # (compose and Kubernetes replicas have no certificate per address).
    router, _ = await secure_router(dns_names=["localhost"], ip_addresses=())
    client = pki.files("client")
    monkeypatch.setenv(client_env.ENV_CA, str(client.ca))
    monkeypatch.setenv(client_env.ENV_CERT, str(client.cert))
    monkeypatch.setenv(client_env.ENV_KEY, str(client.key))
    monkeypatch.setenv(client_env.ENV_ADMIN_TOKEN, ADMIN_TOKEN)
    probe = linear_probe(tmp_path / "deploy", "deployed", np.ones(HIDDEN))
    deployed = await deploy(probe, f"dns:localhost:{router.port}")
    assert [(d.address, d.probe.name) for d in deployed] == [(f"127.0.0.1:{router.port}", "deployed")]
    assert "deployed" in [p.name for p in router.registry.probes()]
    # The same replica named by its address is refused: 127.0.0.1 is not in its certificate.
    with pytest.raises(DeployError, match=r"refused by 1 of 1 replica\(s\): 127\.0\.0\.1:\d+: UNAVAILABLE"):
        await deploy(probe, f"127.0.0.1:{router.port}", name="by_address")


async def test_a_router_certificate_of_another_ca_is_refused_by_the_engine(make_router, pki, rogue, probes_dir):
    from common.security.config import ServerSecurity

    # The impostor trusts the engine's CA (it would accept the engine) but its own
    # certificate chains to another CA.
    impostor_files = rogue.files("router", ca=pki.ca_path, dns_names=["router.test"])
    impostor = await make_router(probes_dir, security=ServerSecurity(ServerTLS(impostor_files, True)))
    await assert_refused(impostor, engine_channel(pki.files("engine"), impostor, server_name="router.test"))


async def test_the_engine_link_connects_only_to_replicas_whose_certificate_names_the_dns_name(
    secure_router, pki
):
    """Through the engine's own wiring (app.link_config): both addresses come
    from resolving dns:router.test, one answers with a certificate for another name."""
    good, _ = await secure_router("good", dns_names=["router.test"], ip_addresses=())
    impostor, _ = await secure_router("impostor", dns_names=["impostor.test"])
    addresses = [f"127.0.0.1:{good.port}", f"127.0.0.1:{impostor.port}"]

    async def resolve(host, port):
        assert host == "router.test"
        return addresses

    args = SimpleNamespace(router=f"dns:router.test:{good.port}", router_timeout=1.0, router_heartbeat_timeout=6.0, send_queue=8,
                           send_queue_bytes=1 << 20,
                           overflow_policy="drop_oldest", max_message_bytes=MAX_MESSAGE_BYTES)
    config = link_config(args, ClientTLS(pki.files("engine")))
    config.reconnect_base_s = config.reconnect_max_s = 0.05
    link = RouterLink(config, MODEL, lambda event: None, resolver=resolve)
    await link.start()
    try:
        await link.wait_ready(1, timeout=10)
        await asyncio.sleep(0.5)  # several reconnect attempts to the impostor
        assert link.replicas_up() == [addresses[0]]
        assert len(good.sessions) == 1 and impostor.sessions == set()
    finally:
        await link.close()


def served_certificate(port: int, files: PemFiles) -> x509.Certificate:
    """The certificate a new TLS connection to port is served (blocking: run in a thread)."""
    context = ssl.create_default_context(cafile=str(files.ca))
    context.load_cert_chain(str(files.cert), str(files.key))
    context.set_alpn_protocols(["h2"])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
        with context.wrap_socket(raw, server_hostname="localhost") as tls:
            return x509.load_der_x509_certificate(tls.getpeercert(binary_form=True))


async def test_a_rotated_router_certificate_is_served_to_new_connections_while_open_sessions_continue(
    secure_router, pki
):
    router, tls = await secure_router()
    engine = pki.files("engine")
    first = await asyncio.to_thread(served_certificate, router.port, engine)
    open_session_client = await open_session(router, engine_channel(engine, router))

    rotated = pki.write("router")  # replaces router.pem and router.key by rename
    assert rotated.serial_number != first.serial_number
    served = await asyncio.to_thread(served_certificate, router.port, engine)
    assert served.serial_number == rotated.serial_number and tls.reloads == 1

    # The session opened before the rotation still scores.
    open_session_client.start("r1", "p")
    step = open_session_client.batch(block(np.ones((1, HIDDEN)), ["r1"], [4]))
    replies = await open_session_client.until_ack(step)
    assert kinds(replies) == ["abort", "ack"] and replies[0].abort.verdict.request_id == "r1"
    # And new sessions open with the new certificate.
    second = await open_session(router, engine_channel(engine, router))
    assert len(router.sessions) == 2
    await asyncio.gather(open_session_client.close(), second.close())


async def test_unusable_rotated_files_keep_the_previous_certificate(secure_router, pki):
    router, tls = await secure_router()
    engine = pki.files("engine")
    before = await asyncio.to_thread(served_certificate, router.port, engine)
    (pki.directory / "router.key").write_bytes(b"-----BEGIN PRIVATE KEY-----\nbroken\n")
    still = await asyncio.to_thread(served_certificate, router.port, engine)
    assert still.serial_number == before.serial_number and tls.reloads == 0


async def test_the_engine_reads_its_client_certificate_afresh_for_every_new_channel(secure_router, pki, rogue):
    router, _ = await secure_router()
    engine = pki.files("engine")
    factory = ChannelFactory(ClientTLS(engine))
    address = f"127.0.0.1:{router.port}"
    client = await open_session(router, factory(address, channel_options()))
    await client.close()
    # Rotate the engine's files to a certificate the router does not trust: the next channel uses it.
    rogue.write("engine")
    for suffix in ("pem", "key"):
        (pki.directory / f"engine.{suffix}").write_bytes((rogue.directory / f"engine.{suffix}").read_bytes())
    await assert_refused(router, factory(address, channel_options()))
    pki.write("engine")
    client = await open_session(router, factory(address, channel_options()))
    await client.close()


def test_a_key_that_is_not_the_certificates_key_fails_naming_both_files(pki, rogue):
    files = pki.files("engine")
    rogue.write("engine")
    mismatched = PemFiles(files.cert, rogue.directory / "engine.key", files.ca)
    with pytest.raises(TLSConfigError, match="is not the private key of"):
        mismatched.read()
    with pytest.raises(TLSConfigError, match="--tls-ca .*nope.pem"):
        PemFiles(files.cert, files.key, pki.directory / "nope.pem").read()


async def test_the_health_probe_command_checks_a_mutual_tls_router(secure_router, pki, capsys):
    from common.health_probe import main as health_probe

    router, _ = await secure_router()
    files = pki.files("router")
    address = f"127.0.0.1:{router.port}"
    with_cert = ["--tls-ca", str(files.ca), "--tls-cert", str(files.cert), "--tls-key", str(files.key)]
    assert await asyncio.to_thread(health_probe, [address, *with_cert]) == 0
    assert await asyncio.to_thread(health_probe, [address, "--tls-ca", str(files.ca)]) == 1
    assert await asyncio.to_thread(health_probe, [address, "--insecure"]) == 1
    out, err = capsys.readouterr()
    assert out == f"{address}: SERVING\n" and err == f"{address}: UNAVAILABLE\n" * 2
    router.registry.unload("p", True)  # no probe: NOT_SERVING, yet alive
    await asyncio.sleep(0.2)
    assert await asyncio.to_thread(health_probe, [address, *with_cert]) == 1
    assert await asyncio.to_thread(health_probe, ["--live", address, *with_cert]) == 0
    assert capsys.readouterr().out == f"{address}: NOT_SERVING\n" * 2


async def test_a_rotated_client_ca_applies_to_new_connections(make_router, probes_dir, pki, rogue, tmp_path):
    """The router's --tls-ca file is replaced: engines of the new CA get in,
    engines of the old one no longer do."""
    from common.security.config import ServerSecurity

    trusted = tmp_path / "router-trusts.pem"
    trusted.write_bytes(pki.ca_path.read_bytes())
    router_files = pki.files("router")
    tls = ServerTLS(PemFiles(router_files.cert, router_files.key, trusted), require_client_cert=True)
    router = await make_router(probes_dir, security=ServerSecurity(tls))
    old_engine = pki.files("engine")
    new_engine = rogue.files("engine", ca=pki.ca_path)  # verifies the router against the router's CA

    async def handshake(files) -> bool:
        async with engine_channel(files, router) as channel:
            try:
                await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
                return True
            except grpc.aio.AioRpcError as err:
                assert err.code() == HANDSHAKE_FAILED
                return False

    assert (await handshake(old_engine), await handshake(new_engine)) == (True, False)
    devcerts.write_atomically(trusted, rogue.ca_path.read_bytes())
    assert (await handshake(old_engine), await handshake(new_engine)) == (False, True)
    assert tls.reloads == 1
