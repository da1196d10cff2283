"""vLLM's engine core ahead of the engine service and the router for a CPU
(`--engine-core-nice`, default auto: NICE_ON_CPU on vLLM's CPU backend, left
alone elsewhere).

Each engine step ends by waking three processes at once: vLLM's engine core
(the workers' reply), the engine service (the step's rows) and then the router
(the service's message). On a CPU host they share the cores the workers
compute on, and the engine core's turnaround, which the workers wait for
before the next step, can queue behind the other two's work. With the engine
core asleep while its workers compute (`engine_core_wait`), it has to be woken
and scheduled each step, so its priority decides how soon the next step
starts. At nice -10 every type at every layer ran 1.5-8.6% faster, in each of
six runs alternating round by round on a 2-core host.

The engine service sets it from outside, once vLLM has started: every thread
of each engine core process vLLM started (threads it starts later inherit a
thread's nice), and not the workers, which vLLM had started by then. Raising a
priority needs CAP_SYS_NICE (root on a bare host) or a RLIMIT_NICE of at least
20 - nice (`ulimit -e`); without either (the images' user has neither) the
engine core keeps its priority and the service says so.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from engine_service.cpu_host.placement import for_each_thread

NICE_ON_CPU = -10
EXPECTED = "expected auto or an integer from -20 to 19"


def resolve(value: str, on_cpu: bool) -> int | None:
    """The nice to give vLLM's engine core, or None to leave it alone: auto is
    NICE_ON_CPU on vLLM's CPU backend and None elsewhere (a GPU host's engine
    core has cores to spare; not measured there)."""
    if value == "auto":
        return NICE_ON_CPU if on_cpu else None
    try:
        nice = int(value)
    except ValueError:
        raise ValueError(f"engine core nice {value!r}: {EXPECTED}") from None
    if not -20 <= nice <= 19:
        raise ValueError(f"engine core nice {nice}: {EXPECTED}")
    return nice


def engine_core_pids(llm) -> list[int]:
    """The processes of vLLM's engine cores that `llm` (an AsyncLLM) started on
    this host; empty where vLLM keeps them elsewhere (in-process, or Ray)."""
    resources = getattr(getattr(llm, "engine_core", None), "resources", None)
    manager = getattr(resources, "engine_manager", None)
    return [p.pid for p in getattr(manager, "processes", ()) if p.pid is not None]


def renice_threads(pid: int, nice: int) -> int:
    """Sets the nice of every thread of process `pid` (Linux keeps one per
    thread); returns the threads set. PermissionError where raising a priority
    is not allowed."""
    return for_each_thread(pid, lambda tid: os.setpriority(os.PRIO_PROCESS, tid, nice))


def apply(value: str, on_cpu: bool, pids: Iterable[int]) -> str:
    """Gives the engine cores `pids` the nice `value` resolves to; returns the
    line the service logs."""
    nice = resolve(value, on_cpu)
    if nice is None:
        return f"vLLM's engine core keeps its priority (--engine-core-nice {value})"
    pids = list(pids)
    if not pids:
        return "vLLM's engine core keeps its priority: it runs in no process of its own here"
    try:
        threads = sum(renice_threads(pid, nice) for pid in pids)
    except PermissionError:
        return (f"vLLM's engine core keeps its priority: nice {nice} needs CAP_SYS_NICE or "
                f"RLIMIT_NICE >= {20 - nice} (--engine-core-nice {value})")
    return f"vLLM's engine core runs at nice {nice}, {threads} threads (--engine-core-nice {value})"
