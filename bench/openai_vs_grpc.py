"""The OpenAI HTTP API against the gRPC API of the same engine, for the same load.

    python -m bench.openai_vs_grpc [--requests 8] [--tokens 64] [--rounds 4] [--probe] [--out FILE]

One engine process (TLS, client tokens, --openai-port) and one router process
on loopback, started here. Each round runs the load once per path, in an order
rotated per round so the shared cores' load hits both alike: --requests
concurrent streamed requests, greedy with ignore_eos, each a distinct prompt
of --prompt-tokens token ids (the same ids on both paths: no prefix-cache hits
between them, no template), --tokens new tokens. With --probe every request
binds an observe probe (scores stream on both paths). Reports per path the
tokens per second over the round's wall time and the median time to first
token, and the ratios to gRPC of their medians over rounds. Paths: `grpc`
(the generated stubs), `http` (the official `openai` package, which parses
every chunk into its models) and `http_sse` (the same HTTP requests read as
raw server-sent events: the server's side without the SDK's). Clients run in
this process, on the engine's cores. Writes bench/results/openai_vs_grpc.json
(or --out).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import openai

from bench import results_file
from common.probe_format.files import write_probe
from tools import stack
from tools.dev_security import DevSecurity
from undercurrent.v1 import engine_pb2 as engine_pb
from undercurrent.v1 import engine_pb2_grpc as engine_pb_grpc
from undercurrent.v1 import types_pb2 as types_pb

MODEL = "bench"
PROBE = "watch"
PATHS = ("grpc", "http", "http_sse")


def observe_probe() -> dict:
    return {"name": PROBE, "version": "1", "kind": "norm", "tensor_type": "residual_stream", "layers": [1],
            "hidden_size": 128, "dtype": "float32", "threshold": 1e9, "action": "observe",
            "tokens": {"scope": "generated"}}


async def one_grpc(stub, ids: list[int], args) -> tuple[int, float]:
    """(tokens received, seconds to the first)."""
    request = engine_pb.GenerateRequest(token_ids=engine_pb.TokenIds(ids=ids), sampling=engine_pb.SamplingParams(
        max_tokens=args.tokens, temperature=0, ignore_eos=True))
    if args.probe:
        request.probes.add(probe=PROBE, failure_policy=types_pb.FAILURE_POLICY_FAIL_OPEN)
    started, first, tokens = time.perf_counter(), None, 0
    async for response in stub.Generate(request, timeout=600):
        if response.HasField("tokens"):
            first = first or time.perf_counter() - started
            tokens += len(response.tokens.token_ids)
    return tokens, first


async def one_http(client: openai.AsyncOpenAI, ids: list[int], args) -> tuple[int, float]:
    extra = {"ignore_eos": True}
    if args.probe:
        extra["undercurrent"] = {"probes": [{"probe": PROBE, "failure_policy": "fail_open"}]}
    started, first, tokens = time.perf_counter(), None, 0
    stream = await client.completions.create(model=MODEL, prompt=ids, max_tokens=args.tokens, temperature=0,
                                             stream=True, stream_options={"include_usage": True}, extra_body=extra)
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            first = first or time.perf_counter() - started
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return tokens, first


async def one_sse(http: httpx.AsyncClient, ids: list[int], args) -> tuple[int, float]:
    """The same HTTP request read as raw server-sent events: the server's cost without the SDK's."""
    body = {"model": MODEL, "prompt": ids, "max_tokens": args.tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True}
    if args.probe:
        body["undercurrent"] = {"probes": [{"probe": PROBE, "failure_policy": "fail_open"}]}
    started, first, tokens = time.perf_counter(), None, 0
    async with http.stream("POST", "completions", json=body) as reply:
        async for line in reply.aiter_lines():
            if not line.startswith("data: {"):
                continue
            if first is None and '"text":"' in line and '"text":""' not in line:
                first = time.perf_counter() - started
            if '"usage":{' in line:
                tokens = json.loads(line[6:])["usage"]["completion_tokens"]
    return tokens, first


async def run_path(path: str, stub, client, http, prompts: list[list[int]], args) -> dict:
    started = time.perf_counter()
    one = {"grpc": lambda ids: one_grpc(stub, ids, args), "http": lambda ids: one_http(client, ids, args),
           "http_sse": lambda ids: one_sse(http, ids, args)}[path]
    results = await asyncio.gather(*(one(ids) for ids in prompts))
    wall = time.perf_counter() - started
    tokens = sum(t for t, _ in results)
    assert tokens == args.tokens * len(prompts), (path, tokens)
    return {"tokens_per_s": tokens / wall, "ttft_ms": 1000 * statistics.median(f for _, f in results)}


async def main(args) -> None:
    began = time.time()
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as tmp:
        write_probe(Path(tmp) / PROBE, observe_probe())
        router = stack.router(stack.free_port(), Path(tmp))
        port = stack.free_port()
        engine = stack.engine(args.model, router.address, "--openai-port", str(port), "--served-model-name", MODEL,
                              "--max-num-seqs", str(max(8, args.requests)))
        try:
            router.start()
            engine.start()
            await engine.wait_health(timeout=600)
            dev = DevSecurity.ensure()
            base_url = f"https://127.0.0.1:{port}/v1/"
            async with stack.channel(engine.address) as channel, httpx.AsyncClient(
                    base_url=base_url, verify=str(dev.ca), timeout=600,
                    headers={"Authorization": f"Bearer {dev.client_token}"}) as http, openai.AsyncOpenAI(
                    base_url=base_url, api_key=dev.client_token, max_retries=0,
                    http_client=httpx.AsyncClient(verify=str(dev.ca), timeout=600)) as client:
                stub = engine_pb_grpc.EngineServiceStub(channel)
                await stack.wait_for_probe(stub, PROBE)
                fresh = lambda: [[rng.randrange(5, 250) for _ in range(args.prompt_tokens)]  # noqa: E731
                                 for _ in range(args.requests)]
                for path in PATHS:  # warm-up, not reported
                    await run_path(path, stub, client, http, fresh(), args)
                rounds = []
                for index in range(args.rounds):
                    order = PATHS[index % len(PATHS):] + PATHS[:index % len(PATHS)]
                    rounds.append({path: await run_path(path, stub, client, http, fresh(), args) for path in order})
                    print(f"round {index + 1}: {rounds[-1]}", flush=True)
        finally:
            engine.kill()
            router.kill()
    medians = results_file.medians(rounds)
    ratios = {path: {key: medians[path][key] / medians["grpc"][key] for key in ("tokens_per_s", "ttft_ms")}
              for path in PATHS[1:]}
    report = results_file.write_rounds(args.out, began, args, "tokens/s over the round; ms to the first token",
                                       rounds, over_grpc=ratios)
    print("| path | tokens/s | TTFT ms | tokens/s / gRPC | TTFT / gRPC |\n|---|---|---|---|---|")
    for path in PATHS:
        ratio = ratios.get(path, {"tokens_per_s": 1.0, "ttft_ms": 1.0})
        print(f"| {path} | {report['medians'][path]['tokens_per_s']:.1f} | {report['medians'][path]['ttft_ms']:.1f} "
              f"| {ratio['tokens_per_s']:.3f} | {ratio['ttft_ms']:.3f} |")


def parse_args():
    parser = argparse.ArgumentParser(prog="python -m bench.openai_vs_grpc", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=".cache/models/tiny-llama",
                        help="the engine's model (default: the embedded one)")
    parser.add_argument("--requests", type=int, default=8, help="concurrent requests per round and path")
    parser.add_argument("--tokens", type=int, default=64, help="new tokens per request")
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--probe", action="store_true", help="bind an observe probe to every request")
    parser.add_argument("--out", default="openai_vs_grpc.json")
    return parser.parse_args()


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
