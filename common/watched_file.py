"""A configuration file read again when it changes, without a restart.

A change shows as a new (mtime, ctime, size, inode) stamp, which a `stat` reads
cheaply on every use. A file changed within the file system's timestamp
granularity of its last read may change again invisibly to that stamp, so it
counts as changed until it is older than SETTLE_S.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

SETTLE_S = 2.0


class WatchedFile:
    def __init__(self, path: Path):
        self.path = Path(path)
        self._stamp: tuple | None = None
        self._settled = False

    def _current(self) -> tuple | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_ctime_ns, st.st_size, st.st_ino)

    def changed(self) -> bool:
        """Whether the file may differ from its last read."""
        return not self._settled or self._current() != self._stamp

    def read(self) -> str:
        """The file's text, now; its stamp is the one seen before reading, so a
        change during the read shows as a change next time. Raises OSError."""
        stamp = self._current()
        text = self.path.read_text()
        self._stamp = stamp
        self._settled = stamp is not None and time.time_ns() - stamp[0] > SETTLE_S * 1e9
        return text
