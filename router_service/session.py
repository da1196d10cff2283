"""One engine session's requests and their probe state, without gRPC.

The servicer feeds each SessionRequest to `SessionState` and sends back the
RouterMessages it returns, in order. For a batch that order is: scores, then at
most one abort per request, then the StepAck, so every verdict caused by step N
precedes ack N. A bad record yields an in-band RequestError naming the field;
the rest of the batch is still scored.

Every RequestError about a request echoes the incarnation its request_start
gave, and every error about a batch's rows names the batch `step`: the engine
then knows which of that step's rows went unscored although the step is acked.

A binding fires once per request, at the first row its rule fires on: that is
its verdict, which the verdict log (when the router keeps one) records, with
the input rows when it is the request's abort. A shadow binding (a shadow
version beside a serving one, router_service.rollout) is a silent column: it
scores and fires like any binding but sends nothing, and at the request's end
its verdict is compared with the serving binding's.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from common import tensor_codec
from common.activations import BatchDecodeError, BatchReader, Block
from common.enum_checks import unknown_enum
from common.errors import UndercurrentError, status_code_value
from router_service import rollout
from router_service.binding_grid import BindingGrid
from router_service.metrics import RouterMetrics
from common.probe_format.probes import Probe, ProjectionPlan, first_firing_segments
from router_service.registry import ProbeRegistry
from common.verdict_log import records
from router_service.verdict_log import VerdictLog
from undercurrent.v1 import router_session_pb2 as session_pb
from undercurrent.v1 import types_pb2 as types_pb

log = logging.getLogger(__name__)

# Remembered so a record that arrives after request_end, or after a refused
# request_start, gets a precise error naming the run.
ENDED_REQUESTS_REMEMBERED = 4096
PLAN_CACHE_SIZE = 64
DEFAULT_MAX_REQUESTS_PER_SESSION = 4096


@dataclass
class RequestState:
    """A request and its bindings: each binding is a cell of the session's
    BindingGrid (the request's row, the probe's column), and what a binding keeps
    besides lives in dicts by column that hold entries only for the bindings that
    need one.

    A request_start may bind a thousand probes, and every Python object a
    binding held was one more for the cyclic garbage collector to walk, at every
    full collection, on the event loop, while the request lived (most of a
    start's cost, and pauses of about 100 ms with 200 such requests open,
    measured). A dict of ints only is not walked at all."""

    request_id: str
    prompt_tokens: int
    row: int  # its row in the session's BindingGrid
    orders: dict[int, int]  # grid column -> its binding's place in request_start (breaks ties between aborts)
    incarnation: int = 0  # echoed on every message about this request
    caller: str = ""
    aborted: bool = False
    canaries: frozenset[int] = frozenset()  # grid columns bound as a canary version
    shadows: dict[int, int] = field(default_factory=dict)  # a shadow's grid column -> its serving binding's
    # A shadow's grid column -> [rows both scored, sum of score deltas, largest |delta|]
    shadow_deltas: dict[int, list] = field(default_factory=dict)
    trajectories: dict[int, list] = field(default_factory=dict)  # column -> a stateful probe's state
    pending: dict[int, tuple[list[int], list[float]]] = field(default_factory=dict)  # column -> scores not sent
    scores_sent: dict[int, float] = field(default_factory=dict)  # column -> when its scores last went out


@dataclass
class _Firing:
    """A binding's rule fired for the first time on its request, at this row."""

    slot: int
    column: int
    position: int
    layer: int
    score: float


@dataclass
class _BoundProbe:
    """A probe bound by some request of the session: its column in the BindingGrid."""

    column: int
    bindings: int = 0


class _SlotTable:
    """A batch's request_ids resolved against this session: per slot its request,
    grid row (-1: unknown request) and prompt length. Consecutive decode steps
    send the same request_ids, so one table serves batch after batch until the ids
    or the session's requests change."""

    def __init__(self, ids: tuple[str, ...], requests: list[RequestState | None]):
        first: dict[str, int] = {}
        # A request named again later in request_ids: that slot is refused (its
        # rows would update the request's rule state twice in one batch).
        self.repeated = {j: first[rid] for j, rid in enumerate(ids) if first.setdefault(rid, j) != j}
        self.requests = requests = [None if j in self.repeated else r for j, r in enumerate(requests)]
        self.known = np.array([r is not None for r in requests], dtype=bool)
        self.rows = np.array([r.row if r else -1 for r in requests], dtype=np.int64)
        self.prompt_tokens = np.array([r.prompt_tokens if r else 0 for r in requests], dtype=np.int64)


@dataclass
class _Rows:
    """The rows some probes read in one batch: those of a group of blocks that the
    same probes read, through one mask. Probes whose rows are the same _Rows, under
    one token selector, are ordered and scored together."""

    slots: np.ndarray  # index into batch.request_ids
    positions: np.ndarray
    layers: np.ndarray
    values: np.ndarray  # [rows, plan.width]: the form values of every probe of the plan
    plan: ProjectionPlan
    plan_columns: np.ndarray  # the grid columns of plan.probes (ascending)
    columns: np.ndarray  # the grid columns of the probes that read these rows (ascending)


