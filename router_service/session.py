"""One engine session's requests and their probe state, without gRPC.

The servicer feeds each EngineMessage to `SessionState` and sends back the
RouterMessages it returns, in order. For a batch that order is: scores, then at
most one abort per request, then the StepAck, so every verdict caused by step N
precedes ack N. A bad record yields an in-band RequestError naming the field;
the rest of the batch is still scored.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from common.activations import BatchDecodeError, decode_block
from common.errors import UndercurrentError
from router_service.metrics import RouterMetrics
from router_service.probes import Probe, ProjectionPlan, RuleState, first_firing
from router_service.registry import ProbeRegistry
from undercurrent.v1 import undercurrent_pb2 as pb

log = logging.getLogger(__name__)

# Remembered so a record that arrives after request_end gets a precise error.
ENDED_REQUESTS_REMEMBERED = 4096
PLAN_CACHE_SIZE = 64


@dataclass
class Binding:
    probe: Probe
    action: int  # pb.OBSERVE or pb.ABORT
    state: list = field(default_factory=list)
    rule: RuleState = field(default_factory=RuleState)
    pending_positions: list[np.ndarray] = field(default_factory=list)
    pending_scores: list[np.ndarray] = field(default_factory=list)
    last_scores_sent: float = float("-inf")


@dataclass
class RequestState:
    request_id: str
    prompt_length: int
    bindings: list[Binding]
    aborted: bool = False


@dataclass
class _Rows:
    """The rows of one request that one binding reads in one batch, in arrival order."""

    positions: list[np.ndarray] = field(default_factory=list)
    layers: list[np.ndarray] = field(default_factory=list)
    generated: list[np.ndarray] = field(default_factory=list)
    values: list[np.ndarray] = field(default_factory=list)


def error(request_id: str, code: str, message: str, probe: str = "") -> pb.RouterMessage:
    return pb.RouterMessage(
        error=pb.RequestError(request_id=request_id, probe=probe, code=code, message=message)
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
    ):
        self.registry = registry
        self.model = model
        self.metrics = metrics
        self.scores_interval = scores_interval
        self.draining = draining
        self.clock = clock
        self.requests: dict[str, RequestState] = {}
        self._ended: OrderedDict[str, None] = OrderedDict()
        self._reported_incompatible: set[tuple[str, str]] = set()
        self._plans: OrderedDict[tuple[int, ...], ProjectionPlan] = OrderedDict()

    # -- catalog ------------------------------------------------------------

    def catalog(self) -> tuple[list[pb.ProbeInfo], list[pb.RouterMessage]]:
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

    def start(self, msg: pb.RequestStart) -> list[pb.RouterMessage]:
        rid = msg.request_id
        if not rid:
            return [self._error("", "INVALID_ARGUMENT", "request_start.request_id is empty")]
        if self.draining():
            return [self._error(rid, "UNAVAILABLE", "router is draining; send the request elsewhere")]
        if rid in self.requests:
            return [self._error(rid, "ALREADY_EXISTS", f"request_start: request {rid!r} already started")]
        if msg.prompt_length < 0:
            return [self._error(rid, "INVALID_ARGUMENT",
                                f"request_start.prompt_length {msg.prompt_length} is negative")]
        out, bindings, names = [], [], set()
        for i, wanted in enumerate(msg.probes):
            if wanted.probe in names:
                out.append(self._error(rid, "INVALID_ARGUMENT",
                                       f"request_start.probes[{i}]: probe {wanted.probe!r} bound twice",
                                       wanted.probe))
                continue
            try:
                probe = self.registry.bind(wanted.probe)
            except UndercurrentError as err:
                out.append(self._error(rid, err.code.name, f"request_start.probes[{i}]: {err}", wanted.probe))
                continue
            reason = probe.manifest.incompatibility(self.model)
            if reason is not None:
                self.registry.release(probe)
                out.append(self._error(rid, "FAILED_PRECONDITION", f"request_start.probes[{i}]: {reason}",
                                       wanted.probe))
                continue
            names.add(wanted.probe)
            action = wanted.action if wanted.action != pb.PROBE_ACTION_UNSPECIFIED else probe.manifest.action
            bindings.append(Binding(probe, action, probe.new_state()))
        self.requests[rid] = RequestState(rid, msg.prompt_length, bindings)
        self._ended.pop(rid, None)
        self.metrics.live_requests.inc()
        return out

    def end(self, msg: pb.RequestEnd) -> list[pb.RouterMessage]:
        request = self.requests.pop(msg.request_id, None)
        if request is None:
            return [self._error(msg.request_id, "NOT_FOUND",
                                f"request_end: request {msg.request_id!r} is not running on this session")]
        out = [m for b in request.bindings if (m := self._flush_scores(request, b, force=True))]
        self._free(request)
        self._ended[msg.request_id] = None
        while len(self._ended) > ENDED_REQUESTS_REMEMBERED:
            self._ended.popitem(last=False)
        return out

    def close(self) -> int:
        """Frees every request of the session (it dropped); returns how many."""
        count = len(self.requests)
        for request in self.requests.values():
            self._free(request)
        self.requests.clear()
        return count

    def _free(self, request: RequestState) -> None:
        for binding in request.bindings:
            self.registry.release(binding.probe)
        request.bindings.clear()
        self.metrics.live_requests.dec()

    # -- batches ------------------------------------------------------------

    def batch(self, batch: pb.ActivationBatch) -> list[pb.RouterMessage]:
        started = time.perf_counter()
        out: list[pb.RouterMessage] = []
        reported: set[tuple[str, str]] = set()  # (request, problem): one error per batch each
        gathered: dict[tuple[str, int], _Rows] = {}
        for i in range(len(batch.blocks)):
            out += self._gather_block(batch, i, gathered, reported)
        out += self._score(gathered)
        out.append(pb.RouterMessage(ack=pb.StepAck(step=batch.step)))
        self.metrics.batches.inc()
        self.metrics.batch_seconds.observe(time.perf_counter() - started)
        return out

    def _gather_block(
        self, batch: pb.ActivationBatch, i: int, gathered: dict[tuple[str, int], _Rows],
        reported: set[tuple[str, str]],
    ) -> list[pb.RouterMessage]:
        msg = batch.blocks[i]
        where = f"blocks[{i}] ({msg.point}@{msg.layer})"
        self.metrics.bytes.inc(len(msg.rows.data))
        request_ids = [
            batch.request_ids[j] if j < len(batch.request_ids) else "" for j in set(msg.request_index)
        ]
        try:
            block = decode_block(batch, i)
        except BatchDecodeError as err:
            return self._block_error(request_ids, "INVALID_ARGUMENT", str(err), reported)
        self.metrics.rows.inc(block.num_rows)
        if block.num_rows == 0:
            return []
        if block.rows.shape[1] != self.model.hidden_size:
            return self._block_error(
                request_ids, "INVALID_ARGUMENT",
                f"{where}.rows.shape: hidden size {block.rows.shape[1]} does not match the "
                f"model's hidden_size {self.model.hidden_size}", reported,
            )
        out = []
        request_index = np.asarray(msg.request_index, dtype=np.int64)
        finite = np.isfinite(block.rows).all(axis=1)
        order = np.argsort(request_index, kind="stable")
        indexes, starts = np.unique(request_index[order], return_index=True)
        readers: dict[int, Probe] = {}
        segments = []
        for j, start, stop in zip(indexes, starts, [*starts[1:], len(order)]):
            rid = batch.request_ids[j]
            request = self.requests.get(rid)
            if request is None:
                out += self._unknown_request(rid, where, reported)
                continue
            rows = order[start:stop]
            bad = rows[~finite[rows]]
            if bad.size:
                if (rid, "nonfinite") not in reported:
                    reported.add((rid, "nonfinite"))
                    out.append(self._error(
                        rid, "INVALID_ARGUMENT",
                        f"{where}.rows: {bad.size} row(s) with NaN or Inf at token_positions "
                        f"{block.token_positions[bad].tolist()[:8]}; those rows were not scored"))
                rows = rows[finite[rows]]
            bindings = [b for b in request.bindings if b.probe.manifest.reads(block.tensor_type, block.layer)]
            if rows.size and bindings:
                segments.append((rid, rows, bindings))
                for b in bindings:
                    readers[id(b.probe)] = b.probe
        if not segments:
            return out
        plan = self._plan(tuple(readers.values()))
        values = plan.apply(block.rows)
        layer = np.int64(block.layer)
        for rid, rows, bindings in segments:
            for b in bindings:
                part = gathered.setdefault((rid, id(b.probe)), _Rows())
                part.positions.append(block.token_positions[rows])
                part.layers.append(np.full(rows.size, layer))
                part.generated.append(block.is_generated[rows])
                part.values.append(values[rows, plan.columns[id(b.probe)]])
        return out

    def _score(self, gathered: dict[tuple[str, int], _Rows]) -> list[pb.RouterMessage]:
        out: list[pb.RouterMessage] = []
        by_request: dict[str, list[tuple[Binding, _Rows]]] = {}
        for (rid, probe_id), part in gathered.items():
            binding = next(b for b in self.requests[rid].bindings if id(b.probe) == probe_id)
            by_request.setdefault(rid, []).append((binding, part))
        for rid, parts in by_request.items():
            request = self.requests[rid]
            candidates = []  # (position, layer, binding order, binding, score)
            for binding, part in parts:
                positions = np.concatenate(part.positions)
                layers = np.concatenate(part.layers)
                generated = np.concatenate(part.generated)
                values = np.concatenate(part.values)
                forward = np.lexsort((layers, positions))
                positions, layers, generated, values = (
                    positions[forward], layers[forward], generated[forward], values[forward])
                selected = selects(binding.probe.manifest.tokens, positions, generated, request.prompt_length)
                if not selected.any():
                    continue
                positions, layers = positions[selected], layers[selected]
                scores = binding.probe.score(values[selected], binding.state)
                self.metrics.probe_rows.labels(binding.probe.name).inc(scores.size)
                if binding.action == pb.ABORT:
                    m = binding.probe.manifest
                    hit = first_firing(scores, m.threshold, m.min_tokens, m.patience, binding.rule)
                    if hit is not None and not request.aborted:
                        order = request.bindings.index(binding)
                        candidates.append((positions[hit], layers[hit], order, binding, scores[hit]))
                else:
                    binding.pending_positions.append(positions)
                    binding.pending_scores.append(scores)
                    if message := self._flush_scores(request, binding, force=False):
                        out.append(message)
            if candidates:
                position, layer, _, binding, score = min(candidates, key=lambda c: c[:3])
                request.aborted = True
                out.append(self._abort(request, binding, float(score), int(position), int(layer)))
        return out

    def _abort(self, request: RequestState, binding: Binding, score: float, position: int,
               layer: int) -> pb.RouterMessage:
        m = binding.probe.manifest
        reason = (
            f"probe {m.name!r} (version {m.version}) scored {score:.4g} >= threshold {m.threshold:g} "
            f"at token {position}, layer {layer} (patience {m.patience}, min_tokens {m.min_tokens})"
        )
        self.metrics.aborts.labels(m.name).inc()
        log.info("abort", extra={"request_id": request.request_id, "probe": m.name, "score": score,
                                 "token_position": position})
        return pb.RouterMessage(abort=pb.Verdict(
            request_id=request.request_id, probe=m.name, score=score, token_position=position,
            reason=reason))

    def _flush_scores(self, request: RequestState, binding: Binding, force: bool) -> pb.RouterMessage | None:
        if not binding.pending_scores:
            return None
        now = self.clock()
        if not force and now - binding.last_scores_sent < self.scores_interval:
            return None
        binding.last_scores_sent = now
        message = pb.ProbeScores(
            request_id=request.request_id,
            probe=binding.probe.name,
            token_positions=np.concatenate(binding.pending_positions).tolist(),
            scores=np.concatenate(binding.pending_scores).tolist(),
        )
        binding.pending_positions.clear()
        binding.pending_scores.clear()
        return pb.RouterMessage(scores=message)

    # -- helpers ------------------------------------------------------------

    def detach_retired(self) -> list[pb.RouterMessage]:
        """Drops bindings of probes unloaded by force; tells each request once.

        Call it before `batch`, on the thread that owns the registry."""
        out = []
        for request in self.requests.values():
            for binding in [b for b in request.bindings if b.probe.retired]:
                request.bindings.remove(binding)
                self.registry.release(binding.probe)
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

    def _unknown_request(self, rid: str, where: str, reported: set[tuple[str, str]]) -> list[pb.RouterMessage]:
        if (rid, "unknown") in reported:
            return []
        reported.add((rid, "unknown"))
        if rid in self._ended:
            return [self._error(rid, "FAILED_PRECONDITION",
                                f"{where}: records for request {rid!r} after its request_end; not scored")]
        return [self._error(rid, "NOT_FOUND",
                            f"{where}: request {rid!r} was never started on this session "
                            "(no request_start); its records were not scored")]

    def _block_error(self, request_ids: list[str], code: str, message: str,
                     reported: set[tuple[str, str]]) -> list[pb.RouterMessage]:
        out = []
        for rid in sorted({r for r in request_ids if r}) or [""]:
            if (rid, message) not in reported:
                reported.add((rid, message))
                out.append(self._error(rid, code, message + "; the block was not scored"))
        return out

    def _error(self, request_id: str, code: str, message: str, probe: str = "") -> pb.RouterMessage:
        self.metrics.errors.labels(code).inc()
        log.warning("request error", extra={"request_id": request_id, "probe": probe, "code": code,
                                            "error": message})
        return error(request_id, code, message, probe)


def selects(scope, positions: np.ndarray, generated: np.ndarray, prompt_length: int) -> np.ndarray:
    """Mask of the rows a probe's token scope reads (the proto's TokenSelector rules)."""
    if scope.scope == pb.TokenSelector.PROMPT:
        in_scope, index = ~generated, positions
    elif scope.scope == pb.TokenSelector.GENERATED:
        in_scope, index = generated, positions - prompt_length
    else:
        in_scope, index = np.ones_like(generated), positions
    if not scope.indexes and not scope.ranges:
        return in_scope

    def resolve(i: int) -> int:
        return i + prompt_length if i < 0 else i

    chosen = np.isin(index, [resolve(i) for i in scope.indexes])
    for start, stop in scope.ranges:
        upper = np.inf if stop is None else resolve(stop)
        chosen |= (index >= resolve(start)) & (index < upper)
    return in_scope & chosen
