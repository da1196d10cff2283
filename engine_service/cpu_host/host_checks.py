"""What the host does to the engine's neighbours, checked once at start-up.

On a CPU host vLLM's workers compute on the same cores as the engine service,
the router and the clients, and wait for each step spinning on `sched_yield`.
With the kernel's scheduler autogroup on, every session (each `setsid`: a
terminal, a service manager's unit, a launcher that starts each process in a
session of its own) is scheduled as one group; a session holding the engine then
kept processes of other sessions (a router, a client, a plain 10 ms sleeper)
from both cores of a 2-core host for up to 3.3 s at a time, and a router went
silent 7 s, long enough for the engine to drop its session. In one session the
router waited at most 11 ms per request; in separate ones with autogroup off, no
stall came either. Containers are outside autogroup, but in control groups that
the kernel schedules the same way: there a higher CPU weight for the router is
the remedy measured (`compose.yaml`). Plain logic: the setting's path is
passed in.
"""

from __future__ import annotations

from pathlib import Path

AUTOGROUP_SETTING = Path("/proc/sys/kernel/sched_autogroup_enabled")


def autogroup_warning(on_cpu: bool, setting: Path = AUTOGROUP_SETTING) -> str | None:
    """The start-up warning for a CPU engine on a host with autogroup on; None otherwise."""
    if not on_cpu:
        return None
    try:
        if setting.read_text().strip() != "1":
            return None
    except OSError:  # not Linux, or a kernel without autogroup
        return None
    return (
        f"{setting} is 1: on this CPU host, processes in other sessions than the engine's "
        "(a router or client started from another terminal or by another launcher) can wait "
        "seconds for a CPU while vLLM's workers run, and a router that waits past "
        "--router-timeout fails its requests; start them from one session (as `make run` and "
        "the tests do), give the router cores vLLM's workers are not pinned to, or set "
        "kernel.sched_autogroup_enabled=0 (docs/deployment.md, CPU hosts)"
    )
