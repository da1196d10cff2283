"""Writes verdict records to the store on a thread of its own, so a slow or
stalled store never holds up scoring.

`submit` never blocks: a record goes into a bounded queue, or, when the queue
is full, is dropped and counted. The thread writes what the queue holds in one
transaction; a write that fails is retried (with backoff) until it succeeds or
the log closes, and meanwhile new records wait in the queue, or are dropped
once it is full. Every record ends as written, dropped or (at close, still
unwritten) abandoned, and each of the three is counted.
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge

from common.log_limits import RateLimitedLog
from common.verdict_log.records import DEFAULT_MAX_ROWS, ShadowOutcome, VerdictRecord
from common.verdict_log.store import Store, open_store

log = logging.getLogger(__name__)
_errors = RateLimitedLog(log)

DEFAULT_QUEUE = 10_000  # records waiting for the store
WRITE_BATCH = 512  # records per transaction at most
RETRY_MIN_S, RETRY_MAX_S = 0.05, 2.0
CLOSE_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class LogSettings:
    target: str  # an SQLite file path or a postgresql:// URL
    max_queue: int = DEFAULT_QUEUE
    max_rows: int = DEFAULT_MAX_ROWS  # input rows kept with an abort; 0 keeps none


class LogMetrics:
    def __init__(self, registry: CollectorRegistry):
        self.written = Counter("undercurrent_router_verdict_log_written", "Verdict records written to the store",
                               registry=registry)
        self.dropped = Counter("undercurrent_router_verdict_log_dropped",
                               "Verdict records dropped: the queue to the store was full, or the log closed "
                               "with them unwritten", ["reason"], registry=registry)
        self.write_errors = Counter("undercurrent_router_verdict_log_write_errors",
                                    "Failed writes to the store (each is retried)", registry=registry)
        self.queued = Gauge("undercurrent_router_verdict_log_queued", "Verdict records waiting for the store",
                            registry=registry)


class VerdictLog:
    def __init__(self, settings: LogSettings, metrics: LogMetrics):
        self.settings = settings
        self.metrics = metrics
        self.store: Store = open_store(settings.target)  # fails start-up on a bad target
        self._queue: queue.Queue[VerdictRecord | ShadowOutcome] = queue.Queue(settings.max_queue)
        metrics.queued.set_function(self._queue.qsize)
        self._digests_written: set[str] = set()
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._run, name="verdict-log", daemon=True)
        self._thread.start()

    @property
    def max_rows(self) -> int:
        return self.settings.max_rows

    def submit(self, record: VerdictRecord | ShadowOutcome) -> bool:
        """Queues a record; False (and counted) when the queue is full."""
        try:
            self._queue.put_nowait(record)
            return True
        except queue.Full:
            self.metrics.dropped.labels("queue_full").inc()
            return False

    def close(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
        """Writes what is queued (for at most timeout seconds), then closes the store."""
        self._closing.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("verdict log still writing at close", extra={"queued": self._queue.qsize()})
            return
        self.store.close()

    def _run(self) -> None:
        pending: list[VerdictRecord | ShadowOutcome] = []
        delay = RETRY_MIN_S
        while True:
            if not pending:
                try:
                    pending.append(self._queue.get(timeout=0.1))
                except queue.Empty:
                    if self._closing.is_set():
                        return
                    continue
                while len(pending) < WRITE_BATCH:
                    try:
                        pending.append(self._queue.get_nowait())
                    except queue.Empty:
                        break
            try:
                self._write(pending)
            except Exception as err:  # the store's own errors are many kinds; all are retried
                self.metrics.write_errors.inc()
                _errors.log("write", logging.WARNING, "verdict log write failed; retrying",
                            extra={"store": self.store.target, "records": len(pending),
                                   "error": f"{type(err).__name__}: {err}"})
                if self._closing.wait(delay):
                    self._abandon(pending)
                    return
                delay = min(delay * 2, RETRY_MAX_S)
                continue
            self.metrics.written.inc(len(pending))
            pending, delay = [], RETRY_MIN_S

    def _write(self, pending: list[VerdictRecord | ShadowOutcome]) -> None:
        records = [r for r in pending if isinstance(r, VerdictRecord)]
        outcomes = [r for r in pending if isinstance(r, ShadowOutcome)]
        versions = {r.probe_version.digest: r.probe_version for r in records
                    if r.probe_version is not None and r.probe_version.digest not in self._digests_written}
        self.store.write(records, list(versions.values()), outcomes)
        self._digests_written.update(versions)

    def _abandon(self, pending: list[VerdictRecord | ShadowOutcome]) -> None:
        left = len(pending) + self._queue.qsize()
        self.metrics.dropped.labels("closed").inc(left)
        log.error("verdict log closed with records unwritten", extra={"records": left,
                                                                      "store": self.store.target})

