"""How the test stacks, the benchmarks and `make run` start each service."""

import os
import signal
import socket

import pytest

from tools import processes
from tools.processes import Service


def test_a_service_shares_the_launchers_session_in_a_process_group_of_its_own():
    """One session: with the kernel's scheduler autogroup on, a service in a
    session of its own is scheduled as its own group, and vLLM's workers kept
    the router from both cores of a 2-core host for seconds. Its own
    process group: kill() reaches vLLM's engine core and workers."""
    service = Service("sleeper", ["timeit", "-n", "1", "import time; time.sleep(60)"], port=0,
                      log_to_file=False).start()
    try:
        assert os.getsid(service.process.pid) == os.getsid(0)
        assert os.getpgid(service.process.pid) == service.process.pid != os.getpgid(0)
    finally:
        service.kill()
    assert service.process.returncode == -signal.SIGKILL


def test_free_port_never_hands_out_a_port_twice(monkeypatch):
    """The kernel may return the same ephemeral port to two binds in a row."""
    kernel_ports = iter([1001, 1001, 1001, 1002])

    class Socket(socket.socket):
        def getsockname(self):
            return ("127.0.0.1", next(kernel_ports))

    monkeypatch.setattr(processes.socket, "socket", Socket)
    monkeypatch.delenv(processes.PORTS_ENV, raising=False)  # make test sets it
    assert [processes.free_port(), processes.free_port()] == [1001, 1002]



def test_free_port_keeps_to_the_range_it_is_given(monkeypatch):
    """Concurrent test processes each take ports from a range of their own,
    skipping ports something else holds."""
    busy = {1001, 1003}

    class Socket(socket.socket):
        def bind(self, address):
            if address[1] in busy:
                raise OSError("in use")

    monkeypatch.setattr(processes.socket, "socket", Socket)
    monkeypatch.setattr(processes, "_handed_out", set())
    monkeypatch.setenv(processes.PORTS_ENV, "1001-1004")
    assert [processes.free_port(), processes.free_port()] == [1002, 1004]
    with pytest.raises(RuntimeError, match=f"^{processes.PORTS_ENV}=1001-1004: every port is busy or handed out$"):
        processes.free_port()


@pytest.mark.parametrize("ports", ["20000", "20000-x", "1-2-3"])
def test_a_malformed_port_range_is_named(monkeypatch, ports):
    monkeypatch.setenv(processes.PORTS_ENV, ports)
    with pytest.raises(RuntimeError, match=f"^{processes.PORTS_ENV}='{ports}': expected LOW-HIGH"):
        processes.free_port()