@dataclass
class _Checked:
    """A block whose fields passed the checks, its rows still as they came (bfloat16
    as bits); `usable` excludes rows of unknown requests and bad positions."""

    index: int
    where: str  # "blocks[i] (point@layer)", for errors
    block: Block
    slots: np.ndarray  # each row's index into batch.request_ids
    usable: np.ndarray
    readers: np.ndarray  # grid columns of the session's probes that read its (tensor type, layer)


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
    def of(cls, parts: list[_Rows], tokens, prompt_tokens: np.ndarray) -> "_Order":
        slots, positions, layers = (_joined([getattr(part, name) for part in parts])
                                    for name in ("slots", "positions", "layers"))
        forward = np.lexsort((layers, positions, slots))  # per request: (token_position, layer)
        selected = forward[tokens.mask(positions[forward], prompt_tokens[slots[forward]])]
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
    column: int  # the binding's grid column
    order: int  # the binding's place in request_start
    score: float

    def key(self) -> tuple[int, int, int]:
        return (self.position, self.layer, self.order)


def error(request_id: str, code: str, message: str, probe: str = "", incarnation: int = 0,
          step: int = 0) -> session_pb.SessionResponse:
    """An in-band RequestError; code is a gRPC status-code name such as "INVALID_ARGUMENT"."""
    return session_pb.SessionResponse(
        error=session_pb.RequestError(
            request_id=request_id, probe=probe, code=status_code_value(code), message=message,
            incarnation=incarnation, step=step,
        )
    )


