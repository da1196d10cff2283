"""Engine memory per capture mode, and whether capture memory stays within the
configured bounds when a router, a client or the engine service stops reading.

    python -m bench.memory                           # bench model, batch 8
    python -m bench.memory --model embedded --tokens 32

Measures the engine's process tree (the engine service, vLLM's engine core and
its workers: `tools.process_memory`, the sum of RSS and of PSS) every
--interval seconds, per phase: its first, peak and last value, and each
process's peak. The engine runs with MALLOC_MMAP_THRESHOLD_ (--malloc-mmap-threshold)
so freed buffers leave RSS and each phase's peak is its own. Two engine
processes run one after the other, each started fresh:

Engine A, linked to a real router process (the probes of bench.overhead):
  idle          after start-up, before any request
  off           --rounds x --batch concurrent requests, no probe, no extraction point
  one_layer     one observe probe on one layer's residual stream
  all_router    every tensor type at every layer, every token, to the router
  all_client    the same streamed to the client

Engine B, linked to a router double in this process (tests/engine_link) that
offers the same probes; its server keeps HTTP/2's 64 KiB window (no BDP
probing), so a router that stops reading pushes back on the engine:
  idle          after start-up
  reading       one round of every type at every layer to the router, which reads and acks
  router_stalled     the router stops reading (its session stays alive): the
                     send queue fills to --send-queue-bytes and drops by policy
  router_no_acks     the router reads every batch but acknowledges none
  client_stalled     every type at every layer streamed to clients that read
                     nothing until generation ends: --client-queue-bytes per stream
  service_stalled    the engine service is stopped (SIGSTOP) for --stop-seconds
                     while its workers capture every type at every layer, then
                     resumed: --capture-backlog-bytes per worker (also reported:
                     what each process gained while the service was stopped,
                     and the requests that ended because a worker dropped
                     their rows: ended_by_backlog_bound)
  router_resumed, acks_released, clients_read: --idle-seconds after the phase
                     before, nothing running: what was kept
Each stalled phase reports the configured bound next to its growth over the
phase before it, and the drops the engine counted (its metrics and the
requests' finished.dropped_records). Requests bind their probes fail_open, so
every request runs to its end whatever is dropped.

Progress goes to stderr; the result to bench/results/memory.json (--out).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import grpc  # noqa: E402

from bench import results_file  # noqa: E402
from bench.overhead import MODELS, TENSOR_TYPES, Workload, generate_request, write_probes  # noqa: E402
from common import embedded_model  # noqa: E402
from tools import processes  # noqa: E402
from tools.process_memory import MemorySampler, Phase, process_name, tree_memory  # noqa: E402
from tools.router_double import RouterDouble  # noqa: E402
from tools.stack import scrape, wait_for_probe  # noqa: E402
from undercurrent.v1 import engine_pb2 as engine_pb  # noqa: E402
from undercurrent.v1 import types_pb2 as types_pb  # noqa: E402
from undercurrent.v1 import engine_pb2_grpc as engine_pb_grpc  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
MIB = 1024 * 1024
# HTTP/2's initial window: what a peer that stops reading leaves the sender, per stream.
NO_BDP = [("grpc.http2.bdp_probe", 0)]


def say(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def double_probes(config: dict) -> list[types_pb.ProbeInfo]:
    """What the router process offers for bench.overhead's all_* probes."""
    layers = list(range(config["num_hidden_layers"]))
    return [types_pb.ProbeInfo(name=f"all_{name}", kind=types_pb.PROBE_KIND_NORM, tensor_type=tensor_type,
                         layers=[] if name == "final_norm" else layers, hidden_size=config["hidden_size"],
                         dtype="float32", action=types_pb.PROBE_ACTION_OBSERVE, threshold=1e30, version="1",
                         tokens=types_pb.TokenSelector(scope=types_pb.TokenSelector.SCOPE_ALL))
            for name, tensor_type in TENSOR_TYPES]


def dropped_by_reason(values: dict[str, float]) -> dict[str, float]:
    """The engine's dropped-row counters (router link and client queues), by label."""
    prefixes = ("undercurrent_router_link_dropped_records_total", "undercurrent_engine_dropped_records")
    return {k: v for k, v in values.items()
            if k.startswith(prefixes) and not k.split("{")[0].endswith("_created")}


