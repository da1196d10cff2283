"""What Undercurrent costs against vanilla vLLM, in one process and one run.

    python -m bench.overhead                       # embedded and bench model, batch 1, 8, 32
    python -m bench.overhead --models bench --batches 8 --rounds 5
    python -m bench.overhead --parallel tp2        # or pp2: every engine with 2 workers (slow here)

Per model, three engines run side by side in this process: vLLM's `AsyncLLM`
with default compilation, the same with `enforce_eager`, and the Undercurrent
engine service (`EngineRuntime`: capture extension, drain loop, router link;
the gRPC front end is left out, as it is the same for every mode), linked to
a real router process on loopback; it runs compiled as vLLM's default does on
CPU, or with `--uc-eager` as it did before capture sites were compiled in.
Every round runs each mode once, in an
order rotated per round, so load from other jobs on the shared cores hits
every mode alike; the reported figure is the median over rounds of tokens/s,
and each ratio is taken between medians.

Modes:
  vllm_default    vanilla AsyncLLM, default compilation
  vllm_eager      vanilla AsyncLLM, enforce_eager (what capture needed on GPU before
                  its sites became graph split points)
  uc_off          Undercurrent, no probe, no extraction point
  uc_one_layer    one observe probe on one layer's residual stream (generated tokens)
  uc_all_router   every tensor type at every layer, every token, to the router
                  (observe probes: residual_stream, attn_out and mlp_out on all
                  layers, and final_norm)
  uc_all_client   every tensor type at every layer, every token, streamed to the client
  uc_many_probes  100 observe probes on one layer's residual stream (generated tokens):
                  the router sends a score message per probe and step, each shown
                  to the client (the run checks every score arrived)
  MODE/rpc        (for the modes in --rpc-modes) the same with rows drained by one
                  collective_rpc per drain instead of pushed by the workers: the
                  drain before and after that change, measured in the same run
  MODE/PLACEMENT  (for the modes in --placement-modes) the same with each placement
                  other than --placement's: none (the engine service and router
                  free to use every core, the default), service (the service off
                  the Undercurrent worker's cores, as `python -m engine_service
                  --keep-off-worker-cores` places itself), service+router (the
                  router too, placed from outside as with `taskset`); each run
                  moves the processes first, so placements alternate round by
                  round. Vanilla vLLM's runs are left unplaced, as deployed
  MODE/held       (for the modes in --held-modes) the same with the requests homed
                  on a second router that sends each binding's scores at most
                  every --held-interval seconds (its --scores-interval), all of
                  them, in fewer messages; the link links to both routers and
                  the run picks request ids that home on one or the other
  MODE/ahead      (for the modes in --ahead-modes) the same with the engine's
                  --max-tokens-ahead set to --tokens-ahead: each request waits
                  for its router's acknowledgements that far behind. With ahead
                  modes, every uc_* mode runs on that flag's scheduler (requests
                  without the bound take its fast path)

Each request is greedy with ignore_eos, a distinct random prompt of
--prompt-tokens tokens (no prefix-cache hits between modes), --tokens new tokens.
With --cpu, each mode's run also reports CPU milliseconds (user + system, from
/proc) per engine step in each process: this process (vLLM's front end, and in
the uc_* modes the engine service; the idle engines' loops run here too), the
mode's engine core (which spins while it waits for its workers), its workers
and, in the uc_* modes, the router. On shared cores CPU time is the
steadier figure: wall time includes waiting for a core.
Writes bench/results/overhead[-PARALLEL].json and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import psutil  # noqa: E402

from bench import results_file  # noqa: E402
from common import embedded_model  # noqa: E402
from common.gc_heap import freeze_startup_heap  # noqa: E402
from engine_service.engine_core.wait import MODES as ENGINE_CORE_WAITS  # noqa: E402
from engine_service.link.assignment import pick_replica  # noqa: E402
from engine_service.cpu_host.placement import core_list, cores_off_workers, move_process  # noqa: E402
from common.probe_format.files import write_probe  # noqa: E402
from tools import processes  # noqa: E402
from undercurrent.v1 import engine_pb2 as engine_pb  # noqa: E402
from undercurrent.v1 import types_pb2 as types_pb  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
MODELS = {"embedded": "tiny-llama", "bench": "bench-llama"}
MODES = ("vllm_default", "vllm_eager", "uc_off", "uc_one_layer", "uc_all_router", "uc_all_client")
OPTIONAL_MODES = ("uc_many_probes",)  # run only when named in --modes
MANY_PROBES = 100
TENSOR_TYPES = (
    ("residual_stream", types_pb.TENSOR_TYPE_RESIDUAL_STREAM),
    ("attn_out", types_pb.TENSOR_TYPE_ATTN_OUT),
    ("mlp_out", types_pb.TENSOR_TYPE_MLP_OUT),
    ("final_norm", types_pb.TENSOR_TYPE_FINAL_NORM),
)
# Who keeps off the Undercurrent worker's cores in a uc_* run: (engine service, router).
PLACEMENTS = {"none": (False, False), "service": (True, False), "service+router": (True, True)}
PARALLEL = {
    "none": ({}, None),
    "tp2": ({"tensor_parallel_size": 2}, "0|1"),
    "pp2": ({"pipeline_parallel_size": 2}, "0|1"),
}


def write_probes(directory: Path, config: dict) -> None:
    """One probe reading one layer, and one per tensor type reading every layer."""
    layers = config["num_hidden_layers"]
    base = {"version": "1", "kind": "norm", "hidden_size": config["hidden_size"], "dtype": "float32",
            "threshold": 1e30, "action": "observe"}
    write_probe(directory / "one_layer", {**base, "name": "one_layer", "tensor_type": "residual_stream",
                                          "layers": [layers // 2], "tokens": {"scope": "generated"}})
    for i in range(MANY_PROBES):
        write_probe(directory / f"many_{i}", {**base, "name": f"many_{i}", "tensor_type": "residual_stream",
                                              "layers": [layers // 2], "tokens": {"scope": "generated"}})
    for name, _ in TENSOR_TYPES:
        extra = {} if name == "final_norm" else {"layers": list(range(layers))}
        write_probe(directory / f"all_{name}", {**base, "name": f"all_{name}", "tensor_type": name,
                                                "tokens": {"scope": "all"}, **extra})


class Workload:
    """Distinct random prompts per (mode, round, request), the same shape for every mode."""

    def __init__(self, vocab: int, prompt_tokens: int, tokens: int, seed: int = 0):
        self.rng = np.random.default_rng(seed)
        self.vocab, self.prompt_tokens, self.tokens = vocab, prompt_tokens, tokens

    def prompts(self, count: int) -> list[list[int]]:
        # Ids from 3 up: 0..2 are the embedded tokenizer's special tokens.
        return self.rng.integers(3, self.vocab, size=(count, self.prompt_tokens)).tolist()


def request_ids(tag: str, count: int) -> list[str]:
    """`count` request ids for a run, hex digests as clients' UUIDs are: their order
    is not the batch's. (Numbered ids sort like the batch below ten requests, which
    would hide any per-step cost of rows arriving in an order unlike their ids'.)"""
    return [f"{tag}-" + hashlib.blake2b(f"{tag}-{i}".encode(), digest_size=8).hexdigest() for i in range(count)]


