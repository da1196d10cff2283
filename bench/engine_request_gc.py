"""What open requests with many probes cost the engine service's garbage
collector: the Python objects it keeps per request, a full collection's pause
with every request open, and the CPU of a request's probe bookkeeping.

    python -m bench.engine_request_gc [--probes 1000] [--requests 256] [--rounds 3] [--out engine_request_gc.json]

Each request goes through what the engine service does with a Generate call's
probe bindings (pinned with `RouterLink.pin` against a catalog of `--probes`
probes, `probe_points`, the request's `RequestLedger` and `RequestRun`, then
`RouterLink.start_request`, whose request_start is taken off the queue of a
replica that is marked up but never connected) and stays open; then every
request ends. CPython's collector walks every object the service keeps at
each full collection, on the service's event loop, which also runs the drain
loop and the router link. Reports per round: CPU ms
per request started and ended, the objects the collector tracks with every
request open (the start-up heap frozen, as the service does), a full
collection's wall ms, and the full collections CPython ran by itself while the
requests started (`gc_watch.open_requests_round`).
Writes bench/results/engine_request_gc.json (or `--out`).
"""

from __future__ import annotations

import itertools
import sys

from bench.gc_watch import open_requests_main, open_requests_round
from common.gc_heap import freeze_startup_heap
from engine_service.link import RouterLink, RouterLinkConfig
from engine_service.link.session import ReplicaSession
from engine_service.request import bindings as pins
from engine_service.request.client_stream import ClientStream
from engine_service.request.ledger import RequestLedger
from engine_service.request.probe_points import probe_points
from engine_service.request.run import RequestRun, run_key
from undercurrent.v1 import engine_pb2 as engine_pb
from undercurrent.v1 import router_session_pb2 as session_pb
from undercurrent.v1 import types_pb2 as types_pb

HIDDEN = 64
PROMPT = 16


def link_with_one_replica(probes: int) -> tuple[RouterLink, ReplicaSession, dict[str, types_pb.ProbeInfo]]:
    catalog = {
        f"probe_{i}": types_pb.ProbeInfo(name=f"probe_{i}", tensor_type=types_pb.TENSOR_TYPE_RESIDUAL_STREAM, layers=[0],
                                   action=types_pb.PROBE_ACTION_ABORT, digest=f"sha256:probe-{i}")
        for i in range(probes)
    }
    model = types_pb.ModelInfo(model="bench", hidden_size=HIDDEN, num_layers=8, dtype="bfloat16",
                         tensor_types=[types_pb.TENSOR_TYPE_RESIDUAL_STREAM])
    address = "127.0.0.1:1"
    link = RouterLink(RouterLinkConfig(targets=address, engine_id="bench"), model, lambda event: None)
    replica = ReplicaSession(address, link.config, link._hello, link, link._metrics)
    link._replicas[address] = replica
    replica._mark_up(session_pb.RouterHello(router_id="bench", probes=list(catalog.values())))
    return link, replica, catalog


def start(link: RouterLink, replica: ReplicaSession, message: engine_pb.GenerateRequest, incarnation: int) -> RequestRun:
    """A request's probe bookkeeping, as `EngineRuntime.generate` and `_run` do it."""
    key = run_key(message.request_id, incarnation)
    policy = types_pb.FAILURE_POLICY_FAIL_CLOSED
    infos = link.pin(key, pins.wanted(message.probes, policy))
    bindings = pins.pinned(message.probes, infos, policy)
    run = RequestRun(key, message.request_id, incarnation, PROMPT, bindings, infos, gate_tokens=False,
                     stream=ClientStream(1 << 20, 1 << 20, lambda dropped: None), decode=str,
                     ledger=RequestLedger(PROMPT, pins.for_ledger(bindings, infos), probe_points(infos)),
                     captures=True)
    link.start_request(key, incarnation, run.bindings, PROMPT, run.ledger)
    while replica.queue:  # the request_start goes out
        replica.queue.pop()
    return run


def prepare(args):
    """The link and the requests' messages; returns the function that measures one round."""
    link, replica, catalog = link_with_one_replica(args.probes)
    messages = [engine_pb.GenerateRequest(request_id=f"req-{i}",
                                   probes=[types_pb.ProbeBinding(probe=name) for name in catalog])
                for i in range(args.requests)]
    freeze_startup_heap()
    active: dict[str, RequestRun] = {}
    incarnations = itertools.count(1)

    def start_all() -> None:
        for message in messages:
            run = start(link, replica, message, next(incarnations))
            active[run.key] = run

    def end_all() -> None:
        for key in list(active):
            link.end_request(key, types_pb.FINISH_REASON_STOP)
            del active[key]
        while replica.queue:
            replica.queue.pop()

    return lambda: open_requests_round(args.requests, start_all, end_all, lambda: len(active))


if __name__ == "__main__":
    sys.exit(open_requests_main(__doc__, prepare, 256, "requests open at once (the engine's default cap)",
                                "engine_request_gc.json"))
