"""The process-tree memory reader the memory benchmark relies on, on real processes."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from tools.process_memory import MemorySampler, tree_memory, tree_pids

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

MIB = 1024 * 1024
# A child that starts a grandchild holding 200 MiB of touched memory, prints both
# pids once the memory is resident, and waits for stdin to close.
FAMILY = """
import subprocess, sys
grandchild = subprocess.Popen([sys.executable, "-c",
    "import sys; b = bytearray(200 * 1024 * 1024); b[::4096] = b'x' * len(b[::4096]); "
    "print('ready', flush=True); sys.stdin.read()"],
    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
assert grandchild.stdout.readline().strip() == "ready"
print(grandchild.pid, flush=True)
sys.stdin.read()
grandchild.stdin.close()
grandchild.wait()
"""


@pytest.fixture
def family():
    child = subprocess.Popen([sys.executable, "-c", FAMILY], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    grandchild = int(child.stdout.readline())
    yield child.pid, grandchild
    child.stdin.close()
    child.wait(timeout=30)


def test_the_tree_holds_the_root_and_every_descendant_and_no_other_process(family):
    child, grandchild = family
    pids = tree_pids(os.getpid())
    assert pids[0] == os.getpid()
    assert child in pids and grandchild in pids
    assert tree_pids(child) == [child, grandchild]
    assert os.getppid() not in pids


def test_a_descendants_resident_memory_counts_in_the_tree(family):
    child, grandchild = family
    alone = tree_memory(grandchild)
    whole = tree_memory(os.getpid())
    # The grandchild touched 200 MiB; the sums include it at every level.
    assert alone.rss_bytes >= 200 * MIB
    assert tree_memory(child).rss_bytes >= alone.rss_bytes
    assert whole.rss_bytes > tree_memory(child).rss_bytes
    if whole.pss_bytes is not None:  # PSS splits shared pages, so never exceeds RSS
        assert 0 < whole.pss_bytes <= whole.rss_bytes


def test_the_sampler_keeps_first_peak_and_last_per_phase(family):
    child, grandchild = family
    with MemorySampler(child, interval=0.05) as sampler:
        sampler.phase("with the grandchild")
        time.sleep(0.3)
        os.kill(grandchild, 9)
        deadline = time.monotonic() + 10
        while grandchild in tree_pids(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        sampler.phase("without it")
        time.sleep(0.2)
        sampler.finish()
    first, second = sampler.phases
    assert [p.name for p in sampler.phases] == ["with the grandchild", "without it"]
    assert first.samples >= 3 and second.samples >= 2
    assert grandchild in first.pids and grandchild not in second.pids
    assert first.peak_rss >= 200 * MIB > second.peak_rss
    assert first.peak_rss_by_pid[grandchild] >= 200 * MIB and grandchild not in second.peak_rss_by_pid
    assert first.first.rss_bytes >= 200 * MIB and second.last.rss_bytes < 200 * MIB