class SessionState:
    def __init__(
        self,
        registry: ProbeRegistry,
        model: types_pb.ModelInfo,
        metrics: RouterMetrics,
        scores_interval: float = 0.0,
        draining: Callable[[], bool] = lambda: False,
        clock: Callable[[], float] = time.monotonic,
        max_requests: int = DEFAULT_MAX_REQUESTS_PER_SESSION,
        verdict_log: VerdictLog | None = None,
        router_id: str = "",
    ):
        self.registry = registry
        self.model = model
        self.metrics = metrics
        self.scores_interval = scores_interval
        self.draining = draining
        self.clock = clock
        self.max_requests = max_requests
        self.verdict_log = verdict_log
        self.router_id = router_id
        self.requests: dict[str, RequestState] = {}
        self._grid = BindingGrid()
        # (id(probe), silent) -> its grid column: a version bound as a shadow has a
        # column of its own, apart from the one it has once promoted.
        self._bound: dict[tuple[int, bool], _BoundProbe] = {}
        # Per (tensor type, layer): the grid columns of the bound probes that read it.
        self._readers: dict[tuple[int, int], np.ndarray] = {}
        self._ended: OrderedDict[str, int] = OrderedDict()  # request id -> its last incarnation
        # Request ids whose request_start was refused -> that start's incarnation: errors
        # about their rows echo it, so the engine knows which run they concern.
        self._refused: OrderedDict[str, int] = OrderedDict()
        self._reported_incompatible: set[tuple[str, str]] = set()
        self._plans: OrderedDict[bytes, ProjectionPlan] = OrderedDict()  # by grid columns
        # The last batch's request_ids and their _SlotTable; cleared whenever a
        # request comes or goes.
        self._slot_table: tuple[tuple[str, ...], _SlotTable] | None = None

    # -- catalog ------------------------------------------------------------

    def catalog(self) -> tuple[list[types_pb.ProbeInfo], list[session_pb.SessionResponse]]:
        """The probes this engine can use (each serving version with its canary,
        which reads the same rows), and an error for each newly seen one it cannot."""
        infos, errors = [], []
        for probe in self.registry.probes():
            reason = probe.manifest.incompatibility(self.model)
            if reason is None:
                infos.append(self.registry.catalog_info(probe))
                continue
            key = (probe.name, probe.manifest.version)
            if key not in self._reported_incompatible:
                self._reported_incompatible.add(key)
                log.warning("probe incompatible with engine model", extra={"probe": probe.name,
                            "reason": reason})
                errors.append(self._error("", "FAILED_PRECONDITION", reason, probe.name))
        return infos, errors

    # -- request lifecycle --------------------------------------------------

    def start(self, msg: session_pb.RequestStart) -> list[session_pb.SessionResponse]:
        rid, incarnation = msg.request_id, msg.incarnation

        def refuse(code: str, message: str, probe: str = "") -> session_pb.SessionResponse:
            return self._error(rid, code, message, probe, incarnation=incarnation)

        def refuse_request(code: str, message: str) -> list[session_pb.SessionResponse]:
            self._remember(self._refused, rid, incarnation)
            return [refuse(code, message)]

        if not rid:
            return [refuse("INVALID_ARGUMENT", "request_start.request_id is empty")]
        if rid in self.requests:
            return [refuse("ALREADY_EXISTS", f"request_start: request {rid!r} already started")]
        if self.draining():
            return refuse_request("UNAVAILABLE", "router is draining; send the request elsewhere")
        if len(self.requests) >= self.max_requests:
            return refuse_request("RESOURCE_EXHAUSTED",
                                  f"request_start: this session already runs {len(self.requests)} requests, "
                                  f"the router's --max-requests-per-session")
        if msg.prompt_tokens < 0:
            return refuse_request("INVALID_ARGUMENT",
                                  f"request_start.prompt_tokens {msg.prompt_tokens} is negative")
        out: list[session_pb.SessionResponse] = []
        orders: dict[int, int] = {}  # grid column -> place, in binding order
        trajectories: dict[int, list] = {}
        names: set[str] = set()
        aborts: list[bool] = []  # per column of orders: the grid cells are written at once
        canaries: set[int] = set()
        shadows: dict[int, int] = {}
        row = self._grid.add_request()
        for i, wanted in enumerate(msg.bindings):
            name = wanted.probe  # read once: each read of a message's string field makes a new str
            if bad := unknown_enum(wanted):  # its path is built for the error only
                out.append(refuse("INVALID_ARGUMENT", f"request_start.bindings[{i}].{bad}", name))
                continue
            if name in names:
                out.append(refuse("INVALID_ARGUMENT",
                                  f"request_start.bindings[{i}]: probe {name!r} bound twice", name))
                continue
            try:
                bound = self.registry.bind(name, wanted.digest)
            except UndercurrentError as err:
                out.append(refuse(err.code.name, f"request_start.bindings[{i}]: {err}", name))
                continue
            probe = bound.probe
            # A probe some request of the session binds was checked against the model then
            # (a shadow reads what its serving version reads).
            if (id(probe), False) not in self._bound and (reason := probe.manifest.incompatibility(self.model)):
                for held in (probe, bound.shadow):
                    if held is not None:
                        self.registry.release(held)
                out.append(refuse("FAILED_PRECONDITION", f"request_start.bindings[{i}]: {reason}", name))
                continue
            names.add(name)
            action = wanted.action or probe.manifest.action  # PROBE_ACTION_UNSPECIFIED is 0
            column = self._column(probe)
            orders[column] = len(orders)
            aborts.append(action == types_pb.PROBE_ACTION_ABORT)
            if bound.role == rollout.CANARY:
                canaries.add(column)
            if (trajectory := probe.new_state()) is not None:
                trajectories[column] = trajectory
            if bound.shadow is not None:
                shadow = self._column(bound.shadow, silent=True)
                shadows[shadow] = column
                self._grid.paired[[shadow, column]] = True
                orders[shadow] = len(orders)
                aborts.append(False)
                if (trajectory := bound.shadow.new_state()) is not None:
                    trajectories[shadow] = trajectory
        self._grid.bind(row, list(orders), aborts)
        self.requests[rid] = RequestState(rid, msg.prompt_tokens, row, orders, incarnation, caller=msg.caller,
                                          canaries=frozenset(canaries), shadows=shadows,
                                          trajectories=trajectories)
        self._slot_table = None
        self._ended.pop(rid, None)
        self._refused.pop(rid, None)
        self.metrics.live_requests.inc()
        return out

    def end(self, msg: session_pb.RequestEnd) -> list[session_pb.SessionResponse]:
        request = self.requests.get(msg.request_id)
        if request is None or request.incarnation != msg.incarnation:
            return [self._error(msg.request_id, "NOT_FOUND",
                                f"request_end: request {msg.request_id!r} incarnation {msg.incarnation} "
                                "is not running on this session", incarnation=msg.incarnation)]
        del self.requests[msg.request_id]
        self._slot_table = None
        out = [m for column in list(request.pending) if (m := self._flush_scores(request, column, force=True))]
        self._compare_shadows(request)
        self._free(request)
        self._remember(self._ended, msg.request_id, request.incarnation)
        return out

    @staticmethod
    def _remember(requests: OrderedDict[str, int], request_id: str, incarnation: int) -> None:
        requests[request_id] = incarnation
        requests.move_to_end(request_id)
        while len(requests) > ENDED_REQUESTS_REMEMBERED:
            requests.popitem(last=False)

    def close(self) -> int:
        """Frees every request of the session (it dropped); returns how many."""
        count = len(self.requests)
        for request in self.requests.values():
            self._compare_shadows(request)
            self._free(request)
        self.requests.clear()
        self._slot_table = None
        return count

    def _free(self, request: RequestState) -> None:
        for column in list(request.orders):
            self._unbind(request, column)
        self._grid.release_request(request.row)
        self.metrics.live_requests.dec()

    def _compare_shadows(self, request: RequestState) -> None:
        """Counts whether each shadow of the request reached the verdict its serving binding did."""
        grid = self._grid
        for shadow, serving in request.shadows.items():
            outcome = rollout.Outcome(bool(grid.fired[request.row, serving]), bool(grid.fired[request.row, shadow]))
            probe = grid.probes[shadow]
            self.metrics.agreement.outcome(probe.name, probe.manifest.version, outcome)
            if self.verdict_log is not None:
                rows, total, largest = request.shadow_deltas.get(shadow, (0, 0.0, 0.0))
                self.verdict_log.submit(records.ShadowOutcome(
                    time.time(), request.request_id, request.caller, probe.name,
                    grid.probes[serving].manifest.version, probe.manifest.version, outcome.serving_fired,
                    outcome.shadow_fired, self.router_id, rows, total, largest))

    def _column(self, probe: Probe, silent: bool = False) -> int:
        """The probe's grid column, made when a request of the session first binds it."""
        key = (id(probe), silent)
        bound = self._bound.get(key)
        if bound is None:
            bound = self._bound[key] = _BoundProbe(
                self._grid.add_probe(probe, self.metrics.probes.slot(probe.name), silent))
            self._readers.clear()
        bound.bindings += 1
        return bound.column

    def _unbind(self, request: RequestState, column: int) -> None:
        probe = self._grid.probes[column]
        del request.orders[column]
        request.trajectories.pop(column, None)
        request.pending.pop(column, None)
        request.scores_sent.pop(column, None)
        if request.shadows:  # a pair that lost either side is no longer compared
            request.shadows = {s: v for s, v in request.shadows.items() if column not in (s, v)}
        self.registry.release(probe)
        key = (id(probe), bool(self._grid.silent[column]))
        bound = self._bound[key]
        self._grid.unbind(request.row, column)
        bound.bindings -= 1
        if bound.bindings == 0:
            del self._bound[key]
            self._grid.release_probe(bound.column)
            self._readers.clear()
            self._plans.clear()  # plans are cached by grid columns, which a new probe may take

    # -- batches ------------------------------------------------------------

    def batch(self, batch: types_pb.ActivationBatch) -> list[session_pb.SessionResponse]:
        started = time.perf_counter()
        out: list[session_pb.SessionResponse] = []
        reported: set[tuple[str, str]] = set()  # (request, problem): one error per batch each
        table = self._slots(batch)
        requests = table.requests
        for j, first in table.repeated.items():
            out += self._repeated_request(batch, j, first)
        reader = BatchReader(batch, as_float32=False)
        read_alike: dict[tuple, list[_Checked]] = {}
        for i in range(len(batch.blocks)):
            try:
                checked, errors = self._check_block(reader, i, table, reported)
            except Exception as err:  # a bug on one block must not cost the others their scores
                checked, errors = None, self._internal_error(batch, [i], err, reported)
            out += errors
            if checked is not None:
                key = (checked.readers.tobytes(), checked.block.wire_dtype)
                read_alike.setdefault(key, []).append(checked)
        gathered: list[_Rows] = []
        for group in read_alike.values():
            try:
                out += self._gather_group(batch, group, table, gathered, reported)
            except Exception as err:
                out += self._internal_error(batch, [c.index for c in group], err, reported)
        candidates: dict[int, list[_Candidate]] = {}
        firings: list[_Firing] = []
        paired: dict[tuple[int, int], tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        for parts, columns in self._sharing_an_order(gathered):
            out += self._score_group(parts, columns, table, candidates, firings, paired)
        aborted: dict[int, _Candidate] = {}
        for slot, found in candidates.items():
            request = requests[slot]
            if not request.aborted:
                request.aborted = True
                best = aborted[slot] = min(found, key=_Candidate.key)
                out.append(self._abort(request, best.column, best.score, best.position, best.layer))
        if paired:
            self._shadow_deltas(table, paired)
        if firings and self.verdict_log is not None:
            self._log_firings(table, firings, aborted, paired, read_alike)
        out.append(session_pb.SessionResponse(ack=session_pb.StepAck(step=batch.step)))
        self.metrics.batches.inc()
        self.metrics.batch_seconds.observe(time.perf_counter() - started)
        return out

    def _slots(self, batch: types_pb.ActivationBatch) -> _SlotTable:
        ids = tuple(batch.request_ids)
        if self._slot_table is None or self._slot_table[0] != ids:
            self._slot_table = (ids, _SlotTable(ids, [self.requests.get(rid) for rid in ids]))
        return self._slot_table[1]

    def _check_block(
        self, reader: BatchReader, i: int, table: _SlotTable, reported: set[tuple[str, str]],
    ) -> tuple[_Checked | None, list[session_pb.SessionResponse]]:
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
            for j in np.unique(slots[~usable]).tolist():
                if j not in table.repeated:  # refused once for the batch, in batch()
                    out += self._unknown_request(batch.request_ids[j], where, batch.step, reported)
        negative = block.token_positions < 0
        if negative.any():
            out += self._bad_rows(batch, table, where, "with a negative token position", block, slots,
                                  usable & negative, reported)
            usable = usable & ~negative
        # A block no probe reads still has its rows checked (in a group of its own kind).
        return _Checked(i, where, block, slots, usable, self._readers_of(block.tensor_type, block.layer)), out

    def _readers_of(self, tensor_type: int, layer: int) -> np.ndarray:
        readers = self._readers.get((tensor_type, layer))
        if readers is None:
            readers = self._readers[(tensor_type, layer)] = np.array(
                sorted(bound.column for bound in self._bound.values()
                       if self._grid.probes[bound.column].manifest.reads(tensor_type, layer)), dtype=np.int64)
        return readers

    def _gather_group(
        self,
        batch: types_pb.ActivationBatch,
        group: list[_Checked],
        table: _SlotTable,
        gathered: list[_Rows],
        reported: set[tuple[str, str]],
    ) -> list[session_pb.SessionResponse]:
        """Widens, checks and projects the rows of blocks that the same probes read
        in one pass (one matrix product for all of them), and files the usable rows
        once per set of probes that read the same ones."""
        first = group[0]
        slots = _joined([c.slots for c in group])
        usable = _joined([c.usable for c in group])
        # [rows, readers]: which rows each reader reads (its request binds it).
        reads = usable[:, None] & self._grid.bound[np.ix_(np.where(usable, table.rows[slots], 0), first.readers)]
        columns = first.readers[reads.any(axis=0)]
        # A group no probe reads still has its rows checked: an empty plan only checks them.
        plan = self._plan(columns)
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
            reads &= finite[:, None]
        reading = reads.any(axis=0)
        if not reading.any():
            return out
        reads, readers = reads[:, reading], first.readers[reading]
        positions = _joined([c.block.token_positions for c in group])
        layers = np.repeat(np.array([c.block.layer for c in group], dtype=np.int64),
                           [c.block.num_rows for c in group])
        # Readers whose requests bind them all read the same rows: the usual case, one set.
        if (reads == reads[:, :1]).all():
            masks, sets = reads[:, :1].T, np.zeros(readers.size, dtype=np.int64)
        else:
            masks, sets = np.unique(reads.T, axis=0, return_inverse=True)
        for k, mask in enumerate(masks):
            take = slice(None) if mask.all() else mask  # the usual case: views, no copies through a mask
            gathered.append(_Rows(slots[take], positions[take], layers[take], values[take], plan, columns,
                                  readers[sets.reshape(-1) == k]))
        return out

    def _sharing_an_order(self, gathered: list[_Rows]) -> list[tuple[list[_Rows], np.ndarray]]:
        """The gathered rows grouped by what orders them: each set of probes (grid
        columns, ascending) that read the same _Rows under one token selector, with
        those _Rows."""
        if not gathered:
            return []
        grid = self._grid
        if len(gathered) == 1:
            member = np.ones((gathered[0].columns.size, 1), dtype=np.int64)
            columns = gathered[0].columns
        else:
            columns = np.unique(np.concatenate([rows.columns for rows in gathered]))
            member = np.zeros((columns.size, len(gathered)), dtype=np.int64)
            for k, rows in enumerate(gathered):
                member[np.searchsorted(columns, rows.columns), k] = 1
        keys, sets = np.unique(np.column_stack([grid.selector[columns], member]), axis=0, return_inverse=True)
        sets = sets.reshape(-1)
        return [([gathered[k] for k in np.flatnonzero(key[1:])], columns[sets == j]) for j, key in enumerate(keys)]

    def _shadow_deltas(self, table: _SlotTable,
                       paired: dict[tuple[int, int], tuple[np.ndarray, np.ndarray, np.ndarray]]) -> None:
        """Each shadow's score minus its serving binding's, on the rows both scored in the batch."""
        grid = self._grid
        for slot in {slot for slot, _ in paired}:
            request = table.requests[slot]
            for shadow, serving in request.shadows.items():
                if (mine := paired.get((slot, shadow))) and (theirs := paired.get((slot, serving))):
                    probe = grid.probes[shadow]
                    deltas = rollout.paired_deltas(theirs, mine)
                    if deltas.size:
                        self.metrics.agreement.deltas(probe.name, probe.manifest.version, deltas)
                        kept = request.shadow_deltas.setdefault(shadow, [0, 0.0, 0.0])
                        kept[0] += int(deltas.size)
                        kept[1] += float(deltas.sum())
                        kept[2] = max(kept[2], float(np.abs(deltas).max()))

    def _log_firings(self, table: _SlotTable, firings: list[_Firing], aborted: dict[int, _Candidate],
                     paired: dict[tuple[int, int], tuple[np.ndarray, np.ndarray, np.ndarray]],
                     read_alike: dict[tuple, list[_Checked]]) -> None:
        """One verdict record per binding that fired in the batch; the abort's with its input rows."""
        grid, now = self._grid, time.time()
        for firing in firings:
            request, column = table.requests[firing.slot], firing.column
            probe = grid.probes[column]
            best = aborted.get(firing.slot)
            reference, rows, keys = None, None, ([], [])
            if grid.silent[column]:
                kind, role = records.SHADOW, rollout.SHADOW
                serving = request.shadows.get(column)  # None once a forced unload took the serving binding
                reference = None if serving is None else _score_at(paired.get((firing.slot, serving)), firing)
            else:
                kind = records.ABORT if best is not None and best.column == column else records.VERDICT
                role = rollout.CANARY if column in request.canaries else rollout.SERVING
                if kind == records.ABORT:
                    rows, keys = _input_rows(read_alike, probe, firing, self.verdict_log.max_rows)
            self.verdict_log.submit(records.VerdictRecord(
                kind, request.request_id, request.caller, probe.name, probe.manifest.version, probe.digest,
                rollout.ROLE_NAMES[role], firing.layer, firing.position, firing.score, probe.manifest.threshold,
                self.router_id, now, reference, rows, keys[0], keys[1],
                probe_version=records.ProbeVersion.of(probe)))

    def _score_group(
        self, parts: list[_Rows], columns: np.ndarray, table: _SlotTable, candidates: dict[int, list[_Candidate]],
        firings: list[_Firing], paired: dict[tuple[int, int], tuple[np.ndarray, np.ndarray, np.ndarray]],
    ) -> list[session_pb.SessionResponse]:
        """Scores probes (grid columns) that read the same rows under one token
        selector, over all their requests' rows: one forward order, one matrix of
        scores and one run of the decision rule for all of them. Files abort
        candidates, first firings, and the scores of bindings paired with a
        shadow (by slot and column); returns scores."""
        started = time.perf_counter()
        grid = self._grid
        probes = [grid.probes[c] for c in columns.tolist()]
        order = _Order.of(parts, probes[0].manifest.tokens, table.prompt_tokens)
        if order.selected.size == 0:
            self.metrics.probes.record(grid.metric_slot[columns], 0, time.perf_counter() - started)
            return []
        positions, layers, starts, ends = order.positions, order.layers, order.starts, order.ends
        segment_slots = order.slots[starts]
        scores = self._scores(parts, columns, probes, order, table, segment_slots)
        cells = np.ix_(table.rows[segment_slots], columns)
        seen, streak, abort = grid.seen[cells], grid.streak[cells], grid.abort[cells]
        hits = first_firing_segments(scores, starts, grid.threshold[columns], grid.min_tokens[columns],
                                     grid.patience[columns], seen, streak)
        grid.seen[cells], grid.streak[cells] = seen, streak
        column_list = columns.tolist()
        for k, j in zip(*(index.tolist() for index in np.nonzero(abort & (hits >= 0)))):
            hit, slot, column = hits[k, j], int(segment_slots[k]), column_list[j]
            candidates.setdefault(slot, []).append(_Candidate(
                int(positions[hit]), int(layers[hit]), column, table.requests[slot].orders[column],
                float(scores[hit, j])))
        fired = grid.fired[cells]
        first = (hits >= 0) & ~fired
        if first.any():
            grid.fired[cells] = fired | first
            for k, j in zip(*(index.tolist() for index in np.nonzero(first))):
                hit = hits[k, j]
                firings.append(_Firing(int(segment_slots[k]), column_list[j], int(positions[hit]),
                                       int(layers[hit]), float(scores[hit, j])))
        if grid.paired[columns].any():
            for j in np.flatnonzero(grid.paired[columns]).tolist():
                for k, (a, b) in enumerate(zip(starts.tolist(), ends.tolist())):
                    paired[(int(segment_slots[k]), column_list[j])] = (positions[a:b], layers[a:b], scores[a:b, j])
        out = []
        observed = np.nonzero(~abort.T & ~grid.silent[columns][:, None])  # probe by probe; shadows send nothing
        if observed[0].size:
            # One message per observe binding and batch: as Python lists, a request's
            # scores are a slice each; numpy would cost a slice and a tolist() per message.
            slots, position_list = segment_slots.tolist(), positions.tolist()
            bounds = list(zip(starts.tolist(), ends.tolist()))
            probe_scores: dict[int, list[float]] = {}
            for j, k in zip(*(index.tolist() for index in observed)):
                request, column = table.requests[slots[k]], column_list[j]
                if (of_probe := probe_scores.get(j)) is None:
                    of_probe = probe_scores[j] = scores[:, j].tolist()
                first, last = bounds[k]
                if (pending := request.pending.get(column)) is None:
                    request.pending[column] = (position_list[first:last], of_probe[first:last])
                else:
                    pending[0].extend(position_list[first:last])
                    pending[1].extend(of_probe[first:last])
                if message := self._flush_scores(request, column, force=False):
                    out.append(message)
        self.metrics.probes.record(grid.metric_slot[columns], order.selected.size,
                                   (time.perf_counter() - started) / columns.size)
        return out

    def _scores(self, parts: list[_Rows], columns: np.ndarray, probes: list[Probe], order: _Order,
                table: _SlotTable, segment_slots: np.ndarray) -> np.ndarray:
        """The probes' scores of the ordered rows: [rows, probes] float64. Probes
        whose score is their one form's value take it from the plans' values in one
        indexing for all of them; the others score probe by probe."""
        def values(plan_columns: list[np.ndarray | slice]) -> np.ndarray:
            """The ordered rows' values in these plan columns (one entry per part)."""
            return _joined([part.values[:, taken] for part, taken in zip(parts, plan_columns)])[order.selected]

        def first_columns(of: np.ndarray) -> list[np.ndarray]:
            return [part.plan.first_columns[np.searchsorted(part.plan_columns, of)] for part in parts]

        direct = self._grid.direct[columns]
        if direct.all():
            return values(first_columns(columns))
        scores = np.empty((order.selected.size, columns.size), dtype=np.float64)
        if direct.any():
            scores[:, direct] = values(first_columns(columns[direct]))
        for j in np.flatnonzero(~direct).tolist():
            probe, column = probes[j], int(columns[j])
            probe_values = values([part.plan.columns[id(probe)] for part in parts])
            if probe.stateless:
                scores[:, j] = probe.score(probe_values, None)
            else:
                scores[:, j] = np.concatenate([
                    probe.score(probe_values[a:b], table.requests[slot].trajectories[column])
                    for a, b, slot in zip(order.starts, order.ends, segment_slots.tolist())])
        return scores

    def _abort(self, request: RequestState, column: int, score: float, position: int,
               layer: int) -> session_pb.SessionResponse:
        m = self._grid.probes[column].manifest
        reason = (
            f"probe {m.name!r} (version {m.version}) scored {score:.4g} >= threshold {m.threshold:g} "
            f"at token {position}, layer {layer} (patience {m.patience}, min_tokens {m.min_tokens})"
        )
        self.metrics.aborts.labels(m.name).inc()
        log.info("abort", extra={"request_id": request.request_id, "probe": m.name, "score": score,
                                 "token_position": position})
        return session_pb.SessionResponse(abort=session_pb.SessionAbort(
            verdict=types_pb.Verdict(request_id=request.request_id, probe=m.name, score=score,
                                     token_position=position, reason=reason),
            incarnation=request.incarnation))

    def _flush_scores(self, request: RequestState, column: int, force: bool) -> session_pb.SessionResponse | None:
        """The binding's scores not sent yet, as one message, unless --scores-interval
        holds them back (`force`: at the request's end)."""
        pending = request.pending.get(column)
        if pending is None or not pending[1]:
            return None
        if self.scores_interval:
            now = self.clock()
            if not force and now - request.scores_sent.get(column, float("-inf")) < self.scores_interval:
                return None
            request.scores_sent[column] = now
        positions, scores = request.pending.pop(column)
        # Filled in place: building a ProbeScores and then the response copies it.
        response = session_pb.SessionResponse()
        response.scores.incarnation = request.incarnation
        message = response.scores.probe_scores
        message.request_id = request.request_id
        message.probe = self._grid.probes[column].name
        message.token_positions.extend(positions)
        message.scores.extend(scores)
        return response

    # -- helpers ------------------------------------------------------------

    def detach_retired(self) -> list[session_pb.SessionResponse]:
        """Drops bindings of probes unloaded by force; tells each request once. A
        shadow column goes silently: the engine has no binding of it (a shadow
        promoted to serving, then unloaded by force, leaves the requests it
        shadowed their serving binding).

        Call it before `batch`, on the thread that owns the registry."""
        out = []
        if not any(self._grid.probes[bound.column].retired for bound in self._bound.values()):
            return out  # the usual case, checked per probe rather than per binding
        for request in self.requests.values():
            for column in [c for c in request.orders if self._grid.probes[c].retired]:
                name, silent = self._grid.probes[column].name, bool(self._grid.silent[column])
                self._unbind(request, column)
                if not silent:
                    out.append(self._error(
                        request.request_id, "NOT_FOUND",
                        f"probe {name!r} was unloaded by force; it no longer scores this request", name))
        return out

    def _plan(self, columns: np.ndarray) -> ProjectionPlan:
        """The plan of the probes at these grid columns (ascending), cached until a
        column changes hands."""
        key = columns.tobytes()
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = ProjectionPlan(tuple(self._grid.probes[c] for c in columns.tolist()))
            if len(self._plans) > PLAN_CACHE_SIZE:
                self._plans.popitem(last=False)
        else:
            self._plans.move_to_end(key)
        return plan

    def _repeated_request(self, batch: types_pb.ActivationBatch, j: int, first: int) -> list[session_pb.SessionResponse]:
        rid = batch.request_ids[j]
        return [self._error(rid, "INVALID_ARGUMENT",
                            f"batch.request_ids[{j}]: request {rid!r} is named again (first at [{first}]); "
                            f"the rows naming [{j}] were not scored", step=batch.step)]

    def _unknown_request(self, rid: str, where: str, step: int,
                         reported: set[tuple[str, str]]) -> list[session_pb.SessionResponse]:
        if (rid, "unknown") in reported:
            return []
        reported.add((rid, "unknown"))
        if rid in self._ended:
            return [self._error(rid, "FAILED_PRECONDITION",
                                f"{where}: records for request {rid!r} after its request_end; not scored",
                                step=step, incarnation=self._ended[rid])]
        if rid in self._refused:
            return [self._error(rid, "FAILED_PRECONDITION",
                                f"{where}: records for request {rid!r}, whose request_start this session "
                                "refused; not scored", step=step, incarnation=self._refused[rid])]
        return [self._error(rid, "NOT_FOUND",
                            f"{where}: request {rid!r} was never started on this session "
                            "(no request_start); its records were not scored", step=step)]

    def _bad_rows(self, batch: types_pb.ActivationBatch, table: _SlotTable, where: str, problem: str, block: Block,
                  slots: np.ndarray, bad: np.ndarray, reported: set[tuple[str, str]]) -> list[session_pb.SessionResponse]:
        """An error per request with `bad` rows (of known requests) in the block."""
        out = []
        for j in np.unique(slots[bad]):
            out += self._rows_error(batch, table.requests[j], where, problem,
                                    block.token_positions[(slots == j) & bad], reported)
        return out

    def _internal_error(self, batch: types_pb.ActivationBatch, blocks: list[int], err: Exception,
                        reported: set[tuple[str, str]]) -> list[session_pb.SessionResponse]:
        """A bug while reading some blocks: INTERNAL for their requests; the other blocks are still scored."""
        log.exception("blocks failed", extra={"step": batch.step, "blocks": blocks})
        out = []
        for i in blocks:
            out += self._block_error(batch, _block_request_ids(batch, i), "INTERNAL",
                                     f"blocks[{i}]: internal error: {type(err).__name__}: {err}", reported)
        return out

    def _rows_error(self, batch: types_pb.ActivationBatch, request: RequestState, where: str, problem: str,
                    positions: np.ndarray, reported: set[tuple[str, str]]) -> list[session_pb.SessionResponse]:
        """One error per request and problem per batch, naming the first bad positions."""
        if (request.request_id, problem) in reported:
            return []
        reported.add((request.request_id, problem))
        return [self._error(
            request.request_id, "INVALID_ARGUMENT",
            f"{where}.rows: {positions.size} row(s) {problem} at token_positions {positions.tolist()[:8]}; "
            "those rows were not scored", step=batch.step)]

    def _block_error(self, batch: types_pb.ActivationBatch, request_ids: list[str], code: str, message: str,
                     reported: set[tuple[str, str]]) -> list[session_pb.SessionResponse]:
        """One error per request that had rows in the block (every request of the
        batch when the block names none it can be matched to)."""
        named = {r for r in request_ids if r} or {r for r in batch.request_ids if r}
        out = []
        for rid in sorted(named) or [""]:
            if (rid, message) not in reported:
                reported.add((rid, message))
                out.append(self._error(rid, code, message + "; the block was not scored", step=batch.step))
        return out

    def batch_failed(self, batch: types_pb.ActivationBatch, err: BaseException) -> list[session_pb.SessionResponse]:
        """A batch that failed as a whole: INTERNAL for every request in it, then its
        ack, so the engine knows exactly which requests' rows of that step went unscored."""
        message = f"batch: internal error: {type(err).__name__}: {err}; the batch was not scored"
        out = [self._error(rid, "INTERNAL", message, step=batch.step)
               for rid in sorted({r for r in batch.request_ids if r}) or [""]]
        return out + [session_pb.SessionResponse(ack=session_pb.StepAck(step=batch.step))]

    def _error(self, request_id: str, code: str, message: str, probe: str = "", step: int = 0,
               incarnation: int | None = None) -> session_pb.SessionResponse:
        """incarnation defaults to the running request's of that id (0 if none runs)."""
        if incarnation is None:
            request = self.requests.get(request_id)
            incarnation = request.incarnation if request is not None else 0
        self.metrics.errors.labels(code).inc()
        log.warning("request error", extra={"request_id": request_id, "probe": probe, "code": code,
                                            "step": step, "error": message})
        return error(request_id, code, message, probe, incarnation=incarnation, step=step)


def _score_at(scored: tuple[np.ndarray, np.ndarray, np.ndarray] | None, firing: _Firing) -> float | None:
    """The score at the firing's row among a binding's scored rows (None: it did not score it)."""
    if scored is None:
        return None
    at = np.flatnonzero((scored[0] == firing.position) & (scored[1] == firing.layer))
    return float(scored[2][at[0]]) if at.size else None


def _input_rows(read_alike: dict[tuple, list[_Checked]], probe: Probe, firing: _Firing,
                max_rows: int) -> tuple[np.ndarray | None, tuple[list[int], list[int]]]:
    """The rows the probe read at the firing's token position, float32 and in
    layer order (the firing row first kept when there are more than max_rows)."""
    manifest, found = probe.manifest, []
    for group in read_alike.values():
        for checked in group:
            block = checked.block
            if block.tensor_type != manifest.tensor_type or not manifest.reads(block.tensor_type, block.layer):
                continue
            at = np.flatnonzero(checked.usable & (checked.slots == firing.slot)
                                & (block.token_positions == firing.position))
            if at.size:
                found.append((block.layer != firing.layer, block.layer,
                              tensor_codec.to_float32(block.rows[at[:1]], block.wire_dtype or "float32")))
    found.sort(key=lambda f: f[:2])
    found = found[:max_rows]
    if not found:
        return None, ([], [])
    rows = np.concatenate([f[2] for f in found]).astype(np.float32)
    return rows, ([firing.position] * len(found), [f[1] for f in found])


def _joined(arrays: list[np.ndarray]) -> np.ndarray:
    """The arrays end to end; the one array itself when there is one (every batch
    flushes with no scores interval; a group of one block)."""
    return arrays[0] if len(arrays) == 1 else np.concatenate(arrays)


def _block_request_ids(batch: types_pb.ActivationBatch, i: int) -> list[str]:
    """The requests blocks[i] names through valid request_index entries."""
    count = len(batch.request_ids)
    return [batch.request_ids[j] for j in set(batch.blocks[i].request_index) if j < count]

