"""Per-step row mapping: from vLLM's flat token batch to capture keys.

vLLM flattens every scheduled token of a step into one batch: the rows of the
request in slot s are [query_start_loc[s], query_start_loc[s + 1]), and each
row's absolute token position is given to the model as `positions`. Rows past
query_start_loc[num_reqs] are padding and never mapped. Workers never see the
caller's request id: vLLM appends "-<random hex>", and the children of an n>1
request are "<index>_<id>-<random hex>". This module resolves those ids back
to registrations and decides which rows each (tensor type, layer) copies.
It needs numpy only, so it is tested without vLLM.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from common.capture_spec import ExtractionPoint

_RANDOM_SUFFIX = re.compile(r"-[0-9a-fA-F]{8,}$")
_CHILD_PREFIX = re.compile(r"^(\d+)_(.+)$")


@dataclass(frozen=True)
class Registration:
    """What one request captures; prompt_len decides which positions are generated."""

    request_id: str
    points: tuple[ExtractionPoint, ...]
    prompt_len: int


@dataclass(frozen=True)
class PromptGap:
    """Selected positions a request never computed (served from the prefix cache)."""

    request_id: str
    point: str
    start: int
    stop: int


@dataclass(frozen=True)
class PointRows:
    """Every row one point copies from one (tensor type, layer) in one step, over
    all its requests in batch order: a hook copies them with one gather."""

    point: str
    tensor_type: str
    layer: int
    row_indices: np.ndarray  # int64 indexes into the step's flat batch
    request_ids: list[str]  # one per row
    positions: np.ndarray  # int64
    is_generated: np.ndarray  # bool


StepPlan = dict[tuple[str, int], list[PointRows]]


class _PointGroup:
    """The requests of one step that share one point (equal specs), collected slot
    by slot so the selector runs once over all their rows."""

    def __init__(self, point: ExtractionPoint, layers: tuple[int, ...]) -> None:
        self.point = point
        self.layers = layers
        self.starts: list[int] = []
        self.stops: list[int] = []
        self.record_ids: list[str] = []
        self.prompt_lens: list[int] = []

    def add(self, start: int, stop: int, record_id: str, prompt_len: int) -> None:
        self.starts.append(start)
        self.stops.append(stop)
        self.record_ids.append(record_id)
        self.prompt_lens.append(prompt_len)

    def rows(self, positions: np.ndarray) -> tuple[np.ndarray, list[str], np.ndarray, np.ndarray] | None:
        """(row indices, request id per row, positions, is_generated) the point
        selects, in batch order; None when it selects nothing this step."""
        starts = np.array(self.starts, dtype=np.int64)
        counts = np.array(self.stops, dtype=np.int64) - starts
        total = int(counts.sum())
        if total == len(starts):  # one row each: a decode step
            rows, prompt_lens = starts, np.array(self.prompt_lens, dtype=np.int64)
        else:  # each request's rows are [start, stop): one arange over all of them
            first_out = np.cumsum(counts) - counts
            rows = np.arange(total, dtype=np.int64) + np.repeat(starts - first_out, counts)
            prompt_lens = np.repeat(np.array(self.prompt_lens, dtype=np.int64), counts)
        row_positions = positions[rows]
        picked = self.point.tokens.mask(row_positions, prompt_lens)
        if picked.all():
            record_ids = (self.record_ids if total == len(starts)
                          else [r for r, n in zip(self.record_ids, counts.tolist()) for _ in range(n)])
            return rows, record_ids, row_positions, row_positions >= prompt_lens
        local = np.flatnonzero(picked)
        if not len(local):
            return None
        owner = np.repeat(np.arange(len(starts)), counts)[local]
        return (rows[local], [self.record_ids[i] for i in owner.tolist()], row_positions[local],
                row_positions[local] >= prompt_lens[local])


def record_request_id(internal_id: str, registered: set[str] | dict) -> str | None:
    """The id records of this vLLM-internal request carry, or None if unregistered.

    A plain request maps to the id it was registered under. A child of an n>1
    request maps to "<index>_<id>" (vLLM's own child naming), since each child
    samples different tokens at the same positions.
    """
    suffix = _RANDOM_SUFFIX.search(internal_id)
    candidates = [internal_id[: suffix.start()], internal_id] if suffix else [internal_id]
    for candidate in candidates:
        if candidate in registered:
            return candidate
        child = _CHILD_PREFIX.match(candidate)
        if child and child.group(2) in registered:
            return candidate
    return None


def parent_request_id(record_id: str, registered: set[str] | dict) -> str:
    """The registered id behind a record id (itself, or the parent of an n>1 child)."""
    if record_id in registered:
        return record_id
    child = _CHILD_PREFIX.match(record_id)
    return child.group(2) if child else record_id


class RowMapper:
    """Registrations of one worker and the per-step plan built from them.

    owned_layers are this rank's decoder layers; has_final_norm is true on the
    last pipeline stage, whose final_norm records carry layer num_layers.
    """

    def __init__(self, owned_layers: range, num_layers: int, has_final_norm: bool) -> None:
        self.owned_layers = owned_layers
        self.num_layers = num_layers
        self.has_final_norm = has_final_norm
        self.registrations: dict[str, Registration] = {}
        # vLLM-internal id -> record id (None: not captured), resolved once per request.
        self._resolved: dict[str, str | None] = {}
        # vLLM-internal id -> first position not yet computed; finds prefix-cache gaps.
        self._next_position: dict[str, int] = {}
        self.gaps: list[PromptGap] = []
        # request id -> its points (one shared instance per spec), each with the
        # layers of it this rank owns; points it owns no layer of are left out.
        self._owned: dict[str, list[tuple[ExtractionPoint, tuple[int, ...]]]] = {}
        # point spec -> [its shared instance, how many registrations use it]
        self._shared: dict[ExtractionPoint, list] = {}

    def register(self, registration: Registration) -> None:
        self._forget_points(registration.request_id)
        self.registrations[registration.request_id] = registration
        self._owned[registration.request_id] = [
            (self._share(point), layers)
            for point in registration.points
            if (layers := tuple(layer for layer in point.capture_layers(self.num_layers) if self._owns(layer)))
        ]
        self._resolved = {k: v for k, v in self._resolved.items() if v is not None}

    def unregister(self, request_id: str) -> None:
        self.registrations.pop(request_id, None)
        self._forget_points(request_id)
        stale = [
            internal
            for internal, record_id in self._resolved.items()
            if record_id is not None
            and parent_request_id(record_id, self.registrations) == request_id
        ]
        for internal in stale:
            del self._resolved[internal]
            self._next_position.pop(internal, None)

    def _share(self, point: ExtractionPoint) -> ExtractionPoint:
        """The one instance of this spec: requests with equal points group by identity."""
        entry = self._shared.setdefault(point, [point, 0])
        entry[1] += 1
        return entry[0]

    def _forget_points(self, request_id: str) -> None:
        for point, _ in self._owned.pop(request_id, ()):
            entry = self._shared[point]
            entry[1] -= 1
            if not entry[1]:
                del self._shared[point]

    def _owns(self, layer: int) -> bool:
        return layer in self.owned_layers or (self.has_final_norm and layer == self.num_layers)

    def _resolve(self, internal_id: str) -> str | None:
        if internal_id not in self._resolved:
            self._resolved[internal_id] = record_request_id(internal_id, self.registrations)
        return self._resolved[internal_id]

    def plan(
        self, req_ids: list[str], query_start_loc: np.ndarray, positions: np.ndarray
    ) -> StepPlan:
        """Which rows of this step each (tensor type, layer) copies, per point.

        req_ids[s] is the vLLM id in batch slot s; query_start_loc has
        len(req_ids) + 1 entries; positions covers at least the real rows.
        The requests that share a point are selected together, with one mask
        over all their rows, and a point's layers share the arrays (read-only):
        the work grows with the points in the step, not with requests x points.
        """
        plan: StepPlan = {}
        if not self.registrations:
            return plan
        positions = np.asarray(positions, dtype=np.int64)
        bounds = np.asarray(query_start_loc, dtype=np.int64).tolist()
        groups: dict[int, _PointGroup] = {}
        for slot, internal_id in enumerate(req_ids):
            record_id = self._resolve(internal_id)
            if record_id is None:
                continue
            lo, hi = bounds[slot], bounds[slot + 1]
            if hi <= lo:
                continue
            registration = self.registrations[parent_request_id(record_id, self.registrations)]
            self._note_gap(internal_id, record_id, registration, int(positions[lo]), int(positions[hi - 1]))
            for point, layers in self._owned[registration.request_id]:
                group = groups.get(id(point))
                if group is None:
                    group = groups[id(point)] = _PointGroup(point, layers)
                group.add(lo, hi, record_id, registration.prompt_len)
        for group in groups.values():
            selected = group.rows(positions)
            if selected is None:
                continue
            point = group.point
            for layer in group.layers:
                plan.setdefault((point.tensor_type, layer), []).append(
                    PointRows(point.name, point.tensor_type, layer, *selected)
                )
        return plan

    def _note_gap(
        self, internal_id: str, record_id: str, registration: Registration, first: int, last: int
    ) -> None:
        """Records selected positions that were skipped (a prefix-cache hit)."""
        expected = self._next_position.get(internal_id, 0)
        if first > expected:
            skipped = np.arange(expected, first)
            for point in registration.points:
                if point.tokens.mask(skipped, registration.prompt_len).any():
                    self.gaps.append(PromptGap(record_id, point.name, expected, first))
        self._next_position[internal_id] = max(expected, last + 1)

    def take_gaps(self) -> list[PromptGap]:
        gaps, self.gaps = self.gaps, []
        return gaps
