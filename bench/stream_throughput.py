"""Engine-to-router stream throughput, against raw gRPC bidi of the same payloads.

Three servers run as separate processes on loopback: the real router
(`python -m router_service`, 10 logistic probes, every request bound to all of
them); an ack-only servicer that answers every batch with its StepAck and
nothing else (the ceiling the transport sets); and an arithmetic-only servicer
that does what no router can skip for those probes before the ack, the rows
widened, checked finite and projected by the router's own
`ProjectionPlan.evaluate` (the ceiling a numpy router reaches on these cores:
no field checks, order, rule or state). Two
senders feed them the same rows, taking turns round by round:
  engine link   the engine's own path: `RouterLink.send_step` of merged blocks
                (bf16 bits, as the capture workers ship them) -> partition per
                replica -> split by size -> ActivationBatch -> bounded queue ->
                Session stream; acks come back as processed positions
  raw gRPC      a bare grpc.aio bidi client writing prebuilt ActivationBatch
                messages of the same rows
Each step is one decode step of `--rows` requests: one bf16 row of `--hidden`
each. Both keep `--window` steps in flight. Results and the exact command go to
bench/results/stream_throughput.md and .json (`--out STEM` for another stem), with
the CPU each sender and server process spent per measured step.

    python -m bench.stream_throughput [--rounds 4] [--seconds 2] [--rows 256] [--hidden 4096] [--out STEM]
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # before numpy: the servers' BLAS as in the router

import argparse
import asyncio
import json
import platform
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import psutil

from bench import results_file
from common import tensor_codec
from common.activations import Block
from common.grpc_server import SERVICE_FULL_NAMES, channel_options, start_server
from common.probe_format.files import load_probe_path, probe_paths, write_probe
from common.probe_format.probes import ProjectionPlan
from tools.processes import free_port
from undercurrent.v1 import router_session_pb2 as session_pb
from undercurrent.v1 import types_pb2 as types_pb
from undercurrent.v1 import router_session_pb2_grpc as session_pb_grpc

REPO = Path(__file__).resolve().parent.parent
LAYER = 16
STALL_SECONDS = 30.0


class AckOnly(session_pb_grpc.ProbeRouterServiceServicer):
    """The transport alone: hello answered, every batch acknowledged, nothing decoded."""

    router_id = "ack-only"

    def process(self, batch: types_pb.ActivationBatch) -> None:
        """What the server does with a batch before its ack: nothing."""

    async def Session(self, request_iterator, context):
        async for message in request_iterator:
            kind = message.WhichOneof("message")
            if kind == "hello":
                yield session_pb.SessionResponse(hello=session_pb.RouterHello(router_id=self.router_id))
            elif kind == "batch":
                self.process(message.batch)
                yield session_pb.SessionResponse(ack=session_pb.StepAck(step=message.batch.step))


class ArithmeticOnly(AckOnly):
    """The probes' arithmetic alone: each batch's rows widened, checked finite and
    projected through every probe at once, then acknowledged."""

    router_id = "arithmetic-only"

    def __init__(self, probes_dir: Path):
        self.plan = ProjectionPlan(tuple(load_probe_path(path) for path in probe_paths(probes_dir)))

    def process(self, batch: types_pb.ActivationBatch) -> None:
        for block in batch.blocks:
            self.plan.evaluate([tensor_codec.decode(block.rows, as_float32=False)], block.rows.dtype)


async def serve(servicer: AckOnly) -> None:
    handle = await start_server(
        [(session_pb_grpc.add_ProbeRouterServiceServicer_to_server, servicer, SERVICE_FULL_NAMES["ProbeRouterService"])],
        "127.0.0.1", 0,
    )
    print(f"listening on 127.0.0.1:{handle.port}", flush=True)
    await handle.server.wait_for_termination()


@dataclass
class Result:
    name: str
    steps: int
    seconds: float
    rows_per_step: int
    bytes_per_step: int
    ack_ms: np.ndarray
    sender_cpu: float  # CPU seconds over the measured steps: this process
    server_cpu: float  # and the server processes

    def __add__(self, other: "Result") -> "Result":
        return Result(self.name, self.steps + other.steps, self.seconds + other.seconds,
                      self.rows_per_step, self.bytes_per_step, np.concatenate([self.ack_ms, other.ack_ms]),
                      self.sender_cpu + other.sender_cpu, self.server_cpu + other.server_cpu)

    def cpu_ms_per_step(self, seconds: float) -> float:
        return seconds / max(self.steps, 1) * 1e3

    @property
    def ack_p50_ms(self) -> float:
        return float(np.percentile(self.ack_ms, 50))

    @property
    def ack_p99_ms(self) -> float:
        return float(np.percentile(self.ack_ms, 99))

    @property
    def rows_per_second(self) -> float:
        return self.steps * self.rows_per_step / self.seconds

    @property
    def megabytes_per_second(self) -> float:
        return self.steps * self.bytes_per_step / self.seconds / 1e6


def payloads(rows: int, hidden: int, count: int = 4) -> list[types_pb.Tensor]:
    rng = np.random.default_rng(0)
    return [tensor_codec.encode(rng.normal(size=(rows, hidden)).astype(np.float32), "bfloat16")
            for _ in range(count)]


def cpu_seconds(processes: list[psutil.Process]) -> float:
    """User + system CPU seconds the processes (their threads included) have used."""
    return sum(sum(p.cpu_times()[:2]) for p in processes)


async def drive(name: str, port: int, args, probe_names: list[str], tensors: list[types_pb.Tensor],
                servers: list[psutil.Process]) -> Result:
    """One round: streams steps for args.seconds with args.window in flight; counts acked steps."""
    model = types_pb.ModelInfo(model="bench", hidden_size=args.hidden, num_layers=32, dtype="bfloat16",
                         tensor_types=[types_pb.TENSOR_TYPE_RESIDUAL_STREAM])
    request_ids = [f"req-{i}" for i in range(args.rows)]
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=channel_options()) as channel:
        call = session_pb_grpc.ProbeRouterServiceStub(channel).Session()
        await call.write(session_pb.SessionRequest(hello=session_pb.SessionHello(engine_id="bench", model=model)))
        hello = await call.read()
        assert hello.WhichOneof("message") == "hello", hello
        digests = {p.name: p.digest for p in hello.hello.probes}
        bindings = [session_pb.SessionBinding(probe=p, digest=digests[p]) for p in probe_names]
        for rid in request_ids:
            await call.write(session_pb.SessionRequest(request_start=session_pb.RequestStart(
                request_id=rid, bindings=bindings, prompt_tokens=1)))
        window = asyncio.Semaphore(args.window)
        sent_at: dict[int, float] = {}
        latencies: list[float] = []
        acked = 0
        problems: list[str] = []

        async def read_acks() -> None:
            nonlocal acked
            while (message := await call.read()) is not grpc.aio.EOF:
                kind = message.WhichOneof("message")
                if kind == "ack":
                    latencies.append(time.perf_counter() - sent_at.pop(message.ack.step))
                    acked += 1
                    window.release()
                elif kind in ("error", "abort"):
                    problems.append(str(message))

        reader = asyncio.create_task(read_acks())
        step, start = 0, None
        deadline = None
        measured_from = 0
        while deadline is None or time.perf_counter() < deadline:
            try:
                await asyncio.wait_for(window.acquire(), STALL_SECONDS)
            except TimeoutError:
                raise RuntimeError(f"{name}: no ack for {STALL_SECONDS} s; reader: {reader}") from None
            step += 1
            if step == args.warmup + 1:  # measure after the warm-up steps were acked
                while acked < args.warmup:
                    await asyncio.sleep(0.001)
                start, measured_from = time.perf_counter(), acked
                cpu_from = (time.process_time(), cpu_seconds(servers))
                latencies.clear()
                deadline = start + args.seconds
            block = types_pb.ActivationBlock(
                point="resid", tensor_type=types_pb.TENSOR_TYPE_RESIDUAL_STREAM, layer=LAYER, rows=tensors[step % len(tensors)],
                request_index=range(args.rows), token_positions=[step] * args.rows,
                is_generated=[True] * args.rows)
            sent_at[step] = time.perf_counter()
            await call.write(session_pb.SessionRequest(batch=types_pb.ActivationBatch(
                step=step, request_ids=request_ids, blocks=[block])))
        drained_by = time.perf_counter() + STALL_SECONDS
        while sent_at and time.perf_counter() < drained_by:
            await asyncio.sleep(0.001)
        elapsed = time.perf_counter() - start
        sender_cpu, server_cpu = time.process_time() - cpu_from[0], cpu_seconds(servers) - cpu_from[1]
        await call.done_writing()
        reader.cancel()
        if problems:
            raise RuntimeError(f"{name}: unexpected messages: {problems[:3]}")
    return Result(name, acked - measured_from, elapsed, args.rows, len(tensors[0].data),
                  np.array(latencies) * 1e3, sender_cpu, server_cpu)


async def drive_link(name: str, ports: int | list[int], args, probe_names: list[str],
                     tensors: list[types_pb.Tensor], servers: list[psutil.Process]) -> Result:
    """One round through the engine's RouterLink (to one replica or several):
    send_step of merged blocks, window by acks."""
    ports = [ports] if isinstance(ports, int) else ports
    from engine_service.link import Processed, RouterLink, RouterLinkConfig
    from engine_service.request.ledger import RequestLedger

    model = types_pb.ModelInfo(model="bench", hidden_size=args.hidden, num_layers=32, dtype="bfloat16",
                         tensor_types=[types_pb.TENSOR_TYPE_RESIDUAL_STREAM])
    request_ids = [f"req-{i}" for i in range(args.rows)]
    bits = [tensor_codec.unpack(t.dtype, t.shape, t.data, as_float32=False) for t in tensors]
    # Like the engine, react to the link's Processed events rather than poll every
    # ledger: per request, the last position acknowledged.
    through = {rid: -1 for rid in request_ids}
    progressed = asyncio.Event()

    def on_event(event) -> None:
        if isinstance(event, Processed):
            through[event.request_id] = ledgers[event.request_id].releasable_through()
            progressed.set()

    link = RouterLink(RouterLinkConfig(targets=",".join(f"127.0.0.1:{p}" for p in ports), engine_id="bench",
                                       queue_max_batches=4 * args.window), model, on_event)
    await link.start()
    try:
        await link.wait_ready(replicas=len(ports), timeout=STALL_SECONDS)
        bindings = [types_pb.ProbeBinding(probe=p, failure_policy=types_pb.FAILURE_POLICY_FAIL_OPEN) for p in probe_names]
        ledgers = {rid: RequestLedger(prompt_tokens=1, policies={p: types_pb.FAILURE_POLICY_FAIL_OPEN for p in probe_names})
                   for rid in request_ids}
        for rid in request_ids:
            link.start_request(rid, 1, bindings, 1, ledgers[rid])
        acked_at: dict[int, float] = {}
        sent_at: dict[int, float] = {}

        def acked() -> int:
            return min(through.values())

        async def progress() -> None:
            progressed.clear()
            try:
                await asyncio.wait_for(progressed.wait(), STALL_SECONDS)
            except TimeoutError:
                raise RuntimeError(f"{name}: no ack for {STALL_SECONDS} s") from None

        step, start, deadline, measured_from = 0, None, None, 0
        while deadline is None or time.perf_counter() < deadline:
            while step - acked() >= args.window:
                await progress()
            done = acked()
            for s in [s for s in sent_at if s <= done and s not in acked_at]:
                acked_at[s] = time.perf_counter()
            step += 1
            if step == args.warmup + 1:
                while acked() < args.warmup:
                    await progress()
                start, measured_from = time.perf_counter(), acked()
                cpu_from = (time.process_time(), cpu_seconds(servers))
                sent_at.clear()
                acked_at.clear()
                deadline = start + args.seconds
            rows = bits[step % len(bits)]
            sent_at[step] = time.perf_counter()
            link.send_step([Block("resid", types_pb.TENSOR_TYPE_RESIDUAL_STREAM, LAYER, rows, request_ids,
                                  np.full(args.rows, step, dtype=np.int64), np.ones(args.rows, dtype=bool),
                                  "bfloat16")])
        while acked() < step:
            await progress()
        elapsed = time.perf_counter() - start
        sender_cpu, server_cpu = time.process_time() - cpu_from[0], cpu_seconds(servers) - cpu_from[1]
        done = acked()
        for s in [s for s in sent_at if s <= done and s not in acked_at]:
            acked_at[s] = time.perf_counter()
        latencies = [acked_at[s] - sent_at[s] for s in sent_at if s in acked_at]
        dropped = sum(ledger.dropped_records + len(ledger.failures) for ledger in ledgers.values())
        if dropped:
            reasons = {f.reason for ledger in ledgers.values() for f in ledger.failures}
            raise RuntimeError(f"{name}: {dropped} rows or failures were not scored: {sorted(reasons)[:3]}")
        return Result(name, done - measured_from, elapsed, args.rows, len(tensors[0].data),
                      np.array(latencies) * 1e3, sender_cpu, server_cpu)
    finally:
        await link.close()


def start_process(argv: list[str], log: Path) -> tuple[subprocess.Popen, int]:
    proc = subprocess.Popen([sys.executable, *argv], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=log.open("w"), text=True)
    line = proc.stdout.readline()
    match = re.search(r":(\d+)$", line.strip())
    if not match:
        proc.kill()
        raise RuntimeError(f"{argv}: did not start: {line!r}")
    return proc, int(match.group(1))


def start_router(probes_dir: str, log: Path, *flags: str) -> tuple[subprocess.Popen, int]:
    """A router process on a free loopback port, plaintext, serving probes_dir."""
    return start_process(["-m", "router_service", "--port", "0", "--host", "127.0.0.1", "--probes", probes_dir,
                          "--insecure", *flags], log)


def router_batch_seconds(metrics_port: int) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
    total = float(re.search(r"^undercurrent_router_batch_seconds_sum (\S+)", text, re.M).group(1))
    count = float(re.search(r"^undercurrent_router_batch_seconds_count (\S+)", text, re.M).group(1))
    return total / count


def write_probes(directory: Path, count: int, hidden: int) -> list[str]:
    rng = np.random.default_rng(1)
    names = []
    for i in range(count):
        name = f"linear_{i}"
        manifest = dict(name=name, version="1", kind="logistic", tensor_type="residual_stream",
                        layers=[LAYER], hidden_size=hidden, dtype="bfloat16",
                        threshold=0.999999, action="abort", rule={"patience": 3})
        weight = rng.normal(size=hidden) / np.sqrt(hidden)
        write_probe(directory / name, manifest, {"weight": weight, "bias": np.array([-8.0])})
        names.append(name)
    return names


def report(args, results: list[Result], batch_ms: float) -> str:
    link_router, raw_router, link_ack, raw_ack, raw_arithmetic, one_replica, two_replicas = results
    command = "python -m bench.stream_throughput" + "".join(f" {a}" for a in sys.argv[1:])
    lines = [
        "# Engine-to-router stream throughput",
        "",
        f"Command: `{command}`",
        "",
        f"Date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; host: {platform.machine()}, "
        f"{os.cpu_count()} cores (shared), Python {platform.python_version()}, grpcio {grpc.__version__}, "
        f"numpy {np.__version__}; load average {os.getloadavg()[0]:.1f} at the end (other jobs share "
        "the cores). Client and servers on one machine over loopback.",
        "",
        f"Stream: one decode step per message, {args.rows} requests x 1 bf16 row of {args.hidden} "
        f"({raw_ack.bytes_per_step / 1e6:.2f} MB of activations per step), {args.window} steps in "
        f"flight. Sender and server pairs take turns, {args.rounds} rounds of {args.warmup} warm-up "
        f"steps and {args.seconds:g} s measured each, so load from other jobs hits all alike. "
        f"Router: {args.probes} logistic probes on the streamed layer, every request bound to all "
        "of them (action abort; no rule fires, so the replies are the acks alone). Engine link: "
        "the engine's RouterLink sending merged blocks; raw gRPC: a bare bidi client sending "
        "prebuilt messages of the same rows.",
        "",
        "| sender -> server | steps | rows/s | MB/s | ack p50 ms | ack p99 ms | CPU ms per step: sender / server |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in results:
        lines.append(f"| {r.name} | {r.steps} | {r.rows_per_second:,.0f} | {r.megabytes_per_second:,.1f} "
                     f"| {r.ack_p50_ms:.1f} | {r.ack_p99_ms:.1f} "
                     f"| {r.cpu_ms_per_step(r.sender_cpu):.2f} / {r.cpu_ms_per_step(r.server_cpu):.2f} |")
    lines += [
        "",
        f"- Engine link -> router / raw gRPC -> ack-only (the target's ratio): "
        f"{link_router.rows_per_second / raw_ack.rows_per_second:.2f}.",
        f"- Engine link / raw gRPC, both to the ack-only server (the engine side's own cost): "
        f"{link_ack.rows_per_second / raw_ack.rows_per_second:.2f}.",
        f"- Router / ack-only, both fed by raw gRPC (the router's own cost): "
        f"{raw_router.rows_per_second / raw_ack.rows_per_second:.2f}. At the router's rate a step took "
        f"{raw_router.seconds / max(raw_router.steps, 1) * 1e3:.1f} ms; {batch_ms:.1f} ms of it went to "
        "decoding and scoring (its `undercurrent_router_batch_seconds` metric; on its event loop for "
        "batches up to 4 MiB of rows), "
        "the rest to gRPC, protobuf parsing and the event loop, which share the two cores with the client.",
        f"- Arithmetic-only / ack-only, both fed by raw gRPC (what widening, checking and projecting "
        f"the rows through {args.probes} probes, and nothing else, leaves of the transport's rate on "
        f"these cores): {raw_arithmetic.rows_per_second / raw_ack.rows_per_second:.2f}; the router "
        f"reaches {raw_router.rows_per_second / raw_arithmetic.rows_per_second:.2f} of it.",
        f"- Router scaling, the engine link to two replicas against one (alternating rounds after the "
        f"rows above): {two_replicas.rows_per_second / one_replica.rows_per_second:.2f}x. Both replicas "
        "share this machine's two cores with the sender, so this measures the link's spreading, not "
        "capacity that a second machine would add.",
        "",
    ]
    return "\n".join(lines)


async def run(args) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        names = write_probes(Path(tmp), args.probes, args.hidden)
        metrics_port = free_port()
        router_log = Path(tmp) / "router.log"
        router, router_port = start_router(tmp, router_log, "--metrics-port", str(metrics_port))
        raw, raw_port = start_process(["-m", "bench.stream_throughput", "--serve-ack-only"],
                                      Path(tmp) / "ack_only.log")
        arithmetic, arithmetic_port = start_process(
            ["-m", "bench.stream_throughput", "--serve-arithmetic-only", tmp], Path(tmp) / "arithmetic_only.log")
        second, second_port = start_router(tmp, Path(tmp) / "router2.log")
        try:
            tensors = payloads(args.rows, args.hidden)
            on = {port: [psutil.Process(proc.pid)] for proc, port in
                  ((router, router_port), (raw, raw_port), (arithmetic, arithmetic_port), (second, second_port))}
            rounds = [(await drive_link(f"engine link -> router, {args.probes} probes", router_port, args, names, tensors,
                                        on[router_port]),
                       await drive(f"raw gRPC -> router, {args.probes} probes", router_port, args, names, tensors,
                                   on[router_port]),
                       await drive_link("engine link -> ack-only", raw_port, args, [], tensors, on[raw_port]),
                       await drive("raw gRPC -> ack-only", raw_port, args, [], tensors, on[raw_port]),
                       await drive(f"raw gRPC -> arithmetic-only, {args.probes} probes", arithmetic_port, args,
                                   [], tensors, on[arithmetic_port]))
                      for _ in range(args.rounds)]
            results = [sum(r[1:], r[0]) for r in zip(*rounds)]
            batch_ms = router_batch_seconds(metrics_port) * 1e3
            # Router scaling: the same engine link and load, one replica against two.
            scaling = [(await drive_link("engine link -> 1 router replica", router_port, args, names, tensors,
                                         on[router_port]),
                        await drive_link("engine link -> 2 router replicas", [router_port, second_port], args,
                                         names, tensors, on[router_port] + on[second_port]))
                       for _ in range(args.rounds)]
            results += [sum(r[1:], r[0]) for r in zip(*scaling)]
        finally:
            for proc in (router, raw, arithmetic, second):
                proc.terminate()
            for proc in (router, raw, arithmetic, second):
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    print(f"{proc.args[:3]} did not stop on SIGTERM; router log tail:\n"
                          + "".join(router_log.read_text().splitlines(True)[-5:]), file=sys.stderr)
    text = report(args, results, batch_ms)
    out = args.out if args.out.is_absolute() else results_file.RESULTS / args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text(text)
    out.with_suffix(".json").write_text(json.dumps({
        "command": "python -m bench.stream_throughput" + "".join(f" {a}" for a in sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "router_batch_ms": batch_ms,
        "results": [{"name": r.name, "steps": r.steps, "seconds": r.seconds, "rows_per_s": r.rows_per_second,
                     "mb_per_s": r.megabytes_per_second, "ack_p50_ms": r.ack_p50_ms, "ack_p99_ms": r.ack_p99_ms,
                     "sender_cpu_ms_per_step": r.cpu_ms_per_step(r.sender_cpu),
                     "server_cpu_ms_per_step": r.cpu_ms_per_step(r.server_cpu)}
                    for r in results]}, indent=1))
    print(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=2.0, help="measured seconds per round and server")
    parser.add_argument("--rounds", type=int, default=4, help="turns each server takes")
    parser.add_argument("--rows", type=int, default=256, help="requests (rows) per step")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--probes", type=int, default=10)
    parser.add_argument("--window", type=int, default=8, help="steps in flight")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--out", type=Path, default=Path("stream_throughput"),
                        help="results stem under bench/results (or absolute): STEM.md and STEM.json")
    parser.add_argument("--serve-ack-only", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--serve-arithmetic-only", type=Path, metavar="PROBES_DIR", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_ack_only:
        asyncio.run(serve(AckOnly()))
    elif args.serve_arithmetic_only:
        asyncio.run(serve(ArithmeticOnly(args.serve_arithmetic_only)))
    else:
        asyncio.run(run(args))


if __name__ == "__main__":
    main()
