"""The engine service's default on vLLM's CPU backend (--engine-core-nice auto):
vLLM's engine core runs at nice -10, its workers and the service at their own."""

from __future__ import annotations

import re
import resource

from tests.e2e.test_client_api import simple
from tools import stack
from tools.processes import thread_nices, vllm_engine_core

CAP_SYS_NICE = 23


def may_raise_priorities() -> bool:
    """Whether the engine service (started by this user) may run a thread at nice -10."""
    with open("/proc/self/status") as status:
        effective = next(int(line.split()[1], 16) for line in status if line.startswith("CapEff:"))
    return bool(effective >> CAP_SYS_NICE & 1) or resource.getrlimit(resource.RLIMIT_NICE)[0] >= 30


def nices(pid: int) -> set[int]:
    return set(thread_nices(pid))


async def test_vllms_engine_core_runs_ahead_of_the_service(engine_service, engine):
    core = vllm_engine_core(engine_service)
    finished = await stack.generate(engine, simple(max_tokens=8))  # threads started by serving, too
    assert finished.reason == "LENGTH"
    log = engine_service.log_path.read_text(errors="replace")
    if not may_raise_priorities():
        assert nices(core.pid) == {0}
        assert "vLLM's engine core keeps its priority: nice -10 needs CAP_SYS_NICE or RLIMIT_NICE" in log
        return
    assert nices(core.pid) == {-10}
    assert all(nices(worker.pid) == {0} for worker in core.children(recursive=True))
    assert nices(engine_service.process.pid) == {0}
    assert re.search(
        r"vLLM's engine core runs at nice -10, \d+ threads \(--engine-core-nice auto\)", log)
