"""`--keep-off-worker-cores`: a real engine service moves its threads off the cores
vLLM bound its worker to, and leaves its engine core where it started."""

from __future__ import annotations

import os

import psutil
import pytest

from engine_service.cpu_host.placement import core_list
from tools import stack
from tools.processes import vllm_engine_core
from undercurrent.v1 import engine_pb2 as engine_pb
from undercurrent.v1 import engine_pb2_grpc as engine_pb_grpc

pytestmark = pytest.mark.vllm


def task_cores(pid: int) -> set[frozenset[int]]:
    return {frozenset(os.sched_getaffinity(int(tid))) for tid in os.listdir(f"/proc/{pid}/task")}


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores: one for the worker, one left")
async def test_the_engine_service_moves_off_its_workers_core_and_its_engine_core_stays(tiny_llama_path):
    started_on = frozenset(os.sched_getaffinity(0))  # what the service inherits from this process
    service = stack.engine(tiny_llama_path, "", "--keep-off-worker-cores").start()
    try:
        await service.wait_health(want_serving=True, timeout=240)
        core = vllm_engine_core(service)
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
        # Serving from there: a request completes.
        async with stack.channel(service.address) as channel:
            outcome = await stack.generate(engine_pb_grpc.EngineServiceStub(channel), engine_pb.GenerateRequest(
                text="placed", sampling=engine_pb.SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)))
        assert outcome.reason == "LENGTH" and len(outcome.tokens) == 4
    finally:
        service.kill()

