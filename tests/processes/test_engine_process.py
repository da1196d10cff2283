"""The engine process on its own (in a package of its own, so the shared e2e
engine is not left idle while these run): optional routers, threads kept off
the workers' cores, metrics, graceful SIGTERM, a dead vLLM engine core, and
`make run`'s demo."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import time
import urllib.request

import grpc
import psutil
import pytest

from engine_service.cpu_host.placement import core_list
from tools import processes, stack
from undercurrent.v1 import engine_pb2 as engine_pb
from undercurrent.v1 import engine_pb2_grpc as engine_pb_grpc

pytestmark = pytest.mark.vllm


def request(rid: str, max_tokens: int) -> engine_pb.GenerateRequest:
    return engine_pb.GenerateRequest(request_id=rid, text="graceful",
                              sampling=engine_pb.SamplingParams(max_tokens=max_tokens, temperature=0,
                                                         ignore_eos=True))


def task_cores(pid: int) -> set[frozenset[int]]:
    return {frozenset(os.sched_getaffinity(int(tid))) for tid in os.listdir(f"/proc/{pid}/task")}


def assert_kept_off_the_workers_cores(service: stack.Service, started_on: frozenset[int]) -> None:
    """--keep-off-worker-cores: every thread of the service runs off the cores vLLM
    bound its worker to; vLLM's engine core stays where it started."""
    core = processes.vllm_engine_core(service)
    children = core.children(recursive=True)
    workers = [p for p in children if "VLLM::Worker" in " ".join(p.cmdline())]
    assert len(workers) == 1, [p.cmdline() for p in children]
    worker_cores = frozenset(os.sched_getaffinity(workers[0].pid))
    assert worker_cores < started_on, "vLLM's CPU backend binds its worker to some of the cores"
    assert task_cores(service.process.pid) == {started_on - worker_cores}
    assert len(psutil.Process(service.process.pid).threads()) > 10  # gRPC's, vLLM's and ours: all moved
    assert os.sched_getaffinity(core.pid) == started_on
    expected = (f"vLLM's workers are bound to cores {core_list(worker_cores)}: the engine service's "
                f"threads now run on {core_list(started_on - worker_cores)}")
    assert expected in service.log_path.read_text(errors="replace"), service.log_tail()


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores: one for the worker, one left")
async def test_routerless_engine_off_its_workers_cores_serves_reports_metrics_and_drains_on_sigterm(
        tiny_llama_path):
    started_on = frozenset(os.sched_getaffinity(0))  # what the service inherits from this process
    metrics_port = stack.free_port()
    service = stack.engine(tiny_llama_path, "", "--metrics-port", str(metrics_port),
                           "--grace-period", "60", "--keep-off-worker-cores", max_model_len=1024).start()
    try:
        # Without --router the engine needs no router to be SERVING.
        await service.wait_health(want_serving=True, timeout=240)
        assert_kept_off_the_workers_cores(service, started_on)
        async with stack.channel(service.address) as channel:
            engine = engine_pb_grpc.EngineServiceStub(channel)
            first = await stack.generate(engine, request("m1", 5))
            assert first.reason == "LENGTH"
            metrics = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics").read().decode()
            assert "undercurrent_engine_requests_started_total 1.0" in metrics
            assert "undercurrent_engine_tokens_generated_total 5.0" in metrics
            assert 'undercurrent_engine_requests_finished_total{reason="LENGTH"} 1.0' in metrics

            draining = stack.Outcome()
            running = asyncio.create_task(stack.generate(engine, request("draining", 1000), outcome=draining))
            await stack.until_started(draining, running)
            # vLLM held, so the request still runs while the checks below look: the tiny
            # model decodes its thousand tokens in about two seconds, and the engine
            # exits as soon as it has.
            with stack.vllm_paused(service):
                service.process.send_signal(15)
                await service.wait_health(want_serving=False, timeout=30)
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await stack.generate(engine, request("late", 3))
                assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
                assert "shutting down" in refused.value.details()
                assert not running.done()
            finished = await running
        # --on-shutdown finish (the default): the running request completes.
        assert finished.reason == "LENGTH" and len(finished.tokens) == 1000
        assert await asyncio.to_thread(service.process.wait, 60) == 0
        # What start-up left (vLLM, torch, grpc: hundreds of thousands of objects) is frozen.
        frozen = re.search(r"start-up heap frozen: (\d+) objects", service.log_path.read_text(errors="replace"))
        assert frozen and int(frozen[1]) > 100_000, service.log_tail()
    finally:
        service.kill()


