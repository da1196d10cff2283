"""Generate with a deployed probe bound by name, and what came back."""

from __future__ import annotations

from typing import Callable

from undercurrent.v1 import engine_pb2 as engine_pb
from undercurrent.v1 import types_pb2 as types_pb
from undercurrent_client import AsyncEngineClient, Event, Generation


def probe_request(text: str, probes: str | list[str], max_tokens: int) -> engine_pb.GenerateRequest:
    """Greedy and ignore_eos, as the dataset was captured, so the probe reads the same rows;
    each probe bound fail_closed with its manifest's action."""
    request = engine_pb.GenerateRequest(
        text=text,
        sampling=engine_pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
    )
    for probe in [probes] if isinstance(probes, str) else probes:
        request.probes.add(probe=probe, failure_policy=types_pb.FAILURE_POLICY_FAIL_CLOSED)
    return request


async def generate_with_probe(
    engine: AsyncEngineClient, text: str, probe: str | list[str], max_tokens: int,
    on_event: Callable[[Event], None] | None = None,
) -> Generation:
    """The whole stream gathered; `on_event` sees each event as it arrives."""
    generation = Generation()
    async for event in engine.generate(probe_request(text, probe, max_tokens)):
        generation.add(event)
        if on_event is not None:
            on_event(event)
    return generation
