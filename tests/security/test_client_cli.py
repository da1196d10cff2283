"""The `undercurrent` command against a real router serving mutual TLS with admin
tokens: a client certificate (--tls-cert/--tls-key) gets in, none is refused in
the handshake, and the certificate flags are checked before any call. The
token comes from $UNDERCURRENT_TOKEN or --token-file, never the command line."""

import asyncio
import os
import subprocess
import sys

from tests.security.conftest import ADMIN_TOKEN

CLI = [sys.executable, "-m", "undercurrent_client"]


async def cli(*args: str, token: str | None = ADMIN_TOKEN) -> tuple[int, str, str]:
    """A process, so the router sharing this event loop keeps answering."""
    env = {k: v for k, v in os.environ.items() if k != "UNDERCURRENT_TOKEN"}
    process = await asyncio.create_subprocess_exec(*CLI, *args, stdout=subprocess.PIPE,
                                                   stderr=subprocess.PIPE,
                                                   env={**env, "UNDERCURRENT_TOKEN": token} if token else env)
    out, err = await asyncio.wait_for(process.communicate(), 60)
    return process.returncode, out.decode(), err.decode()


async def test_probes_list_over_mutual_tls_needs_the_client_certificate(secure_router, pki, tmp_path):
    router, _ = await secure_router()
    client = pki.files("operator-client")
    target = ["--router", f"127.0.0.1:{router.port}", "--tls-root-cert", str(pki.ca_path)]

    code, out, err = await cli("probes", "list", *target, "--tls-cert", str(client.cert),
                               "--tls-key", str(client.key))
    assert (code, err) == (0, "")
    assert [line.split()[0] for line in out.splitlines()] == ["NAME", "p"]

    code, out, err = await cli("probes", "list", *target)
    assert (code, out) == (1, "")
    assert err.startswith("undercurrent: error: ListProbes failed with UNAVAILABLE: ")

    code, out, err = await cli("probes", "list", *target, "--tls-cert", str(client.cert))
    assert (code, out) == (2, "")
    assert err == "undercurrent: error: --tls-cert and --tls-key go together (see --help)\n"

    code, _, err = await cli("probes", "list", *target, "--tls-cert", str(tmp_path / "none.pem"),
                             "--tls-key", str(client.key))
    assert code == 2 and f"--tls-cert '{tmp_path / 'none.pem'}' is not a file" in err
