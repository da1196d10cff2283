"""What one large gRPC bidi message costs each end in CPU, by channel options.

    python -m bench.grpc_transport [--bytes 800000] [--messages 300] [--rounds 2] [--out FILE]

A bare grpc.aio bidi stream on loopback (bytes in, one byte back per message,
no protobuf): the floor under every step the engine service writes to a router.
The server runs in a process of its own and reports its CPU time. Options
compared, round by round: gRPC's defaults (the project's channels use them),
16 MiB HTTP/2 frames, a fixed 16 MiB stream window without BDP probing, both,
and an 8 MiB write buffer; and gRPC's defaults over a Unix socket instead of
TCP on loopback (on loopback the kernel also delivers each write to the receiving
socket inside the sender's `sendmsg`; a router on the engine's host could listen
on a Unix socket). Writes bench/results/grpc_transport.json (or --out).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import resource
import statistics
import tempfile
import time

import grpc
from grpc import aio

from bench import results_file

LIMITS = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]
BIG_FRAMES = [("grpc.http2.max_frame_size", (16 << 20) - 1)]
FIXED_WINDOW = [("grpc.http2.lookahead_bytes", 16 << 20), ("grpc.http2.bdp_probe", 0)]
OPTIONS = {
    "defaults": [],
    "16MiB_frames": BIG_FRAMES,
    "16MiB_fixed_window": FIXED_WINDOW,
    "frames_and_window": BIG_FRAMES + FIXED_WINDOW,
    "8MiB_write_buffer": [("grpc.http2.write_buffer_size", 8 << 20)],
    "unix_socket": [],
}
UNIX_SOCKET_MODES = {"unix_socket"}
IN_FLIGHT = 4
CPU_QUERY = b"cpu?"


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def serve(options: list, listen: str, targets: multiprocessing.Queue) -> None:
    async def echo_ack(messages, context):
        async for message in messages:
            yield json.dumps(cpu_seconds()).encode() if message == CPU_QUERY else b"a"

    handler = grpc.method_handlers_generic_handler(
        "bench.Transport", {"Stream": grpc.stream_stream_rpc_method_handler(echo_ack)})
    server = aio.server(options=LIMITS + options)
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port(listen)
    await server.start()
    targets.put(listen if listen.startswith("unix:") else f"127.0.0.1:{port}")
    await server.wait_for_termination()


def server_process(options: list, listen: str, targets: multiprocessing.Queue) -> None:
    asyncio.run(serve(options, listen, targets))


async def measure(options: list, target: str, size: int, count: int) -> dict:
    """Wall and CPU milliseconds per message, sender and receiver."""
    async with aio.insecure_channel(target, options=LIMITS + options) as channel:
        call = channel.stream_stream("/bench.Transport/Stream")()

        async def server_cpu() -> float:
            await call.write(CPU_QUERY)
            return json.loads(await call.read())

        payload = os.urandom(size)
        await call.write(payload)
        await call.read()  # connected and warm
        server_before, client_before, started = await server_cpu(), cpu_seconds(), time.monotonic()
        window = asyncio.Semaphore(IN_FLIGHT)

        async def read_acks() -> None:
            for _ in range(count):
                await call.read()
                window.release()

        reader = asyncio.create_task(read_acks())
        for _ in range(count):
            await window.acquire()
            await call.write(payload)
        await reader
        wall, client = time.monotonic() - started, cpu_seconds() - client_before
        server = await server_cpu() - server_before
        await call.done_writing()
    return {"wall_ms": 1e3 * wall / count, "sender_cpu_ms": 1e3 * client / count,
            "receiver_cpu_ms": 1e3 * server / count}


def run_one(options: list, unix_socket: bool, size: int, count: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="grpc-transport-") as directory:
        listen = f"unix:{directory}/stream.sock" if unix_socket else "127.0.0.1:0"
        targets: multiprocessing.Queue = multiprocessing.Queue()
        server = multiprocessing.Process(target=server_process, args=(options, listen, targets), daemon=True)
        server.start()
        try:
            return asyncio.run(measure(options, targets.get(timeout=30), size, count))
        finally:
            server.kill()
            server.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bytes", type=int, default=800_000, help="bytes per message (a batch-8 step of every "
                        "type at every layer of the bench model is 0.8 MB)")
    parser.add_argument("--messages", type=int, default=300, help="messages measured per round and option")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default="grpc_transport.json", help="file name under bench/results/")
    args = parser.parse_args()
    started, rounds = time.time(), {name: [] for name in OPTIONS}
    for number in range(args.rounds):
        for name, options in OPTIONS.items():
            result = run_one(options, name in UNIX_SOCKET_MODES, args.bytes, args.messages)
            rounds[name].append(result)
            print(f"round {number} {name:20s} wall {result['wall_ms']:.2f} ms  sender CPU "
                  f"{result['sender_cpu_ms']:.2f} ms  receiver CPU {result['receiver_cpu_ms']:.2f} ms per message",
                  flush=True)
    medians = {name: {key: statistics.median(r[key] for r in results) for key in results[0]}
               for name, results in rounds.items()}
    results_file.write(args.out, {
        **results_file.provenance(started),
        "grpcio": grpc.__version__,
        "args": vars(args),
        "options": {name: [list(o) for o in options] for name, options in OPTIONS.items()},
        "rounds": rounds,
        "medians": medians,
    })


if __name__ == "__main__":
    main()
