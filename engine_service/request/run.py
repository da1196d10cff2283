"""One run of one request on the engine: the single owner of what its client
sees and why it ends.

Everything that happens to a request arrives here as a call: tokens from vLLM,
events from the router link, a capture error, the end of generation. The run
decides (release gated tokens, show scores, end the request, count what went
unprobed) and writes its client's events itself; a call that ended the request
and needs vLLM to stop it returns a `Stop`, which the engine applies
(`AsyncLLM.abort`). The engine only orchestrates: it never decides for a run.
Plain logic: no vLLM, no gRPC, no event loop beyond the client stream's queue.

A run is known by its key, `run_key(request_id, incarnation)`, in every
structure of the engine (capture registrations, the router link, vLLM's own
request id, the routers' sessions): a late message about an earlier run of the
same request id can never reach this one.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from undercurrent.v1 import engine_pb2 as engine_pb
from undercurrent.v1 import router_session_pb2 as session_pb
from undercurrent.v1 import types_pb2 as types_pb

from common.activations import Block
from common.enum_names import short_name
from engine_service.link import events
from engine_service.request.client_stream import ClientStream
from engine_service.request.gate import HeldScores, TokenGate
from engine_service.request.ledger import Failure, RequestLedger

log = logging.getLogger(__name__)

VLLM_FINISH_REASONS = {
    "stop": types_pb.FINISH_REASON_STOP,
    "length": types_pb.FINISH_REASON_LENGTH,
    "abort": types_pb.FINISH_REASON_CLIENT_ABORT,
    "error": types_pb.FINISH_REASON_ERROR,
}
UNSPECIFIED = types_pb.FINISH_REASON_UNSPECIFIED


def run_key(request_id: str, incarnation: int) -> str:
    """The engine's name for one run of a request id: unique in the process."""
    return f"{request_id}#{incarnation}"


@dataclass(frozen=True)
class Stop:
    """The run ended itself; vLLM must stop computing it."""

    reason: int  # types_pb.FinishReason


