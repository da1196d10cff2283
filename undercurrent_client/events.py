"""Typed events of a Generate stream, and the one function that reads them off
the wire."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import AsyncIterable, Iterable, Union

from common.enum_names import short_name
from undercurrent.v1 import engine_pb2 as engine_pb
from undercurrent.v1 import types_pb2 as types_pb
from undercurrent_client.activations import ActivationKey, ActivationSet, batch_arrays


@dataclass(frozen=True)
class Started:
    """First event: the request's id and its prompt length (generated token g is at
    position prompt_tokens + g)."""

    request_id: str
    prompt_tokens: int


@dataclass(frozen=True)
class Tokens:
    """Generated tokens released to the client; first_index counts generated tokens."""

    token_ids: tuple[int, ...]
    text: str
    first_index: int


@dataclass(frozen=True)
class ProbeScores:
    """Scores of an observing probe over some token positions, and the router replica
    that produced them."""

    probe: str
    token_positions: tuple[int, ...]
    scores: tuple[float, ...]
    router: str


@dataclass(frozen=True)
class Activations:
    """Records of extraction points streamed to the client (the raw batch)."""

    batch: types_pb.ActivationBatch

    def arrays(self):
        """The rows as float32 vectors keyed by ActivationKey."""
        return batch_arrays(self.batch)


@dataclass(frozen=True)
class Verdict:
    """Why a request was stopped: the probe, its score and the token that fired."""

    probe: str
    score: float
    token_position: int
    reason: str
    router: str


@dataclass(frozen=True)
class Finished:
    """Last event. reason is the short FinishReason name ("STOP", "LENGTH",
    "PROBE_ABORT", "CLIENT_ABORT", "ROUTER_UNAVAILABLE", "ERROR")."""

    reason: str
    verdict: Verdict | None
    prompt_tokens: int
    generated_tokens: int
    unprobed_tokens: int
    dropped_records: int
    message: str


Event = Union[Started, Tokens, ProbeScores, Activations, Finished]


def event_of(response: engine_pb.GenerateResponse) -> Event:
    """The typed event of one GenerateResponse."""
    kind = response.WhichOneof("event")
    if kind == "started":
        return Started(response.started.request_id, response.started.prompt_tokens)
    if kind == "tokens":
        chunk = response.tokens
        return Tokens(tuple(chunk.token_ids), chunk.text, chunk.first_index)
    if kind == "probe_event":
        s = response.probe_event.scores
        return ProbeScores(s.probe, tuple(s.token_positions), tuple(s.scores), s.router)
    if kind == "activations":
        return Activations(response.activations)
    if kind == "finished":
        done = response.finished
        verdict = None
        if done.HasField("verdict"):
            v = done.verdict
            verdict = Verdict(v.probe, v.score, v.token_position, v.reason, v.router)
        return Finished(
            short_name(types_pb.FinishReason, done.finish_reason), verdict, done.prompt_tokens,
            done.generated_tokens, done.unprobed_tokens, done.dropped_records, done.message,
        )
    raise ValueError(f"GenerateResponse carries no known event (got {kind!r})")


@dataclass
class Generation:
    """Everything one Generate stream returned, gathered from its events."""

    request_id: str = ""
    prompt_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    scores: list[ProbeScores] = field(default_factory=list)
    activations: ActivationSet = field(default_factory=ActivationSet)
    finished: Finished | None = None

    def add(self, event: Event) -> None:
        if isinstance(event, Started):
            self.request_id, self.prompt_tokens = event.request_id, event.prompt_tokens
        elif isinstance(event, Tokens):
            self.token_ids.extend(event.token_ids)
            self.text += event.text
        elif isinstance(event, ProbeScores):
            self.scores.append(event)
        elif isinstance(event, Activations):
            self.activations.add(event.batch)
        elif isinstance(event, Finished):
            self.finished = event

    @property
    def reason(self) -> str:
        return self.finished.reason if self.finished else ""

    def probe_scores(self, probe: str) -> dict[int, float]:
        """token position -> score of one probe."""
        return {p: s for e in self.scores if e.probe == probe
                for p, s in zip(e.token_positions, e.scores)}

    @classmethod
    def of(cls, events: Iterable[Event]) -> "Generation":
        generation = cls()
        for event in events:
            generation.add(event)
        return generation

    @classmethod
    async def of_async(cls, events: AsyncIterable[Event]) -> "Generation":
        generation = cls()
        async for event in events:
            generation.add(event)
        return generation


__all__ = [
    "ActivationKey", "Activations", "Event", "Finished", "Generation", "ProbeScores", "Started",
    "Tokens", "Verdict", "event_of",
]
