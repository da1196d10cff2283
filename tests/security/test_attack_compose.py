"""Attack: take over one container of the compose stack and reach for what
belongs to the others.

Every container used to mount the whole `certs` volume: the CA key, every
leaf key, the client tokens and the admin tokens, so a compromised engine (a
bug in a tokenizer or in vLLM) could replace the safety probe or mint
certificates, and a compromised router held the operator's key. The CA key was
reused across runs, and the engine's ports were published on every host
interface. Now each service mounts a volume of its own with only its
certificate, key, the CA certificate and the one token file it checks; the CA
key is never written; routers' health checks use no credential; the engine's
ports are published on the host's loopback.

The real stack on a Docker daemon (tools/docker_host.py builds the images,
tools/compose_stack.py brings it up); skipped where no daemon runs. The compose file's rendered
configuration is checked without one in tests/deploy/test_compose_files.py.
"""

from __future__ import annotations

import asyncio
import subprocess

import pytest

from tests.security.attacks import connects, outside_address
from tools import docker_host
from tools.compose_stack import PROJECT, TAG, Stack
from tools.compose_test import generate_with_probe
from tools.processes import free_port

SECRETS = {
    "engine": {"ca.pem", "engine.pem", "engine.key", "client-tokens"},
    "router": {"ca.pem", "router.pem", "router.key", "admin-tokens"},
}
# Run inside a container: every file anywhere that holds a private key or tokens.
FIND_SECRETS = ("grep -rlsE 'PRIVATE KEY|^[A-Za-z0-9_.@-]+:[A-Za-z0-9_-]{16,}$' "
                "/secrets /app /home /tmp /certs /models 2>/dev/null | sort")


@pytest.fixture(scope="module")
def stack():
    if not docker_host.daemon_running():
        pytest.skip("no Docker daemon here (tools/compose_test.py starts one)")
    base = docker_host.base_image(None)
    docker_host.build_image("deploy/Dockerfile.router", f"undercurrent-router:{TAG}", base)
    with docker_host.serve_folder(docker_host.pip_wheel_folder()) as wheels_url:
        docker_host.build_image("deploy/Dockerfile.engine", f"undercurrent-engine:{TAG}", base, wheels_url)
    running = Stack(free_port(), free_port())
    running.compose("down", "--volumes", "--remove-orphans", check=False)
    try:
        running.up(log_name="security-compose-up.log")
        yield running
    finally:
        running.compose("down", "--volumes", "--remove-orphans", "--timeout", "30", check=False)


def sh(stack, service: str, command: str, index: int = 1) -> subprocess.CompletedProcess:
    return stack.compose("exec", "-T", "--index", str(index), service, "sh", "-c", command, check=False)


def test_each_container_holds_only_its_own_secrets_and_none_holds_the_ca_key(stack):
    for service, expected in SECRETS.items():
        listed = sh(stack, service, "ls /secrets").stdout.split()
        assert set(listed) == expected, (service, listed)
        found = sh(stack, service, FIND_SECRETS).stdout.split()
        assert found == sorted(f"/secrets/{name}" for name in expected - {"ca.pem", f"{service}.pem"}), found
    # The operator tool's volume: its own pair and tokens, no service's key.
    operator = stack.compose("run", "--rm", "--no-deps", "-T", "--entrypoint", "sh", "operator", "-c",
                             "ls /secrets").stdout.split()
    assert set(operator) == {"ca.pem", "operator.pem", "operator.key", "client-token", "admin-token"}
    # Nowhere a CA key: every file of every secrets volume.
    volumes = ("engine-secrets", "router-secrets", "operator-secrets")
    mounted = [arg for volume in volumes for arg in ("-v", f"{PROJECT}_{volume}:/volumes/{volume}:ro")]
    files = docker_host.run(["docker", "run", "--rm", *mounted, "--entrypoint", "find",
                              f"undercurrent-router:{TAG}", "/volumes", "-type", "f"], quiet=True)
    assert sorted(files.stdout.split()) == sorted(
        f"/volumes/{volume}/{name}" for volume, names in (
            ("engine-secrets", SECRETS["engine"]), ("router-secrets", SECRETS["router"]),
            ("operator-secrets", {"ca.pem", "operator.pem", "operator.key", "client-token", "admin-token"}))
        for name in names)


