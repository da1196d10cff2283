"""How soon a probe's abort takes effect: tokens generated after the triggering
token, and milliseconds from the client receiving the triggering token to the
request's `finished`, over many requests, at TP=1, TP=2 and PP=2.

    python -m bench.abort_latency --model .cache/models/tiny-llama

For each topology: a real router process and an engine process on loopback.
A first run captures layer-3 residual rows of a few prompts; a linear probe is
built to fire first at a known token of prompt 0 (tools/firing_probes.py), loaded
into the router, and then `--requests` greedy requests of prompt 0 run one
after another, then `--idle-requests` more, each after `--idle` seconds with
no request (the engine waking from idle).
Each sample also records the whole request's duration and its longest silence
(no message to the client), the 1-minute load average, how long the router's
threads waited, runnable, for a CPU during the request, and the longest such
wait of any one thread of each engine process (service, engine core, each
worker; Linux schedstat): on a shared host that wait, not the code, is what
stretches the tail. `--stall-dump S` records, for a request still running
after S seconds, how each engine thread spent the next second and a `py-spy
dump` of every engine process. `--router-nice -10` runs the router at a higher
CPU priority than the engine, an attempt to stand in on two shared cores for a
router with CPU of its own (on a 2-core host it made the tail worse: median 6
tokens, p99 115, against 1 and 54 at equal priority).
`--max-tokens-ahead 0,1` measures an engine without the bound and one with it,
in turn, per topology. Topology `compose` measures the stack `python -m
tools.compose_test --keep-up` left running instead (TLS, the probe deployed as
docs/deployment.md does), with the router containers' CPU weight set to each
of `--router-cpu-shares` in turn, `--compose-rounds` times.
Writes bench/results/abort_latency.json (with the command and the machine).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import grpc

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from bench import results_file  # noqa: E402
from common.grpc_server import channel_options  # noqa: E402
from tools import firing_probes, processes, stack  # noqa: E402
from undercurrent.v1 import engine_pb2 as engine_pb  # noqa: E402
from undercurrent.v1 import types_pb2 as types_pb  # noqa: E402
from undercurrent.v1 import admin_pb2_grpc as admin_pb_grpc  # noqa: E402
from undercurrent.v1 import engine_pb2_grpc as engine_pb_grpc  # noqa: E402

PROMPTS = ["The quick brown fox", "Hello, world! How are", "A probe is a small"]
TOPOLOGIES = {
    "tp1": ([], None),
    "tp2": (["--tensor-parallel-size", "2"], "0|1"),
    "pp2": (["--pipeline-parallel-size", "2"], "0|1"),
}


def request(prompt: str, rid: str, max_tokens: int, **fields) -> engine_pb.GenerateRequest:
    return engine_pb.GenerateRequest(
        request_id=rid, text=prompt,
        sampling=engine_pb.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True), **fields)


def runqueue_wait_ms(pids: list[int]) -> float | None:
    """Milliseconds the threads of processes `pids` have waited, runnable, for a CPU
    (Linux schedstat); None where that is not available."""
    try:
        return sum(int((t / "schedstat").read_text().split()[1])
                   for pid in pids for t in Path(f"/proc/{pid}/task").iterdir()) / 1e6
    except (OSError, IndexError, ValueError):
        return None


def thread_waits_ms(pid: int) -> dict[int, float]:
    """Per thread of process `pid`: milliseconds it waited, runnable, for a CPU."""
    waits = {}
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            try:
                waits[int(task.name)] = int((task / "schedstat").read_text().split()[1]) / 1e6
            except (OSError, IndexError, ValueError):
                continue
    except OSError:
        pass
    return waits


def engine_processes(engine_pid: int) -> dict[str, int]:
    """The engine's processes by role: service, engine core, each worker."""
    import psutil

    root = psutil.Process(engine_pid)
    roles = {"service": engine_pid}
    for child in root.children(recursive=True):
        name = child.name()
        if name.startswith("VLLM::"):
            roles[name.removeprefix("VLLM::")] = child.pid
    return roles