def generate_request(mode: str, request_id: str, prompt: list[int], tokens: int, layers: int) -> engine_pb.GenerateRequest:
    message = engine_pb.GenerateRequest(
        request_id=request_id, token_ids=engine_pb.TokenIds(ids=prompt),
        sampling=engine_pb.SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True),
    )
    if mode == "uc_one_layer":
        message.probes.add(probe="one_layer", failure_policy=types_pb.FAILURE_POLICY_FAIL_OPEN)
    elif mode == "uc_many_probes":
        for i in range(MANY_PROBES):
            message.probes.add(probe=f"many_{i}", failure_policy=types_pb.FAILURE_POLICY_FAIL_OPEN)
    elif mode == "uc_all_router":
        for name, _ in TENSOR_TYPES:
            message.probes.add(probe=f"all_{name}", failure_policy=types_pb.FAILURE_POLICY_FAIL_OPEN)
    elif mode == "uc_all_client":
        for name, tensor_type in TENSOR_TYPES:
            message.extraction_points.add(
                name=name, tensor_type=tensor_type,
                layers=[] if name == "final_norm" else list(range(layers)),
                tokens=types_pb.TokenSelector(scope=types_pb.TokenSelector.SCOPE_ALL), stream_to_client=True)
    return message


class Engines:
    """The three engines of one model, and one router for the probe modes."""

    def __init__(self, model: Path, parallel: str, max_model_len: int, uc_eager: bool, tokens_ahead: int = 0,
                 placement: str = "none", scores_interval: float = 0.0, held_interval: float = 0.0,
                 engine_core_wait: str = "auto", engine_core_nice: str = "auto"):
        self.model, self.parallel, self.max_model_len = model, parallel, max_model_len
        self.engine_core_wait, self.engine_core_nice = engine_core_wait, engine_core_nice
        self.uc_eager = uc_eager
        self.placement = placement
        # The router's --scores-interval, and with held_interval a second router's.
        self.scores_interval, self.held_interval = scores_interval, held_interval
        self.tokens_ahead = tokens_ahead
        self.allowances = None
        self.config = json.loads((model / "config.json").read_text())
        self.vanilla: dict[str, object] = {}
        self.runtime = None
        self.uc_llm = None
        self.router = None
        self.held_router = None
        # Per engine ("vllm_default", "vllm_eager", "uc"): the processes it started,
        # as {"engine_core": its own children, "workers": theirs}.
        self.processes: dict[str, dict[str, list[psutil.Process]]] = {}

    def _started(self, engine: str, before: set[int]) -> None:
        """Records the processes started since `before` (a set of child pids) as engine's."""
        new = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
        self.processes[engine] = {
            "engine_core": [p for p in new if p.ppid() == os.getpid()],
            "workers": [p for p in new if p.ppid() != os.getpid()],
        }

    def cpu_processes(self, mode: str) -> dict[str, list[psutil.Process]]:
        """The processes whose CPU a mode's run is charged with, by role."""
        roles = {"front": [psutil.Process()]}
        engine = "uc" if mode.startswith("uc_") else mode.partition("/")[0]
        roles.update(self.processes.get(engine, {}))
        if engine == "uc" and self.router is not None:
            for role, processes_ in zip(("router", "held_router"), self.routers()):
                roles[role] = processes_
        return roles

    def routers(self) -> list[list[psutil.Process]]:
        """Each router's process and its children."""
        tops = [psutil.Process(r.process.pid) for r in (self.router, self.held_router) if r is not None]
        return [[top, *top.children(recursive=True)] for top in tops]

    def _kwargs(self, **extra) -> dict:
        return dict(model=str(self.model), dtype="float32", max_model_len=self.max_model_len,
                    disable_log_stats=True, **PARALLEL[self.parallel][0], **extra)

    async def start(self, modes: list[str]) -> None:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.platforms import current_platform
        from vllm.v1.engine.async_llm import AsyncLLM

        from engine_service.cpu_host import engine_core_priority
        from engine_service.engine_core import wait as engine_core_wait
        from engine_service.capture.driver.controller import CaptureController, capture_engine_kwargs
        from engine_service.link import RouterLinkConfig
        from engine_service.service.runtime import EngineRuntime, EngineSettings

        def children() -> set[int]:
            return {p.pid for p in psutil.Process().children(recursive=True)}

        for mode, eager in (("vllm_default", False), ("vllm_eager", True)):
            if mode in modes:
                print(f"starting {mode} ...", flush=True)
                before = children()
                self.vanilla[mode] = AsyncLLM.from_engine_args(AsyncEngineArgs(**self._kwargs(enforce_eager=eager)))
                self._started(mode, before)
        if not any(m.startswith("uc_") for m in modes):
            return
        probes_dir = REPO / ".cache" / "bench-probes" / self.model.name
        write_probes(probes_dir, self.config)
        # Plaintext: this measures capture and probing, not TLS.
        self.router = processes.router(processes.free_port(), probes_dir, "--scores-interval",
                                       str(self.scores_interval), secure=False).start()
        await self.router.wait_health(timeout=120)
        targets = [self.router.address]
        if self.held_interval:
            self.held_router = processes.router(processes.free_port(), probes_dir, "--scores-interval",
                                                str(self.held_interval), secure=False).start()
            await self.held_router.wait_health(timeout=120)
            targets.append(self.held_router.address)
        print(f"starting the Undercurrent engine ({'eager' if self.uc_eager else 'compiled'}) ...", flush=True)
        before = children()
        extra = {}
        if self.tokens_ahead:
            from engine_service.engine_core.tokens_ahead import ADDRESS_ENV, SCHEDULER_CLS, AllowancePublisher

            self.allowances = AllowancePublisher(self.tokens_ahead)
            os.environ[ADDRESS_ENV] = self.allowances.address
            extra["scheduler_cls"] = SCHEDULER_CLS
        # As the engine service starts it (app.create_llm); vanilla vLLM's engine cores, started
        # before, spin as vLLM's do.
        engine_core_wait.choose(self.engine_core_wait, current_platform.is_cpu())
        self.uc_llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**capture_engine_kwargs(
            **self._kwargs(enforce_eager=self.uc_eager, **extra))))
        self._started("uc", before | {r.process.pid for r in (self.router, self.held_router) if r is not None})
        print(engine_core_priority.apply(self.engine_core_nice, current_platform.is_cpu(),
                                         engine_core_priority.engine_core_pids(self.uc_llm)), flush=True)
        self.runtime = EngineRuntime(
            self.uc_llm, CaptureController(self.uc_llm),
            link_config=RouterLinkConfig(targets=",".join(targets)),
            settings=EngineSettings(default_failure_policy=types_pb.FAILURE_POLICY_FAIL_OPEN),
        )
        await self._learn_cores()
        await self.runtime.start()
        await self.runtime.link.wait_ready(timeout=60)
        deadline = time.monotonic() + 30
        while (len(loaded_probes(self.runtime.link)) < 1 + len(TENSOR_TYPES) + MANY_PROBES
               or self.runtime.routers_up() < len(targets)):
            if time.monotonic() > deadline:
                raise RuntimeError(f"router catalog incomplete: {sorted(loaded_probes(self.runtime.link))}")
            await asyncio.sleep(0.1)
        # This process is the engine service's front end: freeze its start-up heap as the service does.
        print(f"start-up heap frozen: {freeze_startup_heap()} objects", flush=True)

    async def _learn_cores(self) -> None:
        """The cores this process and the router started on, and the Undercurrent worker's."""
        self.all_cores = frozenset(os.sched_getaffinity(0))
        self.worker_cores = frozenset(await self.runtime.capture.local_worker_cores())
        print(f"cores: {core_list(self.all_cores)}; the Undercurrent worker bound to {core_list(self.worker_cores)}",
              flush=True)

    def _place(self, placement: str) -> None:
        """Puts this process (the engine service, and vanilla vLLM's front ends) and the router
        on their cores for one run: PLACEMENTS[placement] says who keeps off the worker's cores."""
        off = cores_off_workers(self.all_cores, self.worker_cores) or self.all_cores
        service, router = PLACEMENTS[placement]
        move_process(os.getpid(), off if service else self.all_cores)
        for process in [p for processes_ in self.routers() for p in processes_]:
            move_process(process.pid, off if router else self.all_cores)

    async def run(self, mode: str, prompts: list[list[int]], tokens: int, tag: str) -> tuple[float, int]:
        """Runs len(prompts) concurrent requests; returns (seconds, tokens generated)."""
        mode, _, variant = mode.partition("/")
        if self.runtime is not None:
            # Vanilla vLLM as deployed: nothing placed.
            self._place(variant if variant in PLACEMENTS else self.placement if mode.startswith("uc_") else "none")
        if self.runtime is not None and mode.startswith("uc_"):
            self.runtime.allowances = self.allowances if variant == "ahead" else None
            push = variant != "rpc"
            if getattr(self, "_push", True) != push:
                await self.runtime.capture.use_push(push)
                self._push = push
        if mode.startswith("vllm_"):
            coros = [self._vanilla_one(self.vanilla[mode], request_id, p, tokens)
                     for request_id, p in zip(request_ids(tag, len(prompts)), prompts)]
        else:
            layers = self.config["num_hidden_layers"]
            coros = [self._uc_one(generate_request(mode, request_id, p, tokens, layers), mode)
                     for request_id, p in zip(self._homed_ids(tag, len(prompts), variant == "held"), prompts)]
        start = time.perf_counter()
        produced = await asyncio.gather(*coros)
        elapsed = time.perf_counter() - start
        if any(p != tokens for p in produced):
            raise RuntimeError(f"{mode}: requests produced {produced} tokens, expected {tokens} each")
        return elapsed, sum(produced)

    def _homed_ids(self, tag: str, count: int, held: bool) -> list[str]:
        """Request ids the router link homes on the held router (held) or the other: the
        link picks a replica per request id by rendezvous hashing (pick_replica)."""
        if self.held_router is None:
            return request_ids(tag, count)
        want = self.held_router.address if held else self.router.address
        replicas = [self.router.address, self.held_router.address]
        ids = [r for r in request_ids(tag, 8 * count) if pick_replica(r, replicas) == want]
        if len(ids) < count:
            raise RuntimeError(f"only {len(ids)} of {8 * count} ids homed on {want}")
        return ids[:count]

    @staticmethod
    async def _vanilla_one(llm, request_id: str, prompt: list[int], tokens: int) -> int:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True,
                                output_kind=RequestOutputKind.DELTA)
        got = 0
        async for output in llm.generate(TokensPrompt(prompt_token_ids=prompt), params, request_id):
            got += len(output.outputs[0].token_ids)
        return got

    async def _uc_one(self, message: engine_pb.GenerateRequest, mode: str) -> int:
        got = rows = scores = 0
        finished = None
        async for response in self.runtime.generate(message):
            if response.HasField("tokens"):
                got += len(response.tokens.token_ids)
            elif response.HasField("activations"):
                rows += sum(len(b.token_positions) for b in response.activations.blocks)
            elif response.HasField("probe_event") and response.probe_event.HasField("scores"):
                scores += len(response.probe_event.scores.scores)
            elif response.HasField("finished"):
                finished = response.finished
        if finished.finish_reason != types_pb.FINISH_REASON_LENGTH or finished.unprobed_tokens or finished.dropped_records:
            raise RuntimeError(f"{mode} {message.request_id}: finished {finished}")
        if mode == "uc_all_client":
            layers = self.config["num_hidden_layers"]
            expected = (len(message.token_ids.ids) + got - 1) * (3 * layers + 1)
            if rows != expected:
                raise RuntimeError(f"{mode} {message.request_id}: {rows} rows streamed, expected {expected}")
        if mode == "uc_many_probes" and scores != MANY_PROBES * (got - 1):  # the last token is never fed back
            raise RuntimeError(f"{mode} {message.request_id}: {scores} scores shown, expected "
                               f"{MANY_PROBES * (got - 1)}")
        return got

    async def close(self) -> None:
        if self.runtime is not None:
            await self.runtime.close()
        for llm in [*self.vanilla.values(), self.uc_llm]:
            if llm is not None:
                llm.shutdown()
        for router in (self.router, self.held_router):
            if router is not None:
                router.kill()


