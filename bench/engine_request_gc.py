"""What open requests with many probes cost the engine service's garbage
collector: the Python objects it keeps per request, a full collection's pause
with every request open, and the CPU of a request's probe bookkeeping.

    python -m bench.engine_request_gc [--probes 1000] [--requests 256] [--rounds 3] [--out engine_request_gc.json]

Each request goes through what the engine service does with a Generate call's
probe bindings (`requests.bind_probes` against a catalog of `--probes` probes,
`probe_points`, the request's `RequestLedger` and `ActiveRequest`, then
`RouterLink.start_request`, whose request_start is taken off the queue of a
replica that is marked up but never connected) and stays open; then every
request ends. CPython's collector walks every object the service keeps at
each full collection, on the service's event loop, which also runs the drain
loop and the router link (BENCHMARKS.md section 28). Reports per round: CPU ms
per request started, the objects the collector tracks with every request open
(the start-up heap frozen, as the service does), a full collection's wall ms,
and the full collections CPython ran by itself while the requests started.
Writes bench/results/engine_request_gc.json (or `--out`).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time

from bench import results_file
from bench.gc_watch import Collections
from common.gc_heap import freeze_startup_heap
from engine_service import requests as reqs
from engine_service.active_request import ActiveRequest
from engine_service.client_stream import ClientStream
from engine_service.link import RouterLink, RouterLinkConfig
from engine_service.link.session import ReplicaSession
from engine_service.probe_points import ExpectedRows, probe_points
from engine_service.request_ledger import RequestLedger
from undercurrent.v1 import undercurrent_pb2 as pb

HIDDEN = 64
PROMPT = 16


def link_with_one_replica(probes: int) -> tuple[RouterLink, ReplicaSession, dict[str, pb.ProbeInfo]]:
    catalog = {
        f"probe_{i}": pb.ProbeInfo(name=f"probe_{i}", tensor_type=pb.TENSOR_TYPE_RESIDUAL_STREAM, layers=[0],
                                   action=pb.PROBE_ACTION_ABORT)
        for i in range(probes)
    }
    model = pb.ModelInfo(model="bench", hidden_size=HIDDEN, num_layers=8, dtype="bfloat16",
                         tensor_types=[pb.TENSOR_TYPE_RESIDUAL_STREAM])
    address = "127.0.0.1:1"
    link = RouterLink(RouterLinkConfig(targets=address, engine_id="bench"), model, lambda event: None)
    replica = ReplicaSession(address, link.config, link._hello, link, link._metrics)
    link._replicas[address] = replica
    replica._mark_up(pb.RouterHello(router_id="bench", probes=list(catalog.values())))
    return link, replica, catalog


def start(link: RouterLink, replica: ReplicaSession, catalog: dict, message: pb.GenerateRequest,
          incarnation: int) -> ActiveRequest:
    """A request's probe bookkeeping, as `Runtime.generate` and `Runtime._run` do it."""
    probes, infos = reqs.bind_probes(message.probes, catalog, pb.FAILURE_POLICY_FAIL_CLOSED)
    captures = probe_points(infos)
    request = ActiveRequest(
        request_id=message.request_id, incarnation=incarnation, prompt_len=PROMPT, probes=probes, gate=None,
        events=ClientStream(1 << 20, 1 << 20, lambda dropped: None), captures=True,
        ledger=RequestLedger(PROMPT, {p.probe: p.failure_policy for p in probes}, ExpectedRows(captures, PROMPT)),
    )
    link.start_request(request.request_id, incarnation, request.probes, PROMPT, request.ledger)
    while replica.queue:  # the request_start goes out
        replica.queue.pop()
    return request


def run(args) -> dict:
    link, replica, catalog = link_with_one_replica(args.probes)
    messages = [pb.GenerateRequest(request_id=f"req-{i}",
                                   probes=[pb.ProbeBinding(probe=name) for name in catalog])
                for i in range(args.requests)]
    freeze_startup_heap()
    rounds = []
    for number in range(args.rounds):
        active: dict[str, ActiveRequest] = {}
        gc.collect()
        with Collections(lambda active=active: {"open_requests": len(active)}) as seen:
            started = time.process_time()
            for i, message in enumerate(messages):
                active[message.request_id] = start(link, replica, catalog, message, number * args.requests + i)
            start_ms = (time.process_time() - started) / args.requests * 1000
        tracked = len(gc.get_objects())
        paused = time.perf_counter()
        gc.collect()
        pause_ms = (time.perf_counter() - paused) * 1000
        for request_id in list(active):
            link.end_request(request_id, pb.FINISH_REASON_STOP)
            del active[request_id]
        while replica.queue:
            replica.queue.pop()
        rounds.append({"start_ms": round(start_ms, 3), "full_collection_ms": round(pause_ms, 1),
                       "tracked_objects": tracked, "collections_while_starting": seen.full})
        print(rounds[-1], flush=True)
    medians = {key: statistics.median(r[key] for r in rounds) for key in rounds[0]
               if key != "collections_while_starting"}
    return {"probes_per_request": args.probes, "requests": args.requests, "rounds": rounds, "medians": medians}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--probes", type=int, default=1000, help="probes bound to every request")
    parser.add_argument("--requests", type=int, default=256, help="requests open at once (the engine's default cap)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="engine_request_gc.json", help="file name under bench/results/")
    args = parser.parse_args()
    started = time.time()
    report = {**results_file.provenance(started), **run(args)}
    results_file.write(args.out, report)
    print(json.dumps(report["medians"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
