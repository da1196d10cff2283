"""The security flags of both services, and the development-certificate command."""

from __future__ import annotations

import ipaddress
import subprocess
import sys

import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID

from common.grpc_server import start_server
from common.security.config import PROBE_ADMIN_SERVICE, PROBE_ROUTER_SERVICE, SecurityConfigError, router_security
from router_service.cli import parse_args
from tests.conftest import REPO
from tests.models import EMBEDDED_MODELS
from tests.security.conftest import ADMIN_TOKEN


def router_args(tmp_path, *flags):
    return parse_args(["--port", "0", "--probes", str(tmp_path), *flags])


def tls_flags(files):
    return ["--tls-cert", str(files.cert), "--tls-key", str(files.key), "--tls-ca", str(files.ca)]


@pytest.mark.parametrize("flags, message", [
    ([], "--tls-cert, --tls-key, --tls-ca: required for TLS (or --insecure for plaintext development)"),
    (["--insecure", "--tls-ca", "x"], "--insecure: conflicts with --tls-ca (choose one)"),
    (["--tls-cert", "c"], "--tls-key, --tls-ca: required for TLS (or --insecure for plaintext development)"),
])
def test_tls_is_required_unless_insecure(tmp_path, flags, message):
    with pytest.raises(SecurityConfigError) as err:
        router_security(router_args(tmp_path, *flags), environ={})
    assert str(err.value) == message


def test_tls_needs_engine_identities_and_a_way_to_check_admins(tmp_path, pki):
    flags = [*tls_flags(pki.files("router")), "--engine-identities", "engine,engine.example"]
    with pytest.raises(SecurityConfigError, match=r"^--engine-identities: required with TLS"):
        router_security(router_args(tmp_path, *tls_flags(pki.files("router"))),
                        environ={"UNDERCURRENT_ADMIN_TOKENS": f"ops:{ADMIN_TOKEN}"})
    with pytest.raises(SecurityConfigError, match=r"^--admin-tokens-file: ProbeAdminService needs admin tokens"):
        router_security(router_args(tmp_path, *flags), environ={})
    security = router_security(router_args(tmp_path, *flags),
                               environ={"UNDERCURRENT_ADMIN_TOKENS": f"ops:{ADMIN_TOKEN}"})
    assert security.tls.require_client_cert and not security.reflection
    assert security.access[PROBE_ADMIN_SERVICE].tokens.caller_of(ADMIN_TOKEN) == "ops"
    assert security.access[PROBE_ADMIN_SERVICE].identities is None
    assert security.access[PROBE_ROUTER_SERVICE].identities == {"engine", "engine.example"}
    (tmp_path / "admin").write_text(f"root:{ADMIN_TOKEN}\n")
    security = router_security(
        router_args(tmp_path, *flags, "--admin-tokens-file", str(tmp_path / "admin"), "--reflection"), environ={})
    assert security.access[PROBE_ADMIN_SERVICE].tokens.caller_of(ADMIN_TOKEN) == "root"
    assert security.reflection
    # Operators by certificate identity alone: no admin token source needed.
    security = router_security(router_args(tmp_path, *flags, "--admin-identities", "ops"), environ={})
    assert (security.access[PROBE_ADMIN_SERVICE].tokens, security.access[PROBE_ADMIN_SERVICE].identities) == (
        None, {"ops"})
    with pytest.raises(SecurityConfigError, match=r"^--insecure: conflicts with --engine-identities"):
        router_security(router_args(tmp_path, "--insecure", "--engine-identities", "engine"), environ={})


async def test_insecure_is_plaintext_and_logged_as_a_warning_once_listening(tmp_path, caplog):
    security = router_security(router_args(tmp_path, "--insecure"), environ={})
    assert security.tls is None and security.access == {}
    handle = await start_server([], "127.0.0.1", 0, security=security)
    await handle.server.stop(None)
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warnings == ["--insecure: serving PLAINTEXT gRPC with no transport security and no admin "
                        "tokens (ProbeAdminService accepts any caller); development only"]


def run(module, *args):
    return subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, capture_output=True, text=True,
                          timeout=120)


def test_both_services_refuse_to_start_without_tls_or_insecure_in_one_line(tmp_path):
    router = run("router_service", "--port", "0", "--probes", str(tmp_path))
    engine = run("engine_service", "--model", str(EMBEDDED_MODELS["tiny-llama"]), "--port", "0")
    for result, prog in ((router, "router_service"), (engine, "engine_service")):
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
        errors = [line for line in result.stderr.splitlines() if "error:" in line]
        assert errors == [f"{prog}: error: --tls-cert, --tls-key, --tls-ca: required for TLS "
                          "(or --insecure for plaintext development)"]


