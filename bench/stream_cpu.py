"""CPU per step of the engine-to-router stream's Python, both ends, without a network.

    python -m bench.stream_cpu [--steps 150] [--rows 256] [--hidden 4096] [--probes 10] [--blocks 1]
                               [--rounds 1] [--service-heap] [--no-gc-freeze] [--out stream_cpu.json]

Each step carries `--blocks` blocks (layers 0..blocks-1) of `--rows` requests
with one bf16 row each: the default is one layer's decode step of 256
requests; `--rows 8 --hidden 1024 --blocks 25 --probes 4` is the shape of
every type at every layer of the bench model at batch 8.

engine drain: what the engine service does with a step's worker shipment
    before the link (`shipment_from_frames`, `decode_parts`, `merge_blocks`,
    `DeliveredPositions.filter`), the shipment built as a worker builds it.
engine link: `RouterLink.send_step` of the merged blocks (partition, split,
    serialisation, ledger entries), the session's write path (step numbering,
    `batch_sent`, the message's bytes) and, 8 steps later, its StepAck
    (`steps_acked`: ledgers, Processed events), on one replica that is marked up
    but never connected: the socket and gRPC are left out.
router: `SessionState.batch` for a parsed batch of the same rows, every request
    bound to `--probes` logistic probes reading every layer, handed to a thread
    and back as the router does with batches over 4 MiB.

`--service-heap` first imports what the engine service process holds (vLLM,
torch, transformers: some 670,000 objects the garbage collector tracks), so
the engine end's collections walk a heap of the service's size; the setup is
then frozen out of the collector's way, as both services do after start-up,
unless `--no-gc-freeze`. Each round also reports the engine end's garbage
collections (per generation: how many, their milliseconds, the longest one).

Reports process CPU milliseconds per step (time.process_time), which shared
cores inflate less than wall time, per round and the median over `--rounds`,
and writes them to bench/results/stream_cpu.json (or `--out`); run it
alternately against another tree for a same-run comparison. BLAS runs one
thread, as in the router process.
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse  # noqa: E402
import asyncio  # noqa: E402
import gc  # noqa: E402
import importlib  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from concurrent.futures import ThreadPoolExecutor  # noqa: E402
from pathlib import Path  # noqa: E402

import msgspec  # noqa: E402
import numpy as np  # noqa: E402

from bench import results_file  # noqa: E402
from bench.gc_watch import Collections  # noqa: E402
from common import tensor_codec  # noqa: E402
from common.gc_heap import freeze_startup_heap  # noqa: E402
from common.activations import Block, decode_parts, encode_part, session_request_bytes, to_batch  # noqa: E402
from undercurrent.v1 import router_session_pb2 as session_pb  # noqa: E402
from undercurrent.v1 import types_pb2 as types_pb  # noqa: E402

from engine_service.request.probe_points import point_name  # noqa: E402

WINDOW = 8


def rows(args) -> np.ndarray:
    values = np.random.default_rng(0).normal(size=(args.rows, args.hidden)).astype(np.float32)
    return tensor_codec.float32_to_bfloat16_bits(values)


def step_blocks(args, bits: np.ndarray, request_ids: list[str], step: int) -> list[Block]:
    positions, flags = np.full(args.rows, step, np.int64), np.ones(args.rows, bool)
    return [Block(point_name("residual_stream", layer), types_pb.TENSOR_TYPE_RESIDUAL_STREAM, layer, bits, request_ids,
                  positions, flags, "bfloat16")
            for layer in range(args.blocks)]


async def engine(args) -> tuple[float, float, Collections, int]:
    """CPU seconds per step (drain, link), the collections while measuring, and how
    many objects the setup froze (0 with --no-gc-freeze)."""
    from engine_service.capture.driver.merge import DeliveredPositions, merge_blocks
    from engine_service.capture.channel import shipment_frames, shipment_from_frames
    from engine_service.link import RouterLink, RouterLinkConfig
    from engine_service.link.session import ReplicaSession
    from common.capture_spec import TokenSelector
    from engine_service.request.ledger import LedgerBinding, RequestLedger

    model = types_pb.ModelInfo(model="bench", hidden_size=args.hidden, num_layers=max(32, args.blocks), dtype="bfloat16",
                         tensor_types=[types_pb.TENSOR_TYPE_RESIDUAL_STREAM])
    address = "127.0.0.1:1"
    link = RouterLink(RouterLinkConfig(targets=address, engine_id="bench", queue_max_batches=64), model,
                      lambda event: None)
    replica = ReplicaSession(address, link.config, link._hello, link, link._metrics)
    link._replicas[address] = replica
    replica._mark_up(session_pb.RouterHello(router_id="bench"))
    request_ids = [f"req-{i}" for i in range(args.rows)]
    # One fail_open binding per request reading every block's layer.
    reads = LedgerBinding("p", False, False, tuple(point_name("residual_stream", layer) for layer in range(args.blocks)),
                          TokenSelector())
    for request_id in request_ids:
        link.start_request(request_id, 1, [session_pb.SessionBinding(probe="p", failure_policy=types_pb.FAILURE_POLICY_FAIL_OPEN)],
                           1, RequestLedger(1, [reads]))
    while replica.queue:
        replica.queue.pop()
    bits, in_flight = rows(args), []
    shipments = []  # each step's frames as the worker sends them (its rows, one buffer, not copied)
    for step in range(1, args.steps + 1):
        step_rows = np.concatenate([bits] * args.blocks)  # the step's buffer: a slice per block
        blocks = step_blocks(args, bits, request_ids, step)
        for layer, block in enumerate(blocks):
            block.rows = step_rows[layer * args.rows : (layer + 1) * args.rows]
        header, buffers = shipment_frames({"rank": 0, "seq": step, "parts": [
            encode_part(b, copy=False) for b in blocks]})
        shipments.append([msgspec.msgpack.encode(header), *buffers])
    delivered, drain_s, link_s = DeliveredPositions(), 0.0, 0.0
    frozen = freeze_startup_heap() if args.gc_freeze else 0
    with Collections() as collections:
        for data in shipments:
            started = time.process_time()
            blocks = delivered.filter(merge_blocks(decode_parts(shipment_from_frames(data)["parts"])))
            drained = time.process_time()
            link.send_step(blocks)
            item = replica.queue.pop()
            number = replica.steps.record(item, time.monotonic())
            link.batch_sent(replica, item, number)
            session_request_bytes(item.batch_bytes, number)
            in_flight.append(number)
            if len(in_flight) >= WINDOW:
                replica._on_message(session_pb.SessionResponse(ack=session_pb.StepAck(step=in_flight.pop(0))))
            drain_s += drained - started
            link_s += time.process_time() - drained
    if args.gc_freeze:
        gc.unfreeze()  # the next round starts from the same heap
    return drain_s / args.steps, link_s / args.steps, collections, frozen


def router(args) -> float:
    from router_service.metrics import RouterMetrics
    from common.probe_format.files import load_probe_path, write_probe
    from router_service.registry import ProbeRegistry
    from router_service.session import SessionState

    registry, rng, names = ProbeRegistry(), np.random.default_rng(1), []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.probes):
            name = f"linear_{i}"
            manifest = dict(name=name, version="1", kind="logistic", tensor_type="residual_stream",
                            layers=list(range(args.blocks)), hidden_size=args.hidden, dtype="bfloat16", threshold=0.999999,
                            action="abort", rule={"patience": 3})
            write_probe(Path(tmp) / name, manifest,
                        {"weight": rng.normal(size=args.hidden) / np.sqrt(args.hidden), "bias": np.array([-8.0])})
            registry.load(load_probe_path(str(Path(tmp) / name)))
            names.append(name)
    model = types_pb.ModelInfo(model="bench", hidden_size=args.hidden, num_layers=max(32, args.blocks), dtype="bfloat16",
                         tensor_types=[types_pb.TENSOR_TYPE_RESIDUAL_STREAM])
    state = SessionState(registry, model, RouterMetrics(), max_requests=args.rows + 1)
    request_ids = [f"req-{i}" for i in range(args.rows)]
    for request_id in request_ids:
        state.start(session_pb.RequestStart(request_id=request_id, prompt_tokens=1, bindings=[
            session_pb.SessionBinding(probe=p.name, digest=p.digest) for p in registry.probes() if p.name in names]))
    bits, batches = rows(args), []
    for step in range(1, args.steps + 1):
        wire = session_pb.SessionRequest(batch=to_batch(step_blocks(args, bits, request_ids, step), step)).SerializeToString()
        batches.append(session_pb.SessionRequest.FromString(wire).batch)
    with ThreadPoolExecutor(1) as scoring:  # as the router scores batches over INLINE_SCORING_BYTES
        scoring.submit(state.batch, batches[0]).result()
        started = time.process_time()
        for batch in batches[1:]:
            scoring.submit(state.batch, batch).result()
        return (time.process_time() - started) / (len(batches) - 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--rows", type=int, default=256, help="requests (one bf16 row each) per step")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--probes", type=int, default=10)
    parser.add_argument("--blocks", type=int, default=1, help="blocks (layers) per step")
    parser.add_argument("--rounds", type=int, default=1, help="measure each end this many times")
    parser.add_argument("--service-heap", action="store_true",
                        help="import vLLM, torch and transformers first, as the engine service process does")
    parser.add_argument("--no-gc-freeze", dest="gc_freeze", action="store_false",
                        help="leave the setup's heap to the garbage collector (the services freeze it)")
    parser.add_argument("--out", default="stream_cpu.json", help="file name under bench/results/")
    args = parser.parse_args()
    if args.service_heap:
        for module in ("transformers", "vllm.v1.engine.async_llm", "engine_service.service.app", "engine_service.service.runtime"):
            importlib.import_module(module)
    started, rounds = time.time(), []
    for number in range(args.rounds):
        drain_s, link_s, collections, frozen = asyncio.run(engine(args))
        rounds.append({"engine_drain_ms": drain_s * 1e3, "engine_link_ms": link_s * 1e3,
                       "router_ms": router(args) * 1e3, "engine_gc_collections": collections.count,
                       "engine_gc_ms": collections.ms, "engine_gc_longest_ms": collections.longest_ms,
                       "engine_frozen_objects": frozen})
        print(f"round {number}: engine drain {rounds[-1]['engine_drain_ms']:.2f} ms, engine link "
              f"{rounds[-1]['engine_link_ms']:.2f} ms, router {rounds[-1]['router_ms']:.2f} ms CPU per step "
              f"({args.blocks} block(s) of {args.rows} rows x {args.hidden} bf16, {args.probes} probes); "
              f"{frozen} objects frozen; engine collections per generation {collections.count}, "
              f"{' / '.join(f'{ms:.0f}' for ms in collections.ms)} ms (longest "
              f"{' / '.join(f'{ms:.0f}' for ms in collections.longest_ms)}); "
              f"load average {os.getloadavg()[0]:.1f}", flush=True)
    results_file.write_rounds(args.out, started, args, "CPU ms per step", rounds)


if __name__ == "__main__":
    main()
