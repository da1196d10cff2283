"""The engine service's default on vLLM's CPU backend (--engine-core-wait auto):
vLLM's engine core sleeps while its worker computes, instead of spinning on a core."""

from __future__ import annotations

import asyncio

import psutil

from tests.e2e.test_client_api import simple
from tools import stack
from tools.processes import vllm_engine_core

TOKENS = 1000
HOLD_S = 0.5  # under the second vLLM's engine core spins after a reply


def main_thread(pid: int) -> tuple[int, float]:
    """How often the process's main thread has blocked (a spinning thread does not),
    and its CPU seconds."""
    with open(f"/proc/{pid}/task/{pid}/status") as status:
        switches = next(int(line.split()[1]) for line in status if line.startswith("voluntary_ctxt_switches:"))
    thread = next(t for t in psutil.Process(pid).threads() if t.id == pid)
    return switches, thread.user_time + thread.system_time


async def test_vllms_engine_core_sleeps_while_its_worker_computes(engine_service, engine):
    """A decoding request's worker held for HOLD_S (as a long forward pass would
    take): the engine core, which had just read the worker's last reply, sleeps."""
    core = vllm_engine_core(engine_service)
    workers = core.children(recursive=True)
    outcome = stack.Outcome()
    with stack.vllm_paused(engine_service) as held:
        stream = asyncio.create_task(stack.generate(engine, simple(max_tokens=TOKENS), outcome=outcome))
        await stack.until_started(outcome, stream)
        for process in held.processes:
            process.resume()
        await asyncio.sleep(0.05)  # decoding: the engine core reads a reply every step
        for worker in workers:
            worker.suspend()
        switches, cpu = main_thread(core.pid)
        await asyncio.sleep(HOLD_S)
        switches_after, cpu_after = main_thread(core.pid)
    finished = await stream
    assert finished.reason == "LENGTH" and len(finished.tokens) == TOKENS
    # Polls of at most a millisecond each: hundreds of sleeps and little CPU. Spinning: neither.
    assert switches_after - switches >= 100, switches_after - switches
    assert cpu_after - cpu < 0.25 * HOLD_S, cpu_after - cpu
    assert ("vLLM's engine core sleeps while its workers compute (--engine-core-wait auto)"
            in engine_service.log_path.read_text(errors="replace"))
