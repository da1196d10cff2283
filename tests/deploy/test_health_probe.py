"""common.health_probe against a real router process: readiness is SERVING,
liveness is any health answer (a router without probes is alive, not ready)."""

import asyncio
import subprocess
import sys

import pytest

from tools import processes


def health_probe(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "common.health_probe", *args],
                          capture_output=True, text=True, timeout=60)


@pytest.fixture
def router_without_probes(tmp_path):
    (tmp_path / "probes").mkdir()
    # Plaintext: these check health semantics (tests/security checks the probe over mutual TLS).
    router = processes.router(processes.free_port(), tmp_path / "probes", secure=False).start()
    try:
        asyncio.run(router.wait_health(want_serving=False, timeout=60))
        yield router
    finally:
        router.terminate(timeout=30)


def test_router_without_probes_is_alive_but_not_ready(router_without_probes):
    ready = health_probe(router_without_probes.address)
    assert ready.returncode == 1
    assert ready.stdout.strip() == f"{router_without_probes.address}: NOT_SERVING"
    live = health_probe("--live", router_without_probes.address)
    assert live.returncode == 0
    assert live.stdout.strip() == f"{router_without_probes.address}: NOT_SERVING"


def test_nothing_listening_is_neither_alive_nor_ready():
    address = f"127.0.0.1:{processes.free_port()}"
    for args in ([address], ["--live", address]):
        result = health_probe(*args)
        assert result.returncode == 1
        assert result.stderr.strip() == f"{address}: UNAVAILABLE"


@pytest.mark.parametrize("args", [[], ["--live"], ["--ready", "127.0.0.1:1"], ["a:1", "b:2"]])
def test_bad_arguments_print_usage(args):
    result = health_probe(*args)
    assert result.returncode == 2
    assert result.stderr.startswith("usage: python -m common.health_probe [--live] HOST:PORT")
