"""`make compose-test`: compose.yaml run for real on a Docker daemon, and the
checks of what comes back through the stack. The daemon and the images are
tools/docker_host.py's, the compose project tools/compose_stack.py's.

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
     read from the engine's secrets volume): tokens stream, probe scores come back;
  6. the engine's word on its engine core's priority (--engine-core-nice auto)
     matches the nice of the engine core's threads, read from this host: the
     engine's user may not raise it here, so nice 0 and the line saying so;
  7. `--scale router=2`: the engine's replicas_up gauge follows 3 -> 2, and a
     second Generate still gets scores; vLLM's own series (time to first token,
     end-to-end latency) on the engine's metrics endpoint count both requests;
  8. an abort through the stack: a probe built to fire at a known token (from
     a first run's activations, streamed to this client) is deployed to every
     router replica with `probe_lifecycle deploy --routers dns:router:50061`,
     run by the stack's `operator` tool as docs/deployment.md shows; then
     `--abort-pairs` pairs of fail_closed requests: each pair's first request
     must end PROBE_ABORT at that token, the other run to its end untouched,
     and the median abort must land within ABORT_LATENCY_BOUND tokens;
  9. routers that stop answering: a gated fail_closed request is running when
     every router container is frozen (`docker compose pause router`, vLLM
     held meanwhile so the request cannot finish first); it must end
     ROUTER_UNAVAILABLE within the engine's router timeout plus slack, with no
     token released that a router did not score; after `unpause` a request is
     scored again;
  10. the stack down, then the attacks on a compose stack of their own
     (tests/security/test_attack_compose.py, which `make test` skips as no
     daemon runs yet): what each container holds, a compromised engine or
     router reaching for the others, health checks, published ports;
  11. `docker compose down -v`, and the daemon stopped if it was started here.
Exits 0 only if every check passed; prints a table of step times.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import subprocess
import sys
import time

import grpc

from common.grpc_server import channel_options
from engine_service.service.runtime import EngineSettings
from tools import aborts
from tools import stack as e2e_stack
from tools.compose_stack import TAG, Stack
from tools.shipped_probe import PROBE_NAME
from tools.docker_host import (
    PUBLIC_BASE,
    WORK,
    Failure,
    base_image,
    build_image,
    daemon_running,
    log,
    pip_wheel_folder,
    serve_folder,
    start_daemon,
    stop_daemon,
)
from tools.processes import engine_core_under, free_port, thread_nices
from undercurrent.v1 import engine_pb2 as engine_pb
from undercurrent.v1 import types_pb2 as types_pb
from undercurrent.v1 import engine_pb2_grpc as engine_pb_grpc

REPLICAS_UP = "undercurrent_router_link_replicas_up"
VLLM_SERIES = ("vllm:time_to_first_token_seconds_count", "vllm:e2e_request_latency_seconds_count")
ATTACKS = "tests/security/test_attack_compose.py"
# compose.yaml's engine runs with the default --router-timeout; a request whose
# routers fell silent ends this soon after, plus the slack the fault tests allow
# (the watchdog's tick, one scheduler step, the finished message on a loaded host).
ROUTER_TIMEOUT_S = EngineSettings.router_timeout_s


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


async def generate_with_probe(port: int, credentials: grpc.ChannelCredentials, prompt: str,
                              max_tokens: int) -> dict:
    """One Generate through the published port; returns what came back. A probe
    unknown to the engine (NOT_FOUND) is retried for 30 s: routers' catalogs reach
    the engine asynchronously after they connect."""
    request = engine_pb.GenerateRequest(
        text=prompt,
        sampling=engine_pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    request.probes.add(probe=PROBE_NAME, failure_policy=types_pb.FAILURE_POLICY_FAIL_CLOSED)
    deadline = time.monotonic() + 30
    async with grpc.aio.secure_channel(f"127.0.0.1:{port}", credentials, options=channel_options()) as channel:
        engine = engine_pb_grpc.EngineServiceStub(channel)
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
    if finished.finish_reason != types_pb.FINISH_REASON_LENGTH:
        raise Failure(f"finish reason {types_pb.FinishReason.Name(finished.finish_reason)}, expected LENGTH")
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
        engine = engine_pb_grpc.EngineServiceStub(channel)
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
    request = engine_pb.GenerateRequest(
        text="Routers that stop answering", gate_tokens=True,
        sampling=engine_pb.SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True))
    request.probes.add(probe=PROBE_NAME, failure_policy=types_pb.FAILURE_POLICY_FAIL_CLOSED)
    address = f"127.0.0.1:{stack.engine_port}"
    async with grpc.aio.secure_channel(address, credentials, options=channel_options()) as channel:
        engine = engine_pb_grpc.EngineServiceStub(channel)
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


def attacks_on_the_stack() -> str:
    """tests/security/test_attack_compose.py brings up a stack of its own and
    attacks it. `make test` runs before any daemon does and skips it, so it
    runs here, where the daemon and the images are ready; a skip is a failure.
    pytest's lines are echoed as they come."""
    command = [sys.executable, "-m", "pytest", ATTACKS, "-v", "-rs", "-p", "no:cacheprovider"]
    lines = []
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as run:
        for line in run.stdout:
            lines.append(line.rstrip())
            log("   | " + lines[-1])
    summary = lines[-1] if lines else ""
    if run.returncode or "skipped" in summary or "passed" not in summary:
        raise Failure(f"{ATTACKS}: {summary or 'no output'}")
    return f"{ATTACKS}: {summary.strip('= ')}"


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
        with steps.step("the attacks on the stack"):
            stack.compose("down", "--volumes", "--remove-orphans", "--timeout", "30", check=False)
            log("   " + attacks_on_the_stack())
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
