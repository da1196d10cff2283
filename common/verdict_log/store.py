"""Where the verdict log lives: an SQLite file (one router, the default) or a
PostgreSQL database (a fleet of routers writing to one log). One schema and one
set of queries; the two differ only in placeholders and type names.

`open_store(target)`: a `postgresql://` URL opens PostgreSQL (psycopg 3), any
other target is an SQLite file path. A connection is not shared between
threads: the log's writer thread opens its own.
"""

from __future__ import annotations

import json
import sqlite3
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from common.verdict_log.records import ProbeVersion, ShadowOutcome, VerdictRecord

SQLITE_BUSY_TIMEOUT_S = 1.0  # a write that waits longer on a lock fails, and the writer retries it

_COLUMNS = ("time", "kind", "request_id", "caller", "probe", "version", "digest", "role", "layer",
            "token_position", "score", "threshold", "reference_score", "router", "rows", "rows_hidden",
            "row_positions", "row_layers")


_OUTCOME_COLUMNS = ("time", "request_id", "caller", "probe", "serving_version", "shadow_version", "serving_fired",
                    "shadow_fired", "router", "rows", "delta_sum", "delta_max")


class StoreError(Exception):
    """The store cannot be opened or used; names the target and the reason."""


@dataclass(frozen=True)
class Query:
    """Which records to list; every field set narrows it."""

    since: float | None = None  # Unix seconds, inclusive
    until: float | None = None  # exclusive
    probe: str | None = None
    caller: str | None = None
    kind: str | None = None
    request_id: str | None = None
    limit: int | None = None


class Store:
    placeholder = "?"
    id_column = "INTEGER PRIMARY KEY AUTOINCREMENT"
    blob = "BLOB"
    real = "REAL"

    def __init__(self, connection, target: str):
        self.connection = connection
        self.target = target

    def create(self) -> None:
        statements = [
            f"""CREATE TABLE IF NOT EXISTS verdicts (
                id {self.id_column}, time {self.real} NOT NULL, kind TEXT NOT NULL,
                request_id TEXT NOT NULL, caller TEXT NOT NULL, probe TEXT NOT NULL,
                version TEXT NOT NULL, digest TEXT NOT NULL, role TEXT NOT NULL, layer INTEGER NOT NULL,
                token_position BIGINT NOT NULL, score {self.real} NOT NULL, threshold {self.real} NOT NULL,
                reference_score {self.real}, router TEXT NOT NULL, rows {self.blob}, rows_hidden INTEGER,
                row_positions TEXT, row_layers TEXT)""",
            f"""CREATE TABLE IF NOT EXISTS probe_versions (
                digest TEXT PRIMARY KEY, name TEXT NOT NULL, version TEXT NOT NULL,
                manifest_json TEXT NOT NULL, weights {self.blob})""",
            f"""CREATE TABLE IF NOT EXISTS shadow_outcomes (
                id {self.id_column}, time {self.real} NOT NULL, request_id TEXT NOT NULL, caller TEXT NOT NULL,
                probe TEXT NOT NULL, serving_version TEXT NOT NULL, shadow_version TEXT NOT NULL,
                serving_fired BOOLEAN NOT NULL, shadow_fired BOOLEAN NOT NULL, router TEXT NOT NULL,
                rows INTEGER NOT NULL, delta_sum {self.real} NOT NULL, delta_max {self.real} NOT NULL)""",
            "CREATE INDEX IF NOT EXISTS shadow_outcomes_probe_time ON shadow_outcomes (probe, time)",
            "CREATE INDEX IF NOT EXISTS verdicts_time ON verdicts (time)",
            "CREATE INDEX IF NOT EXISTS verdicts_request ON verdicts (request_id)",
            "CREATE INDEX IF NOT EXISTS verdicts_probe_time ON verdicts (probe, time)",
        ]
        with self.transaction():
            for statement in statements:
                self.connection.execute(statement)

    # -- writing ---------------------------------------------------------------

    def write(self, records: list[VerdictRecord], versions: list[ProbeVersion],
              outcomes: list[ShadowOutcome] = ()) -> None:
        """Writes records, the versions they name and shadow outcomes in one transaction."""
        p = self.placeholder
        with self.transaction():
            cursor = self.connection.cursor()
            for v in versions:
                cursor.execute(f"INSERT INTO probe_versions (digest, name, version, manifest_json, weights) "
                               f"VALUES ({p}, {p}, {p}, {p}, {p}) {self._ignore_conflict('digest')}",
                               (v.digest, v.name, v.version, v.manifest_json, v.weights))
            cursor.executemany(
                f"INSERT INTO verdicts ({', '.join(_COLUMNS)}) VALUES ({', '.join([p] * len(_COLUMNS))})",
                [_row(r) for r in records])
            cursor.executemany(
                f"INSERT INTO shadow_outcomes ({', '.join(_OUTCOME_COLUMNS)}) "
                f"VALUES ({', '.join([p] * len(_OUTCOME_COLUMNS))})",
                [tuple(getattr(o, c) for c in _OUTCOME_COLUMNS) for o in outcomes])

    def transaction(self):
        """Commits on success, rolls back on error."""
        return self.connection

    def _ignore_conflict(self, key: str) -> str:
        return f"ON CONFLICT ({key}) DO NOTHING"

    # -- reading ---------------------------------------------------------------

    def records(self, query: Query) -> list[VerdictRecord]:
        """Records in time order (then in the order written)."""
        where, values = self._where(query, kind=query.kind, request_id=query.request_id)
        sql = f"SELECT id, {', '.join(_COLUMNS)} FROM verdicts{where} ORDER BY time, id"
        if query.limit is not None:
            sql += f" LIMIT {int(query.limit)}"
        cursor = self.connection.cursor()
        cursor.execute(sql, values)
        return [_record(row) for row in cursor.fetchall()]

    def outcomes(self, query: Query) -> list[ShadowOutcome]:
        """Shadow outcomes in time order (query's window, probe and caller apply)."""
        where, values = self._where(query)
        cursor = self.connection.cursor()
        cursor.execute(f"SELECT {', '.join(_OUTCOME_COLUMNS)} FROM shadow_outcomes{where} ORDER BY time, id", values)
        return [ShadowOutcome(**dict(zip(_OUTCOME_COLUMNS, row))) for row in cursor.fetchall()]

    def _where(self, query: Query, **equal) -> tuple[str, list]:
        """The WHERE clause of query's window, probe and caller, and of `equal`, with its values."""
        tests = [("time", ">=", query.since), ("time", "<", query.until), ("probe", "=", query.probe),
                 ("caller", "=", query.caller), *((column, "=", value) for column, value in equal.items())]
        kept = [(column, op, value) for column, op, value in tests if value is not None]
        if not kept:
            return "", []
        clause = " AND ".join(f"{column} {op} {self.placeholder}" for column, op, _ in kept)
        return " WHERE " + clause, [value for _, _, value in kept]

    def probe_version(self, digest: str) -> ProbeVersion | None:
        cursor = self.connection.cursor()
        cursor.execute(f"SELECT digest, name, version, manifest_json, weights FROM probe_versions "
                       f"WHERE digest = {self.placeholder}", (digest,))
        row = cursor.fetchone()
        return None if row is None else ProbeVersion(row[0], row[1], row[2], row[3],
                                                     None if row[4] is None else bytes(row[4]))

    def close(self) -> None:
        self.connection.close()