class Engine:
    """One engine service process, its gRPC stub and its memory sampler."""

    def __init__(self, args, router_address: str, *flags: str):
        self.args = args
        self.metrics_port = processes.free_port()
        self.service = processes.engine(str(args.model_path), router_address, "--metrics-port",
                                        str(self.metrics_port), "--failure-policy", "fail_open", *flags,
                                        secure=False, max_model_len=args.max_model_len)
        if args.malloc_mmap_threshold:
            self.service.env["MALLOC_MMAP_THRESHOLD_"] = str(args.malloc_mmap_threshold)
        self.layers = args.config["num_hidden_layers"]
        self.channel = None
        self.stub = None
        self.sampler: MemorySampler | None = None
        self.tokens_seen = 0  # by every request so far

    async def start(self) -> None:
        self.service.start()
        await self.service.wait_health(timeout=300)
        # Stalled clients get HTTP/2's initial window alone, like the stalled router.
        self.channel = grpc.aio.insecure_channel(self.service.address, options=NO_BDP)
        self.stub = engine_pb_grpc.EngineServiceStub(self.channel)
        self.sampler = MemorySampler(self.service.process.pid, self.args.interval).__enter__()
        root = self.service.process.pid
        self.names = {pid: "engine_service" if pid == root else process_name(pid)
                      for pid in self.sampler.phase("start").pids}

    async def close(self) -> None:
        if self.sampler:
            self.sampler.finish()
            self.sampler.__exit__(None, None, None)
        if self.channel:
            await self.channel.close()
        self.service.kill()

    def metrics(self) -> dict[str, float]:
        return dropped_by_reason(scrape(self.metrics_port))

    async def one(self, message: engine_pb.GenerateRequest, read_after: float = 0.0,
                  backlog_drops: bool = False) -> engine_pb.GenerateFinished:
        """One request to its end; with read_after, the stream is left unread that long first.
        backlog_drops: the request may end early because a worker dropped its rows
        at --capture-backlog-bytes (what the service_stalled phase provokes)."""
        call = self.stub.Generate(message, timeout=600)
        if read_after:
            await asyncio.sleep(read_after)
        finished = None
        tokens = 0
        async for response in call:
            kind = response.WhichOneof("event")
            if kind == "tokens":
                tokens += len(response.tokens.token_ids)
                self.tokens_seen += len(response.tokens.token_ids)
            elif kind == "finished":
                finished = response.finished
        if backlog_drops and finished is not None and ended_by_backlog_bound(finished):
            return finished
        if finished is None or tokens != self.args.tokens:
            raise RuntimeError(f"{message.request_id}: {tokens} tokens, finished {finished}\n"
                               f"the engine's log ends:\n{self.service.log_tail(60)}")
        return finished

    async def load(self, mode: str, tag: str, workload: Workload, rounds: int, read_after: float = 0.0,
                   backlog_drops: bool = False) -> dict:
        """rounds x batch concurrent requests of one mode; what the requests report."""
        finished = []
        for r in range(rounds):
            messages = [generate_request(mode, f"{tag}-r{r}-{i}", prompt, self.args.tokens, self.layers)
                        for i, prompt in enumerate(workload.prompts(self.args.batch))]
            started = time.monotonic()
            finished += await asyncio.gather(*[self.one(m, read_after, backlog_drops) for m in messages])
            say(f"  {tag} round {r}: {len(messages)} requests in {time.monotonic() - started:.1f} s")
        return {"requests": len(finished),
                "dropped_records": sum(f.dropped_records for f in finished),
                "unprobed_tokens": sum(f.unprobed_tokens for f in finished),
                "ended_by_backlog_bound": sum(ended_by_backlog_bound(f) for f in finished)}

    def phase(self, name: str) -> Phase:
        phase = self.sampler.phase(name)
        say(f"{name}: tree {phase.first.rss_bytes / MIB:,.0f} MiB RSS, pids {list(phase.first.pids)}")
        return phase


def ended_by_backlog_bound(finished: engine_pb.GenerateFinished) -> bool:
    return finished.finish_reason == types_pb.FINISH_REASON_ERROR and "--capture-backlog-bytes" in finished.message


