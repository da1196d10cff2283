"""CPU per step of a worker's capture plan: which rows each site copies.

    python -m bench.capture_plan [--steps 2000] [--rounds 3] [--out capture_plan.json]

Before every forward pass a capturing worker maps the step's flat batch to its
registered requests' points and joins each point's rows over the requests
(`RowMapper.plan`), on the worker's own thread, so this time adds to the step.
Decode steps (one row per request) of three shapes: every type at every layer
of the bench model at batch 8 (residual, attention and MLP outputs on 8 layers
and the final norm: 25 sites), and three types on one layer at batch 32 and
256. Reports process CPU milliseconds per step (time.process_time) per round
and their median; run it alternately against another tree for a same-run
comparison.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from bench import results_file
from common.capture_spec import ExtractionPoint, Scope, TokenSelector
from engine_service.capture.worker.row_mapping import Registration, RowMapper

LAYERS = 8  # the bench model's
PROMPT = 16
SHAPES = {
    "batch 8, every type at every layer": (8, True),
    "batch 32, three types on one layer": (32, False),
    "batch 256, three types on one layer": (256, False),
}


def points(every_layer: bool) -> tuple[ExtractionPoint, ...]:
    layers = tuple(range(LAYERS)) if every_layer else (1,)
    chosen = tuple(ExtractionPoint(f"p_{t}", t, layers, TokenSelector(Scope.ALL))
                   for t in ("residual_stream", "attn_out", "mlp_out"))
    if every_layer:
        chosen += (ExtractionPoint("p_norm", "final_norm", (), TokenSelector(Scope.ALL)),)
    return chosen


def plan_ms(requests: int, every_layer: bool, steps: int) -> float:
    mapper = RowMapper(range(LAYERS), LAYERS, has_final_norm=True)
    for i in range(requests):
        mapper.register(Registration(f"req-{i}", points(every_layer), PROMPT))
    internal_ids = [f"req-{i}-0123abcd" for i in range(requests)]  # as vLLM suffixes them
    query_start_loc = np.arange(requests + 1)
    started = time.process_time()
    for step in range(steps):
        mapper.plan(internal_ids, query_start_loc, np.full(requests, PROMPT + step))
    return (time.process_time() - started) / steps * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="capture_plan.json", help="file name under bench/results/")
    args = parser.parse_args()
    started, rounds = time.time(), []
    for number in range(args.rounds):
        rounds.append({name: plan_ms(requests, every_layer, args.steps)
                       for name, (requests, every_layer) in SHAPES.items()})
        print(f"round {number}: " + "; ".join(f"{name}: {ms:.3f} ms" for name, ms in rounds[-1].items()),
              flush=True)
    results_file.write_rounds(args.out, started, args, "CPU ms per step", rounds)


if __name__ == "__main__":
    main()
