"""A throwaway PostgreSQL server on loopback, for tests of the verdict log.

It runs the server binaries of the Debian `postgresql` package (initdb,
pg_ctl) on a fresh data directory with trust authentication on 127.0.0.1 only,
and removes everything at stop. PostgreSQL refuses to run as root, so as root
it runs as the `postgres` user the package creates.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import tempfile
from pathlib import Path

from tools.processes import free_port


class PostgresUnavailable(Exception):
    """No PostgreSQL server binaries here; says what to install."""


def server_binaries() -> Path:
    """The folder of initdb and pg_ctl: on PATH, else the newest Debian install."""
    on_path = shutil.which("initdb")
    if on_path and shutil.which("pg_ctl"):
        return Path(os.path.realpath(on_path)).parent
    for folder in sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True):
        if (Path(folder) / "initdb").is_file() and (Path(folder) / "pg_ctl").is_file():
            return Path(folder)
    raise PostgresUnavailable("PostgreSQL server binaries (initdb, pg_ctl) not found; install the Debian "
                              "package postgresql (apt-get install postgresql)")


class PostgresServer:
    def __init__(self) -> None:
        self.bin = server_binaries()
        self.port = free_port()
        self.directory = Path(tempfile.mkdtemp(prefix="undercurrent-pg-"))
        self.data = self.directory / "data"
        self._user: str | None = None
        if os.geteuid() == 0:
            try:
                account = pwd.getpwnam("postgres")
            except KeyError:
                raise PostgresUnavailable("running as root, and there is no postgres user to run the "
                                          "server as (the postgresql package creates one)") from None
            self._user = "postgres"
            os.chown(self.directory, account.pw_uid, account.pw_gid)

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def _run(self, *args: str) -> None:
        command = [str(self.bin / args[0]), *args[1:]]
        if self._user:
            command = ["runuser", "-u", self._user, "--", *command]
        done = subprocess.run(command, capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"{args[0]} failed ({done.returncode}): {done.stderr or done.stdout}")

    def start(self) -> "PostgresServer":
        self._run("initdb", "-D", str(self.data), "-U", "postgres", "--auth=trust", "--no-sync")
        options = (f"-p {self.port} -c listen_addresses=127.0.0.1 -k {self.directory} -c fsync=off "
                   "-c max_connections=40")
        self._run("pg_ctl", "-D", str(self.data), "-o", options, "-l", str(self.directory / "server.log"),
                  "-w", "-t", "60", "start")
        return self

    def stop(self) -> None:
        try:
            self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop")
        finally:
            shutil.rmtree(self.directory, ignore_errors=True)