async def timed_generate(stub, message, trigger: int, router_pids: list[int],
                         engine: dict[str, int] | None = None) -> dict:
    """One request; the client-side time the triggering token and `finished` arrived,
    how long the routers' threads waited for a CPU meanwhile, and the longest any
    one thread of each engine process waited for a CPU."""
    waited_before = runqueue_wait_ms(router_pids)
    engine_before = {role: thread_waits_ms(pid) for role, pid in (engine or {}).items()}
    tokens, trigger_at, finished = 0, None, None
    started_wall, started = time.time(), time.monotonic()
    last, longest_gap = started, 0.0
    async for response in stub.Generate(message, timeout=300):
        kind = response.WhichOneof("event")
        now = time.monotonic()
        longest_gap, last = max(longest_gap, now - last), now
        if kind == "tokens":
            tokens += len(response.tokens.token_ids)
            if trigger_at is None and tokens > trigger:
                trigger_at = now
        elif kind == "finished":
            finished = response.finished
            finished_at = now
    assert finished is not None
    waited_after = runqueue_wait_ms(router_pids)
    engine_waits = {}
    for role, pid in (engine or {}).items():
        after, before = thread_waits_ms(pid), engine_before[role]
        engine_waits[role] = round(max((w - before.get(t, 0.0) for t, w in after.items()), default=0.0), 1)
    # Negative tokens (and no ms) when the verdict overtook the triggering token on its
    # way to the client: rows and tokens leave the engine by different paths.
    return {
        "reason": finished.finish_reason,
        "after_trigger": finished.generated_tokens - (trigger + 1),
        "ms": None if trigger_at is None else (finished_at - trigger_at) * 1000,
        # The whole request, and its longest silence: a stall anywhere (generation or
        # the capture path) shows here even when it falls before the trigger.
        "started": time.strftime("%H:%M:%S", time.gmtime(started_wall)) + f".{int(started_wall % 1 * 1000):03d}",
        "duration_ms": round((finished_at - started) * 1000, 1),
        "longest_gap_ms": round(longest_gap * 1000, 1),
        "load_average_1min": round(os.getloadavg()[0], 2),
        "router_runqueue_ms": (None if waited_before is None or waited_after is None
                               else round(waited_after - waited_before, 1)),
        "engine_thread_runqueue_ms": engine_waits,
    }


def thread_states(pid: int) -> dict[int, tuple[str, str, float, float]]:
    """Per thread of process `pid`: name, scheduler state (R runnable, S sleeping),
    and milliseconds run and waited for a CPU so far."""
    states = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            stat = (task / "stat").read_text()
            run, wait = (int(v) / 1e6 for v in (task / "schedstat").read_text().split()[:2])
        except (OSError, ValueError):
            continue
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        states[int(task.name)] = (name, stat[stat.rindex(")") + 2], run, wait)
    return states


async def dump_if_stalled(engine_pid: int, rid: str, after: float, directory: Path) -> None:
    """When a request is still running `after` seconds in: how each engine process's
    threads spent the next second (run, waited for a CPU, state), then `py-spy dump`
    of them all at once; again 2 s later. Where each one waits while a request stalls."""
    import psutil

    py_spy = str(Path(sys.executable).parent / "py-spy")
    for round_ in range(2):
        await asyncio.sleep(after if round_ == 0 else 2.0)
        root = psutil.Process(engine_pid)
        processes_ = [root, *root.children(recursive=True)]
        before = {p.pid: thread_states(p.pid) for p in processes_}
        await asyncio.sleep(1.0)
        with (directory / f"stall-{rid}-{round_}-sched.txt").open("w") as out:
            for process in processes_:
                for tid, (name, state, run, wait) in thread_states(process.pid).items():
                    _, _, run0, wait0 = before[process.pid].get(tid, (name, state, run, wait))
                    if run - run0 > 1 or wait - wait0 > 1 or state == "R":
                        out.write(f"{process.pid} {process.name()} {tid} {name} state={state} "
                                  f"ran={run - run0:.0f}ms waited={wait - wait0:.0f}ms in 1 s\n")
        dumps = []
        for process in processes_:
            path = directory / f"stall-{rid}-{round_}-{process.pid}.txt"
            dumps.append(await asyncio.create_subprocess_exec(
                py_spy, "dump", "--pid", str(process.pid),
                stdout=path.open("wb"), stderr=asyncio.subprocess.STDOUT))
        await asyncio.gather(*(d.wait() for d in dumps))
        print(f"{rid}: still running {after}s in; stacks in {directory}/stall-{rid}-*", flush=True)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def measure(name: str, model: str, count: int, max_tokens: int, idle: float, idle_count: int,
                  probes_dir: Path, stall_dump: float | None = None, router_nice: int = 0,
                  tokens_ahead: int = 0, engine_core_nice: str = "auto") -> dict:
    """A topology of this host's processes: a router and an engine started here."""
    flags, bind = TOPOLOGIES[name]
    flags = [*flags, "--max-tokens-ahead", str(tokens_ahead), f"--engine-core-nice={engine_core_nice}"]
    router = processes.router(processes.free_port(), probes_dir, "--heartbeat-interval", "1",
                              nice=router_nice).start()
    engine = processes.engine(model, router.address, *flags, workers_bind=bind).start()
    try:
        await router.wait_health(want_serving=None, timeout=60)
        await engine.wait_health(want_serving=True, timeout=900)  # a loaded 2-core host is slow

        async def load(probe: firing_probes.FiringProbe) -> None:
            async with stack.channel(router.address) as admin:
                await admin_pb_grpc.ProbeAdminServiceStub(admin).LoadProbe(probe.load_request())

        async with stack.channel(engine.address) as channel:
            sampled = await sample(name, engine_pb_grpc.EngineServiceStub(channel), load, count, max_tokens,
                                   idle, idle_count, [router.process.pid], engine.process.pid,
                                   stall_dump)
    finally:
        engine.kill()
        router.kill()
    return {"topology": name, "router_nice": router_nice, "max_tokens_ahead": tokens_ahead,
            "engine_core_nice": engine_core_nice, **sampled}


