"""How vLLM's engine core waits for its workers' output: spinning or asleep.

While a forward pass runs, vLLM's engine core waits for the workers' reply on
a shared-memory queue by spinning, calling sched_yield, for up to a second
after its last read: on a busy engine it never sleeps, and takes a whole core
to wait. Where cores are the compute (vLLM's CPU backend), that core is the
one vLLM leaves to other processes, the engine service and the router among
them, which then run beside a spinning process instead of beside the forward
pass. Asleep, the engine core spins only for SPIN_AFTER_READ_S after each
read (a step's second reply, the sampled tokens, follows its first within a
millisecond, and its notification is often lost behind the first's), then
waits in the queue's own poll for the workers' notification, bounded so that a
missed one costs at most POLL_BOUND_MS (`python -m bench.overhead
--engine-core-wait auto|spin` measures both ways).

The engine core runs in a process of vLLM's own, so the choice reaches it as
the environment variable ENV, read by `register`: a vLLM general plugin
(pyproject.toml's `vllm.general_plugins` entry point), which vLLM loads in
each of its processes. Only the engine core's waits change; workers keep
vLLM's spin.
"""

from __future__ import annotations

import logging
import multiprocessing
import os

log = logging.getLogger("engine_service")

ENV = "UNDERCURRENT_ENGINE_CORE_WAIT"
MODES = ("auto", "spin", "sleep")
# The longest a waiting engine core sleeps before it looks at the queue again
# (ZeroMQ's poll counts whole milliseconds).
POLL_BOUND_MS = 1
# How long after a read the engine core still spins, as vLLM's does for a second.
SPIN_AFTER_READ_S = 0.002
# vLLM names its engine core's process EngineCore (EngineCore_DP<n> with data parallelism).
ENGINE_CORE_PROCESS = "EngineCore"


def resolve(mode: str, on_cpu: bool) -> str:
    """auto sleeps on vLLM's CPU backend, where the spin takes a core from the
    engine service and the router, and spins elsewhere, as vLLM does."""
    if mode not in MODES:
        raise ValueError(f"engine core wait {mode!r}: expected one of {', '.join(MODES)}")
    if mode == "auto":
        return "sleep" if on_cpu else "spin"
    return mode


def choose(mode: str, on_cpu: bool) -> str:
    """Sets the wait of the engine cores this process starts from here on, and
    returns it. Spawned, an engine core reads ENV when vLLM loads its plugins;
    forked, it inherits this process's SpinCondition, patched here already."""
    wait = os.environ[ENV] = resolve(mode, on_cpu)
    register()
    return wait


def in_engine_core() -> bool:
    return multiprocessing.current_process().name.startswith(ENGINE_CORE_PROCESS)


def sleeping_wait(wait):
    """vLLM's SpinCondition.wait, asleep in the engine core's process: its busy
    loop cut to SPIN_AFTER_READ_S, and a poll bounded by POLL_BOUND_MS. Elsewhere
    (vLLM forks workers from a process that loaded this plugin), vLLM's own wait."""

    def wait_asleep(self, timeout_ms: int | None = None) -> None:
        if not in_engine_core():
            return wait(self, timeout_ms)
        self.busy_loop_s = SPIN_AFTER_READ_S
        return wait(self, POLL_BOUND_MS if timeout_ms is None else min(timeout_ms, POLL_BOUND_MS))

    wait_asleep.undercurrent_asleep = True
    return wait_asleep


def register() -> None:
    """vLLM's general plugin hook: with ENV=sleep, the engine core's waits sleep.
    Loaded in every vLLM process (and possibly more than once in one)."""
    if os.environ.get(ENV) != "sleep":
        return
    try:
        from vllm.distributed.device_communicators.shm_broadcast import SpinCondition
    except ImportError as err:
        log.warning("%s=sleep ignored: this vLLM has no SpinCondition (%s)", ENV, err)
        return
    if not getattr(SpinCondition.wait, "undercurrent_asleep", False):
        SpinCondition.wait = sleeping_wait(SpinCondition.wait)
