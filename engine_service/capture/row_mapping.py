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
from collections import defaultdict
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
class Selection:
    """The rows one point copies from one (tensor type, layer) in one step."""

    point: str
    tensor_type: str
    layer: int
    row_indices: np.ndarray  # int64 indexes into the step's flat batch
    request_id: str
    positions: np.ndarray  # int64
    is_generated: np.ndarray  # bool


@dataclass(frozen=True)
class PromptGap:
    """Selected positions a request never computed (served from the prefix cache)."""

    request_id: str
    point: str
    start: int
    stop: int


StepPlan = dict[tuple[str, int], list[Selection]]


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


def rows_per_point(plan: StepPlan) -> dict[tuple[str, int], list[PointRows]]:
    """The plan with each point's selections of a (tensor type, layer) joined: one
    gather per point and hook instead of one per request (a decode step selects
    one row per request, so the per-request gathers were mostly overhead)."""
    joined: dict[tuple[str, int], list[PointRows]] = {}
    # A point's selections on its layers share their arrays (RowMapper.plan):
    # the rows joined from one set of arrays serve every layer that has them.
    rows_of: dict[tuple[str, tuple[int, ...]], tuple] = {}
    for key, selections in plan.items():
        by_point: dict[str, list[Selection]] = {}
        for selection in selections:
            by_point.setdefault(selection.point, []).append(selection)
        entries = []
        for point, chosen in by_point.items():
            identity = (point, tuple(id(s.row_indices) for s in chosen))
            rows = rows_of.get(identity)
            if rows is None:
                rows = rows_of[identity] = (
                    np.concatenate([s.row_indices for s in chosen]),
                    [s.request_id for s in chosen for _ in range(len(s.positions))],
                    np.concatenate([s.positions for s in chosen]),
                    np.concatenate([s.is_generated for s in chosen]),
                )
            entries.append(PointRows(point, chosen[0].tensor_type, chosen[0].layer, *rows))
        joined[key] = entries
    return joined


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
        # request id -> its points, each with the layers of it this rank owns.
        self._owned: dict[str, list[tuple[ExtractionPoint, tuple[int, ...]]]] = {}

    def register(self, registration: Registration) -> None:
        self.registrations[registration.request_id] = registration
        self._owned.pop(registration.request_id, None)
        self._resolved = {k: v for k, v in self._resolved.items() if v is not None}

    def unregister(self, request_id: str) -> None:
        self.registrations.pop(request_id, None)
        self._owned.pop(request_id, None)
        stale = [
            internal
            for internal, record_id in self._resolved.items()
            if record_id is not None
            and parent_request_id(record_id, self.registrations) == request_id
        ]
        for internal in stale:
            del self._resolved[internal]
            self._next_position.pop(internal, None)

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
        """
        plan: StepPlan = defaultdict(list)
        if not self.registrations:
            return plan
        for slot, internal_id in enumerate(req_ids):
            record_id = self._resolve(internal_id)
            if record_id is None:
                continue
            lo, hi = int(query_start_loc[slot]), int(query_start_loc[slot + 1])
            if hi <= lo:
                continue
            registration = self.registrations[parent_request_id(record_id, self.registrations)]
            request_positions = np.asarray(positions[lo:hi], dtype=np.int64)
            self._note_gap(internal_id, record_id, registration, request_positions)
            for point, layers in self._owned_layers(registration):
                picked = point.tokens.mask(request_positions, registration.prompt_len)
                if not picked.any():
                    continue
                local = np.flatnonzero(picked)
                # The same rows on every layer of the point: its layers share these
                # arrays (read-only), and rows_per_point joins them once.
                row_indices = lo + local
                selected_positions = request_positions[local]
                is_generated = selected_positions >= registration.prompt_len
                for layer in layers:
                    plan[(point.tensor_type, layer)].append(
                        Selection(point.name, point.tensor_type, layer, row_indices, record_id,
                                  selected_positions, is_generated)
                    )
        return plan

    def _owned_layers(self, registration: Registration) -> list[tuple[ExtractionPoint, tuple[int, ...]]]:
        """Each point of the registration with the layers of it this rank computes."""
        owned = self._owned.get(registration.request_id)
        if owned is None:
            owned = self._owned[registration.request_id] = [
                (point, tuple(layer for layer in point.capture_layers(self.num_layers) if self._owns(layer)))
                for point in registration.points
            ]
        return owned

    def _note_gap(
        self,
        internal_id: str,
        record_id: str,
        registration: Registration,
        request_positions: np.ndarray,
    ) -> None:
        """Records selected positions that were skipped (a prefix-cache hit)."""
        expected = self._next_position.get(internal_id, 0)
        first = int(request_positions[0])
        if first > expected:
            skipped = np.arange(expected, first)
            for point in registration.points:
                if point.tokens.mask(skipped, registration.prompt_len).any():
                    self.gaps.append(PromptGap(record_id, point.name, expected, first))
        self._next_position[internal_id] = max(expected, int(request_positions[-1]) + 1)

    def take_gaps(self) -> list[PromptGap]:
        gaps, self.gaps = self.gaps, []
        return gaps
