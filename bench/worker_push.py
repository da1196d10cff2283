"""CPU per step of moving a step's captured rows from a worker to the engine service.

    python -m bench.worker_push [--steps 200] [--rounds 3] [--out worker_push.json]

A worker process pushes steps over the real ZeroMQ socket (`capture.worker.pusher.Pusher`,
the parts built from views of one step buffer, as the worker's drain builds
them), and this process takes them as the engine service does (`Sink.receive`,
then `decode_parts`). One step at a time: the worker pushes the next step once
the service read the last, as a step's forward pass spaces them. Reports process
CPU milliseconds per step on each side (time.process_time, so ZeroMQ's I/O
threads count; the worker's is all its CPU but filling the step buffers) per
round and their median, for these shapes:

- every type at every layer of the bench model at batch 8: 25 blocks of 8 float32
  rows of 1024 (0.8 MB per step);
- three types on one layer at batch 256 of a 4096-wide bfloat16 model (6 MB);
- every type at every layer of an 8-layer, 4096-wide bfloat16 model at batch 32
  (25 blocks, 6.5 MB).

The step buffer is allocated and filled outside the timed part (the worker's
capture sites fill it during the forward pass). Run it alternately against
another tree for a same-run comparison.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import time

import numpy as np

from bench import results_file
from common.activations import Block, decode_parts, encode_part
from engine_service.capture.worker.pusher import Pusher
from engine_service.capture.driver.sink import Sink
from undercurrent.v1 import types_pb2 as types_pb

SHAPES = {  # name -> (blocks, rows per block, hidden, numpy dtype of the rows, wire dtype)
    "bench model, every type, batch 8 (0.8 MB)": (25, 8, 1024, np.float32, "float32"),
    "4096 bf16, 3 types on one layer, batch 256 (6 MB)": (3, 256, 4096, np.uint16, "bfloat16"),
    "4096 bf16, every type on 8 layers, batch 32 (6.5 MB)": (25, 32, 4096, np.uint16, "bfloat16"),
}
PACE_S = 0.0005  # the worker's poll for the service's read (sleeping, so not CPU)


def worker(address: dict, shape: tuple, steps: int, results) -> None:
    """Pushes `steps` steps, each after the service read the last; sends back CPU s per step."""
    blocks, rows, hidden, dtype, wire_dtype = shape
    pusher = Pusher(address, 0)
    request_ids = [f"req-{i}" for i in range(rows)]
    filling = 0.0
    started = time.process_time()
    for step in range(1, steps + 1):
        filled = time.process_time()
        buffer = np.empty((blocks * rows, hidden), dtype)
        buffer.fill(step)
        positions, flags = np.full(rows, 16 + step, np.int64), np.ones(rows, bool)
        filling += time.process_time() - filled
        parts = [encode_part(Block(f"p{b % 4}", types_pb.TENSOR_TYPE_RESIDUAL_STREAM, b // 4,
                                   buffer[b * rows : (b + 1) * rows], request_ids, positions, flags, wire_dtype),
                             copy=False)
                 for b in range(blocks)]
        pusher.push({"rank": 0, "parts": parts, "gaps": [], "errors": []})
        while pusher.held_bytes:  # ZeroMQ's I/O thread writes the step meanwhile: its CPU counts
            time.sleep(PACE_S)
    cpu = time.process_time() - started - filling
    pusher.close()
    results.put(cpu / steps)


async def service(shape: tuple, steps: int) -> tuple[float, float]:
    """(worker, service) CPU ms per step for one shape."""
    sink = Sink()
    results = multiprocessing.get_context("spawn").Queue()
    process = multiprocessing.get_context("spawn").Process(
        target=worker, args=(sink.address.as_dict(), shape, steps, results))
    process.start()
    cpu, taken, rows = 0.0, 0, 0
    try:
        while taken < steps:
            started = time.process_time()
            shipments = await sink.receive(10)
            blocks = decode_parts(p for s in shipments for p in s["parts"])
            cpu += time.process_time() - started
            taken += len(shipments)
            rows += sum(b.num_rows for b in blocks)
            if not shipments:
                raise RuntimeError("the worker sent nothing for 10 s")
        worker_s = results.get(timeout=60)
    finally:
        process.join(60)
        sink.close()
    assert rows == steps * shape[0] * shape[1], (rows, steps, shape)
    return worker_s * 1e3, cpu / steps * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="worker_push.json", help="file name under bench/results/")
    args = parser.parse_args()
    started, rounds = time.time(), []
    for number in range(args.rounds):
        measured = {}
        for name, shape in SHAPES.items():
            worker_ms, service_ms = asyncio.run(service(shape, args.steps))
            measured[name] = {"worker_ms": worker_ms, "service_ms": service_ms}
            print(f"round {number}: {name}: worker {worker_ms:.3f} ms, service {service_ms:.3f} ms per step",
                  flush=True)
        rounds.append(measured)
    results_file.write_rounds(args.out, started, args, "CPU ms per step", rounds)


if __name__ == "__main__":
    main()
