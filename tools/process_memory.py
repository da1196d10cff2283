"""Resident memory of a process tree, read from /proc (Linux).

An engine service is several processes: the service itself, vLLM's engine
core and, with parallelism, its workers. What the engine costs in memory is
their sum. RSS counts a page shared between two of them (libraries, torch,
shared-memory rings) once per process, so the sum overstates; PSS splits each
shared page between its sharers, so the sum of PSS is the tree's real share
of RAM. PSS comes from /proc/PID/smaps_rollup, which some kernels lack.

`MemorySampler` samples a tree on a thread every `interval` seconds and keeps
the first, peak and last value of each named phase, so a benchmark can run its
load on the event loop and read what each phase cost afterwards.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

PROC = Path("/proc")


@dataclass(frozen=True)
class TreeMemory:
    """One reading of a process tree."""

    pids: tuple[int, ...]
    rss_bytes: int
    pss_bytes: int | None  # None when any process's smaps_rollup was unreadable
    rss_by_pid: dict[int, int] = field(default_factory=dict)


def _parent(pid: int) -> int | None:
    """The parent of a live process; None for one gone, unreadable or a zombie
    (exited, holding no memory, waiting for its parent to reap it)."""
    try:
        stat = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after the last ')'.
    state, parent = stat.rsplit(")", 1)[1].split()[:2]
    return None if state in ("Z", "X") else int(parent)


def tree_pids(root: int) -> list[int]:
    """root and every live descendant, root first (one pass over /proc); zombies left out."""
    children: dict[int, list[int]] = {}
    for entry in PROC.iterdir():
        if entry.name.isdigit():
            parent = _parent(int(entry.name))
            if parent is not None:
                children.setdefault(parent, []).append(int(entry.name))
    found, frontier = [root], [root]
    while frontier:
        frontier = [c for p in frontier for c in sorted(children.get(p, []))]
        found += frontier
    return found


def _kib_field(path: Path, name: str) -> int | None:
    try:
        text = path.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith(name + ":"):
            return int(line.split()[1]) * 1024
    return None


def tree_memory(root: int) -> TreeMemory:
    """Sum of RSS (VmRSS) and of PSS over root and its descendants; a process
    that exits between listing and reading counts as nothing."""
    pids = tree_pids(root)
    rss_by_pid = {pid: _kib_field(PROC / str(pid) / "status", "VmRSS") or 0 for pid in pids}
    pss = 0
    pss_known = True
    for pid in pids:
        value = _kib_field(PROC / str(pid) / "smaps_rollup", "Pss")
        if value is None:
            pss_known = False
        else:
            pss += value
    return TreeMemory(tuple(pids), sum(rss_by_pid.values()), pss if pss_known else None, rss_by_pid)


def process_name(pid: int) -> str:
    """The kernel's name of a process (vLLM names its own: VLLM::EngineCor, VLLM::Worker)."""
    try:
        return (PROC / str(pid) / "comm").read_text().strip()
    except OSError:
        return "?"


@dataclass
class Phase:
    """What one phase saw: its first, peak and last reading (bytes), and how many."""

    name: str
    first: TreeMemory
    peak_rss: int = 0
    peak_pss: int | None = None
    last: TreeMemory | None = None
    samples: int = 0
    pids: set[int] = field(default_factory=set)
    peak_rss_by_pid: dict[int, int] = field(default_factory=dict)

    def add(self, reading: TreeMemory) -> None:
        self.samples += 1
        self.last = reading
        self.pids.update(reading.pids)
        for pid, rss in reading.rss_by_pid.items():
            self.peak_rss_by_pid[pid] = max(self.peak_rss_by_pid.get(pid, 0), rss)
        self.peak_rss = max(self.peak_rss, reading.rss_bytes)
        if reading.pss_bytes is not None:
            self.peak_pss = max(self.peak_pss or 0, reading.pss_bytes)


class MemorySampler:
    """Samples one process tree every `interval` seconds on a daemon thread."""

    def __init__(self, root: int, interval: float = 0.2) -> None:
        self.root = root
        self.interval = interval
        self.phases: list[Phase] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="memory-sampler", daemon=True)

    def __enter__(self) -> "MemorySampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def phase(self, name: str) -> Phase:
        """Ends the current phase (with one last reading) and starts `name`."""
        reading = tree_memory(self.root)
        with self._lock:
            if self.phases:
                self.phases[-1].add(reading)
            phase = Phase(name, reading)
            phase.add(reading)
            self.phases.append(phase)
        return phase

    def finish(self) -> None:
        """Closes the current phase with one last reading."""
        reading = tree_memory(self.root)
        with self._lock:
            if self.phases:
                self.phases[-1].add(reading)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            reading = tree_memory(self.root)
            with self._lock:
                if self.phases:
                    self.phases[-1].add(reading)

