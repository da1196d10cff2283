"""The garbage collector's runs while a benchmark measures, from `gc.callbacks`;
and the round and command line of the benchmarks of what open requests cost
the collector (`bench.session_gc` for a router, `bench.engine_request_gc` for
the engine service)."""

from __future__ import annotations

import argparse
import gc
import json
import time
from collections.abc import Callable
from typing import Self

from bench import results_file


class Collections:
    """The collections CPython runs while the block runs: per generation, how many,
    their milliseconds in all and the longest one (what held the thread longest),
    and each full collection with what `label` says of that moment."""

    def __init__(self, label: Callable[[], dict] = dict) -> None:
        self.label = label
        self.count, self.ms, self.longest_ms = [0, 0, 0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]
        self.full: list[dict] = []  # per full collection: label() and its milliseconds
        self._started = 0.0

    def __enter__(self) -> Self:
        gc.callbacks.append(self._on)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._on)

    def _on(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        generation, ms = info["generation"], 1e3 * (time.perf_counter() - self._started)
        self.count[generation] += 1
        self.ms[generation] += ms
        self.longest_ms[generation] = max(self.longest_ms[generation], ms)
        if generation == 2:
            self.full.append({**self.label(), "ms": round(ms, 1)})


def open_requests_round(requests: int, start_all: Callable[[], None], end_all: Callable[[], None],
                        open_requests: Callable[[], int]) -> dict:
    """One round: `start_all()` opens `requests` requests, timed (CPU ms per request)
    with the collections CPython runs meanwhile; then, every request open, the
    objects the collector tracks and a full collection's wall ms; then
    `end_all()` ends them, timed."""
    gc.collect()
    with Collections(lambda: {"open_requests": open_requests()}) as seen:
        started = time.process_time()
        start_all()
        start_ms = (time.process_time() - started) / requests * 1000
    tracked = len(gc.get_objects())
    paused = time.perf_counter()
    gc.collect()
    pause_ms = (time.perf_counter() - paused) * 1000
    started = time.process_time()
    end_all()
    end_ms = (time.process_time() - started) / requests * 1000
    measured = {"start_ms": round(start_ms, 3), "end_ms": round(end_ms, 3), "full_collection_ms": round(pause_ms, 1),
                "tracked_objects": tracked, "collections_while_starting": seen.full}
    print(measured, flush=True)
    return measured


def open_requests_main(doc: str, run_round: Callable[[argparse.Namespace], Callable[[], dict]],
                       requests: int, requests_help: str, out: str) -> int:
    """The command line of such a benchmark: `run_round(args)` sets up, then returns
    the function that measures one round (`open_requests_round`); writes every
    round and the medians to bench/results/`out` (or `--out`)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--probes", type=int, default=1000, help="probes bound to every request")
    parser.add_argument("--requests", type=int, default=requests, help=requests_help)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=out, help="file name under bench/results/")
    args = parser.parse_args()
    started = time.time()
    measure = run_round(args)
    rounds = [measure() for _ in range(args.rounds)]
    report = results_file.write_rounds(
        args.out, started, args, "start_ms, end_ms: CPU ms per request; full_collection_ms: wall ms", rounds,
        probes_per_request=args.probes, requests=args.requests)
    print(json.dumps(report["medians"]))
    return 0
