"""Keeps the engine service's threads off the cores vLLM bound its workers to
(`--keep-off-worker-cores`, off by default).

On a CPU host vLLM binds each worker's compute threads to cores of their own
(`VLLM_CPU_OMP_THREADS_BIND`, `auto` by default) and reserves the rest for other
processes, but nothing keeps those other processes off the workers' cores. A
pinned worker that loses its core stalls, and with several workers it stalls the
others at the next all-reduce. A router can be kept off them from outside
(`taskset`, a container cpuset); the engine service cannot, because vLLM's
processes inherit the cores of the process that starts them: it moves itself
once its workers are bound. Its own engine core stays where it started: moved
with the service it took the service's core, and every type at every layer ran
about 10% slower. Where workers are not bound (GPU hosts, `nobind`) their cores
are every core the service may use, and nothing moves.

Off by default because it has not been shown to pay: on the 2-core bench host
with one worker, alternating round by round, every type at every layer ran at
0.99-1.02 of the unplaced service's speed, the router placed too at 0.97-1.01.

Plain logic: the caller passes the workers' cores; `move_process` acts on any pid
(the benchmarks place a router the same way an operator would with `taskset`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable

log = logging.getLogger(__name__)


def cores_off_workers(allowed: Iterable[int], worker_cores: Iterable[int]) -> frozenset[int]:
    """The cores of `allowed` no worker is bound to; empty when there is nothing
    to move to: the workers hold none of `allowed` (nothing to avoid), or all of
    it (no core left; the service then stays where it was)."""
    allowed = frozenset(allowed)
    workers = frozenset(worker_cores)
    if not allowed & workers:
        return frozenset()
    return allowed - workers


def move_process(pid: int, cores: Iterable[int]) -> int:
    """Puts every thread of process `pid` on `cores`; threads it starts later
    inherit the set from the thread that starts them. Returns the threads moved
    (a thread that ended meanwhile is skipped)."""
    cores = set(cores)
    return for_each_thread(pid, lambda tid: os.sched_setaffinity(tid, cores))


def for_each_thread(pid: int, act) -> int:
    """Calls act(tid) for every thread of process `pid` (Linux keeps affinity and nice per
    thread); returns how many it acted on, skipping a thread that ended meanwhile."""
    done = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            act(int(tid))
        except ProcessLookupError:
            continue
        done += 1
    return done


def keep_off_worker_cores(worker_cores: Iterable[int], pid: int | None = None) -> frozenset[int]:
    """Moves process `pid` (default: this one) to the cores its threads may use
    that no worker is bound to; returns those cores, empty when nothing moved."""
    pid = os.getpid() if pid is None else pid
    target = cores_off_workers(os.sched_getaffinity(pid), worker_cores)
    if target:
        move_process(pid, target)
    return target


async def place_engine_service(capture) -> frozenset[int]:
    """Keeps this process off the cores of its engine's workers on this node
    (`capture`: the engine's CaptureController); logs where it moved."""
    workers = await capture.local_worker_cores()
    try:
        cores = keep_off_worker_cores(workers)
    except OSError as err:  # a runtime that forbids it: the service runs on, unplaced
        log.warning("could not keep the engine service off its workers' cores %s: %s", core_list(workers), err)
        return frozenset()
    if cores:
        log.info(
            "vLLM's workers are bound to cores %s: the engine service's threads now run on %s",
            core_list(workers), core_list(cores),
        )
    return cores


def core_list(cores: Iterable[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5", as `taskset -c` and VLLM_CPU_OMP_THREADS_BIND write them."""
    runs: list[list[int]] = []
    for core in sorted(cores):
        if runs and core == runs[-1][1] + 1:
            runs[-1][1] = core
        else:
            runs.append([core, core])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
