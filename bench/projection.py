"""CPU per batch of the router's arithmetic: rows widened, checked finite and projected.

    python -m bench.projection [--repeats 200] [--rounds 3] [--out projection.json]

`ProjectionPlan.evaluate` works through a batch's bf16 rows a slice of
`probes.SLICE_BYTES` float32 bytes at a time, so each slice is still in the
core's cache for the finiteness check and the product. This sweeps the slice
size on batches of four shapes, 10 logistic probes each, against one slice
holding the whole batch (three passes over a float32 copy of it, as the router
did before slicing), on one BLAS thread as in the router. Reports process CPU
milliseconds per batch (time.process_time), per round and their median.
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # before numpy: the router's BLAS

import argparse  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

from bench import results_file  # noqa: E402
from common import tensor_codec  # noqa: E402
from common.probe_format import probes  # noqa: E402
from common.probe_format.manifest import manifest_from_dict  # noqa: E402

PROBES = 10
# name -> (blocks, rows per block, hidden)
SHAPES = {
    "one layer, 256 requests, hidden 4096": (1, 256, 4096),
    "one layer, 2048 requests, hidden 4096": (1, 2048, 4096),
    "one layer, 512 requests, hidden 8192": (1, 512, 8192),
    "25 blocks of 8 requests, hidden 1024": (25, 8, 1024),
}
WHOLE = 1 << 40  # one slice for the whole batch
SLICES = {"32 KiB": 32 << 10, "64 KiB": 64 << 10, "128 KiB": 128 << 10, "256 KiB": 256 << 10,
          "512 KiB": 512 << 10, "1 MiB": 1 << 20, "whole batch": WHOLE}


def plan(hidden: int, rng: np.random.Generator) -> probes.ProjectionPlan:
    built = []
    for i in range(PROBES):
        manifest = manifest_from_dict({"name": f"p{i}", "version": "1", "kind": "logistic",
                                       "tensor_type": "residual_stream", "layers": [0],
                                       "hidden_size": hidden, "dtype": "bfloat16", "threshold": 0.5,
                                       "action": "observe"})
        built.append(probes.build_probe(manifest, {"weight": rng.normal(size=hidden) / np.sqrt(hidden),
                                                   "bias": np.array([-1.0])}))
    return probes.ProjectionPlan(tuple(built))


def batch_ms(shape: tuple[int, int, int], slice_bytes: int, repeats: int) -> float:
    count, rows, hidden = shape
    rng = np.random.default_rng(0)
    blocks = [tensor_codec.float32_to_bfloat16_bits(rng.normal(size=(rows, hidden)).astype(np.float32))
              for _ in range(count)]
    projection = plan(hidden, rng)
    probes.SLICE_BYTES = slice_bytes
    projection.evaluate(blocks, "bfloat16")
    started = time.process_time()
    for _ in range(repeats):
        projection.evaluate(blocks, "bfloat16")
    return (time.process_time() - started) / repeats * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=200, help="batches per measurement")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="projection.json", help="file name under bench/results/")
    args = parser.parse_args()
    started, rounds = time.time(), []
    for number in range(args.rounds):
        rounds.append({shape: {size: batch_ms(SHAPES[shape], slice_bytes, max(10, args.repeats * 256 // (
            SHAPES[shape][0] * SHAPES[shape][1]))) for size, slice_bytes in SLICES.items()} for shape in SHAPES})
        for shape, by_size in rounds[-1].items():
            print(f"round {number}, {shape}: " + ", ".join(f"{s} {ms:.3f}" for s, ms in by_size.items()) + " ms",
                  flush=True)
    results_file.write_rounds(args.out, started, args, "CPU ms per batch", rounds, probes=PROBES)


if __name__ == "__main__":
    main()
