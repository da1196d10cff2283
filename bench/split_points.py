"""What the capture op costs the host as a graph split point, in one run.

Where vLLM replays CUDA graphs (GPU), capture makes its op one of the points
vLLM's piecewise backend splits the model at (`engine_service/capture/graphs.py`),
so every capture site runs between graph pieces. Each split point adds work per
step on the host: one more piece for the backend to dispatch (on a GPU, one more
graph replay) and the op's call between pieces. There is no GPU here, so both
engines run vLLM's piecewise backend on CPU without graphs
(`tools.capture_engines.vllm_piecewise_on_cpu`): the same sites, capture
started, no request capturing; they differ only in the split points:
  unsplit   vLLM's own split points (attention), the sites run inside the pieces
  split     the same plus the capture op, as capture configures a GPU engine
Rounds alternate the engines (order rotated), each a batch of greedy requests;
the step time is the batch's seconds over its tokens. The run is made twice,
each engine started first once (the second-started engine ran faster here,
whichever it was), and the host's cost per split point is the mean of the two
runs' differences of median step times over the extra points vLLM's
compilation counters report. What this leaves out on a GPU: a graph
replay's launch per piece (a few microseconds) and the device time, which the
host's work overlaps unless the step is host-bound.

    python -m bench.split_points [--model embedded|bench] [--rounds 8] [--batch 8] [--tokens 64]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from contextlib import AsyncExitStack
from pathlib import Path
from unittest import mock

from bench import results_file
from bench.overhead import MODELS, make_model
from engine_service.capture import graphs

MODES = ("unsplit", "split")


async def serve_batch(engine, batch: int, tokens: int, tag: str) -> float:
    """Seconds for `batch` concurrent greedy requests of `tokens` tokens each."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)

    async def one(i: int) -> None:
        async for _ in engine.generate({"prompt_token_ids": [3 + (i * 7 + j) % 500 for j in range(8)]},
                                       params, f"{tag}-{i}"):
            pass

    started = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(batch)))
    return time.perf_counter() - started


async def measure(model: Path, first: str, args) -> dict:
    """Both engines, `first` started first; alternating rounds; their step times."""
    from tools.capture_engines import capture_engine, split_points, vllm_piecewise_on_cpu

    engines, points = {}, {}
    async with AsyncExitStack() as stack:
        with vllm_piecewise_on_cpu() as piecewise:
            for mode in sorted(MODES, key=lambda m: m != first):
                print(f"starting the {mode} engine ...", flush=True)
                with mock.patch.object(graphs, "graphs_replay_without_python", lambda m=mode: m == "split"):
                    engine, _ = await stack.enter_async_context(capture_engine(
                        str(model), compilation_config=dict(piecewise), max_model_len=512))
                engines[mode] = engine
                [(_, points[mode])] = await engine.collective_rpc(split_points)
        for mode in MODES:  # warm-up
            await serve_batch(engines[mode], args.batch, args.tokens, f"warm-{mode}")
        steps: dict[str, list[float]] = {mode: [] for mode in MODES}
        for r in range(args.rounds):
            for mode in MODES[r % 2:] + MODES[: r % 2]:
                seconds = await serve_batch(engines[mode], args.batch, args.tokens, f"{mode}-{r}")
                steps[mode].append(seconds / args.tokens * 1000)
            print(f"{first} first, round {r}: "
                  + ", ".join(f"{m} {steps[m][-1]:.2f} ms/step" for m in MODES), flush=True)
    median = {mode: statistics.median(values) for mode, values in steps.items()}
    return {
        "split_points": points,
        "step_ms": {mode: [round(v, 3) for v in values] for mode, values in steps.items()},
        "median_step_ms": {mode: round(v, 3) for mode, v in median.items()},
        "split_minus_unsplit_ms": round(median["split"] - median["unsplit"], 3),
    }


async def run(args) -> dict:
    model = make_model(args.model)
    name = MODELS[args.model]
    # The counters are read by a function sent to the workers.
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    # The engine started second ran 4-8% faster here whichever it was, more than the
    # split points cost: each order runs, and their mean difference cancels that.
    orders = {first: await measure(model, first, args) for first in MODES}
    points = orders["split"]["split_points"]
    extra = points["split"] - points["unsplit"]
    difference = statistics.mean(order["split_minus_unsplit_ms"] for order in orders.values())
    unsplit = statistics.mean(order["median_step_ms"]["unsplit"] for order in orders.values())
    return {
        **results_file.provenance(),
        "model": name, "batch": args.batch, "tokens": args.tokens, "rounds": args.rounds,
        "orders": {f"{first}_first": order for first, order in orders.items()},
        "extra_split_points": extra,
        "split_over_unsplit": round((unsplit + difference) / unsplit, 4),
        "host_us_per_extra_split_point": round(difference / extra * 1000, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="embedded")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--out", default="split_points.json", help="under bench/results/")
    args = parser.parse_args()
    report = asyncio.run(run(args))
    print({k: report[k] for k in ("extra_split_points", "split_over_unsplit",
                                  "host_us_per_extra_split_point")})
    results_file.write(args.out, report)


if __name__ == "__main__":
    main()