class RequestRun:
    """One run: its gate, its ledger, the scores it holds, how it ended."""

    def __init__(
        self,
        key: str,
        request_id: str,
        incarnation: int,
        prompt_tokens: int,
        bindings: Sequence[session_pb.SessionBinding],
        infos: Sequence[types_pb.ProbeInfo],
        gate_tokens: bool,
        stream: ClientStream,
        decode: Callable[[list[int]], str],
        ledger: RequestLedger | None = None,
        captures: bool = False,
        on_first_token: Callable[[], None] = lambda: None,
        operator_probes: frozenset[str] = frozenset(),
    ) -> None:
        self.key = key
        self.request_id = request_id
        self.incarnation = incarnation
        self.prompt_tokens = prompt_tokens
        # One message's repeated field (what the router link sends on), and the
        # pinned versions' descriptions: one object each for the garbage collector.
        self.bindings = bindings
        self.infos = infos
        self.gate = TokenGate(prompt_tokens) if gate_tokens else None
        self.operator_probes = operator_probes  # bindings the caller's guards set
        self.stream = stream
        self.ledger = ledger
        self.captures = captures  # registered extraction points (client or probe)
        self.scores = HeldScores()
        self.generated = 0
        self.finish_reason = UNSPECIFIED
        self.verdict: types_pb.Verdict | None = None
        self.message = ""
        self.tokens_sent = False
        self.finished_sent = False
        # Rows of client points a worker dropped past its backlog bound (the
        # ledger counts those of probe points).
        self.backlog_dropped_client_rows = 0
        # Set whenever the ledger moved (acks, failures) or the run ended; the end
        # of the run waits on it.
        self.changed = asyncio.Event()
        self._decode = decode
        self._on_first_token = on_first_token
        self._said_unprobed = False
        # (generated, settled_below) when last seen to change, and when (held_on_lost_rows).
        self._progress: tuple[int, int] = (0, 0)
        self._progress_at = time.monotonic()

    @property
    def ended(self) -> bool:
        return self.finish_reason != UNSPECIFIED

    # -- what happens to the run -----------------------------------------------

    def tokens(self, token_ids: list[int], text: str) -> None:
        """vLLM generated these tokens (the next ones, in order)."""
        first = self.generated
        self.generated += len(token_ids)
        if self.ledger is not None:
            # Token g was sampled from position prompt_tokens + g - 1, computed by every
            # stage: every position before the newest token's owes its probe rows.
            self.ledger.computed_below(self.prompt_tokens + self.generated - 1)
        if self.scores.held:
            self._show(self.scores.release(self.ledger, self._received_below()))
        if self.gate is None:
            self._send_tokens(engine_pb.TokenChunk(token_ids=token_ids, text=text, first_index=first))
            return
        self.gate.hold(first, token_ids)
        self._release()

    def activations(self, blocks: list[Block]) -> None:
        """Rows of the client's own extraction points, captured under the run's
        key: the client sees them under its request id."""
        ids = [self.request_id]
        self.stream.put_activations([replace(block, request_ids=ids * block.num_rows) for block in blocks])

    def link_event(self, event: events.LinkEvent) -> Stop | None:
        """The router link's news about this run (checked to be about this run)."""
        if isinstance(event, (events.Processed, events.Unscored, events.Failed)):
            self.changed.set()
        if isinstance(event, events.Scores):
            scores = types_pb.ProbeScores()
            scores.CopyFrom(event.scores)
            scores.request_id = self.request_id
            scores.router = event.replica
            self._show(self.scores.add(scores, self.ledger, self._received_below()))
            return None
        if isinstance(event, events.Abort):
            verdict = types_pb.Verdict()
            verdict.CopyFrom(event.verdict)
            verdict.request_id = self.request_id
            verdict.router = event.replica
            return Stop(types_pb.FINISH_REASON_PROBE_ABORT) if self.end(types_pb.FINISH_REASON_PROBE_ABORT, verdict) else None
        if isinstance(event, events.Processed):
            self._show(self.scores.release(self.ledger, self._received_below()))
            if self.gate is not None and not self.ended:
                self._release()
            return None
        if isinstance(event, events.Unscored):
            self._show(self.scores.release(self.ledger, self._received_below()))
            return self.unscored(event.failure)
        if isinstance(event, events.Unavailable):
            return self.unscored(self.ledger.outage(f"no router reachable for {event.waited_s:.1f} s"))
        if isinstance(event, events.Failed):
            return self.failed(event.reason)
        if isinstance(event, events.StateRestarted):
            log.warning("request %s: stateful probe(s) %s start afresh: %s (fail_open)",
                        self.key, ", ".join(event.probes), event.reason)
        return None

    def unscored(self, failure: Failure) -> Stop | None:
        """Rows some bindings will never have scored: a fail_closed binding among
        them ends the run at the first position it has not scored; fail_open ones
        go on, counted."""
        if self.ended:
            return None
        if failure.fail_closed:
            reason = f"{failure.reason} (fail_closed)"
            verdict = types_pb.Verdict(request_id=self.request_id, token_position=self.ledger.first_unscored(),
                                 reason=reason)
            if self.end(types_pb.FINISH_REASON_ROUTER_UNAVAILABLE, verdict, reason):
                return Stop(types_pb.FINISH_REASON_ROUTER_UNAVAILABLE)
            return None
        level = logging.DEBUG if self._said_unprobed else logging.WARNING
        self._said_unprobed = True
        log.log(level, "request %s continues with unprobed rows (fail_open): %s", self.key, failure.reason)
        if self.gate is not None:
            self._release()
        return None

    def failed(self, message: str) -> Stop | None:
        """The engine could not serve the run (a capture error, a lost drain, an
        internal error): it ends ERROR and its client sees no token it was not
        shown already, whatever the ledger says later."""
        if not self.end(types_pb.FINISH_REASON_ERROR, message=message):
            return None
        if self.gate is not None:
            self.gate.close_at(self.prompt_tokens + self.gate.first_held_index)
        return Stop(types_pb.FINISH_REASON_ERROR)

    def backlog_dropped(self, point: str, positions: list[int], probe_point: bool) -> None:
        """A worker dropped rows of this run's `point` past its backlog bound, at these positions."""
        if probe_point and self.ledger is not None:
            self.ledger.capture_dropped(point, positions)
        else:
            self.backlog_dropped_client_rows += len(positions)

    def held_on_lost_rows(self, now: float, limit_s: float) -> Stop | None:
        """With --max-tokens-ahead, vLLM holds a run whose rows are not settled, and
        only its end declares rows capture never delivered lost: a run held on such
        rows would wait for good. One that neither generated nor settled anything
        for `limit_s`, with nothing in flight to a router (the link's watchdog ends
        those) but rows owed by capture (drained within a step when capture works),
        has lost them: they fail as at the end, under each binding's policy."""
        ledger = self.ledger
        progress = (self.generated, ledger.settled_below())
        if progress != self._progress:
            self._progress, self._progress_at = progress, now
            return None
        if now - self._progress_at > limit_s and not ledger.in_flight() and ledger.owed_by_capture():
            failure = ledger.capture_lost()
            if failure is not None:
                return self.unscored(failure)
        return None

    def end(self, reason: int, verdict: types_pb.Verdict | None = None, message: str = "") -> bool:
        """Records the first reason the run ended (False if it had ended) and
        closes the gate at the verdict: no token at or after it is ever shown;
        scored tokens before it may be."""
        if self.ended:
            return False
        self.finish_reason, self.verdict, self.message = reason, verdict, message
        self.changed.set()  # the end of the run waits on the reason too
        if self.gate is not None and verdict is not None:
            self.gate.close_at(verdict.token_position)
            self._release()
        return True

    def settle(self) -> Stop | None:
        """Generation ended and its last rows were drained and answered (or the
        wait gave up): rows still unacknowledged, and rows capture owed and never
        delivered, are unscored; a fail_closed binding among them ends the run
        (vLLM has nothing left to stop)."""
        ledger = self.ledger
        if ledger is None:
            return None
        ledger.expire(float("inf"), "rows still unacknowledged when the request ended")
        if self.captures:
            ledger.capture_lost()
        failure = ledger.fail_closed_failure()
        return self.unscored(failure) if failure is not None else None

    def finish(self, vllm_reason: str | None) -> engine_pb.GenerateFinished:
        """The client's last event: why the run ended and what it cost."""
        if not self.ended:
            self.end(VLLM_FINISH_REASONS.get(vllm_reason, types_pb.FINISH_REASON_ERROR))
        ledger = self.ledger
        received_below = self._received_below()
        if ledger is not None:
            self._show(self.scores.release(ledger, received_below, final=True))
        if self.gate is not None:
            if self.finish_reason in (types_pb.FINISH_REASON_STOP, types_pb.FINISH_REASON_LENGTH):
                first, released = self.gate.release_all()
                self._send_released(first, released)
            else:  # scored tokens before the trigger (or the first unscored row)
                self._release()
        finished = engine_pb.GenerateFinished(
            finish_reason=self.finish_reason,
            verdict=self.verdict,
            prompt_tokens=self.prompt_tokens,
            generated_tokens=self.generated,
            unprobed_tokens=ledger.unprobed_tokens(below=received_below) if ledger else 0,
            dropped_records=self.dropped_records(),
            message=self.message,
            gated=self.gate is not None,
        )
        if ledger is not None:
            for binding, info, (scored, unprobed, restarts, why) in zip(
                    self.bindings, self.infos, ledger.report(below=received_below)):
                finished.bindings.add(
                    probe=binding.probe, version=info.version, digest=binding.digest,
                    failure_policy=binding.failure_policy, action=binding.action,
                    rows_scored=scored, rows_unprobed=unprobed, state_restarts=restarts, message=why,
                    operator_set=binding.probe in self.operator_probes)
            first = next(iter(ledger.failures), None)
            if not finished.message and finished.unprobed_tokens and first and not ledger.fail_closed_failure():
                finished.message = f"{finished.unprobed_tokens} tokens unprobed (fail_open): {first.reason}"
        self.stream.put_nowait(engine_pb.GenerateResponse(finished=finished))
        self.finished_sent = True
        return finished

    def finish_after_error(self, message: str) -> None:
        """The client's finish when finish() failed: ERROR, with the counts that
        can still be read."""
        if self.finished_sent:
            return
        self.finish_reason, self.message = types_pb.FINISH_REASON_ERROR, message
        finished = engine_pb.GenerateFinished(finish_reason=types_pb.FINISH_REASON_ERROR, prompt_tokens=self.prompt_tokens,
                                       generated_tokens=self.generated, message=message)
        for field_name, count in (("unprobed_tokens", lambda: self.ledger.unprobed_tokens() if self.ledger else 0),
                                  ("dropped_records", self.dropped_records)):
            try:
                setattr(finished, field_name, count())
            except Exception:  # the count is what failed: the finish goes without it
                log.exception("request %s: counting %s failed", self.key, field_name)
        self.stream.put_nowait(engine_pb.GenerateResponse(finished=finished))
        self.finished_sent = True

    def dropped_records(self) -> int:
        """Records the client never got: probe rows dropped or lost on the way to a
        router, client rows dropped by a worker past its backlog bound, and
        activations and scores past the client queue's budget."""
        return ((self.ledger.dropped_records if self.ledger else 0)
                + self.backlog_dropped_client_rows + self.stream.dropped_records)

    def _received_below(self) -> int:
        """One past the position of the newest token the engine received (token g
        sits at prompt_tokens + g)."""
        return self.prompt_tokens + self.generated

    def finish_reason_name(self) -> str:
        return short_name(types_pb.FinishReason, self.finish_reason)

    # -- what the client sees ---------------------------------------------------

    def _release(self) -> None:
        """Shows the held tokens the ledger cleared."""
        first, released = self.gate.releasable(self.ledger.releasable_through())
        self._send_released(first, released)

    def _send_released(self, first: int, released: list[int]) -> None:
        if released:
            self._send_tokens(engine_pb.TokenChunk(token_ids=released, text=self._decode(released), first_index=first))

    def _send_tokens(self, chunk: engine_pb.TokenChunk) -> None:
        if not self.tokens_sent:
            self.tokens_sent = True
            self._on_first_token()
        self.stream.put_nowait(engine_pb.GenerateResponse(tokens=chunk))

    def _show(self, shown: list[types_pb.ProbeScores]) -> None:
        for scores in shown:
            response = engine_pb.GenerateResponse()
            response.probe_event.scores.CopyFrom(scores)  # one copy; nested constructors make two
            self.stream.put_nowait(response)