def cpu_seconds(roles: dict[str, list[psutil.Process]]) -> dict[str, float]:
    """User + system CPU seconds so far, summed per role."""
    result = {}
    for role, procs in roles.items():
        total = 0.0
        for proc in procs:
            try:
                times = proc.cpu_times()
            except psutil.NoSuchProcess:
                continue
            total += times.user + times.system
        result[role] = total
    return result


def make_model(name: str) -> Path:
    """The benchmark model called `name` (a key of MODELS), made in .cache/models if missing."""
    return embedded_model.make(MODELS[name], REPO / ".cache" / "models" / MODELS[name])


async def bench_model(name: str, args) -> dict:
    model = make_model(name)
    engines = Engines(model, args.parallel, args.max_model_len, args.uc_eager,
                      args.tokens_ahead if args.ahead_modes else 0, args.placement, args.scores_interval,
                      args.held_interval if args.held_modes else 0.0, args.engine_core_wait,
                      args.engine_core_nice)
    modes = (list(args.modes) + [f"{m}/rpc" for m in args.rpc_modes] + [f"{m}/ahead" for m in args.ahead_modes]
             + [f"{m}/{p}" for m in args.placement_modes for p in PLACEMENTS if p != args.placement]
             + [f"{m}/held" for m in args.held_modes])
    workload = Workload(engines.config["vocab_size"], args.prompt_tokens, args.tokens)
    seconds: dict[tuple[int, str], list[float]] = {}
    cpu_ms: dict[tuple[int, str], list[dict[str, float]]] = {}
    try:
        await engines.start(list(args.modes))
        for mode in modes:  # warm-up: compile, allocate, first router binding
            await engines.run(mode, workload.prompts(2), 4, f"warm-{mode}")
        for batch in args.batches:
            for r in range(args.rounds):
                order = modes[r % len(modes):] + modes[: r % len(modes)]
                for mode in order:
                    roles = engines.cpu_processes(mode) if args.cpu else {}
                    cpu_before = cpu_seconds(roles)
                    elapsed, produced = await engines.run(mode, workload.prompts(batch), args.tokens,
                                                          f"{mode}-b{batch}-r{r}")
                    seconds.setdefault((batch, mode), []).append(elapsed)
                    line = (f"{name} batch {batch:>2} round {r} {mode:>14}: {elapsed:6.2f} s "
                            f"{produced / elapsed:8.1f} tok/s")
                    if args.cpu:
                        # One engine step per new token (the prompts' prefill rides on the first).
                        per_step = {role: 1000 * (spent - cpu_before[role]) / args.tokens
                                    for role, spent in cpu_seconds(roles).items()}
                        cpu_ms.setdefault((batch, mode), []).append(per_step)
                        line += "  CPU ms/step " + " ".join(f"{k} {v:5.1f}" for k, v in per_step.items())
                    print(line, flush=True)
    finally:
        await engines.close()
    rows = []
    for batch in args.batches:
        tps = {m: statistics.median(batch * args.tokens / s for s in seconds[(batch, m)]) for m in modes}
        for mode in modes:
            rows.append({
                "model": name, "batch": batch, "mode": mode,
                "seconds": seconds[(batch, mode)],
                "tokens_per_s_median": tps[mode],
                "vs_vllm_eager": tps[mode] / tps["vllm_eager"] if "vllm_eager" in tps else None,
                "vs_vllm_default": tps[mode] / tps["vllm_default"] if "vllm_default" in tps else None,
                **({"cpu_ms_per_step": cpu_ms[(batch, mode)], "cpu_ms_per_step_median": {
                    role: statistics.median(r[role] for r in cpu_ms[(batch, mode)])
                    for role in cpu_ms[(batch, mode)][0]}} if args.cpu else {}),
            })
    return {"model": name, "path": str(model.relative_to(REPO)), "config": {
        k: engines.config[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                       "num_key_value_heads", "intermediate_size")}, "rows": rows}


