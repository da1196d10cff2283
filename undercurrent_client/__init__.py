"""Python client of Undercurrent: blocking and asyncio clients of the engine and of
the routers' ProbeAdmin, typed Generate events, and activations as numpy arrays.

    from undercurrent_client import EngineClient

    with EngineClient("127.0.0.1:50051") as engine:
        for event in engine.generate("Hello", max_tokens=16, probes=["toxicity"]):
            print(event)

The `undercurrent` command (undercurrent_client.cli) is built on it.
"""

from undercurrent_client.activations import ActivationKey, ActivationSet, batch_arrays
from undercurrent_client.client import (
    AsyncEngineClient,
    AsyncProbeAdminClient,
    EngineClient,
    ProbeAdminClient,
)
from undercurrent_client.connection import Connection
from undercurrent_client.errors import RpcError
from undercurrent_client.events import (
    Activations,
    Event,
    Finished,
    Generation,
    ProbeScores,
    Started,
    Tokens,
    Verdict,
)
from undercurrent_client.requests import Probe, generate_request, inline_probe, point

__all__ = [
    "ActivationKey", "ActivationSet", "Activations", "AsyncEngineClient", "AsyncProbeAdminClient",
    "Connection", "EngineClient", "Event", "Finished", "Generation", "Probe", "ProbeAdminClient",
    "ProbeScores", "RpcError", "Started", "Tokens", "Verdict", "batch_arrays", "generate_request",
    "inline_probe", "point",
]
