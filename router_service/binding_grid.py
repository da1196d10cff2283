"""Every binding of one engine session as a cell of [request, probe] matrices.

A request holds a row and a probe bound in the session a column, for as long as
they live. A cell says whether the request binds the probe, whether that binding
aborts, its decision rule's state (rows seen, the current run of rows at or
over the threshold) and whether the rule has fired yet. A batch reads and writes the cells of its requests and
probes with a few numpy calls, however many probes a request binds: a router
with a thousand probes per request would otherwise pay microseconds of Python
per probe and batch, which splitting rows over replicas never divides.

Rows and columns are reused once freed, and the matrices grow by doubling; the
grid holds requests x probes cells of 11 bytes (4,096 requests x 1,000 probes:
45 MB), sized by the session's live requests and bound probes, never by load.
"""

from __future__ import annotations

import numpy as np

from common.probe_format.probes import Probe


class BindingGrid:
    def __init__(self) -> None:
        self.bound = np.zeros((0, 0), dtype=bool)
        self.abort = np.zeros((0, 0), dtype=bool)
        self.seen = np.zeros((0, 0), dtype=np.int32)  # rows scored so far
        self.streak = np.zeros((0, 0), dtype=np.int32)  # consecutive rows >= threshold, up to now
        self.fired = np.zeros((0, 0), dtype=bool)  # the rule fired on some row of the request
        # Per column: the probe and what the rule and the scoring need of it.
        self.probes: list[Probe | None] = []
        self.threshold = np.zeros(0, dtype=np.float64)
        self.min_tokens = np.zeros(0, dtype=np.int64)
        self.patience = np.zeros(0, dtype=np.int64)
        self.direct = np.zeros(0, dtype=bool)  # its score is its one form's value
        self.selector = np.zeros(0, dtype=np.int64)  # its token selector, numbered
        self.metric_slot = np.zeros(0, dtype=np.int64)  # its row in RouterMetrics.probes
        self.silent = np.zeros(0, dtype=bool)  # a shadow version: scores, sends nothing
        self.paired = np.zeros(0, dtype=bool)  # a shadow, or a version some request binds with a shadow
        self._selectors: dict[object, int] = {}
        self._free_rows: list[int] = []
        self._free_columns: list[int] = []
        self._grow(rows=16, columns=16)  # never empty: a batch's lookups index row 0 for unknown requests

    # -- requests -----------------------------------------------------------

    def add_request(self) -> int:
        if not self._free_rows:
            self._grow(rows=2 * self.bound.shape[0], columns=self.bound.shape[1])
        return self._free_rows.pop()

    def release_request(self, row: int) -> None:
        self.bound[row] = False  # so the row is clean when taken again
        self._free_rows.append(row)

    # -- probes -------------------------------------------------------------

    def add_probe(self, probe: Probe, metric_slot: int, silent: bool = False) -> int:
        if not self._free_columns:
            self._grow(rows=self.bound.shape[0], columns=2 * self.bound.shape[1])
        column = self._free_columns.pop()
        manifest = probe.manifest
        self.probes[column] = probe
        self.threshold[column] = manifest.threshold
        self.min_tokens[column] = manifest.min_tokens
        self.patience[column] = manifest.patience
        self.direct[column] = probe.stateless and not probe.cascade_k
        self.selector[column] = self._selectors.setdefault(manifest.tokens, len(self._selectors))
        self.metric_slot[column] = metric_slot
        self.silent[column] = silent
        self.paired[column] = False
        return column

    def release_probe(self, column: int) -> None:
        self.bound[:, column] = False  # so the column is clean when taken again
        self.probes[column] = None
        self._free_columns.append(column)

    # -- bindings -----------------------------------------------------------

    def bind(self, row: int, columns: list[int], aborts: list[bool]) -> None:
        """A request's bindings, all at once (a request_start may bind a thousand probes)."""
        self.bound[row, columns], self.abort[row, columns] = True, aborts
        self.seen[row, columns], self.streak[row, columns] = 0, 0
        self.fired[row, columns] = False

    def unbind(self, row: int, column: int) -> None:
        self.bound[row, column] = False

    def _grow(self, rows: int, columns: int) -> None:
        old_rows, old_columns = self.bound.shape

        def grown(matrix: np.ndarray) -> np.ndarray:
            bigger = np.zeros((rows, columns), dtype=matrix.dtype)
            bigger[:old_rows, :old_columns] = matrix
            return bigger

        self.bound, self.abort, self.seen, self.streak, self.fired = (
            grown(m) for m in (self.bound, self.abort, self.seen, self.streak, self.fired))
        if columns > old_columns:
            extra = columns - old_columns
            self.probes += [None] * extra
            (self.threshold, self.min_tokens, self.patience, self.direct, self.selector, self.metric_slot,
             self.silent, self.paired) = (
                np.concatenate([a, np.zeros(extra, dtype=a.dtype)])
                for a in (self.threshold, self.min_tokens, self.patience, self.direct, self.selector,
                          self.metric_slot, self.silent, self.paired))
            self._free_columns += range(columns - 1, old_columns - 1, -1)
        if rows > old_rows:
            self._free_rows += range(rows - 1, old_rows - 1, -1)
