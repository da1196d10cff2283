"""--engine-core-nice: the rule that picks it, and the nice of every thread of a
real process (the engine service's own engine core: tests/e2e/test_engine_core_priority.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from engine_service.cpu_host import engine_core_priority
from tools.processes import thread_nices

# A process with three threads, all asleep until its stdin closes.
THREADS = """
import sys, threading
for _ in range(2):
    threading.Thread(target=sys.stdin.read, daemon=True).start()
print("ready", flush=True)
sys.stdin.read()
"""


def test_auto_raises_it_on_the_cpu_backend_only():
    assert engine_core_priority.resolve("auto", on_cpu=True) == -10
    assert engine_core_priority.resolve("auto", on_cpu=False) is None
    assert engine_core_priority.resolve("5", on_cpu=False) == 5
    assert engine_core_priority.resolve("-20", on_cpu=True) == -20


@pytest.mark.parametrize("value", ["high", "1.5", "20", "-21"])
def test_anything_but_auto_or_a_nice_is_refused(value):
    with pytest.raises(ValueError, match="expected auto or an integer from -20 to 19"):
        engine_core_priority.resolve(value, on_cpu=True)


@pytest.fixture
def process():
    child = subprocess.Popen([sys.executable, "-c", THREADS],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline() == "ready\n"
    yield child
    child.stdin.close()
    child.wait(timeout=10)


def test_every_thread_of_the_process_gets_the_nice(process):
    """Linux keeps a nice per thread: setting the process's id alone would leave two of three."""
    assert thread_nices(process.pid) == [0, 0, 0]
    line = engine_core_priority.apply("7", on_cpu=True, pids=[process.pid])
    assert thread_nices(process.pid) == [7, 7, 7]
    assert line == "vLLM's engine core runs at nice 7, 3 threads (--engine-core-nice 7)"


def test_without_the_right_to_raise_it_the_engine_core_keeps_its_priority(process, monkeypatch):
    def refused(which, who, prio):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "setpriority", refused)
    line = engine_core_priority.apply("auto", on_cpu=True, pids=[process.pid])
    assert line == ("vLLM's engine core keeps its priority: nice -10 needs CAP_SYS_NICE or "
                    "RLIMIT_NICE >= 30 (--engine-core-nice auto)")
    monkeypatch.undo()
    assert thread_nices(process.pid) == [0, 0, 0]


def test_left_alone_off_the_cpu_backend_and_where_no_process_is_its_own(process):
    assert engine_core_priority.apply("auto", on_cpu=False, pids=[process.pid]) == (
        "vLLM's engine core keeps its priority (--engine-core-nice auto)")
    assert engine_core_priority.apply("auto", on_cpu=True, pids=[]) == (
        "vLLM's engine core keeps its priority: it runs in no process of its own here")
    assert thread_nices(process.pid) == [0, 0, 0]


def test_the_engine_cores_of_an_async_llm_are_found_in_its_process_manager():
    processes = [SimpleNamespace(pid=101), SimpleNamespace(pid=None), SimpleNamespace(pid=102)]
    manager = SimpleNamespace(processes=processes)
    llm = SimpleNamespace(
        engine_core=SimpleNamespace(resources=SimpleNamespace(engine_manager=manager)))
    assert engine_core_priority.engine_core_pids(llm) == [101, 102]
    assert engine_core_priority.engine_core_pids(SimpleNamespace(engine_core=None)) == []