def summary(phase: Phase, idle: Phase, before: Phase | None = None, names: dict[int, str] | None = None) -> dict:
    """A phase's figures in MiB: first, peak and last, and growth over idle's last value
    (and over the phase before it, for the stalled phases)."""

    def mib(value):
        return None if value is None else round(value / MIB, 1)

    row = {"phase": phase.name, "samples": phase.samples, "processes": len(phase.pids),
           "rss_first": mib(phase.first.rss_bytes), "rss_peak": mib(phase.peak_rss),
           "rss_last": mib(phase.last.rss_bytes), "pss_first": mib(phase.first.pss_bytes),
           "pss_peak": mib(phase.peak_pss), "pss_last": mib(phase.last.pss_bytes),
           "rss_peak_over_idle": mib(phase.peak_rss - idle.last.rss_bytes),
           "pss_peak_over_idle": mib(None if phase.peak_pss is None or idle.last.pss_bytes is None
                                     else phase.peak_pss - idle.last.pss_bytes)}
    names = names or {}
    row["rss_peak_by_process"] = {names.get(pid, str(pid)): mib(peak) for pid, peak in phase.peak_rss_by_pid.items()}
    if before is not None:
        row["rss_peak_over_previous_by_process"] = {
            names.get(pid, str(pid)): mib(peak - before.last.rss_by_pid.get(pid, 0))
            for pid, peak in phase.peak_rss_by_pid.items()}
        row["rss_peak_over_previous"] = mib(phase.peak_rss - before.last.rss_bytes)
        row["pss_peak_over_previous"] = mib(None if phase.peak_pss is None or before.last.pss_bytes is None
                                            else phase.peak_pss - before.last.pss_bytes)
    return row


async def idle_phase(engine: Engine, seconds: float) -> Phase:
    idle = engine.phase("idle")
    await asyncio.sleep(seconds)
    return idle


async def engine_a(args, workload: Workload) -> list[dict]:
    """Idle and the four capture modes of bench.overhead, on a real router."""
    probes_dir = REPO / ".cache" / "bench-probes" / args.model_path.name
    write_probes(probes_dir, args.config)
    router = processes.router(processes.free_port(), probes_dir, secure=False).start()
    engine = Engine(args, router.address)
    rows = []
    try:
        await router.wait_health(timeout=120)
        say("engine A (real router): starting ...")
        await engine.start()
        idle = await idle_phase(engine, args.idle_seconds)
        engine.phase("catalog_check")  # one 1-token request per probe; not reported
        for probe in ["one_layer", *(f"all_{name}" for name, _ in TENSOR_TYPES)]:
            await wait_for_probe(engine.stub, probe, timeout=60)
        rows.append(summary(idle, idle, names=engine.names))
        for mode, name in (("uc_off", "off"), ("uc_one_layer", "one_layer"),
                           ("uc_all_router", "all_router"), ("uc_all_client", "all_client")):
            phase = engine.phase(name)
            before = engine.metrics()
            requests = await engine.load(mode, name, workload, args.rounds)
            row = summary(phase, idle, names=engine.names)
            row.update(requests, dropped_metrics=delta(before, engine.metrics()))
            rows.append(row)
    finally:
        await engine.close()
        router.kill()
    return rows


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v - before.get(k, 0.0)}


