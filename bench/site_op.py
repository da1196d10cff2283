"""What one call of the capture sites' op costs a real vLLM worker, without the capture.

Under compilation every capture site is a call of `undercurrent::capture` in the
model's graph, made at every step whether or not a request captures (25 sites per
step on the bench model with every type on every layer, 33 on the embedded one):
the op's dispatch is a fixed cost per site and step. This starts one capture
engine (compiled, as Undercurrent runs on CPU), serves one batch so the worker is
in its serving state, then sends each worker a function (`collective_rpc`) that
calls the op `--calls` times on a decode step's worth of rows with no receiver,
under `torch.no_grad` and under `torch.inference_mode`, and reports microseconds
per call (median of `--rounds`). Run it alternately against another tree to
compare two ways of defining the op.

    python -m bench.site_op [--model embedded|bench] [--calls 20000] [--rounds 5] [--out site_op.json]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time

from bench import results_file
from bench.overhead import MODELS, make_model
from bench.split_points import serve_batch


def time_site_op(worker, calls: int, rounds: int) -> dict:
    """Sent to each worker: microseconds per call of the op with no receiver, per context."""
    import torch

    from engine_service.capture.worker import sites

    rows = torch.zeros(8, worker.vllm_config.model_config.get_hidden_size())
    keep_alive = torch.zeros(1)
    receiver, sites._receiver = sites._receiver, None
    try:
        result = {}
        for name, context in (("no_grad", torch.no_grad), ("inference_mode", torch.inference_mode)):
            with context():
                result[name] = []
                for _ in range(rounds):
                    started = time.perf_counter()
                    for _ in range(calls):
                        torch.ops.undercurrent.capture(rows, None, 0, 0, keep_alive)
                    result[name].append((time.perf_counter() - started) / calls * 1e6)
        return result
    finally:
        sites._receiver = receiver


async def run(args) -> dict:
    from tools.capture_engines import capture_engine

    model = make_model(args.model)
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # the timing function is sent to the workers
    async with capture_engine(str(model), max_model_len=512) as (engine, _):
        await serve_batch(engine, 8, 16, "warm")
        [per_context] = await engine.collective_rpc(time_site_op, args=(args.calls, args.rounds))
    return {"model": MODELS[args.model], "us_per_call": per_context}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="bench")
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default="site_op.json", help="file name under bench/results/")
    args = parser.parse_args()
    started = time.time()
    report = asyncio.run(run(args))
    rounds = [{context: values[r] for context, values in report["us_per_call"].items()}
              for r in range(args.rounds)]
    summary = results_file.write_rounds(args.out, started, args, "microseconds per call of the op",
                                        rounds, model=report["model"])
    print(", ".join(f"{context}: {us:.2f} us per call" for context, us in summary["medians"].items()))


if __name__ == "__main__":
    main()
