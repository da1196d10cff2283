"""Router memory and CPU per open request: resident memory of a real router
process as one Session opens requests bound to probes, none of them ended, and
the router's CPU per request_start (its process, gRPC included).

    python -m bench.router_memory [--requests 1000,5000,10000] [--probes 4] [--out router_memory.json]

Reads the router's RSS (tools.process_memory: its process tree, the router alone) after each level, once the router has
acknowledged an empty batch sent after the last request_start (so every start
was processed); the CPU is the router's user and system time over each level,
less the sleep before reading memory. Writes bench/results/router_memory.json (or `--out`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import psutil

from bench import results_file
from common.probe_format.files import write_probe
from tools import processes
from tools.process_memory import tree_memory
from tools.session_client import SessionClient
from undercurrent.v1 import types_pb2 as types_pb

HIDDEN = 1024


def rss_kib(pid: int) -> int:
    return tree_memory(pid).rss_bytes // 1024


def cpu_seconds(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system


async def run(args) -> dict:
    levels = [int(n) for n in args.requests.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        names = []
        for i in range(args.probes):
            name = f"p{i}"
            write_probe(Path(tmp) / name, {
                "name": name, "version": "1", "kind": "logistic", "tensor_type": "residual_stream",
                "layers": [1], "hidden_size": HIDDEN, "dtype": "float32", "threshold": 0.99,
                "action": "abort"}, {"weight": np.zeros(HIDDEN), "bias": np.array([0.0])})
            names.append(name)
        router = processes.router(processes.free_port(), Path(tmp), "--max-requests-per-session",
                                  str(max(levels)), secure=False).start()
        try:
            await router.wait_health(timeout=120)
            client = SessionClient(router.port)
            await client.open(types_pb.ModelInfo(model="bench-model", hidden_size=HIDDEN, num_layers=4, dtype="bfloat16",
                                           tensor_types=[types_pb.TENSOR_TYPE_RESIDUAL_STREAM]))
            await client.sync()
            rows = [{"open_requests": 0, "rss_kib": rss_kib(router.process.pid)}]
            opened = 0
            process = psutil.Process(router.process.pid)
            for level in levels:
                before, starts = cpu_seconds(process), level - opened
                while opened < level:
                    client.start(f"req-{opened}", *names, prompt_tokens=16)
                    opened += 1
                await client.sync()
                cpu_ms_per_start = (cpu_seconds(process) - before) / starts * 1000
                await asyncio.sleep(0.5)
                rows.append({"open_requests": level, "rss_kib": rss_kib(router.process.pid),
                             "router_cpu_ms_per_start": round(cpu_ms_per_start, 3)})
                print(rows[-1], flush=True)
            await client.close()
        finally:
            router.kill()
    base = rows[0]["rss_kib"]
    for row in rows[1:]:
        row["kib_per_1000_requests"] = (row["rss_kib"] - base) / row["open_requests"] * 1000
    return {"probes_per_request": args.probes, "rows": rows}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", default="1000,5000,10000", help="open-request levels, ascending")
    parser.add_argument("--probes", type=int, default=4, help="probes bound to every request")
    parser.add_argument("--out", default="router_memory.json", help="file name under bench/results/")
    args = parser.parse_args()
    started = time.time()
    report = {**results_file.provenance(started), **asyncio.run(run(args))}
    results_file.write(args.out, report)
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
