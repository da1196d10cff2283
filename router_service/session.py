"""One engine session's requests and their probe state, without gRPC.

The servicer feeds each SessionRequest to `SessionState` and sends back the
RouterMessages it returns, in order. For a batch that order is: scores, then at
most one abort per request, then the StepAck, so every verdict caused by step N
precedes ack N. A bad record yields an in-band RequestError naming the field;
the rest of the batch is still scored.

Every RequestError about a request echoes the incarnation its request_start
gave, and every error about a batch's rows names the batch `step`: the engine
then knows which of that step's rows went unscored although the step is acked.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np

from common.activations import BatchDecodeError, BatchReader, Block
from common.enum_checks import unknown_enum
from common.errors import UndercurrentError, status_code_value
from router_service.metrics import RouterMetrics
from router_service.probes import Probe, ProjectionPlan, first_firing_segments
from router_service.registry import ProbeRegistry
from undercurrent.v1 import undercurrent_pb2 as pb

log = logging.getLogger(__name__)

# Remembered so a record that arrives after request_end gets a precise error.
ENDED_REQUESTS_REMEMBERED = 4096
PLAN_CACHE_SIZE = 64
DEFAULT_MAX_REQUESTS_PER_SESSION = 4096


@dataclass
class Binding:
    probe: Probe
    action: int  # pb.PROBE_ACTION_OBSERVE or pb.PROBE_ACTION_ABORT
    order: int  # position in the request's bindings: breaks ties between aborts
    row: int  # this binding's row in its probe's _BoundProbe rule arrays
    state: list = field(default_factory=list)
    pending_positions: list[np.ndarray] = field(default_factory=list)
    pending_scores: list[np.ndarray] = field(default_factory=list)
    last_scores_sent: float = float("-inf")


@dataclass
class RequestState:
    request_id: str
    prompt_length: int
    bindings: dict[int, Binding]  # id(probe) -> binding, in request_start order
    incarnation: int = 0  # echoed on every message about this request
    aborted: bool = False


class _BoundProbe:
    """A probe bound in this session, with the decision-rule state of every binding
    of it as arrays, so a batch updates them all at once."""

    def __init__(self, probe: Probe):
        self.probe = probe
        self.bindings = 0
        self.seen = np.zeros(16, dtype=np.int64)  # rows scored so far, per binding row
        self.streak = np.zeros(16, dtype=np.int64)  # consecutive rows >= threshold
        self.abort = np.zeros(16, dtype=bool)  # the binding's action is ABORT
        self._free = list(range(15, -1, -1))

    def allocate(self, abort: bool) -> int:
        if not self._free:
            size = self.seen.size
            self.seen, self.streak, self.abort = (
                np.concatenate([a, np.zeros_like(a)]) for a in (self.seen, self.streak, self.abort))
            self._free = list(range(2 * size - 1, size - 1, -1))
        row = self._free.pop()
        self.seen[row], self.streak[row], self.abort[row] = 0, 0, abort
        self.bindings += 1
        return row

    def release(self, row: int) -> None:
        self._free.append(row)
        self.bindings -= 1


class _SlotTable:
    """A batch's request_ids resolved against this session: per slot its request,
    prompt length and, per probe, its binding. Consecutive decode steps send the
    same request_ids, so one table serves batch after batch until the ids or the
    session's requests or bindings change; a step then costs no Python per row."""

    def __init__(self, requests: list[RequestState | None]):
        self.requests = requests
        self.known = np.array([r is not None for r in requests], dtype=bool)
        self.prompt_lengths = np.array([r.prompt_length if r else 0 for r in requests], dtype=np.int64)
        self._probes: dict[int, tuple[np.ndarray, np.ndarray, list[Binding | None]]] = {}

    def bindings_of(self, probe: Probe) -> tuple[np.ndarray, np.ndarray, list[Binding | None]]:
        """Per slot: does its request bind `probe`, the binding's rule row (-1: none), the Binding."""
        entry = self._probes.get(id(probe))
        if entry is None:
            bindings = [r.bindings.get(id(probe)) if r is not None else None for r in self.requests]
            bound = np.array([b is not None for b in bindings], dtype=bool)
            rows = np.array([b.row if b is not None else -1 for b in bindings], dtype=np.int64)
            entry = self._probes[id(probe)] = (bound, rows, bindings)
        return entry