def test_make_run_shows_the_probe_lifecycle(tiny_llama_path):
    """`make run`: capture, train, deploy live, then flagged prompts abort and others finish."""
    result = subprocess.run(
        [sys.executable, "-m", "tools.run_demo", "--model", tiny_llama_path, "--exit-after-demo"],
        capture_output=True, text=True, timeout=900,
    )
    out = result.stdout
    assert result.returncode == 0, out[-3000:] + result.stderr[-3000:]
    assert "dataset " in out and "400 examples, 2800 rows" in out
    assert float(re.search(r"held-out AUROC ([0-9.]+)", out).group(1)) >= 0.95
    assert "loaded marker (abort" in out and "loaded marker_scores (observe" in out
    assert out.count("-> PROBE_ABORT") >= 4 and out.count("-> LENGTH") >= 4
    assert "verdict: probe 'marker'" in out
    right, total = map(int, re.search(r"== (\d+) of (\d+) requests ended as their label says",
                                      out).groups())
    assert total == 10 and right >= 9, out[-2000:]


# The engine checks vLLM every second and then gives running requests 10 s to end.
ENGINE_EXIT_BOUND_S = 60


async def refusal_after_engine_loss(service, engine) -> grpc.aio.AioRpcError:
    """The answer to a new Generate once the engine reports NOT_SERVING (or exited)."""
    try:
        await service.wait_health(want_serving=False, timeout=ENGINE_EXIT_BOUND_S)
    except RuntimeError:  # wait_health: the process already exited
        pass
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await stack.generate(engine, request("after", 3), timeout=30)
    return refused.value


async def test_the_engine_exits_when_vllms_engine_core_dies(tiny_llama_path):
    """vLLM never recovers from a dead engine core: the engine ends the running
    request with the reason, reports NOT_SERVING, refuses new requests with
    UNAVAILABLE and exits 1, so a supervisor restarts it, instead of answering
    every request with an error behind a SERVING health."""
    service = stack.engine(tiny_llama_path, "", max_model_len=1024).start()
    try:
        await service.wait_health(want_serving=True, timeout=240)
        async with stack.channel(service.address) as channel:
            engine = engine_pb_grpc.EngineServiceStub(channel)
            progress = stack.Outcome()
            # vLLM runs in short bursts until the client has seen 5 tokens and is
            # killed while held: unpaced, the tiny model decoded all 1000 tokens
            # before the client saw its 5th.
            with stack.vllm_paused(service) as vllm:
                running = asyncio.create_task(stack.generate(engine, request("running", 1000), outcome=progress))
                async with asyncio.timeout(120):
                    while len(progress.tokens) < 5:
                        assert not running.done(), running.result().finished
                        await vllm.run_for(0.02)
                        await asyncio.sleep(0.2)
                processes.vllm_engine_core(service).kill()
                killed_at = time.monotonic()
            outcome = await asyncio.wait_for(running, ENGINE_EXIT_BOUND_S)
            refusal = await refusal_after_engine_loss(service, engine)
        code = await asyncio.to_thread(service.process.wait, ENGINE_EXIT_BOUND_S)
        print(f"engine exited {time.monotonic() - killed_at:.1f} s after its engine core was killed; "
              f"the running request ended with: {outcome.finished.message}")
        assert outcome.reason == "ERROR" and 5 <= len(outcome.tokens) < 1000, outcome.finished
        assert outcome.finished.message.startswith("engine error: "), outcome.finished
        # Refused, not served into a dead vLLM (which ends a request ERROR): by
        # the engine while it is still up, or by a closed port once it exited.
        assert refusal.code() == grpc.StatusCode.UNAVAILABLE, refusal
        assert service.process.poll() is not None or (
            "the engine cannot serve: vLLM's engine core stopped" in refusal.details()), refusal.details()
        assert code == 1, service.log_tail()
        log = service.log_tail(200)
        assert "engine_service: NOT_SERVING (vLLM's engine core stopped)" in log, log
        assert "exiting: vLLM's engine core stopped" in log, log
    finally:
        service.kill()
