"""What open requests cost the router's garbage collector: one session's
request_start and request_end CPU per request, and a full collection's pause,
with many probes bound to every request.

    python -m bench.session_gc [--probes 1000] [--requests 200] [--rounds 3] [--out session_gc.json]

Every Python object a router keeps while a request lives is walked by
CPython's cyclic collector at each full collection, which it runs on the event
loop whenever the long-lived objects grew by a quarter: a pause of the router's
every session, verdicts included. A binding is a cell of the session's arrays,
so the objects walked should not grow with the probes bound.
Runs `router_service.session.SessionState` in this process (no gRPC; the
start-up heap frozen as the router's is) and reports, per round: CPU ms per
request_start and per request_end, a full collection's wall ms with every
request open, the objects the collector tracks then, and the full collections
CPython ran by itself while the requests started (the requests open at each,
and its pause). Writes
bench/results/session_gc.json (or `--out`).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import numpy as np

from bench.gc_watch import open_requests_main, open_requests_round
from common.gc_heap import freeze_startup_heap
from router_service.metrics import RouterMetrics
from common.probe_format.files import load_probe_path, write_probe
from router_service.registry import ProbeRegistry
from router_service.session import SessionState
from undercurrent.v1 import router_session_pb2 as session_pb
from undercurrent.v1 import types_pb2 as types_pb

HIDDEN = 64


def session(probes: int, requests: int) -> tuple[SessionState, list[str]]:
    registry, rng, names = ProbeRegistry(), np.random.default_rng(1), []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(probes):
            name = f"logistic_{i}"
            write_probe(Path(tmp) / name, {
                "name": name, "version": "1", "kind": "logistic", "tensor_type": "residual_stream",
                "layers": [0], "hidden_size": HIDDEN, "dtype": "bfloat16", "threshold": 0.99,
                "action": "abort"}, {"weight": rng.normal(size=HIDDEN), "bias": np.array([-8.0])})
            registry.load(load_probe_path(str(Path(tmp) / name)))
            names.append(name)
    model = types_pb.ModelInfo(model="bench", hidden_size=HIDDEN, num_layers=32, dtype="bfloat16",
                         tensor_types=[types_pb.TENSOR_TYPE_RESIDUAL_STREAM])
    return SessionState(registry, model, RouterMetrics(), max_requests=requests + 1), names


def prepare(args):
    """The session, warmed; returns the function that measures one round."""
    state, names = session(args.probes, args.requests)
    digests = {p.name: p.digest for p in state.registry.probes()}
    starts = [session_pb.RequestStart(request_id=f"req-{i}", prompt_tokens=1,
                              bindings=[session_pb.SessionBinding(probe=n, digest=digests[n]) for n in names])
              for i in range(args.requests)]
    ends = [session_pb.RequestEnd(request_id=f"req-{i}") for i in range(args.requests)]
    freeze_startup_heap()
    state.start(starts[0])  # warm: every probe's grid column made once
    state.end(ends[0])

    def start_all() -> None:
        for message in starts:
            state.start(message)

    def end_all() -> None:
        for message in ends:
            state.end(message)

    return lambda: open_requests_round(args.requests, start_all, end_all, lambda: len(state.requests))


if __name__ == "__main__":
    sys.exit(open_requests_main(__doc__, prepare, 200, "requests open at once", "session_gc.json"))