@dataclass
class _Gathered:
    """Every row one probe reads in one batch, over all requests, in arrival order."""

    probe: Probe
    # (block, mask) per part appended: probes with equal sources read the same rows,
    # so they share one forward order (see _Order).
    sources: list[tuple[int, int]] = field(default_factory=list)
    slots: list[np.ndarray] = field(default_factory=list)  # index into batch.request_ids
    positions: list[np.ndarray] = field(default_factory=list)
    layers: list[np.ndarray] = field(default_factory=list)
    values: list[np.ndarray] = field(default_factory=list)


@dataclass
class _Checked:
    """A block whose fields passed the checks, its rows still as they came (bfloat16
    as bits); `usable` excludes rows of unknown requests and bad positions."""

    index: int
    where: str  # "blocks[i] (point@layer)", for errors
    block: Block
    slots: np.ndarray  # each row's index into batch.request_ids
    usable: np.ndarray
    readers: tuple[Probe, ...]  # the session's probes that read the block's (tensor type, layer)


@dataclass
class _Order:
    """The rows a token selector keeps from some gathered rows, in forward order per
    request, cut into one segment per request; shared by the probes that read them."""

    selected: np.ndarray  # indexes into the gathered rows
    slots: np.ndarray
    positions: np.ndarray
    layers: np.ndarray
    starts: np.ndarray  # first row of each segment
    ends: np.ndarray

    @classmethod
    def of(cls, part: _Gathered, tokens, prompt_lengths: np.ndarray) -> "_Order":
        slots, positions, layers = (np.concatenate(a) for a in (part.slots, part.positions, part.layers))
        forward = np.lexsort((layers, positions, slots))  # per request: (token_position, layer)
        selected = forward[tokens.mask(positions[forward], prompt_lengths[slots[forward]])]
        slots, positions, layers = slots[selected], positions[selected], layers[selected]
        boundary = np.ones(slots.size, dtype=bool)
        boundary[1:] = slots[1:] != slots[:-1]
        starts = np.flatnonzero(boundary)
        ends = np.append(starts[1:], slots.size)
        return cls(selected, slots, positions, layers, starts, ends)


@dataclass
class _Candidate:
    """A row where an abort binding's rule fired; the earliest per request wins."""

    position: int
    layer: int
    binding: Binding
    score: float

    def key(self) -> tuple[int, int, int]:
        return (self.position, self.layer, self.binding.order)


def error(request_id: str, code: str, message: str, probe: str = "", incarnation: int = 0,
          step: int = 0) -> pb.SessionResponse:
    """An in-band RequestError; code is a gRPC status-code name such as "INVALID_ARGUMENT"."""
    return pb.SessionResponse(
        error=pb.RequestError(
            request_id=request_id, probe=probe, code=status_code_value(code), message=message,
            incarnation=incarnation, step=step,
        )
    )