async def measure_compose(count: int, max_tokens: int, idle: float, idle_count: int,
                          router_cpu_shares: int) -> dict:
    """The stack `python -m tools.compose_test --keep-up` left running: its engine
    (TP=1) and router containers, each router container's CPU weight set to
    `router_cpu_shares` first (`docker update`), the probe deployed as
    docs/deployment.md does."""
    from tools.compose_stack import Stack
    from tools.docker_host import run

    running = Stack.running()
    routers = running.containers("router")
    for container in routers:
        run(["docker", "update", "--cpu-shares", str(router_cpu_shares), container], quiet=True)

    async def load(probe: firing_probes.FiringProbe) -> None:
        with tempfile.TemporaryDirectory() as directory:
            running.deploy_probe(probe.write(Path(directory) / "probe"))

    router_pids = [running.host_pid(c) for c in routers]
    engine_pid = running.host_pid(running.containers("engine")[0])
    async with grpc.aio.secure_channel(f"127.0.0.1:{running.engine_port}", running.client_credentials(),
                                       options=channel_options()) as channel:
        sampled = await sample("compose", engine_pb_grpc.EngineServiceStub(channel), load, count, max_tokens,
                               idle, idle_count, router_pids, engine_pid)
    return {"topology": "compose", "router_replicas": len(routers),
            "router_cpu_shares": router_cpu_shares, **sampled}


async def sample(name: str, stub: engine_pb_grpc.EngineServiceStub, load, count: int, max_tokens: int,
                 idle: float, idle_count: int, router_pids: list[int], engine_pid: int,
                 stall_dump: float | None = None) -> dict:
    """Builds a probe that fires at a known token of PROMPTS[0], loads it with `load`,
    then times `count` fail_closed requests back to back and `idle_count` after
    `idle` seconds each."""
    baseline = await asyncio.gather(*[
        stack.generate(stub, request(p, f"{name}-base-{i}-{time.time_ns()}", max_tokens,
                                     extraction_points=[firing_probes.trace_point()]))
        for i, p in enumerate(PROMPTS)])
    rows = [firing_probes.rows_by_position(o.batches) for o in baseline]
    probe = firing_probes.probe_firing_at(f"bench_{name}", rows[0], rows[1:], min_index=4)
    await load(probe)
    await stack.wait_for_probe(stub, probe.name)
    trigger = probe.position - baseline[0].finished.prompt_tokens
    binding = types_pb.ProbeBinding(probe=probe.name, failure_policy=types_pb.FAILURE_POLICY_FAIL_CLOSED)
    phases = {}
    roles = engine_processes(engine_pid)
    for phase, runs, gap in (("back_to_back", count, 0.0), ("after_idle", idle_count, idle)):
        samples = []
        for i in range(runs):
            await asyncio.sleep(gap)
            rid = f"{name}-{phase}-{i}-{time.time_ns()}"
            watchdog = (asyncio.create_task(dump_if_stalled(engine_pid, rid, stall_dump, processes.LOGS))
                        if stall_dump else None)
            try:
                samples.append(await timed_generate(
                    stub, request(PROMPTS[0], rid, max_tokens, probes=[binding]),
                    trigger, router_pids, roles))
            finally:
                if watchdog:
                    watchdog.cancel()
            print(rid, {k: samples[-1][k] for k in ("started", "duration_ms", "longest_gap_ms",
                                                    "after_trigger", "load_average_1min",
                                                    "engine_thread_runqueue_ms")},
                  flush=True)
        if samples:
            phases[phase] = summarize(samples, gap)
    return {"max_tokens": max_tokens, "trigger_index": trigger, **phases}


