"""--engine-core-wait: the rule that picks it, and vLLM's own SpinCondition
(real ZeroMQ sockets) waiting asleep only in a process named as vLLM's engine core."""

from __future__ import annotations

import multiprocessing
import os
import time
from dataclasses import dataclass

import pytest
import zmq
from vllm.distributed.device_communicators import shm_broadcast
from vllm.distributed.device_communicators.shm_broadcast import SpinCondition
from vllm.utils.network_utils import get_open_zmq_ipc_path

from engine_service.engine_core import wait as engine_core_wait

WAIT_S = 0.3


def test_auto_sleeps_on_vllms_cpu_backend_and_spins_elsewhere():
    assert engine_core_wait.resolve("auto", on_cpu=True) == "sleep"
    assert engine_core_wait.resolve("auto", on_cpu=False) == "spin"
    assert engine_core_wait.resolve("spin", on_cpu=True) == "spin"
    assert engine_core_wait.resolve("sleep", on_cpu=False) == "sleep"
    with pytest.raises(ValueError, match="engine core wait 'nap': expected one of auto, spin, sleep"):
        engine_core_wait.resolve("nap", on_cpu=True)


@pytest.fixture
def vllm_wait(monkeypatch):
    """SpinCondition.wait restored after the test; the plugin asked to sleep."""
    monkeypatch.setattr(SpinCondition, "wait", SpinCondition.wait)
    monkeypatch.setenv(engine_core_wait.ENV, "sleep")
    return SpinCondition.wait


def test_the_plugin_patches_once_and_only_when_asked(vllm_wait, monkeypatch):
    monkeypatch.setenv(engine_core_wait.ENV, "spin")
    engine_core_wait.register()
    assert SpinCondition.wait is vllm_wait
    monkeypatch.setenv(engine_core_wait.ENV, "sleep")
    engine_core_wait.register()
    patched = SpinCondition.wait
    assert patched is not vllm_wait
    engine_core_wait.register()  # vLLM may load its plugins more than once in a process
    assert SpinCondition.wait is patched


@pytest.fixture
def condition_pair():
    context = zmq.Context()
    address = get_open_zmq_ipc_path()
    writer = SpinCondition(is_reader=False, context=context, notify_address=address)
    reader = SpinCondition(is_reader=True, context=context, notify_address=address)
    time.sleep(0.2)  # the subscription reaches the publisher
    reader.record_read()  # as after a read: vLLM's reader now spins for a second
    yield reader, writer
    context.destroy(linger=0)


@dataclass
class Waiting:
    """reader.wait() called for WAIT_S with nothing written."""

    cpu_s: float  # CPU seconds this thread spent
    calls: int  # calls that returned
    shortest_s: float  # the quickest call: load only makes calls longer


def waiting(reader: SpinCondition) -> Waiting:
    calls, shortest = 0, float("inf")
    cpu, deadline = time.thread_time(), time.monotonic() + WAIT_S
    while (start := time.monotonic()) < deadline:
        reader.wait()
        shortest = min(shortest, time.monotonic() - start)
        calls += 1
    return Waiting(time.thread_time() - cpu, calls, shortest)


def test_the_engine_core_waits_asleep_only_in_vllms_engine_core(vllm_wait, condition_pair, monkeypatch):
    reader, _ = condition_pair
    engine_core_wait.register()
    bound_s = engine_core_wait.POLL_BOUND_MS / 1000
    # This process is not vLLM's engine core: vLLM's spin, whose calls return at
    # once (some call does, however loaded the host).
    spun = waiting(reader)
    assert reader.busy_loop_s == 1
    assert spun.shortest_s < bound_s / 2, spun
    monkeypatch.setattr(multiprocessing.current_process(), "name", "EngineCore_DP0")
    reader.record_read()
    time.sleep(engine_core_wait.SPIN_AFTER_READ_S)
    slept = waiting(reader)
    # Each call sleeps in the poll until its bound (a notification missed costs no
    # more): about WAIT_S / 1 ms calls, none quicker than the bound, a little CPU each.
    bounded_calls = WAIT_S / bound_s
    assert 0.3 * bounded_calls <= slept.calls <= 1.1 * bounded_calls, slept
    assert slept.shortest_s >= bound_s / 2, slept
    assert slept.cpu_s < WAIT_S / 3, slept


def test_the_engine_core_spins_just_after_a_read_and_polls_later(vllm_wait, condition_pair, monkeypatch):
    """Right after a read (when a step's second reply follows its first) vLLM's spin,
    which leaves the notification socket alone; later, the poll, which takes it."""
    reader, writer = condition_pair
    engine_core_wait.register()
    monkeypatch.setattr(multiprocessing.current_process(), "name", "EngineCore")
    writer.notify()
    time.sleep(0.05)
    reader.record_read()
    reader.wait(timeout_ms=10_000)
    assert reader.busy_loop_s == engine_core_wait.SPIN_AFTER_READ_S
    assert reader.local_notify_socket.poll(0) == zmq.POLLIN, "spinning, the notification stays"
    time.sleep(engine_core_wait.SPIN_AFTER_READ_S)
    reader.wait(timeout_ms=10_000)  # the caller's own timeout: returns at the notification
    assert reader.local_notify_socket.poll(0) == 0, "the notification was taken"


def test_a_vllm_without_spin_condition_is_left_alone(vllm_wait, monkeypatch, caplog):
    monkeypatch.delattr(shm_broadcast, "SpinCondition")
    engine_core_wait.register()
    assert "UNDERCURRENT_ENGINE_CORE_WAIT=sleep ignored: this vLLM has no SpinCondition" in caplog.text


def test_choose_sets_the_wait_for_spawned_and_forked_engine_cores(vllm_wait):
    assert engine_core_wait.choose("auto", on_cpu=False) == "spin"
    assert os.environ[engine_core_wait.ENV] == "spin" and SpinCondition.wait is vllm_wait
    assert engine_core_wait.choose("auto", on_cpu=True) == "sleep"
    # Spawned, the engine core reads the variable; forked, it inherits the patched class.
    assert os.environ[engine_core_wait.ENV] == "sleep" and SpinCondition.wait is not vllm_wait
