"""A worker node's watch on node 0 (a real process and a real socket, no vLLM):
it exits once node 0's master port, seen up before, stops answering."""

import socket
import subprocess
import sys
import time

from engine_service.worker_node import NODE0_GONE_EXIT_CODE

WATCH = ("from engine_service.worker_node import watch_node0; print('watching', flush=True); "
         "watch_node0('127.0.0.1', {port}, interval_s=0.1, misses=3)")


def watch(port: int) -> subprocess.Popen:
    """A watch that has started checking (its import takes seconds on a busy host)."""
    watcher = subprocess.Popen([sys.executable, "-c", WATCH.format(port=port)],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert watcher.stdout.readline() == "watching\n"
    return watcher


def test_the_watch_exits_once_a_master_it_saw_stops_answering():
    master = socket.create_server(("127.0.0.1", 0))
    port = master.getsockname()[1]
    master.settimeout(10)
    watcher = watch(port)
    try:
        master.accept()[0].close()  # the watch has seen node 0 up
        time.sleep(0.5)  # answering: the watch keeps running
        assert watcher.poll() is None, watcher.stdout.read()
        master.close()
        started = time.monotonic()
        assert watcher.wait(timeout=20) == NODE0_GONE_EXIT_CODE
        assert time.monotonic() - started < 10
        assert f"node 0 (127.0.0.1:{port}) stopped answering 3 times in a row" in watcher.stdout.read()
    finally:
        master.close()
        watcher.kill()


def test_the_watch_waits_for_a_master_that_has_not_started_yet():
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
    watcher = watch(port)
    try:
        time.sleep(1.5)  # 15 failed checks, but node 0 was never up: vLLM waits for it
        assert watcher.poll() is None
    finally:
        watcher.kill()
