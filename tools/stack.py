"""Real engine and router processes on loopback, and gRPC clients for them."""

from __future__ import annotations

import asyncio
import time
import urllib.request
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import psutil
from prometheus_client.parser import text_string_to_metric_families

from common.enum_names import short_name
from tools import processes
from tools.dev_security import DevSecurity
from tools.processes import Service, free_port  # noqa: F401  (re-exported for the tests)
from undercurrent.v1 import engine_pb2 as engine_pb
from undercurrent.v1 import types_pb2 as types_pb
from undercurrent.v1 import engine_pb2_grpc as engine_pb_grpc
from undercurrent_client import Connection


def router(port: int, probes_dir: Path, *extra: str) -> Service:
    """A router with fast heartbeats, so lost sessions show quickly, and reflection."""
    return processes.router(port, probes_dir, "--heartbeat-interval", "1", "--reflection", *extra)


def engine(model: str, router_addresses: str, *extra: str, workers_bind: str | None = None,
           max_model_len: int = 512, router_timeout_s: float = 3.0, dtype: str = "float32",
           log_stats: bool = False) -> Service:
    """An engine whose requests give up on an unreachable router after router_timeout_s, with reflection."""
    return processes.engine(model, router_addresses, "--router-timeout", str(router_timeout_s), "--reflection", *extra,
                            workers_bind=workers_bind, max_model_len=max_model_len, dtype=dtype, log_stats=log_stats)


# The slack a failure may take on top of the engine's --router-timeout to end a
# request: the watchdog's tick (timeout / 5), one scheduler step to abort, and
# the finished message on a loaded 2-core machine.
END_SLACK_S = 3.0


@dataclass
class Outcome:
    """Everything one Generate stream returned."""

    request_id: str = ""
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    scores: list[types_pb.ProbeScores] = field(default_factory=list)
    batches: list[types_pb.ActivationBatch] = field(default_factory=list)
    finished: engine_pb.GenerateFinished | None = None

    @property
    def reason(self) -> str:
        return short_name(types_pb.FinishReason, self.finished.finish_reason)


def scored_positions(outcome: Outcome) -> list[int]:
    """The positions of every score the client was shown, in arrival order."""
    return [p for event in outcome.scores for p in event.token_positions]


def assert_released_tokens_were_scored(outcome: Outcome) -> None:
    """gate_tokens under fail_closed: token g reached the client only if its row
    (position prompt_tokens + g) was scored."""
    prompt = outcome.finished.prompt_tokens
    scored = set(scored_positions(outcome))
    unscored = [g for g in range(len(outcome.tokens)) if prompt + g not in scored]
    assert not unscored, (
        f"{len(unscored)} of {len(outcome.tokens)} released tokens were never scored "
        f"(first {unscored[:5]}); last scored position {max(scored, default=None)}")


async def generate(stub: engine_pb_grpc.EngineServiceStub, request: engine_pb.GenerateRequest, timeout=120,
                   scored: asyncio.Event | None = None, outcome: Outcome | None = None) -> Outcome:
    """Runs one Generate stream to its end, filling `outcome` as responses arrive;
    sets `scored` at the first probe event."""
    outcome = outcome if outcome is not None else Outcome()
    async for response in stub.Generate(request, timeout=timeout):
        kind = response.WhichOneof("event")
        if kind == "started":
            outcome.request_id = response.started.request_id
        elif kind == "tokens":
            assert response.tokens.first_index == len(outcome.tokens)
            outcome.tokens.extend(response.tokens.token_ids)
            outcome.text += response.tokens.text
        elif kind == "probe_event":
            outcome.scores.append(response.probe_event.scores)
            if scored is not None:
                scored.set()
        elif kind == "activations":
            outcome.batches.append(response.activations)
        elif kind == "finished":
            outcome.finished = response.finished
    assert outcome.finished is not None, "the stream ended without a finished message"
    return outcome


@contextmanager
def vllm_paused(engine_service: Service):
    """vLLM's engine core and workers stopped (SIGSTOP) while the block runs.

    A request started meanwhile stays in the engine's table, unfinished, until
    the block ends, however fast the model and however slow the host: the tiny
    model can decode a thousand tokens before a loaded client sees the first, so
    a test that needs a running request must not race it. The engine service
    itself keeps answering (nothing on its event loop waits for vLLM)."""
    with suspended(processes.vllm_engine_core(engine_service)) as held:
        yield held


