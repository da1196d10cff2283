"""Attacks on how credentials are kept and where services listen.

- A token file that breaks or disappears used to keep the old tokens valid,
  so a revocation that went wrong left the revoked token working: now the
  service refuses every token until the file is fixed, and says so.
- `--token` put the token in `ps` and shell history: the command refuses it
  and takes $UNDERCURRENT_TOKEN or --token-file.
- The client library sent a bearer token as plain metadata over plaintext:
  now it refuses to unless told to.
- Metrics (probe names, replica addresses, refusal rates) were served
  unauthenticated on every interface, and --insecure listened on every
  interface: both now bind loopback unless told otherwise.
Real router and engine processes; "from outside" is this host's address on
its default route.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import grpc
import pytest

from tests.models import EMBEDDED_MODELS
from tests.security.attacks import connects, listening_addresses, outside_address
from tools.dev_security import DevSecurity
from tools.processes import Service, free_port
from undercurrent.v1 import admin_pb2 as admin_pb
from undercurrent.v1 import admin_pb2_grpc as admin_pb_grpc
from undercurrent_client import EngineClient
from undercurrent_client.connection import Connection, PlaintextToken

UNUSABLE = ("this service cannot check tokens now (its token file is unusable); every call is refused until "
            "it is fixed")


async def list_probes(router, token: str) -> tuple[str, str]:
    async with router.service.channel(token) as channel:
        try:
            listed = await admin_pb_grpc.ProbeAdminServiceStub(channel).ListProbes(admin_pb.ListProbesRequest(), timeout=10)
        except grpc.aio.AioRpcError as err:
            return err.code().name, err.details()
    return "OK", ",".join(p.name for p in listed.probes)


async def test_a_revoked_broken_or_deleted_token_file_leaves_no_token_working(start_router_process):
    router = await start_router_process()
    operator = DevSecurity.ensure().admin_token
    successor = "successor-token-0123456789abcdef"
    assert await list_probes(router, operator) == ("OK", "p")
    # Revoked in place: the operator's token is gone, another takes its place.
    router.tokens_file.write_text(f"successor:{successor}\n")
    assert await list_probes(router, operator) == ("UNAUTHENTICATED",
                                                   "authentication failed: the token is not valid for this service")
    assert await list_probes(router, successor) == ("OK", "p")
    # Broken (a token too short), then deleted: nobody gets in, not even the last valid token.
    router.tokens_file.write_text("successor:short\n")
    assert await list_probes(router, successor) == ("UNAVAILABLE", UNUSABLE)
    router.tokens_file.unlink()
    assert await list_probes(router, successor) == ("UNAVAILABLE", UNUSABLE)
    assert await list_probes(router, operator) == ("UNAVAILABLE", UNUSABLE)
    # Fixed by a rename, as a secret store rotates files: only what it holds works.
    replacement = router.tokens_file.with_name("new-admin-tokens")
    replacement.write_text(f"operator:{operator}\n")
    os.replace(replacement, router.tokens_file)
    assert await list_probes(router, operator) == ("OK", "p")
    assert await list_probes(router, successor) == ("UNAUTHENTICATED",
                                                    "authentication failed: the token is not valid for this service")
    logged = router.service.log_path.read_text(errors="replace")
    assert "refusing every admin token until it is fixed" in logged and successor not in logged


async def run_cli(*args: str, env: dict) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "undercurrent_client", *args, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        env={k: v for k, v in os.environ.items() if not k.startswith("UNDERCURRENT_")} | env)
    out, err = await asyncio.wait_for(process.communicate(), 60)
    return process.returncode, out.decode(), err.decode()


async def test_the_command_takes_no_token_on_its_command_line(start_router_process, tmp_path):
    router = await start_router_process()
    dev = DevSecurity.ensure()
    cert, key = dev.pem("client")
    target = ["probes", "list", "--router", router.service.address, "--tls-root-cert", str(dev.ca),
              "--tls-cert", str(cert), "--tls-key", str(key)]
    code, out, err = await run_cli(*target, "--token", dev.admin_token, env={})
    assert (code, out) == (2, "")
    assert err == ("undercurrent: error: probes list: --token: give the token in $UNDERCURRENT_TOKEN or in a file "
                   "with --token-file, not on the command line (it would show in ps and in shell history) "
                   "(see --help)\n")
    token_file = tmp_path / "token"
    token_file.write_text(dev.admin_token + "\n")
    token_file.chmod(0o600)
    by_file = await run_cli(*target, "--token-file", str(token_file), env={})
    by_env = await run_cli(*target, env={"UNDERCURRENT_TOKEN": dev.admin_token})
    assert by_file[0] == by_env[0] == 0 and by_file[1] == by_env[1]
    assert [line.split()[0] for line in by_env[1].splitlines()] == ["NAME", "p"]


async def test_the_client_library_does_not_send_a_token_over_plaintext():
    """A listener stands in for a server anyone on the path could read."""
    seen = bytearray()

    async def record(reader, writer):
        seen.extend(await reader.read(65536))
        writer.close()

    listener = await asyncio.start_server(record, "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    secret = DevSecurity.ensure().client_token
    with pytest.raises(PlaintextToken, match="refusing to send a bearer token over a plaintext connection"):
        EngineClient(f"127.0.0.1:{port}", token=secret)
    with pytest.raises(PlaintextToken):
        Connection(f"127.0.0.1:{port}", token=secret)
    # Told to (a development service on loopback), it connects.
    client = EngineClient(f"127.0.0.1:{port}", token=secret, allow_token_over_plaintext=True, timeout=5)
    with pytest.raises(Exception):
        await asyncio.to_thread(client.model_info)
    client.close()
    listener.close()
    await listener.wait_closed()
    assert seen.startswith(b"PRI * HTTP/2.0")  # only the connection that was allowed reached it


async def test_router_metrics_and_an_insecure_router_listen_on_loopback_only(start_router_process, tmp_path):
    outside = outside_address()
    router = await start_router_process()
    assert listening_addresses(router.pid, router.metrics_port) == {"127.0.0.1"}
    assert connects("127.0.0.1", router.metrics_port) and not connects(outside, router.metrics_port)

    port = free_port()
    insecure = Service("router", ["router_service", "--port", str(port), "--probes", str(tmp_path / "probes"),
                                  "--insecure"], port).start()
    try:
        await insecure.wait_health(want_serving=None, timeout=60)
        assert listening_addresses(insecure.process.pid, port) == {"127.0.0.1"}
        assert not connects(outside, port)
    finally:
        insecure.kill()


@pytest.mark.vllm
async def test_engine_metrics_listen_on_loopback_only(attacked_engine):
    outside = outside_address()
    assert listening_addresses(attacked_engine.pid, attacked_engine.metrics_port) == {"127.0.0.1"}
    assert not connects(outside, attacked_engine.metrics_port)


async def test_an_insecure_engine_listens_on_loopback_only():
    """Checked once the engine listens (before vLLM has started)."""
    port = free_port()
    engine = Service("engine", ["engine_service", "--model", str(EMBEDDED_MODELS["tiny-llama"]), "--port", str(port),
                                "--insecure", "--max-model-len", "512"], port).start()
    try:
        deadline = asyncio.get_running_loop().time() + 180
        while "starting vLLM" not in engine.log_tail():
            assert engine.process.poll() is None, engine.log_tail()
            assert asyncio.get_running_loop().time() < deadline, engine.log_tail()
            await asyncio.sleep(0.2)
        assert listening_addresses(engine.process.pid, port) == {"127.0.0.1"}
        assert not connects(outside_address(), port)
    finally:
        engine.kill()
