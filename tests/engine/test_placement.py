"""Keeping the engine service off its workers' cores: the rule, and moving a real
process with several threads (needs two cores the test may use)."""

import asyncio
import logging
import os
import subprocess
import sys

import pytest

from engine_service.cpu_host.placement import (
    core_list,
    cores_off_workers,
    keep_off_worker_cores,
    move_process,
    place_engine_service,
)

CORES = sorted(os.sched_getaffinity(0))
two_cores = pytest.mark.skipif(len(CORES) < 2, reason="needs two cores this process may use")

# A child with three threads besides its main one, each asleep; prints "ready" once they
# run, and starts one more for each line it reads.
THREADED_CHILD = """
import sys, threading, time
def start():
    threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
for _ in range(3):
    start()
print("ready", flush=True)
for line in sys.stdin:
    start()
    print("started", flush=True)
"""


def test_the_service_keeps_the_cores_no_worker_is_bound_to():
    assert cores_off_workers({0, 1, 2, 3}, {0}) == {1, 2, 3}
    assert cores_off_workers({0, 1, 2, 3}, {1, 3}) == {0, 2}
    # Workers bound to cores outside the service's own set: nothing to avoid.
    assert cores_off_workers({2, 3}, {0, 1}) == frozenset()
    # Unbound workers (GPU hosts, VLLM_CPU_OMP_THREADS_BIND=nobind) may use every core: no move.
    assert cores_off_workers({0, 1, 2, 3}, {0, 1, 2, 3}) == frozenset()
    assert cores_off_workers({0, 1}, {0, 1, 2, 3}) == frozenset()
    # TP=2 on two cores: the workers hold both, the service stays where it was.
    assert cores_off_workers({0, 1}, {0, 1}) == frozenset()
    assert cores_off_workers({0, 1}, set()) == frozenset()


def test_core_lists_read_as_taskset_writes_them():
    assert core_list([5, 0, 1, 2]) == "0-2,5"
    assert core_list({3}) == "3"
    assert core_list([1, 3, 4, 6, 7, 8]) == "1,3-4,6-8"


@pytest.fixture
def threaded_child():
    child = subprocess.Popen(
        [sys.executable, "-c", THREADED_CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout.readline().strip() == "ready"
        yield child
    finally:
        child.kill()
        child.wait()


def task_affinities(pid: int) -> dict[int, frozenset[int]]:
    return {int(tid): frozenset(os.sched_getaffinity(int(tid))) for tid in os.listdir(f"/proc/{pid}/task")}


def start_thread(child) -> None:
    child.stdin.write("\n")
    child.stdin.flush()
    assert child.stdout.readline().strip() == "started"


@two_cores
def test_every_thread_of_a_process_moves_and_threads_started_later_inherit(threaded_child):
    assert set(task_affinities(threaded_child.pid).values()) == {frozenset(CORES)}
    worker = {CORES[0]}
    moved = keep_off_worker_cores(worker, threaded_child.pid)
    assert moved == set(CORES) - worker
    affinities = task_affinities(threaded_child.pid)
    assert len(affinities) == 4
    assert set(affinities.values()) == {moved}, affinities
    start_thread(threaded_child)
    affinities = task_affinities(threaded_child.pid)
    assert len(affinities) == 5 and set(affinities.values()) == {moved}, affinities
    # Moved again onto one core, by the lower-level call the rule uses.
    assert move_process(threaded_child.pid, {CORES[-1]}) == 5
    assert set(task_affinities(threaded_child.pid).values()) == {frozenset({CORES[-1]})}


@two_cores
def test_a_process_already_off_the_workers_cores_or_with_none_left_stays_as_it_was(threaded_child):
    assert keep_off_worker_cores(set(CORES), threaded_child.pid) == frozenset()  # workers hold every core
    assert set(task_affinities(threaded_child.pid).values()) == {frozenset(CORES)}
    move_process(threaded_child.pid, {CORES[1]})
    assert keep_off_worker_cores({CORES[0]}, threaded_child.pid) == frozenset()  # already off core 0
    assert set(task_affinities(threaded_child.pid).values()) == {frozenset({CORES[1]})}


class WorkersOn:
    """The one call place_engine_service makes on a CaptureController."""

    def __init__(self, cores: set[int]):
        self.cores = cores

    async def local_worker_cores(self) -> set[int]:
        return self.cores


@two_cores
def test_the_service_logs_where_it_moved_and_nothing_when_it_stays(caplog):
    """The move runs in a child process, so pytest's own cores stay as they were."""
    code = (
        "import asyncio, logging, os, sys\n"
        "sys.path.insert(0, os.getcwd())\n"
        "from tests.engine.test_placement import WorkersOn\n"
        "from engine_service.cpu_host.placement import place_engine_service\n"
        "logging.basicConfig(level=logging.INFO, format='%(message)s')\n"
        f"moved = asyncio.run(place_engine_service(WorkersOn({{{CORES[0]}}})))\n"
        "print(sorted(moved), sorted(os.sched_getaffinity(0)))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    rest = sorted(set(CORES) - {CORES[0]})
    assert done.stdout.strip() == f"{rest} {rest}"
    assert done.stderr.splitlines() == [
        f"vLLM's workers are bound to cores {CORES[0]}: the engine service's threads now run on "
        f"{core_list(rest)}"
    ], done.stderr
    with caplog.at_level(logging.INFO, logger="engine_service.cpu_host.placement"):
        assert asyncio.run(place_engine_service(WorkersOn(set(CORES)))) == frozenset()
    assert caplog.records == []
    assert os.sched_getaffinity(0) == set(CORES)


@two_cores
def test_a_host_that_refuses_the_move_leaves_the_service_running_where_it_was(monkeypatch, caplog):
    def refuse(pid, cores):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "sched_setaffinity", refuse)
    with caplog.at_level(logging.WARNING, logger="engine_service.cpu_host.placement"):
        assert asyncio.run(place_engine_service(WorkersOn({CORES[0]}))) == frozenset()
    assert [r.getMessage() for r in caplog.records] == [
        f"could not keep the engine service off its workers' cores {CORES[0]}: "
        "[Errno 1] Operation not permitted"
    ]
    assert os.sched_getaffinity(0) == set(CORES)
