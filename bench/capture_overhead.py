"""What capture, probing and token gating cost, against the same engine with
capture off, in one process and one run (rounds alternate between modes so
machine noise hits every mode alike).

    python -m bench.capture_overhead --model .cache/models/tiny-llama

Modes, each N concurrent greedy requests of T tokens through EngineRuntime
(the engine service minus its gRPC front end):
  off         no extraction point, no probe (the drain loop idles)
  capture     residual_stream of every layer for every generated token,
              streamed back to the client in-band
  probe       one observe probe on the last layer, scored by a real router
              process over loopback
  probe+gate  the same with gate_tokens (tokens wait for the router's ack)
Writes bench/results/capture_overhead.md with the command that produced it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from common.probe_format.files import write_probe  # noqa: E402
from tools import processes  # noqa: E402
from undercurrent.v1 import engine_pb2 as engine_pb  # noqa: E402
from undercurrent.v1 import types_pb2 as types_pb  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "capture_overhead.md"
PROBE = "bench_norm"


def write_bench_probe(directory: Path, config: dict) -> None:
    write_probe(directory / PROBE, {
        "name": PROBE, "version": "1", "kind": "norm", "tensor_type": "residual_stream",
        "layers": [config["num_hidden_layers"] - 1], "hidden_size": config["hidden_size"],
        "dtype": "float32", "threshold": 1e9, "action": "observe", "tokens": {"scope": "generated"},
    })


def requests_for(mode: str, count: int, tokens: int, layers: int, round_index: int):
    out = []
    for i in range(count):
        message = engine_pb.GenerateRequest(
            request_id=f"{mode}-{round_index}-{i}", text=f"benchmark prompt number {i}",
            sampling=engine_pb.SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True),
        )
        if mode == "capture":
            message.extraction_points.add(
                name="all", tensor_type=types_pb.TENSOR_TYPE_RESIDUAL_STREAM, layers=list(range(layers)),
                tokens=types_pb.TokenSelector(scope=types_pb.TokenSelector.SCOPE_GENERATED), stream_to_client=True)
        if mode.startswith("probe"):
            message.probes.add(probe=PROBE, failure_policy=types_pb.FAILURE_POLICY_FAIL_OPEN)
            message.gate_tokens = mode == "probe+gate"
        out.append(message)
    return out


async def run_mode(runtime, mode, count, tokens, layers, round_index) -> tuple[float, int]:
    async def one(message):
        got = 0
        async for response in runtime.generate(message):
            if response.HasField("tokens"):
                got += len(response.tokens.token_ids)
        return got

    start = time.perf_counter()
    produced = await asyncio.gather(*[one(m) for m in requests_for(mode, count, tokens, layers, round_index)])
    elapsed = time.perf_counter() - start
    assert all(p == tokens for p in produced), produced
    return elapsed, sum(produced)


async def main_async(args) -> str:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from engine_service.capture.driver.controller import CaptureController, capture_engine_kwargs
    from engine_service.link import RouterLinkConfig
    from engine_service.service.runtime import EngineRuntime, EngineSettings

    config = json.loads((Path(args.model) / "config.json").read_text())
    probes_dir = Path(".cache/bench-probes")
    write_bench_probe(probes_dir, config)
    # Plaintext: this measures capture and probing, not TLS.
    router = processes.router(processes.free_port(), probes_dir, secure=False).start()
    await router.wait_health(timeout=60)
    llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**capture_engine_kwargs(
        model=args.model, dtype="float32", max_model_len=1024, disable_log_stats=True)))
    runtime = EngineRuntime(llm, CaptureController(llm),
                            link_config=RouterLinkConfig(targets=router.address),
                            settings=EngineSettings(default_failure_policy=types_pb.FAILURE_POLICY_FAIL_OPEN))
    await runtime.start()
    await runtime.link.wait_ready(timeout=30)
    await asyncio.sleep(0.5)  # the router's catalog reaches the link after hello
    modes = ["off", "capture", "probe", "probe+gate"]
    layers = config["num_hidden_layers"]
    times: dict[str, list[float]] = {m: [] for m in modes}
    try:
        for mode in modes:  # warm-up
            await run_mode(runtime, mode, 2, 8, layers, -1)
        for r in range(args.rounds):
            for mode in modes:
                elapsed, _ = await run_mode(runtime, mode, args.requests, args.tokens, layers, r)
                times[mode].append(elapsed)
                print(f"round {r} {mode:>10}: {elapsed:.2f} s", flush=True)
    finally:
        await runtime.close()
        llm.shutdown()
        router.kill()
    base = statistics.median(times["off"])
    rows = []
    for mode in modes:
        median = statistics.median(times[mode])
        tokens_per_s = args.requests * args.tokens / median
        rows.append(f"| {mode} | {median:.2f} | {tokens_per_s:,.0f} | {median / base:.3f} |")
    command = "python -m bench.capture_overhead " + " ".join(sys.argv[1:])
    return "\n".join([
        "# Capture, probe and gating overhead",
        "",
        f"Command: `{command.strip()}`",
        "",
        f"Date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {platform.machine()}, "
        f"{os.cpu_count()} cores (shared, noisy), vLLM CPU build. Model: {args.model} "
        f"({layers} layers, hidden {config['hidden_size']}, float32). {args.requests} concurrent "
        f"greedy requests x {args.tokens} tokens per mode, median of {args.rounds} alternating rounds.",
        "",
        "| mode | median s | tokens/s | time / off |",
        "|---|---:|---:|---:|",
        *rows,
        "",
        "capture: residual_stream of every layer for every generated token, streamed to the "
        "client in-band. probe: one observe probe on the last layer, scored by a router process "
        "on loopback. probe+gate: the same with gate_tokens.",
        "",
    ])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=".cache/models/tiny-llama")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    report = asyncio.run(main_async(args))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(report)
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
