"""The engine service's per-step post-processing, without vLLM: worker parts ->
merge -> exactly-once filter -> forward-order gate -> per-replica partition ->
ActivationBatch messages, timed on one synthetic decode step.

    python -m bench.postprocess [--requests 256] [--layers 32] [--hidden 4096] [--repeat 5] [--out F]

Each worker part is what a capture worker ships for one (point, layer): one
bf16 row per request, requests in batch order under ids like clients' (hex
digests, `bench.overhead.request_ids`), decoded as the drain decodes a step
(`decode_parts`: the step's parts share one key set). Prints the median
milliseconds per stage and writes bench/results/postprocess.json (or --out).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np

from bench import results_file
from bench.overhead import request_ids
from common.activations import Block, decode_parts, encode_part, to_batch
from engine_service.link import batching
from engine_service.link.assignment import pick_replica
from engine_service.capture.driver.merge import DeliveredPositions, ForwardOrderGate, merge_blocks
from undercurrent.v1 import types_pb2 as types_pb

def worker_parts(ids: list[str], layers: int, hidden: int, step: int) -> list[dict]:
    rng = np.random.default_rng(step)
    requests = len(ids)
    positions = np.full(requests, 100 + step, dtype=np.int64)
    return [
        encode_part(Block(f"probe.residual_stream.{layer}", types_pb.TENSOR_TYPE_RESIDUAL_STREAM, layer,
                          rng.integers(0, 2**16, size=(requests, hidden), dtype=np.uint16), ids, positions,
                          np.ones(requests, dtype=bool), "bfloat16"))
        for layer in range(layers)
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--out", default="postprocess.json", help="file name under bench/results/")
    args = parser.parse_args()
    started = time.time()
    replicas = [f"router-{i}" for i in range(args.replicas)]
    ids = request_ids("req", args.requests)
    owner = {request_id: pick_replica(request_id, replicas) for request_id in ids}
    delivered, gate = DeliveredPositions(), ForwardOrderGate()
    times: dict[str, list[float]] = {}

    def timed(name, fn, *a):
        start = time.perf_counter()
        out = fn(*a)
        times.setdefault(name, []).append((time.perf_counter() - start) * 1e3)
        return out

    for step in range(args.repeat):
        parts = worker_parts(ids, args.layers, args.hidden, step)
        blocks = timed("decode_parts", decode_parts, parts)
        blocks = timed("merge_blocks", merge_blocks, blocks)
        blocks = timed("DeliveredPositions.filter", delivered.filter, blocks)
        blocks = timed("ForwardOrderGate.release", gate.release, blocks, set())
        by_owner = timed("partition_by_owner", batching.partition_by_owner, blocks, owner.get)
        timed("split + to_batch", lambda: [to_batch(p) for part in by_owner.values()
                                           for p in batching.split_by_size(part, 64 << 20)])
    medians = {name: statistics.median(values) for name, values in times.items()}
    total = sum(medians.values())
    print(f"{args.requests} requests x {args.layers} layers x {args.hidden} bf16, {args.replicas} replicas; "
          f"median of {args.repeat} steps")
    for name, ms in medians.items():
        print(f"  {name:<28} {ms:8.3f} ms")
    print(f"  {'total':<28} {total:8.3f} ms")
    results_file.write(args.out, {**results_file.provenance(started), "args": vars(args),
                                  "median_ms": medians, "total_ms": total})
    return 0


if __name__ == "__main__":
    sys.exit(main())