class SessionState:
    def __init__(
        self,
        registry: ProbeRegistry,
        model: pb.ModelInfo,
        metrics: RouterMetrics,
        scores_interval: float = 0.0,
        draining: Callable[[], bool] = lambda: False,
        clock: Callable[[], float] = time.monotonic,
        max_requests: int = DEFAULT_MAX_REQUESTS_PER_SESSION,
    ):
        self.registry = registry
        self.model = model
        self.metrics = metrics
        self.scores_interval = scores_interval
        self.draining = draining
        self.clock = clock
        self.max_requests = max_requests
        self.requests: dict[str, RequestState] = {}
        self._bound: dict[int, _BoundProbe] = {}  # id(probe) -> its bindings' rule state
        self._ended: OrderedDict[str, int] = OrderedDict()  # request id -> its last incarnation
        self._reported_incompatible: set[tuple[str, str]] = set()
        self._plans: OrderedDict[tuple[int, ...], ProjectionPlan] = OrderedDict()
        # The last batch's request_ids and their _SlotTable; cleared whenever a
        # request or binding comes or goes.
        self._slot_table: tuple[tuple[str, ...], _SlotTable] | None = None

    # -- catalog ------------------------------------------------------------

    def catalog(self) -> tuple[list[pb.ProbeInfo], list[pb.SessionResponse]]:
        """The probes this engine can use, and an error for each newly seen one it cannot."""
        infos, errors = [], []
        for probe in self.registry.probes():
            reason = probe.manifest.incompatibility(self.model)
            if reason is None:
                infos.append(self.registry.info(probe))
                continue
            key = (probe.name, probe.manifest.version)
            if key not in self._reported_incompatible:
                self._reported_incompatible.add(key)
                log.warning("probe incompatible with engine model", extra={"probe": probe.name,
                            "reason": reason})
                errors.append(self._error("", "FAILED_PRECONDITION", reason, probe.name))
        return infos, errors

    # -- request lifecycle --------------------------------------------------

    def start(self, msg: pb.RequestStart) -> list[pb.SessionResponse]:
        rid, incarnation = msg.request_id, msg.incarnation

        def refuse(code: str, message: str, probe: str = "") -> pb.SessionResponse:
            return self._error(rid, code, message, probe, incarnation=incarnation)

        if not rid:
            return [refuse("INVALID_ARGUMENT", "request_start.request_id is empty")]
        if self.draining():
            return [refuse("UNAVAILABLE", "router is draining; send the request elsewhere")]
        if rid in self.requests:
            return [refuse("ALREADY_EXISTS", f"request_start: request {rid!r} already started")]
        if len(self.requests) >= self.max_requests:
            return [refuse("RESOURCE_EXHAUSTED",
                           f"request_start: this session already runs {len(self.requests)} requests, "
                           f"the router's --max-requests-per-session")]
        if msg.prompt_length < 0:
            return [refuse("INVALID_ARGUMENT", f"request_start.prompt_length {msg.prompt_length} is negative")]
        out: list[pb.SessionResponse] = []
        bindings: dict[int, Binding] = {}
        names: set[str] = set()
        for i, wanted in enumerate(msg.probes):
            if bad := unknown_enum(wanted, f"request_start.probes[{i}]"):
                out.append(refuse("INVALID_ARGUMENT", bad, wanted.probe))
                continue
            if wanted.probe in names:
                out.append(refuse("INVALID_ARGUMENT",
                                  f"request_start.probes[{i}]: probe {wanted.probe!r} bound twice", wanted.probe))
                continue
            try:
                probe = self.registry.bind(wanted.probe)
            except UndercurrentError as err:
                out.append(refuse(err.code.name, f"request_start.probes[{i}]: {err}", wanted.probe))
                continue
            reason = probe.manifest.incompatibility(self.model)
            if reason is not None:
                self.registry.release(probe)
                out.append(refuse("FAILED_PRECONDITION", f"request_start.probes[{i}]: {reason}", wanted.probe))
                continue
            names.add(wanted.probe)
            action = wanted.action if wanted.action != pb.PROBE_ACTION_UNSPECIFIED else probe.manifest.action
            row = self._bound.setdefault(id(probe), _BoundProbe(probe)).allocate(action == pb.PROBE_ACTION_ABORT)
            bindings[id(probe)] = Binding(probe, action, len(bindings), row, probe.new_state())
        self.requests[rid] = RequestState(rid, msg.prompt_length, bindings, incarnation)
        self._slot_table = None
        self._ended.pop(rid, None)
        self.metrics.live_requests.inc()
        return out

    def end(self, msg: pb.RequestEnd) -> list[pb.SessionResponse]:
        request = self.requests.get(msg.request_id)
        if request is None or request.incarnation != msg.incarnation:
            return [self._error(msg.request_id, "NOT_FOUND",
                                f"request_end: request {msg.request_id!r} incarnation {msg.incarnation} "
                                "is not running on this session", incarnation=msg.incarnation)]
        del self.requests[msg.request_id]
        self._slot_table = None
        out = [m for b in request.bindings.values() if (m := self._flush_scores(request, b, force=True))]
        self._free(request)
        self._ended[msg.request_id] = request.incarnation
        self._ended.move_to_end(msg.request_id)
        while len(self._ended) > ENDED_REQUESTS_REMEMBERED:
            self._ended.popitem(last=False)
        return out

    def close(self) -> int:
        """Frees every request of the session (it dropped); returns how many."""
        count = len(self.requests)
        for request in self.requests.values():
            self._free(request)
        self.requests.clear()
        self._slot_table = None
        return count

    def _free(self, request: RequestState) -> None:
        for binding in list(request.bindings.values()):
            self._unbind(request, binding)
        self.metrics.live_requests.dec()

    def _unbind(self, request: RequestState, binding: Binding) -> None:
        del request.bindings[id(binding.probe)]
        self._slot_table = None
        self.registry.release(binding.probe)
        bound = self._bound[id(binding.probe)]
        bound.release(binding.row)
        if bound.bindings == 0:
            del self._bound[id(binding.probe)]

    # -- batches ------------------------------------------------------------

    def batch(self, batch: pb.ActivationBatch) -> list[pb.SessionResponse]:
        started = time.perf_counter()
        out: list[pb.SessionResponse] = []
        reported: set[tuple[str, str]] = set()  # (request, problem): one error per batch each
        table = self._slots(batch)
        requests = table.requests
        reader = BatchReader(batch, as_float32=False)
        read_alike: dict[tuple, list[_Checked]] = {}
        for i in range(len(batch.blocks)):
            try:
                checked, errors = self._check_block(reader, i, table, reported)
            except Exception as err:  # a bug on one block must not cost the others their scores
                checked, errors = None, self._internal_error(batch, [i], err, reported)
            out += errors
            if checked is not None:
                key = (tuple(id(p) for p in checked.readers), checked.block.wire_dtype)
                read_alike.setdefault(key, []).append(checked)
        gathered: dict[int, _Gathered] = {}
        for group in read_alike.values():
            try:
                out += self._gather_group(batch, group, table, gathered, reported)
            except Exception as err:
                out += self._internal_error(batch, [c.index for c in group], err, reported)
        candidates: dict[int, list[_Candidate]] = {}
        for parts in _sharing_an_order(gathered.values()):
            out += self._score_group(parts, table, candidates)
        for slot, found in candidates.items():
            request = requests[slot]
            if not request.aborted:
                request.aborted = True
                best = min(found, key=_Candidate.key)
                out.append(self._abort(request, best.binding, best.score, best.position, best.layer))
        out.append(pb.SessionResponse(ack=pb.StepAck(step=batch.step)))
        self.metrics.batches.inc()
        self.metrics.batch_seconds.observe(time.perf_counter() - started)
        return out

    def _slots(self, batch: pb.ActivationBatch) -> _SlotTable:
        ids = tuple(batch.request_ids)
        if self._slot_table is None or self._slot_table[0] != ids:
            self._slot_table = (ids, _SlotTable([self.requests.get(rid) for rid in ids]))
        return self._slot_table[1]

    def _check_block(
        self, reader: BatchReader, i: int, table: _SlotTable, reported: set[tuple[str, str]],
    ) -> tuple[_Checked | None, list[pb.SessionResponse]]:
        """Checks block i's fields and rows; the block to score (None: nothing to
        score in it), and the errors to send.

        A step carries one block per (point, layer), so this runs 25 to 100 times
        per batch: it costs a few array operations when nothing is wrong, and leaves
        the rows' values to _gather_group, which takes the blocks the same probes
        read together."""
        batch = reader.batch
        msg = batch.blocks[i]
        if bad := unknown_enum(msg, f"blocks[{i}]"):
            self.metrics.bytes.inc(len(msg.rows.data))
            return None, self._block_error(batch, _block_request_ids(batch, i), "INVALID_ARGUMENT", bad,
                                           reported)
        try:
            block, slots = reader.block(i)
        except BatchDecodeError as err:
            self.metrics.bytes.inc(len(msg.rows.data))
            return None, self._block_error(batch, _block_request_ids(batch, i), "INVALID_ARGUMENT", str(err),
                                           reported)
        where = f"blocks[{i}] ({msg.point}@{msg.layer})"
        # Counted from the decoded rows: each read of msg.rows.data copies the bytes.
        self.metrics.bytes.inc(block.rows.nbytes)
        self.metrics.rows.inc(block.num_rows)
        if block.num_rows == 0:
            return None, []
        if block.rows.shape[1] != self.model.hidden_size:
            return None, self._block_error(
                batch, block.request_ids, "INVALID_ARGUMENT",
                f"{where}.rows.shape: hidden size {block.rows.shape[1]} does not match the "
                f"model's hidden_size {self.model.hidden_size}", reported,
            )
        out = []
        usable = table.known[slots]
        if not usable.all():
            for j in np.unique(slots[~usable]):
                out += self._unknown_request(batch.request_ids[j], where, batch.step, reported)
        negative = block.token_positions < 0
        if negative.any():
            out += self._bad_rows(batch, table, where, "with a negative token position", block, slots,
                                  usable & negative, reported)
            usable = usable & ~negative
        readers = tuple(bound.probe for bound in self._bound.values()
                        if bound.probe.manifest.reads(block.tensor_type, block.layer))
        # A block no probe reads still has its rows checked (in a group of its own kind).
        return _Checked(i, where, block, slots, usable, readers), out

    def _gather_group(
        self,
        batch: pb.ActivationBatch,
        group: list[_Checked],
        table: _SlotTable,
        gathered: dict[int, _Gathered],
        reported: set[tuple[str, str]],
    ) -> list[pb.SessionResponse]:
        """Widens, checks and projects the rows of blocks that the same probes read
        in one pass (one matrix product for all of them), and files the usable rows
        under each probe that reads them."""
        first = group[0]
        slots = _joined([c.slots for c in group])
        usable = _joined([c.usable for c in group])
        readers = [(probe, usable & table.bindings_of(probe)[0][slots]) for probe in first.readers]
        # A group no probe reads still has its rows checked: an empty plan only checks them.
        plan = self._plan(tuple(probe for probe, reads in readers if reads.any()))
        values, finite = plan.evaluate([c.block.rows for c in group], first.block.wire_dtype)
        out = []
        if not finite.all():
            start = 0
            for c in group:
                end = start + c.block.num_rows
                bad = c.usable & ~finite[start:end]
                if bad.any():
                    out += self._bad_rows(batch, table, c.where, "with NaN or Inf", c.block, c.slots, bad, reported)
                start = end
            readers = [(probe, reads & finite) for probe, reads in readers]
        readers = [(probe, reads) for probe, reads in readers if reads.any()]
        if not readers:
            return out
        positions = _joined([c.block.token_positions for c in group])
        layers = np.repeat(np.array([c.block.layer for c in group], dtype=np.int64),
                           [c.block.num_rows for c in group])
        masks: dict[bytes, int] = {}  # readers with the same rows share one mask number
        for probe, reads in readers:
            part = gathered.setdefault(id(probe), _Gathered(probe))
            part.sources.append((first.index, masks.setdefault(reads.tobytes(), len(masks))))
            take = slice(None) if reads.all() else reads  # the usual case: views, no copies through a mask
            part.slots.append(slots[take])
            part.positions.append(positions[take])
            part.layers.append(layers[take])
            part.values.append(values[take, plan.columns[id(probe)]])
        return out

    def _score_group(
        self, parts: list[_Gathered], table: _SlotTable, candidates: dict[int, list[_Candidate]],
    ) -> list[pb.SessionResponse]:
        """Scores probes that read the same rows under one token selector, over all
        their requests' rows: one forward order and one run of the decision rule
        for all of them. Files abort candidates; returns scores."""
        started = time.perf_counter()
        order = _Order.of(parts[0], parts[0].probe.manifest.tokens, table.prompt_lengths)
        probes = [part.probe for part in parts]
        if order.selected.size == 0:
            self._observe_probe_seconds(probes, [0.0] * len(probes), time.perf_counter() - started)
            return []
        positions, layers, starts, ends = order.positions, order.layers, order.starts, order.ends
        segment_slots = order.slots[starts]
        scores, own_seconds = [], []
        for part in parts:
            probe_started = time.perf_counter()
            scores.append(self._scores(part, order, table, segment_slots))
            own_seconds.append(time.perf_counter() - probe_started)
            self.metrics.probe_rows.labels(part.probe.name).inc(scores[-1].size)
        bound = [self._bound[id(probe)] for probe in probes]
        _, rows_by_slot, by_slot = zip(*(table.bindings_of(probe) for probe in probes))
        rule_rows = [rows[segment_slots] for rows in rows_by_slot]
        seen = np.column_stack([b.seen[rows] for b, rows in zip(bound, rule_rows)])
        streak = np.column_stack([b.streak[rows] for b, rows in zip(bound, rule_rows)])
        abort = np.column_stack([b.abort[rows] for b, rows in zip(bound, rule_rows)])
        manifests = [probe.manifest for probe in probes]
        hits = first_firing_segments(
            np.column_stack(scores), starts, np.array([m.threshold for m in manifests]),
            np.array([m.min_tokens for m in manifests]), np.array([m.patience for m in manifests]),
            seen, streak)
        for j, (b, rows) in enumerate(zip(bound, rule_rows)):
            b.seen[rows], b.streak[rows] = seen[:, j], streak[:, j]
        for k, j in zip(*(index.tolist() for index in np.nonzero(abort & (hits >= 0)))):
            hit, slot = hits[k, j], int(segment_slots[k])
            candidates.setdefault(slot, []).append(
                _Candidate(int(positions[hit]), int(layers[hit]), by_slot[j][slot], float(scores[j][hit])))
        out = []
        for j, k in zip(*(index.tolist() for index in np.nonzero(~abort.T))):  # probe by probe
            slot = int(segment_slots[k])
            binding = by_slot[j][slot]
            binding.pending_positions.append(positions[starts[k]:ends[k]])
            binding.pending_scores.append(scores[j][starts[k]:ends[k]])
            if message := self._flush_scores(table.requests[slot], binding, force=False):
                out.append(message)
        self._observe_probe_seconds(probes, own_seconds, time.perf_counter() - started)
        return out

    @staticmethod
    def _scores(part: _Gathered, order: _Order, table: _SlotTable, segment_slots: np.ndarray) -> np.ndarray:
        """One probe's scores of the ordered rows (float64, one per row)."""
        probe = part.probe
        values = np.concatenate(part.values)[order.selected]
        if probe.stateless:
            return probe.score(values, None)
        by_slot = table.bindings_of(probe)[2]
        return np.concatenate([probe.score(values[a:b], by_slot[s].state)
                               for a, b, s in zip(order.starts, order.ends, segment_slots.tolist())])

    def _observe_probe_seconds(self, probes: list[Probe], own: list[float], total: float) -> None:
        """Each probe's own scoring time plus an equal share of what its group shares."""
        shared = (total - sum(own)) / len(probes)
        for probe, seconds in zip(probes, own):
            self.metrics.probe_seconds.labels(probe.name).observe(seconds + shared)

    def _abort(self, request: RequestState, binding: Binding, score: float, position: int,
               layer: int) -> pb.SessionResponse:
        m = binding.probe.manifest
        reason = (
            f"probe {m.name!r} (version {m.version}) scored {score:.4g} >= threshold {m.threshold:g} "
            f"at token {position}, layer {layer} (patience {m.patience}, min_tokens {m.min_tokens})"
        )
        self.metrics.aborts.labels(m.name).inc()
        log.info("abort", extra={"request_id": request.request_id, "probe": m.name, "score": score,
                                 "token_position": position})
        return pb.SessionResponse(abort=pb.Verdict(
            request_id=request.request_id, probe=m.name, score=score, token_position=position,
            reason=reason, incarnation=request.incarnation))

    def _flush_scores(self, request: RequestState, binding: Binding, force: bool) -> pb.SessionResponse | None:
        if not binding.pending_scores:
            return None
        now = self.clock()
        if not force and now - binding.last_scores_sent < self.scores_interval:
            return None
        binding.last_scores_sent = now
        message = pb.ProbeScores(
            request_id=request.request_id,
            probe=binding.probe.name,
            token_positions=_joined(binding.pending_positions).tolist(),
            scores=_joined(binding.pending_scores).tolist(),
            incarnation=request.incarnation,
        )
        binding.pending_positions.clear()
        binding.pending_scores.clear()
        return pb.SessionResponse(scores=message)

    # -- helpers ------------------------------------------------------------

    def detach_retired(self) -> list[pb.SessionResponse]:
        """Drops bindings of probes unloaded by force; tells each request once.

        Call it before `batch`, on the thread that owns the registry."""
        out = []
        if not any(bound.probe.retired for bound in self._bound.values()):
            return out  # the usual case, checked per probe rather than per binding
        for request in self.requests.values():
            for binding in [b for b in request.bindings.values() if b.probe.retired]:
                self._unbind(request, binding)
                out.append(self._error(
                    request.request_id, "NOT_FOUND",
                    f"probe {binding.probe.name!r} was unloaded by force; it no longer scores this request",
                    binding.probe.name))
        return out

    def _plan(self, probes: tuple[Probe, ...]) -> ProjectionPlan:
        # The cached plan holds its probes, so their ids cannot be reused while it lives.
        key = tuple(id(p) for p in probes)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = ProjectionPlan(probes)
            if len(self._plans) > PLAN_CACHE_SIZE:
                self._plans.popitem(last=False)
        else:
            self._plans.move_to_end(key)
        return plan

    def _unknown_request(self, rid: str, where: str, step: int,
                         reported: set[tuple[str, str]]) -> list[pb.SessionResponse]:
        if (rid, "unknown") in reported:
            return []
        reported.add((rid, "unknown"))
        if rid in self._ended:
            return [self._error(rid, "FAILED_PRECONDITION",
                                f"{where}: records for request {rid!r} after its request_end; not scored",
                                step=step, incarnation=self._ended[rid])]
        return [self._error(rid, "NOT_FOUND",
                            f"{where}: request {rid!r} was never started on this session "
                            "(no request_start); its records were not scored", step=step)]

    def _bad_rows(self, batch: pb.ActivationBatch, table: _SlotTable, where: str, problem: str, block: Block,
                  slots: np.ndarray, bad: np.ndarray, reported: set[tuple[str, str]]) -> list[pb.SessionResponse]:
        """An error per request with `bad` rows (of known requests) in the block."""
        out = []
        for j in np.unique(slots[bad]):
            out += self._rows_error(batch, table.requests[j], where, problem,
                                    block.token_positions[(slots == j) & bad], reported)
        return out

    def _internal_error(self, batch: pb.ActivationBatch, blocks: list[int], err: Exception,
                        reported: set[tuple[str, str]]) -> list[pb.SessionResponse]:
        """A bug while reading some blocks: INTERNAL for their requests; the other blocks are still scored."""
        log.exception("blocks failed", extra={"step": batch.step, "blocks": blocks})
        out = []
        for i in blocks:
            out += self._block_error(batch, _block_request_ids(batch, i), "INTERNAL",
                                     f"blocks[{i}]: internal error: {type(err).__name__}: {err}", reported)
        return out

    def _rows_error(self, batch: pb.ActivationBatch, request: RequestState, where: str, problem: str,
                    positions: np.ndarray, reported: set[tuple[str, str]]) -> list[pb.SessionResponse]:
        """One error per request and problem per batch, naming the first bad positions."""
        if (request.request_id, problem) in reported:
            return []
        reported.add((request.request_id, problem))
        return [self._error(
            request.request_id, "INVALID_ARGUMENT",
            f"{where}.rows: {positions.size} row(s) {problem} at token_positions {positions.tolist()[:8]}; "
            "those rows were not scored", step=batch.step)]

    def _block_error(self, batch: pb.ActivationBatch, request_ids: list[str], code: str, message: str,
                     reported: set[tuple[str, str]]) -> list[pb.SessionResponse]:
        """One error per request that had rows in the block (every request of the
        batch when the block names none it can be matched to)."""
        named = {r for r in request_ids if r} or {r for r in batch.request_ids if r}
        out = []
        for rid in sorted(named) or [""]:
            if (rid, message) not in reported:
                reported.add((rid, message))
                out.append(self._error(rid, code, message + "; the block was not scored", step=batch.step))
        return out

    def batch_failed(self, batch: pb.ActivationBatch, err: BaseException) -> list[pb.SessionResponse]:
        """A batch that failed as a whole: INTERNAL for every request in it, then its
        ack, so the engine knows exactly which requests' rows of that step went unscored."""
        message = f"batch: internal error: {type(err).__name__}: {err}; the batch was not scored"
        out = [self._error(rid, "INTERNAL", message, step=batch.step)
               for rid in sorted({r for r in batch.request_ids if r}) or [""]]
        return out + [pb.SessionResponse(ack=pb.StepAck(step=batch.step))]

    def _error(self, request_id: str, code: str, message: str, probe: str = "", step: int = 0,
               incarnation: int | None = None) -> pb.SessionResponse:
        """incarnation defaults to the running request's of that id (0 if none runs)."""
        if incarnation is None:
            request = self.requests.get(request_id)
            incarnation = request.incarnation if request is not None else 0
        self.metrics.errors.labels(code).inc()
        log.warning("request error", extra={"request_id": request_id, "probe": probe, "code": code,
                                            "step": step, "error": message})
        return error(request_id, code, message, probe, incarnation=incarnation, step=step)


def _sharing_an_order(parts: Iterable[_Gathered]) -> list[list[_Gathered]]:
    """The probes' gathered rows grouped by what orders them: probes that read the
    same rows (the same blocks through the same masks) under one token selector."""
    groups: dict[tuple, list[_Gathered]] = {}
    for part in parts:
        groups.setdefault((tuple(part.sources), part.probe.manifest.tokens), []).append(part)
    return list(groups.values())


def _joined(arrays: list[np.ndarray]) -> np.ndarray:
    """The arrays end to end; the one array itself when there is one (every batch
    flushes with no scores interval; a group of one block)."""
    return arrays[0] if len(arrays) == 1 else np.concatenate(arrays)


def _block_request_ids(batch: pb.ActivationBatch, i: int) -> list[str]:
    """The requests blocks[i] names through valid request_index entries."""
    count = len(batch.request_ids)
    return [batch.request_ids[j] for j in set(batch.blocks[i].request_index) if j < count]

