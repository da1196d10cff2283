"""Per-step row mapping: from vLLM's flat token batch to capture keys.

vLLM flattens every scheduled token of a step into one batch: the rows of the
request in slot s are [query_start_loc[s], query_start_loc[s + 1]), and each
row's absolute token position is given to the model as `positions`. Rows past
query_start_loc[num_reqs] are padding and never mapped. Workers never see the
caller's request id as it is (`capture.request_ids` resolves vLLM's forms back
to registrations). This module decides which rows each (tensor type, layer)
copies.
It needs numpy only, so it is tested without vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import numpy as np

from common.capture_spec import ExtractionPoint
from engine_service.capture.request_ids import parent_request_id, record_request_id

@dataclass(frozen=True)
class Registration:
    """What one request captures; prompt_tokens decides which positions are generated."""

    request_id: str
    points: tuple[ExtractionPoint, ...]
    prompt_tokens: int


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


# One capturing request in a step: (first row, row after its last, record id, prompt length).
_Slot = tuple[int, int, str, int]


def _select(point: ExtractionPoint, slots: list[_Slot], positions: np.ndarray
            ) -> tuple[np.ndarray, list[str], np.ndarray, np.ndarray] | None:
    """(row indices, request id per row, positions, is_generated) the point
    selects from these requests' rows (given in batch order), with one mask over
    all of them, each row with its own request's prompt length; None when it
    selects nothing this step."""
    starts_, stops_, record_ids, prompt_tokens_ = zip(*slots)
    starts = np.array(starts_, dtype=np.int64)
    counts = np.array(stops_, dtype=np.int64) - starts
    total = int(counts.sum())
    if total == len(starts):  # one row each: a decode step
        rows, prompt_tokens = starts, np.array(prompt_tokens_, dtype=np.int64)
    else:  # each request's rows are [start, stop): one arange over all of them
        first_out = np.cumsum(counts) - counts
        rows = np.arange(total, dtype=np.int64) + np.repeat(starts - first_out, counts)
        prompt_tokens = np.repeat(np.array(prompt_tokens_, dtype=np.int64), counts)
    row_positions = positions[rows]
    picked = point.tokens.mask(row_positions, prompt_tokens)
    if picked.all():
        per_row = (list(record_ids) if total == len(starts)
                   else [r for r, n in zip(record_ids, counts.tolist()) for _ in range(n)])
        return rows, per_row, row_positions, row_positions >= prompt_tokens
    local = np.flatnonzero(picked)
    if not len(local):
        return None
    owner = np.repeat(np.arange(len(starts)), counts)[local]
    return (rows[local], [record_ids[i] for i in owner.tolist()], row_positions[local],
            row_positions[local] >= prompt_tokens[local])


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
        # request id -> its points, each with the layers of it this rank owns (points
        # it owns no layer of left out). Equal point specs, and equal sets of them,
        # are one shared instance each, so a step groups its requests by identity:
        # usually every request of a step has the same set (the same probes).
        self._owned: dict[str, tuple[tuple[ExtractionPoint, tuple[int, ...]], ...]] = {}
        # a point spec or a set of them -> [its shared instance, registrations using it]
        self._shared: dict[object, list] = {}

    def register(self, registration: Registration) -> None:
        self._forget_points(registration.request_id)
        self.registrations[registration.request_id] = registration
        owned = []
        for point in registration.points:
            wanted = point.capture_layers(self.num_layers)
            layers = tuple(layer for layer in wanted if self._owns(layer))
            if layers:
                owned.append((self._share(point), layers))
        self._owned[registration.request_id] = self._share(tuple(owned))
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

    def _share(self, spec):
        """The one instance of this point spec (or set of them), counted per registration."""
        entry = self._shared.setdefault(spec, [spec, 0])
        entry[1] += 1
        return entry[0]

    def _forget_points(self, request_id: str) -> None:
        owned = self._owned.pop(request_id, None)
        if owned is None:
            return
        for spec in (owned, *(point for point, _ in owned)):
            entry = self._shared[spec]
            entry[1] -= 1
            if not entry[1]:
                del self._shared[spec]

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
        Each request is filed once, under its set of points; then the requests
        that share a point are selected together, with one mask over all their
        rows, and a point's layers share the arrays (read-only). Beyond one
        append per request, the work grows with the distinct points in the
        step, not with requests x points x layers.
        """
        plan: StepPlan = {}
        if not self.registrations:
            return plan
        positions = np.asarray(positions, dtype=np.int64)
        bounds = np.asarray(query_start_loc, dtype=np.int64).tolist()
        by_point_set: dict[int, tuple[tuple, list[_Slot]]] = {}
        for slot, internal_id in enumerate(req_ids):
            record_id = self._resolve(internal_id)
            if record_id is None:
                continue
            lo, hi = bounds[slot], bounds[slot + 1]
            if hi <= lo:
                continue
            registration = self.registrations[parent_request_id(record_id, self.registrations)]
            first, last = int(positions[lo]), int(positions[hi - 1])
            self._note_gap(internal_id, record_id, registration, first, last)
            point_set = self._owned[registration.request_id]
            requests = by_point_set.get(id(point_set))
            if requests is None:
                requests = by_point_set[id(point_set)] = (point_set, [])
            requests[1].append((lo, hi, record_id, registration.prompt_tokens))
        by_point: dict[int, tuple[ExtractionPoint, tuple[int, ...], list[list[_Slot]]]] = {}
        for point_set, slots in by_point_set.values():
            for point, layers in point_set:
                by_point.setdefault(id(point), (point, layers, []))[2].append(slots)
        for point, layers, slot_lists in by_point.values():
            # Several sets hold this point: their requests again in batch order.
            slots = slot_lists[0] if len(slot_lists) == 1 else sorted(chain(*slot_lists))
            selected = _select(point, slots, positions)
            if selected is None:
                continue
            for layer in layers:
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
                if point.tokens.mask(skipped, registration.prompt_tokens).any():
                    self.gaps.append(PromptGap(record_id, point.name, expected, first))
        self._next_position[internal_id] = max(expected, last + 1)

    def take_gaps(self) -> list[PromptGap]:
        gaps, self.gaps = self.gaps, []
        return gaps