def test_a_compromised_engine_cannot_administer_probes_and_a_router_cannot_open_sessions(stack):
    """From inside the engine container, with everything it holds: ProbeAdmin
    needs an admin token it does not have. From inside a router, with its own
    certificate (server usage only): no Session on another replica."""
    attempt = ("python - <<'EOF'\n"
               "import grpc\n"
               "from undercurrent.v1 import admin_pb2 as admin_pb, router_session_pb2 as session_pb\n"
               "from undercurrent.v1 import types_pb2 as types_pb\n"
               "from undercurrent.v1 import admin_pb2_grpc, router_session_pb2_grpc\n"
               "r = lambda p: open(p, 'rb').read()\n"
               "c = grpc.ssl_channel_credentials(r('/secrets/ca.pem'), r('/secrets/{me}.key'),\n"
               "                                 r('/secrets/{me}.pem'))\n"
               "ch = grpc.secure_channel('router:50061', c)\n"
               "try:\n"
               "    {call}\n"
               "    print('SERVED')\n"
               "except grpc.RpcError as e:\n"
               "    print(e.code().name)\n"
               "EOF")
    unload = ("admin_pb2_grpc.ProbeAdminServiceStub(ch).UnloadProbe(admin_pb.UnloadProbeRequest(name='residual_norm', force=True),"
              " timeout=10)")
    session = ("next(iter(router_session_pb2_grpc.ProbeRouterServiceStub(ch).Session(iter([session_pb.SessionRequest(hello=session_pb.SessionHello("
               "engine_id='x', model=types_pb.ModelInfo(hidden_size=128, num_layers=4)))]), timeout=10)))")
    from_engine = sh(stack, "engine", attempt.format(me="engine", call=unload))
    from_router = sh(stack, "router", attempt.format(me="router", call=session))
    assert from_engine.stdout.split()[-1:] == ["UNAUTHENTICATED"], from_engine.stderr[-2000:]
    assert from_router.stdout.split()[-1:] == ["UNAVAILABLE"], from_router.stderr[-2000:]  # the handshake


def test_router_health_checks_hold_no_credential_and_pass(stack):
    containers = stack.containers("router")
    assert len(containers) == 3
    for container in containers:
        state = docker_host.run(["docker", "inspect", "--format", "{{.State.Health.Status}}", container],
                                 quiet=True).stdout.strip()
        assert state == "healthy", container
        env = docker_host.run(["docker", "inspect", "--format", "{{range .Config.Env}}{{println .}}{{end}}",
                                container], quiet=True).stdout
        assert "UNDERCURRENT_TLS" not in env


def test_the_engine_is_published_on_the_hosts_loopback_only(stack):
    for port in (stack.engine_port, stack.metrics_port):
        binding = docker_host.run(["docker", "port", stack.containers("engine")[0]], quiet=True).stdout
        assert f"127.0.0.1:{port}" in binding and "0.0.0.0" not in binding, binding
        assert connects("127.0.0.1", port) and not connects(outside_address(), port)


def test_no_ca_key_outlives_an_issue_and_a_renewal_replaces_every_certificate(stack):
    """An `up` keeps valid certificates (clients keep trusting the CA); a
    renewal makes a new CA, whose key again goes nowhere, and the running
    services serve with its certificates."""
    before = sh(stack, "engine", "cat /secrets/ca.pem").stdout
    tokens = sh(stack, "engine", "cat /secrets/client-tokens").stdout
    kept = stack.compose("run", "--rm", "--no-deps", "-T", "certs").stdout
    assert "kept the certificates" in kept and sh(stack, "engine", "cat /secrets/ca.pem").stdout == before
    stack.compose("run", "--rm", "--no-deps", "-T", "certs", "--renew")
    after = sh(stack, "engine", "cat /secrets/ca.pem").stdout
    assert before.startswith("-----BEGIN CERTIFICATE-----") and after != before
    assert sh(stack, "router", "cat /secrets/ca.pem").stdout == after
    assert sh(stack, "engine", "cat /secrets/client-tokens").stdout == tokens  # callers keep their tokens
    # A client that trusts the new CA is served by the running engine.
    seen = asyncio.run(generate_with_probe(stack.engine_port, stack.client_credentials(),
                                                       "Renewed", 4))
    assert seen["finished"].generated_tokens == 4
