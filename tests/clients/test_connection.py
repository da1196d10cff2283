"""TLS and bearer-token options reach a real TLS server (the router's ProbeAdmin
servicer behind gRPC's own TLS), and fail when the certificate is not trusted."""

import asyncio
import datetime
import ipaddress

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from grpc import aio

from router_service.servicers import AdminServicer
from undercurrent.v1 import admin_pb2_grpc as admin_pb_grpc
from undercurrent_client import AsyncProbeAdminClient, ProbeAdminClient, RpcError


def certificate(subject: str, issuer_key, issuer_name, key, ca: bool) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
        .issuer_name(issuer_name or x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if not ca:
        builder = builder.add_extension(x509.SubjectAlternativeName(
            [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def pem(value) -> bytes:
    if isinstance(value, x509.Certificate):
        return value.public_bytes(serialization.Encoding.PEM)
    return value.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                               serialization.NoEncryption())


class RecordMetadata(aio.ServerInterceptor):
    def __init__(self):
        self.seen: list[dict[str, str]] = []

    async def intercept_service(self, continuation, details):
        self.seen.append(dict(details.invocation_metadata or ()))
        return await continuation(details)


@pytest.fixture
async def tls_admin(router, tmp_path):
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = certificate("test CA", ca_key, None, ca_key, ca=True)
    server_key = ec.generate_private_key(ec.SECP256R1())
    server = certificate("localhost", ca_key, ca.subject, server_key, ca=False)
    (tmp_path / "ca.pem").write_bytes(pem(ca))
    recorder = RecordMetadata()
    grpc_server = aio.server(interceptors=[recorder])
    admin_pb_grpc.add_ProbeAdminServiceServicer_to_server(AdminServicer(router), grpc_server)
    port = grpc_server.add_secure_port(
        "127.0.0.1:0", grpc.ssl_server_credentials([(pem(server_key), pem(server))]))
    await grpc_server.start()
    yield port, tmp_path / "ca.pem", recorder
    await grpc_server.stop(0)


async def test_tls_with_a_root_certificate_and_a_bearer_token(tls_admin, tmp_path):
    port, ca_path, recorder = tls_admin
    async with AsyncProbeAdminClient(f"localhost:{port}", root_certificates=ca_path,
                                     token="s3cret") as admin:
        assert await admin.list() == []
    assert recorder.seen[-1]["authorization"] == "Bearer s3cret"

    def blocking() -> list:
        with ProbeAdminClient(f"127.0.0.1:{port}", root_certificates=ca_path.read_bytes()) as admin:
            return admin.list()

    assert await asyncio.to_thread(blocking) == []
    assert "authorization" not in recorder.seen[-1]


async def test_untrusted_or_plaintext_connections_fail_unavailable(tls_admin, tmp_path):
    port, _, _ = tls_admin
    other_key = ec.generate_private_key(ec.SECP256R1())
    (tmp_path / "other.pem").write_bytes(pem(certificate("other CA", other_key, None, other_key, ca=True)))
    for options in ({"root_certificates": tmp_path / "other.pem"}, {}):
        async with AsyncProbeAdminClient(f"localhost:{port}", timeout=10, **options) as admin:
            with pytest.raises(RpcError) as failure:
                await admin.list()
        assert failure.value.code == grpc.StatusCode.UNAVAILABLE, options