class SQLiteStore(Store):
    @classmethod
    def open(cls, path: str) -> "SQLiteStore":
        try:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            connection = sqlite3.connect(path, timeout=SQLITE_BUSY_TIMEOUT_S, isolation_level=None,
                                         check_same_thread=False)  # opened here, used by one thread
            # Readers (the audit command) never block the router's writes, nor the reverse.
            connection.execute("PRAGMA journal_mode=WAL")
            connection.isolation_level = "DEFERRED"
        except (sqlite3.Error, OSError) as err:
            raise StoreError(f"verdict log {path}: {err}") from None
        return cls(connection, path)


class PostgresStore(Store):
    placeholder = "%s"
    id_column = "BIGSERIAL PRIMARY KEY"
    blob = "BYTEA"
    real = "DOUBLE PRECISION"

    @classmethod
    def open(cls, url: str) -> "PostgresStore":
        try:
            import psycopg
        except ImportError:
            raise StoreError("verdict log: a postgresql:// log needs the psycopg package "
                             "(requirements/router.txt)") from None
        try:
            connection = psycopg.connect(url, connect_timeout=10, autocommit=True)
        except psycopg.Error as err:
            raise StoreError(f"verdict log {_redacted(url)}: {' '.join(str(err).split())}") from None  # one line
        return cls(connection, _redacted(url))

    def transaction(self):
        return self.connection.transaction()

    def create(self) -> None:
        # Routers of a fleet start together: one creates the tables at a time.
        with self.transaction():
            self.connection.execute("SELECT pg_advisory_xact_lock(7283501)")
            super().create()


def open_store(target: str, create: bool = True) -> Store:
    """The store at target (see the module docstring), its tables made if `create`."""
    if not target:
        raise StoreError("verdict log: no store given (a file path, or a postgresql:// URL)")
    postgres = target.startswith(("postgresql://", "postgres://"))
    if not postgres and not create and not Path(target).is_file():
        raise StoreError(f"verdict log {target}: no such file")
    store = PostgresStore.open(target) if postgres else SQLiteStore.open(target)
    if create:
        store.create()
    return store


def _redacted(url: str) -> str:
    """The URL without its password, for messages."""
    head, at, tail = url.rpartition("@")
    if not at or ":" not in head.split("//", 1)[-1]:
        return url
    scheme, _, credentials = head.partition("//")
    return f"{scheme}//{credentials.split(':', 1)[0]}:***@{tail}"


def _row(r: VerdictRecord) -> tuple:
    rows = None if r.rows is None else np.ascontiguousarray(r.rows, dtype="<f4").tobytes()
    return (r.time, r.kind, r.request_id, r.caller, r.probe, r.version, r.digest, r.role, r.layer,
            r.token_position, r.score, r.threshold, r.reference_score, r.router, rows,
            None if r.rows is None else int(r.rows.shape[1]),
            json.dumps(r.row_positions) if r.rows is not None else None,
            json.dumps(r.row_layers) if r.rows is not None else None)


def _record(row: tuple) -> VerdictRecord:
    (id_, time, kind, request_id, caller, probe, version, digest, role, layer, position, score, threshold,
     reference, router, rows, hidden, positions, layers) = row
    array = None if rows is None else np.frombuffer(bytes(rows), dtype="<f4").reshape(-1, hidden)
    return VerdictRecord(kind, request_id, caller, probe, version, digest, role, layer, position, score,
                         threshold, router, time, reference, array,
                         json.loads(positions) if positions else [], json.loads(layers) if layers else [],
                         id=id_)