async def engine_b(args, workload: Workload) -> list[dict]:
    """The bounds: a router that stops reading, one that never acks, clients
    that stop reading, and an engine service that stops reading its workers."""
    router = RouterDouble("bench-double", probes=double_probes(args.config), threshold=float("inf"),
                          heartbeat_s=0.5)
    router.transport_options = NO_BDP
    await router.start()
    flags = ["--send-queue", str(args.send_queue), "--send-queue-bytes", str(args.send_queue_bytes),
             "--client-queue-bytes", str(args.client_queue_bytes),
             "--capture-backlog-bytes", str(args.capture_backlog_bytes)]
    engine = Engine(args, router.address, *flags)
    rows = []
    try:
        say("engine B (router double): starting ...")
        await engine.start()
        idle = await idle_phase(engine, args.idle_seconds)
        engine.phase("catalog_check")
        for name, _ in TENSOR_TYPES:
            await wait_for_probe(engine.stub, f"all_{name}", timeout=60)
        rows.append(summary(idle, idle, names=engine.names))

        async def run(name: str, mode: str, bound: dict | None, rounds: int, read_after: float = 0.0,
                      during=None, backlog_drops: bool = False) -> Phase:
            previous = engine.sampler.phases[-1]
            phase = engine.phase(name)
            before = engine.metrics()
            load = engine.load(mode, name, workload, rounds, read_after, backlog_drops)
            requests = (await asyncio.gather(load, during()))[0] if during else await load
            router.batches.clear()  # the double's record of what it read: this process's memory
            row = summary(phase, idle, previous if bound else None, engine.names)
            row.update(requests, dropped_metrics=delta(before, engine.metrics()))
            if bound:
                row["bound"] = bound
            rows.append(row)
            return phase

        await run("reading", "uc_all_router", None, 1)
        router.reading.clear()
        await run("router_stalled", "uc_all_router", {
            "flag": "--send-queue-bytes (one router replica)", "mib": args.send_queue_bytes / MIB}, args.rounds)
        router.reading.set()
        await settle(engine, "router_resumed", args.idle_seconds, rows, idle)
        router.withhold_ack = lambda step: True
        await run("router_no_acks", "uc_all_router", {
            "flag": "--send-queue-bytes (one router replica); written batches wait for their acks",
            "mib": args.send_queue_bytes / MIB}, args.rounds)
        router.release_acks()
        await settle(engine, "acks_released", args.idle_seconds, rows, idle)
        await run("client_stalled", "uc_all_client", {
            "flag": f"--client-queue-bytes x {args.batch} streams",
            "mib": args.client_queue_bytes * args.batch / MIB}, 1, read_after=args.stop_seconds)
        await settle(engine, "clients_read", args.idle_seconds, rows, idle)

        stopped: dict[str, object] = {}

        async def stop_service() -> None:
            seen = engine.tokens_seen
            while engine.tokens_seen == seen:  # stop once the requests are decoding
                await asyncio.sleep(0.05)
            root = engine.service.process.pid
            engine.service.process.send_signal(signal.SIGSTOP)
            stopped["at_stop"] = tree_memory(root)
            say(f"  engine service stopped for {args.stop_seconds:g} s")
            await asyncio.sleep(args.stop_seconds)
            stopped["before_resume"] = tree_memory(root)
            engine.service.process.send_signal(signal.SIGCONT)

        log_before = engine.service.log_path.read_text(errors="replace")
        await run("service_stalled", "uc_all_client", {
            "flag": "--capture-backlog-bytes (one worker)", "mib": args.capture_backlog_bytes / MIB},
            1, during=stop_service, backlog_drops=True)
        # While the service was stopped nothing left the workers: what each process
        # gained then is what it kept. The workers log when they start keeping
        # shipments and each time the backlog bound drops one.
        log = engine.service.log_path.read_text(errors="replace")[len(log_before):]
        rows[-1]["while_stopped_rss_growth_by_process"] = {
            engine.names.get(pid, str(pid)): round((rss - stopped["at_stop"].rss_by_pid.get(pid, 0)) / MIB, 1)
            for pid, rss in stopped["before_resume"].rss_by_pid.items()}
        rows[-1]["worker_log"] = {"keeping_started": log.count("the engine service is not reading"),
                                  "backlog_drops": log.count("dropped a shipment")}
    finally:
        engine.service.process.send_signal(signal.SIGCONT)
        await engine.close()
        await router.kill()
    return rows


async def settle(engine: Engine, name: str, seconds: float, rows: list[dict], idle: Phase) -> None:
    phase = engine.phase(name)
    await asyncio.sleep(seconds)
    rows.append(summary(phase, idle, names=engine.names))


