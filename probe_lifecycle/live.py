"""Generate with a deployed probe bound by name, and what came back."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from common.enum_names import short_name
from undercurrent.v1 import undercurrent_pb2 as pb
from undercurrent.v1 import undercurrent_pb2_grpc as pb_grpc


@dataclass
class LiveOutcome:
    text: str = ""
    scores: list[tuple[int, float]] = field(default_factory=list)  # (token position, score)
    finished: pb.GenerateFinished | None = None

    @property
    def reason(self) -> str:
        return short_name(pb.FinishReason, self.finished.finish_reason) if self.finished else "NONE"

    @property
    def aborted(self) -> bool:
        return self.finished is not None and self.finished.finish_reason == pb.FINISH_REASON_PROBE_ABORT


def probe_request(text: str, probes: str | list[str], max_tokens: int) -> pb.GenerateRequest:
    """Greedy and ignore_eos, as the dataset was captured, so the probe reads the same rows;
    each probe bound fail_closed with its manifest's action."""
    request = pb.GenerateRequest(
        text=text,
        sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
    )
    for probe in [probes] if isinstance(probes, str) else probes:
        request.probes.add(probe=probe, failure_policy=pb.FAILURE_POLICY_FAIL_CLOSED)
    return request


async def generate_with_probe(
    stub: pb_grpc.EngineServiceStub, text: str, probe: str | list[str], max_tokens: int,
    on_response: Callable[[pb.GenerateResponse, LiveOutcome], None] | None = None,
    timeout: float = 120,
) -> LiveOutcome:
    outcome = LiveOutcome()
    async for response in stub.Generate(probe_request(text, probe, max_tokens), timeout=timeout):
        kind = response.WhichOneof("event")
        if kind == "tokens":
            outcome.text += response.tokens.text
        elif kind == "probe_event":
            event = response.probe_event.scores
            outcome.scores.extend(zip(event.token_positions, event.scores))
        elif kind == "finished":
            outcome.finished = response.finished
        if on_response is not None:
            on_response(response, outcome)
    return outcome