def summarize(samples: list[dict], idle: float) -> dict:
    aborted = [s for s in samples if s["reason"] == types_pb.FINISH_REASON_PROBE_ABORT]
    tokens = [s["after_trigger"] for s in aborted]
    ms = [round(s["ms"], 1) for s in aborted if s["ms"] is not None]
    load = [s["load_average_1min"] for s in samples]
    stats = (lambda v: {"median": statistics.median(v), "p99": percentile(v, 0.99), "max": max(v)}
             if v else None)
    return {
        "requests": len(samples), "aborted": len(aborted), "idle_before_each_s": idle,
        "tokens_after_trigger": stats(tokens),
        "ms_trigger_to_finished": stats(ms),
        "request_ms": stats([s["duration_ms"] for s in samples]),
        "longest_gap_ms": stats([s["longest_gap_ms"] for s in samples]),
        "load_average_1min": {"min": min(load), "max": max(load)},
        "router_runqueue_ms": stats([s["router_runqueue_ms"] for s in samples
                                     if s["router_runqueue_ms"] is not None]),
        "samples": samples,
    }


async def main_async(args) -> dict:
    results = []
    for name in args.topologies.split(","):
        if name == "compose":
            for _ in range(args.compose_rounds):
                for shares in (int(n) for n in args.router_cpu_shares.split(",")):
                    results.append(await measure_compose(args.requests, args.max_tokens, args.idle,
                                                         args.idle_requests, shares))
                    write(args.out, results)
            continue
        for tokens_ahead in (int(n) for n in args.max_tokens_ahead.split(",")):
            for engine_core_nice in args.engine_core_nice.split(","):
                with tempfile.TemporaryDirectory() as probes_dir:
                    result = await measure(name, args.model, args.requests, args.max_tokens, args.idle,
                                           args.idle_requests, Path(probes_dir), args.stall_dump,
                                           args.router_nice, tokens_ahead, engine_core_nice)
                results.append(result)
                write(args.out, results)  # after every engine: a long run keeps what it measured
    return results


def write(path: Path, results: list[dict]) -> None:
    results_file.write(path, {**results_file.provenance(), "results": results})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=".cache/models/tiny-llama")
    parser.add_argument("--topologies", default="tp1,tp2,pp2")
    parser.add_argument("--requests", type=int, default=40, help="per topology")
    parser.add_argument("--max-tokens", type=int, default=120)
    parser.add_argument("--idle-requests", type=int, default=5,
                        help="then this many requests, each after --idle seconds without any")
    parser.add_argument("--idle", type=float, default=8.0,
                        help="seconds idle before each of --idle-requests")
    parser.add_argument("--out", type=Path, default=results_file.RESULTS / "abort_latency.json")
    parser.add_argument("--stall-dump", type=float, metavar="SECONDS",
                        help="py-spy dump the engine's processes when a request runs this long")
    parser.add_argument("--router-nice", type=int, default=0,
                        help="the router's niceness (negative: before the engine for a CPU; needs root)")
    parser.add_argument("--max-tokens-ahead", default="0",
                        help="the engine's --max-tokens-ahead; a comma list measures each in turn")
    parser.add_argument("--engine-core-nice", default="auto",
                        help="the engine's --engine-core-nice; a comma list measures each in turn")
    parser.add_argument("--router-cpu-shares", default="16384",
                        help="topology compose: the router containers' CPU weight; a comma list "
                             "measures each in turn (compose.yaml sets 16384, Docker's default is 1024)")
    parser.add_argument("--compose-rounds", type=int, default=1,
                        help="topology compose: how many times to go through --router-cpu-shares")
    args = parser.parse_args()
    asyncio.run(main_async(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
