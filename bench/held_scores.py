"""CPU per request and step of showing a router's scores to the client, by the
probes bound to the request.

    python -m bench.held_scores [--probes 4,100,1000] [--steps 50] [--rounds 3] [--out held_scores.json]

A router sends one ProbeScores message per binding and step, just before the
step's StepAck; the engine service holds each until the request's ledger
counts its rows scored (`request.gate.HeldScores`), on its event loop. Each
step here: the step's rows queued and sent on the ledger, one message per
bound probe taken as the engine takes a Scores event, then the ack and the
release the engine runs on it. Reports CPU ms per request and step
(time.process_time) per round and the medians; run it alternately against
another tree for a same-run comparison.
"""

from __future__ import annotations

import argparse
import time

from bench import results_file
from common.capture_spec import TokenSelector
from engine_service.request.gate import HeldScores
from engine_service.request.ledger import LedgerBinding, RequestLedger
from engine_service.request.probe_points import point_name
from undercurrent.v1 import types_pb2 as types_pb

PROMPT = 16
LAYERS = 8  # the bench model's: a probe over every layer scores 8 rows a token


def step_ms(probes: int, steps: int) -> float:
    names = [f"probe_{i}" for i in range(probes)]
    points = tuple(point_name("residual_stream", layer) for layer in range(LAYERS))
    ledger = RequestLedger(PROMPT, [LedgerBinding(name, False, False, points, TokenSelector()) for name in names])
    held, shown = HeldScores(), 0
    started = time.process_time()
    for step in range(1, steps + 1):
        position = PROMPT + step
        ledger.computed_below(position)
        message = ledger.queued("router", {point: [position] for point in points}, 0.0)
        ledger.sent(message, step)
        for name in names:
            shown += len(held.add(types_pb.ProbeScores(request_id="r", probe=name, token_positions=[position] * LAYERS,
                                                 scores=[0.5] * LAYERS), ledger, position + 1))
        ledger.acknowledged(message)
        shown += len(held.release(ledger, position + 1))
    elapsed = time.process_time() - started
    assert shown == probes * steps, (shown, probes, steps)
    return elapsed / steps * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--probes", default="4,100,1000", help="probes bound to the request, comma-separated")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="held_scores.json", help="file name under bench/results/")
    args = parser.parse_args()
    counts = [int(p) for p in args.probes.split(",")]
    started, rounds = time.time(), []
    for number in range(args.rounds):
        rounds.append({str(probes): step_ms(probes, args.steps) for probes in counts})
        print(f"round {number}: " + "; ".join(f"{p} probes: {ms:.3f} ms" for p, ms in rounds[-1].items()),
              flush=True)
    results_file.write_rounds(args.out, started, args, "CPU ms per request and step", rounds)


if __name__ == "__main__":
    main()