def test_a_mismatched_key_fails_start_up_naming_the_files(tmp_path, pki, rogue):
    files = pki.files("router")
    rogue.write("router")
    (tmp_path / "admin").write_text(f"ops:{ADMIN_TOKEN}\n")
    result = run("router_service", "--port", "0", "--probes", str(tmp_path), "--tls-cert", str(files.cert),
                 "--tls-key", str(rogue.directory / "router.key"), "--tls-ca", str(files.ca),
                 "--admin-tokens-file", str(tmp_path / "admin"), "--engine-identities", "engine")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        f"router_service: error: {rogue.directory / 'router.key'} is not the private key of {files.cert}")


def test_devcerts_gives_each_certificate_the_usages_and_names_of_its_role_only(tmp_path):
    result = run("common.devcerts", "--out", str(tmp_path), "--engine", "engine", "--router", "router",
                 "--client", "operator", "--namespaces", "default,probes")
    assert result.returncode == 0, result.stderr
    assert not list(tmp_path.glob("ca.key")) and "its key was not kept" in result.stdout
    ca = x509.load_pem_x509_certificate((tmp_path / "ca.pem").read_bytes())

    def certificate(name):
        cert = x509.load_pem_x509_certificate((tmp_path / f"{name}.pem").read_bytes())
        cert.verify_directly_issued_by(ca)
        usages = set(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value)
        try:
            san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
            names = set(san.get_values_for_type(x509.DNSName)) | set(san.get_values_for_type(x509.IPAddress))
        except x509.ExtensionNotFound:
            names = set()
        return usages, names

    server, client = ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH
    router_usages, router_names = certificate("router")
    assert router_usages == {server}
    assert router_names == {"router", "router.default.svc", "router.default.svc.cluster.local",
                            "*.router.default.svc", "*.router.default.svc.cluster.local", "router.probes.svc",
                            "router.probes.svc.cluster.local", "*.router.probes.svc",
                            "*.router.probes.svc.cluster.local"}
    engine_usages, engine_names = certificate("engine")
    assert engine_usages == {server, client} and "engine.probes.svc" in engine_names
    assert certificate("operator") == ({client}, set())
    assert (tmp_path / "router.key").stat().st_mode & 0o077 == 0
    # Loopback names only when asked for.
    assert run("common.devcerts", "--out", str(tmp_path / "local"), "--router", "router",
               "--loopback", "router").returncode == 0
    local = x509.load_pem_x509_certificate((tmp_path / "local" / "router.pem").read_bytes())
    san = local.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "localhost" in san.get_values_for_type(x509.DNSName)
    assert ipaddress.ip_address("127.0.0.1") in san.get_values_for_type(x509.IPAddress)
    bad = run("common.devcerts", "--out", str(tmp_path), "--router", "a b")
    assert bad.returncode == 2 and "'a b' is not a DNS name" in bad.stderr


def test_devcerts_per_service_gives_each_party_only_its_own_files(tmp_path):
    flags = ["--out", str(tmp_path), "--engine", "engine", "--router", "router", "--client", "operator",
             "--client-tokens", "demo,operator", "--admin-tokens", "operator", "--per-service"]
    assert run("common.devcerts", *flags).returncode == 0
    files = {p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file()}
    assert files == {
        "engine/engine.pem", "engine/engine.key", "engine/ca.pem", "engine/client-tokens",
        "router/router.pem", "router/router.key", "router/ca.pem", "router/admin-tokens",
        "operator/operator.pem", "operator/operator.key", "operator/ca.pem", "operator/client-token",
        "operator/admin-token",
    }
    client_tokens = dict(line.split(":", 1) for line in (tmp_path / "engine/client-tokens").read_text().split())
    admin_tokens = dict(line.split(":", 1) for line in (tmp_path / "router/admin-tokens").read_text().split())
    assert set(client_tokens) == {"demo", "operator"} and set(admin_tokens) == {"operator"}
    assert (tmp_path / "operator/client-token").read_text() == client_tokens["operator"]
    assert (tmp_path / "operator/admin-token").read_text() == admin_tokens["operator"]
    first_ca = (tmp_path / "engine/ca.pem").read_bytes()
    # A second run keeps valid certificates (clients keep trusting the CA) ...
    kept = run("common.devcerts", *flags)
    assert kept.stdout.startswith(f"kept the certificates in {tmp_path}")
    assert (tmp_path / "engine/ca.pem").read_bytes() == first_ca
    # ... and --renew issues a new CA and certificates, with the same tokens.
    assert run("common.devcerts", *flags, "--renew").returncode == 0
    assert (tmp_path / "engine/ca.pem").read_bytes() != first_ca
    assert (tmp_path / "router/ca.pem").read_bytes() == (tmp_path / "engine/ca.pem").read_bytes()
    assert (tmp_path / "engine/client-tokens").read_text().split() == [
        f"{name}:{token}" for name, token in client_tokens.items()]
    assert not list(tmp_path.rglob("ca.key"))