@contextmanager
def suspended(core: psutil.Process):
    """vLLM's engine core `core` and its workers stopped (SIGSTOP) while the block runs."""
    stopped = [core, *core.children(recursive=True)]
    for process in stopped:
        process.suspend()
    try:
        yield HeldVllm(stopped)
    finally:
        for process in stopped:
            with suppress(psutil.NoSuchProcess):  # a test may kill one while held
                process.resume()


@dataclass
class HeldVllm:
    """vLLM's processes inside vllm_paused."""

    processes: list

    async def run_for(self, seconds: float) -> None:
        """Lets vLLM run for `seconds`, then holds it again: run in short bursts,
        the tiny model cannot outpace the engine service and a router however
        slow the host."""
        for process in self.processes:
            process.resume()
        try:
            await asyncio.sleep(seconds)
        finally:
            for process in self.processes:
                process.suspend()


async def until_started(outcome: Outcome, stream: asyncio.Task) -> None:
    """Until the request is in the engine's table (its `started` event)."""
    while not outcome.request_id:
        assert not stream.done(), stream
        await asyncio.sleep(0.005)


def engine_connection(address: str) -> Connection:
    """For the client library: TLS trusting the development CA, with the `demo`
    client token (engines here run with TLS)."""
    dev = DevSecurity.ensure()
    return Connection(address, root_certificates=dev.ca, token=dev.client_token)


def channel(address: str, token: str | None = None) -> grpc.aio.Channel:
    """TLS with the development client certificate; the `demo` client token (the
    admin token for ProbeAdminService) unless `token` is given."""
    return DevSecurity.ensure().channel(address, token)


async def wait_for_probe(stub: engine_pb_grpc.EngineServiceStub, probe: str, timeout: float = 30) -> None:
    """Waits until the engine's router catalog offers `probe` (catalogs propagate
    asynchronously after a router starts or loads a probe)."""
    deadline = time.monotonic() + timeout
    request = engine_pb.GenerateRequest(token_ids=engine_pb.TokenIds(ids=[5, 6, 7]),
                                 sampling=engine_pb.SamplingParams(max_tokens=1, temperature=0))
    request.probes.add(probe=probe, failure_policy=types_pb.FAILURE_POLICY_FAIL_OPEN)
    while True:
        try:
            await generate(stub, request)
            return
        except grpc.aio.AioRpcError as err:
            if err.code() != grpc.StatusCode.NOT_FOUND or time.monotonic() > deadline:
                raise
        await asyncio.sleep(0.2)


def scrape(port: int) -> dict[str, float]:
    """One Prometheus scrape: sample name (with labels, `name{k="v"}`) -> value."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            values[sample.name + (f"{{{labels}}}" if labels else "")] = sample.value
    return values


async def wait_metric(port: int, name: str, reached, timeout: float = 30) -> float:
    """Scrapes until reached(value) holds for the sample `name` (absent reads 0.0),
    and returns that value; fails after timeout seconds."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not reached(value := (await asyncio.to_thread(scrape, port)).get(name, 0.0)):
        assert asyncio.get_running_loop().time() < deadline, f"{name} still {value} after {timeout} s"
        await asyncio.sleep(0.05)
    return value


def running_requests(metrics_port: int) -> int:
    """Requests an engine accepted and has not finished, from its metrics."""
    values = scrape(metrics_port)
    started = values.get("undercurrent_engine_requests_started_total", 0.0)
    finished = sum(v for k, v in values.items() if k.startswith("undercurrent_engine_requests_finished_total"))
    return int(started - finished)


async def wait_model_info(stub: engine_pb_grpc.EngineServiceStub, service: Service,
                          timeout: float = 240) -> types_pb.ModelInfo:
    """Waits until a starting engine answers GetModelInfo (its health stays
    NOT_SERVING until a router session is up)."""
    deadline = time.monotonic() + timeout
    while True:
        if service.process.poll() is not None:
            raise RuntimeError(f"engine exited:\n{service.log_tail()}")
        try:
            return (await stub.GetModelInfo(engine_pb.GetModelInfoRequest(), timeout=2)).model
        except grpc.aio.AioRpcError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.5)
