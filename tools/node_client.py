"""The Node.js client's pinned packages (clients/node): installed on demand with `npm ci`.

`npm ci` installs exactly what package-lock.json pins. It runs again only when
the lockfile changed since the last install, so the lint and Node tests of one
`make test` share one install. The folder also pins `@bufbuild/buf`, the linter
of the contract.
"""

from __future__ import annotations

import fcntl
import hashlib
import shutil
import subprocess
from pathlib import Path

NODE_CLIENT = Path(__file__).resolve().parent.parent / "clients" / "node"
_STAMP = NODE_CLIENT / "node_modules" / ".installed-lock-sha256"


def install(timeout: float = 600) -> Path:
    """Runs `npm ci` in clients/node unless the installed lockfile is current;
    returns the node_modules folder. Raises RuntimeError with npm's output."""
    if shutil.which("npm") is None:
        raise RuntimeError("npm is not installed; the Node client and buf need Node.js 20 and npm")
    digest = hashlib.sha256((NODE_CLIENT / "package-lock.json").read_bytes()).hexdigest()
    with open(NODE_CLIENT / ".install.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # concurrent test processes install once
        if _STAMP.exists() and _STAMP.read_text() == digest:
            return _STAMP.parent
        result = subprocess.run(
            ["npm", "ci", "--no-audit", "--no-fund"], cwd=NODE_CLIENT, capture_output=True, text=True,
            timeout=timeout,
        )
        if result.returncode != 0:
            raise RuntimeError(f"npm ci failed in {NODE_CLIENT}:\n{result.stdout}\n{result.stderr}")
        _STAMP.write_text(digest)
        return _STAMP.parent


def buf() -> Path:
    """The buf binary shipped by the pinned @bufbuild/buf package."""
    return install() / ".bin" / "buf"
