"""How many bytes a router that stops reading takes in before the engine's writes
block: the HTTP/2 flow-control window the engine's send queue sits behind.

    python -m bench.router_window [--message-kib 64] [--block-s 1.0]

A RouterDouble (a real grpc.aio server speaking the Session protocol) stops
reading its stream; a client writes ActivationBatch messages until one write has
not completed for --block-s. Run twice, with gRPC's default BDP probing (the
window grows with the measured link) and with `grpc.http2.bdp_probe=0` (HTTP/2's
fixed 64 KiB window). Writes bench/results/router_window.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

from grpc import aio

from tools.router_double import RouterDouble
from undercurrent.v1 import router_session_pb2 as session_pb
from undercurrent.v1 import router_session_pb2_grpc as session_pb_grpc

RESULTS = Path(__file__).resolve().parent / "results" / "router_window.json"
MODES = {"bdp_probing": [], "fixed_window": [("grpc.http2.bdp_probe", 0)]}


async def absorbed_bytes(transport_options, message_bytes: int, block_s: float, limit_s: float) -> dict:
    router = RouterDouble("window", probes=[])
    router.transport_options = transport_options
    await router.start()
    router.reading.clear()
    channel = aio.insecure_channel(router.address)
    call = session_pb_grpc.ProbeRouterServiceStub(channel).Session()
    message = session_pb.SessionRequest()
    message.batch.step = 1
    message.batch.blocks.add().rows.data = b"\0" * message_bytes
    size, written, started = message.ByteSize(), 0, time.monotonic()
    try:
        while time.monotonic() - started < limit_s:
            try:
                await asyncio.wait_for(call.write(message), block_s)
            except TimeoutError:
                break
            written += size
    finally:
        call.cancel()
        await channel.close()
        await router.kill()
    return {"bytes_written_before_a_write_blocked": written, "seconds": round(time.monotonic() - started, 2)}


async def run(args) -> dict:
    results = {}
    for name, options in MODES.items():
        results[name] = await absorbed_bytes(options, args.message_kib * 1024, args.block_s, args.limit_s)
        print(f"{name}: {results[name]['bytes_written_before_a_write_blocked'] / 1e6:.2f} MB written "
              f"before a write blocked for {args.block_s} s", file=sys.stderr)
    return {"command": "python -m " + " ".join(["bench.router_window", *sys.argv[1:]]),
            "message_kib": args.message_kib, "block_s": args.block_s, "results": results}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--message-kib", type=int, default=64, help="rows bytes per ActivationBatch")
    parser.add_argument("--block-s", type=float, default=1.0, help="a write pending this long counts as blocked")
    parser.add_argument("--limit-s", type=float, default=30.0, help="give up after this long")
    args = parser.parse_args()
    report = asyncio.run(run(args))
    RESULTS.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report["results"], indent=1))


if __name__ == "__main__":
    main()