def table(results: list[dict]) -> str:
    lines = ["| model | batch | mode | tokens/s (median) | vs vLLM eager | vs vLLM default | CPU ms per step (median) |",
             "|---|---:|---|---:|---:|---:|---|"]
    for result in results:
        for row in result["rows"]:
            fmt = lambda v: "" if v is None else f"{v:.3f}"  # noqa: E731
            cpu = " ".join(f"{k} {v:.1f}" for k, v in row.get("cpu_ms_per_step_median", {}).items())
            lines.append(f"| {row['model']} | {row['batch']} | {row['mode']} | {row['tokens_per_s_median']:,.1f} "
                         f"| {fmt(row['vs_vllm_eager'])} | {fmt(row['vs_vllm_default'])} | {cpu} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="embedded,bench", help=f"comma list of {sorted(MODELS)}")
    parser.add_argument("--batches", default="1,8,32", help="concurrent requests, comma list")
    parser.add_argument("--modes", default=",".join(MODES), help="comma list")
    parser.add_argument("--rpc-modes", default="uc_off,uc_all_router",
                        help="Undercurrent modes also run with the collective_rpc drain (MODE/rpc)")
    parser.add_argument("--tokens", type=int, default=32, help="new tokens per request")
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--parallel", choices=sorted(PARALLEL), default="none")
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--uc-eager", action="store_true",
                        help="run the Undercurrent engine with enforce_eager (default: compiled, as vLLM's default)")
    parser.add_argument("--cpu", action="store_true",
                        help="also report CPU ms per step per process (front end, engine core, workers, router)")
    parser.add_argument("--ahead-modes", default="",
                        help="Undercurrent modes also run with --max-tokens-ahead (MODE/ahead)")
    parser.add_argument("--tokens-ahead", type=int, default=1, help="the bound of the MODE/ahead runs")
    parser.add_argument("--placement", choices=sorted(PLACEMENTS), default="none",
                        help="in the uc_* modes, keep neither the engine service nor the router off the "
                             "Undercurrent worker's cores (as `python -m engine_service` runs by default), "
                             "the service (as with its --keep-off-worker-cores), or both")
    parser.add_argument("--placement-modes", default="",
                        help="Undercurrent modes also run with each other placement (MODE/PLACEMENT)")
    parser.add_argument("--scores-interval", type=float, default=0.0,
                        help="the router's --scores-interval (default 0: a score message per binding and step)")
    parser.add_argument("--held-modes", default="",
                        help="Undercurrent modes also run with their requests on a second router that sends "
                             "scores every --held-interval seconds (MODE/held)")
    parser.add_argument("--held-interval", type=float, default=0.1, help="the held router's --scores-interval")
    parser.add_argument("--engine-core-wait", choices=ENGINE_CORE_WAITS, default="auto",
                        help="the Undercurrent engine's --engine-core-wait (vanilla vLLM's engine cores spin)")
    parser.add_argument("--engine-core-nice", default="auto",
                        help="the Undercurrent engine's --engine-core-nice (vanilla vLLM's engine cores keep theirs)")
    parser.add_argument("--out", default="", help="result file name (default: overhead[-PARALLEL].json)")
    args = parser.parse_args()
    args.batches = [int(b) for b in args.batches.split(",")]
    args.modes = [m for m in args.modes.split(",") if m]
    args.rpc_modes = [m for m in args.rpc_modes.split(",") if m]
    args.ahead_modes = [m for m in args.ahead_modes.split(",") if m]
    args.placement_modes = [m for m in args.placement_modes.split(",") if m]
    args.held_modes = [m for m in args.held_modes.split(",") if m]
    unknown = ((set(args.modes) - set(MODES + OPTIONAL_MODES))
               | (set(args.rpc_modes + args.ahead_modes + args.placement_modes + args.held_modes) - set(args.modes)))
    if unknown:
        parser.error(f"--modes: unknown {sorted(unknown)}; choose from {list(MODES + OPTIONAL_MODES)}")
    bind = PARALLEL[args.parallel][1]
    if bind:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = bind
    started = time.time()
    results = [asyncio.run(bench_model(name, args)) for name in args.models.split(",")]
    import vllm

    report = {
        **results_file.provenance(started),
        "wall_seconds": round(time.time() - started, 1),
        "vllm": vllm.__version__,
        "parallel": args.parallel, "uc_eager": args.uc_eager, "tokens": args.tokens, "prompt_tokens": args.prompt_tokens,
        "rounds": args.rounds, "placement": args.placement, "scores_interval": args.scores_interval,
        **({"held_interval": args.held_interval} if args.held_modes else {}),
        **({"tokens_ahead": args.tokens_ahead} if args.ahead_modes else {}),
        "results": results,
    }
    results_file.write(args.out or ("overhead.json" if args.parallel == "none" else f"overhead-{args.parallel}.json"),
                       report)
    print(f"\n{report['command']}  ({report['date']}, {report['wall_seconds']} s, {report['machine']})\n")
    print(table(results))
    return 0


def loaded_probes(link) -> set[str]:
    """The probes new requests can bind: those of the replicas that take requests."""
    return {name for catalog in link.catalogs().values() for name in catalog}


if __name__ == "__main__":
    sys.exit(main())
