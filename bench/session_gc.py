"""What open requests cost the router's garbage collector: one session's
request_start and request_end CPU per request, and a full collection's pause,
with many probes bound to every request.

    python -m bench.session_gc [--probes 1000] [--requests 200] [--rounds 3] [--out session_gc.json]

Every Python object a router keeps while a request lives is walked by
CPython's cyclic collector at each full collection, which it runs on the event
loop whenever the long-lived objects grew by a quarter: a pause of the router's
every session, verdicts included. A binding is a cell of the session's arrays,
so the objects walked should not grow with the probes bound (BENCHMARKS.md
section 26).
Runs `router_service.session.SessionState` in this process (no gRPC; the
start-up heap frozen as the router's is) and reports, per round: CPU ms per
request_start and per request_end, a full collection's wall ms with every
request open, the objects the collector tracks then, and the full collections
CPython ran by itself while the requests started (the requests open at each,
and its pause). Writes
bench/results/session_gc.json (or `--out`).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench import results_file
from bench.gc_watch import Collections
from common.gc_heap import freeze_startup_heap
from router_service.metrics import RouterMetrics
from router_service.probe_files import load_probe_path, write_probe
from router_service.registry import ProbeRegistry
from router_service.session import SessionState
from undercurrent.v1 import undercurrent_pb2 as pb

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
    model = pb.ModelInfo(model="bench", hidden_size=HIDDEN, num_layers=32, dtype="bfloat16",
                         tensor_types=[pb.TENSOR_TYPE_RESIDUAL_STREAM])
    return SessionState(registry, model, RouterMetrics(), max_requests=requests + 1), names


def run(args) -> dict:
    state, names = session(args.probes, args.requests)
    starts = [pb.RequestStart(request_id=f"req-{i}", prompt_length=1,
                              probes=[pb.ProbeBinding(probe=n) for n in names]) for i in range(args.requests)]
    ends = [pb.RequestEnd(request_id=f"req-{i}") for i in range(args.requests)]
    freeze_startup_heap()
    state.start(starts[0])  # warm: every probe's grid column made once
    state.end(ends[0])
    rounds = []
    for _ in range(args.rounds):
        gc.collect()
        with Collections(lambda: {"open_requests": len(state.requests)}) as seen:
            started = time.process_time()
            for message in starts:
                state.start(message)
            start_ms = (time.process_time() - started) / args.requests * 1000
        tracked = len(gc.get_objects())
        paused = time.perf_counter()
        gc.collect()
        pause_ms = (time.perf_counter() - paused) * 1000
        started = time.process_time()
        for message in ends:
            state.end(message)
        end_ms = (time.process_time() - started) / args.requests * 1000
        rounds.append({"start_ms": round(start_ms, 3), "end_ms": round(end_ms, 3),
                       "full_collection_ms": round(pause_ms, 1), "tracked_objects": tracked,
                       "collections_while_starting": seen.full})
        print(rounds[-1], flush=True)
    medians = {key: statistics.median(r[key] for r in rounds) for key in rounds[0]
               if key != "collections_while_starting"}
    return {"probes_per_request": args.probes, "requests": args.requests, "rounds": rounds, "medians": medians}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--probes", type=int, default=1000, help="probes bound to every request")
    parser.add_argument("--requests", type=int, default=200, help="requests open at once")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="session_gc.json", help="file name under bench/results/")
    args = parser.parse_args()
    started = time.time()
    report = {**results_file.provenance(started), **run(args)}
    results_file.write(args.out, report)
    print(json.dumps(report["medians"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
