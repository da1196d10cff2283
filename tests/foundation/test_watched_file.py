"""A configuration file read again when it changes (common.watched_file), on a
file system whose timestamps are as coarse as a second."""

from __future__ import annotations

import os
import time
from types import SimpleNamespace

import pytest

from common import watched_file
from common.watched_file import SETTLE_S, WatchedFile


def coarse_stat(path):
    """os.stat as a file system with one-second timestamps reports it."""
    st = os.stat(path)
    second = st.st_mtime_ns // 10**9 * 10**9
    return SimpleNamespace(st_mtime_ns=second, st_ctime_ns=second, st_size=st.st_size, st_ino=st.st_ino)


def write(path, text: str, when_ns: int) -> None:
    path.write_text(text)
    os.utime(path, ns=(when_ns, when_ns))


def test_a_rewrite_its_stamp_cannot_show_is_read_until_the_file_is_older_than_the_granularity(tmp_path, monkeypatch):
    monkeypatch.setattr(watched_file, "os", SimpleNamespace(stat=coarse_stat))
    path = tmp_path / "guards.json"
    now = time.time_ns()
    write(path, "one", now)
    watched = WatchedFile(path)
    assert watched.read() == "one"
    write(path, "two", now)  # the same size, within the same second: the same stamp
    assert watched.changed() and watched.read() == "two"
    old = now - int((SETTLE_S + 1) * 1e9)
    write(path, "two", old)
    assert watched.changed() and watched.read() == "two"
    assert not watched.changed()  # settled: unchanged until its stamp moves
    write(path, "three", old)
    assert watched.changed() and watched.read() == "three"


def test_a_missing_file_raises_and_counts_as_changed_until_it_is_read(tmp_path):
    watched = WatchedFile(tmp_path / "missing")
    assert watched.changed()
    with pytest.raises(FileNotFoundError):
        watched.read()
    assert watched.changed()