def table(rows: list[dict]) -> str:
    lines = ["| engine | phase | RSS peak MiB | RSS last | RSS peak - idle | PSS peak MiB | PSS peak - idle "
             "| peak - previous phase (RSS / PSS) | of it, by process (RSS) | configured bound MiB "
             "| rows dropped (engine metrics) |",
             "|---|---|---:|---:|---:|---:|---:|---:|---|---|---:|"]
    for row in rows:
        growth = (f"{row['rss_peak_over_previous']:,.1f} / {row['pss_peak_over_previous'] or 0:,.1f}"
                  if "rss_peak_over_previous" in row else "")
        bound = f"{row['bound']['mib']:,.1f} ({row['bound']['flag']})" if "bound" in row else ""
        by_process = ", ".join(f"{name} {value:+,.1f}" for name, value in
                               row.get("rss_peak_over_previous_by_process", {}).items() if abs(value) >= 1)
        dropped = f"{sum(row['dropped_metrics'].values()):,.0f}" if "dropped_metrics" in row else ""
        lines.append(f"| {row['engine']} | {row['phase']} | {row['rss_peak']:,.1f} | {row['rss_last']:,.1f} "
                     f"| {row['rss_peak_over_idle']:,.1f} | {row['pss_peak'] or 0:,.1f} "
                     f"| {row['pss_peak_over_idle'] or 0:,.1f} | {growth} | {by_process} | {bound} | {dropped} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="bench")
    parser.add_argument("--batch", type=int, default=8, help="concurrent requests")
    parser.add_argument("--rounds", type=int, default=2, help="batches per load phase")
    parser.add_argument("--tokens", type=int, default=64, help="new tokens per request")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--interval", type=float, default=0.2, help="seconds between memory samples")
    parser.add_argument("--idle-seconds", type=float, default=5.0)
    parser.add_argument("--stop-seconds", type=float, default=15.0,
                        help="how long clients (client_stalled) and the service (service_stalled) stop reading")
    parser.add_argument("--send-queue", type=int, default=256, help="engine B's --send-queue")
    parser.add_argument("--send-queue-bytes", type=int, default=32 * MIB, help="engine B's --send-queue-bytes")
    parser.add_argument("--client-queue-bytes", type=int, default=4 * MIB, help="engine B's --client-queue-bytes")
    parser.add_argument("--capture-backlog-bytes", type=int, default=64 * MIB,
                        help="engine B's --capture-backlog-bytes; above one prefill step's capture "
                        "(every type at every layer of the bench model at batch 8 x 64 prompt tokens: "
                        "about 52 MB), or rows are dropped whenever the service is a step behind")
    parser.add_argument("--malloc-mmap-threshold", type=int, default=128 * 1024,
                        help="the engine's MALLOC_MMAP_THRESHOLD_: buffers this large or larger are "
                        "returned to the system when freed, so RSS follows live memory from phase "
                        "to phase (0: glibc's default, which keeps freed buffers up to 32 MiB)")
    parser.add_argument("--out", default="memory.json", help="result file name under bench/results")
    parser.add_argument("--engines", default="a,b", help="a (capture modes), b (bounds), or both")
    args = parser.parse_args()
    args.model_path = embedded_model.make(MODELS[args.model], REPO / ".cache" / "models" / MODELS[args.model])
    args.config = json.loads((args.model_path / "config.json").read_text())
    started = time.time()

    async def both() -> list[dict]:
        rows = []
        for name, part in (("a", engine_a), ("b", engine_b)):
            if name in args.engines.split(","):
                workload = Workload(args.config["vocab_size"], args.prompt_tokens, args.tokens,
                                    seed=ord(name))
                rows += [{"engine": name.upper(), **row} for row in await part(args, workload)]
        return rows

    rows = asyncio.run(both())
    import vllm

    report = {
        **results_file.provenance(started),
        "wall_seconds": round(time.time() - started, 1),
        "vllm": vllm.__version__,
        "model": args.model, "batch": args.batch, "rounds": args.rounds, "tokens": args.tokens,
        "prompt_tokens": args.prompt_tokens, "interval_s": args.interval,
        "malloc_mmap_threshold": args.malloc_mmap_threshold,
        "engine_b_flags": {"send_queue": args.send_queue, "send_queue_bytes": args.send_queue_bytes,
                           "client_queue_bytes": args.client_queue_bytes,
                           "capture_backlog_bytes": args.capture_backlog_bytes},
        "rows": rows,
    }
    results_file.write(args.out, report)
    print(f"{report['command']}  ({report['date']}, {report['wall_seconds']} s, {report['machine']})\n")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
