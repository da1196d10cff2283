"""Experiment: the engine core waits for its workers asleep instead of spinning.

Patches vLLM's SpinCondition.wait (inherited by forked engine cores): in a
process named EngineCore*, it reads byte 0 of FLAG each wait; 1 = no busy loop."""
import mmap
import multiprocessing
import os

from vllm.distributed.device_communicators import shm_broadcast as sb

FLAG = "/dev/shm/uc-exp-ec-sleep"
_orig = sb.SpinCondition.wait
_map = None


def _flag() -> int:
    global _map
    if _map is None:
        fd = os.open(FLAG, os.O_RDONLY)
        _map = mmap.mmap(fd, 1, prot=mmap.PROT_READ)
        os.close(fd)
    return _map[0]


def wait(self, timeout_ms=None):
    if multiprocessing.current_process().name.startswith("EngineCore"):
        if _flag():
            self.busy_loop_s = 0.0
            # A lost notification costs at most a millisecond.
            return _orig(self, 1 if timeout_ms is None else min(timeout_ms, 1))
        self.busy_loop_s = 1.0
    return _orig(self, timeout_ms)


def plugin():
    """vLLM general plugin: runs in every vLLM process, spawned ones included."""
    if sb.SpinCondition.wait is not wait:
        sb.SpinCondition.wait = wait


def install():
    with open(FLAG, "wb") as f:
        f.write(b"\0")
    plugin()


def set_sleep(on: bool):
    with open(FLAG, "r+b") as f:
        f.write(b"\1" if on else b"\0")
