"""Router scaling: the engine link to one router replica against two, under a router-bound load.

    python -m bench.router_scaling [--probes 1000] [--rounds 4] [--seconds 3] [--out router_scaling.json]

Replicas add capacity when the routers, not the engine, limit the stream. Here
the load makes them the limit: every request of a step (256 requests x one
bf16 row of 4096, as in `bench.stream_throughput`) is bound to `--probes`
logistic probes on the streamed layer, so a router spends many times the
sender's CPU per step. The sender is the engine's own `RouterLink` (requests
spread over the replicas by rendezvous hashing, each replica sent its rows of
every step), with 8 steps in flight; rounds alternate one replica and two, all
router processes started before the first round. Two replicas and the sender
share this machine's cores, so two replicas can approach 2x one only while the
sender's CPU per step is small against a router's: the report gives both.

Reports rows/s per arm (sums over rounds), their ratio, and CPU milliseconds
per step of the sender (this process) and of the routers (all replicas of the
arm together), and writes them to bench/results/router_scaling.json (or `--out`).
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # before numpy: the routers' BLAS

import argparse  # noqa: E402
import asyncio  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import psutil  # noqa: E402

from bench import results_file  # noqa: E402
from bench.stream_throughput import Result, drive_link, payloads, start_router, write_probes  # noqa: E402


async def run(args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        started = time.perf_counter()
        names = write_probes(Path(tmp), args.probes, args.hidden)
        routers = [start_router(tmp, Path(tmp) / f"router{i}.log") for i in range(2)]
        print(f"{len(routers)} routers with {args.probes} probes each up in {time.perf_counter() - started:.1f} s",
              flush=True)
        (first, first_port), (second, second_port) = routers
        processes = [psutil.Process(first.pid), psutil.Process(second.pid)]
        try:
            tensors = payloads(args.rows, args.hidden)
            arms: dict[str, list[Result]] = {"1 replica": [], "2 replicas": []}
            for number in range(args.rounds):
                arms["1 replica"].append(await drive_link(
                    "engine link -> 1 router replica", first_port, args, names, tensors, processes[:1]))
                arms["2 replicas"].append(await drive_link(
                    "engine link -> 2 router replicas", [first_port, second_port], args, names, tensors, processes))
                print(f"round {number}: " + ", ".join(
                    f"{arm} {results[-1].rows_per_second:,.0f} rows/s" for arm, results in arms.items()), flush=True)
        finally:
            for proc, _ in routers:
                proc.terminate()
            for proc, _ in routers:
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
    totals = {arm: sum(results[1:], results[0]) for arm, results in arms.items()}
    one, two = totals["1 replica"], totals["2 replicas"]
    return {
        "arms": {arm: {"steps": r.steps, "seconds": r.seconds, "rows_per_s": r.rows_per_second,
                       "rows_per_s_per_round": [x.rows_per_second for x in arms[arm]],
                       "ack_p50_ms": r.ack_p50_ms, "ack_p99_ms": r.ack_p99_ms,
                       "sender_cpu_ms_per_step": r.cpu_ms_per_step(r.sender_cpu),
                       "routers_cpu_ms_per_step": r.cpu_ms_per_step(r.server_cpu)}
                 for arm, r in totals.items()},
        "two_over_one": two.rows_per_second / one.rows_per_second,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--probes", type=int, default=1000, help="probes every request is bound to")
    parser.add_argument("--rounds", type=int, default=4, help="turns each arm takes")
    parser.add_argument("--seconds", type=float, default=3.0, help="measured seconds per round and arm")
    parser.add_argument("--rows", type=int, default=256, help="requests (rows) per step")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--window", type=int, default=8, help="steps in flight")
    parser.add_argument("--warmup", type=int, default=10, help="steps before each measured round")
    parser.add_argument("--out", default="router_scaling.json", help="file name under bench/results/")
    args = parser.parse_args()
    started = time.time()
    report = asyncio.run(run(args))
    for arm, figures in report["arms"].items():
        print(f"{arm}: {figures['rows_per_s']:,.0f} rows/s, CPU ms per step: sender "
              f"{figures['sender_cpu_ms_per_step']:.1f}, routers {figures['routers_cpu_ms_per_step']:.1f}")
    print(f"two replicas / one: {report['two_over_one']:.2f}x")
    results_file.write(args.out, {**results_file.provenance(started), "args": vars(args), **report})


if __name__ == "__main__":
    main()
