"""`make run`: a router and an engine as two real processes on loopback.

Waits until both report SERVING on gRPC health, then runs the probe lifecycle
(`probe_lifecycle.demo`: capture a labelled set, train, deploy live, generate
with the probe bound); with --norm-demo it sends one Generate request with a
norm monitor bound instead. Keeps both running until Ctrl-C (or exits with
--exit-after-demo).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from pathlib import Path

from common.enum_names import short_name
from tools import processes
from undercurrent.v1 import engine_pb2 as engine_pb
from undercurrent.v1 import types_pb2 as types_pb
from undercurrent.v1 import engine_pb2_grpc as engine_pb_grpc

REPO = Path(__file__).resolve().parent.parent


async def demo(engine_service: processes.Service, prompt: str, max_tokens: int, probe: str | None) -> None:
    async with engine_service.channel() as channel:
        engine = engine_pb_grpc.EngineServiceStub(channel)
        info = (await engine.GetModelInfo(engine_pb.GetModelInfoRequest())).model
        print(
            f"model {info.architecture}: {info.num_layers} layers, hidden {info.hidden_size}, "
            f"{info.dtype}, TP={info.tensor_parallel_size} PP={info.pipeline_parallel_size}"
        )
        request = engine_pb.GenerateRequest(
            text=prompt,
            sampling=engine_pb.SamplingParams(max_tokens=max_tokens, temperature=0.0),
        )
        if probe:
            request.probes.add(probe=probe, failure_policy=types_pb.FAILURE_POLICY_FAIL_OPEN)
        print(f"prompt: {prompt!r}\n--- streamed text (random weights: the words are noise) ---")
        scores: list[tuple[int, float]] = []
        async for response in engine.Generate(request):
            kind = response.WhichOneof("event")
            if kind == "tokens":
                print(response.tokens.text, end="", flush=True)
            elif kind == "probe_event":
                event = response.probe_event.scores
                scores.extend(zip(event.token_positions, event.scores))
            elif kind == "finished":
                done = response.finished
                print(
                    f"\n--- finished: {short_name(types_pb.FinishReason, done.finish_reason)}, "
                    f"{done.generated_tokens} tokens ---"
                )
        if scores:
            shown = ", ".join(f"{pos}:{value:.1f}" for pos, value in scores[:8])
            print(f"probe {probe}: {len(scores)} scores (token position:score) {shown} ...")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--prompt", default="The quick brown fox")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--exit-after-demo", action="store_true")
    parser.add_argument("--startup-timeout", type=float, default=300)
    parser.add_argument("--norm-demo", action="store_true",
                        help="one generation with a norm monitor instead of the probe lifecycle")
    args = parser.parse_args(argv)
    if not Path(args.model).is_dir():
        raise SystemExit(f"run_demo: error: --model {args.model!r} is not a directory")

    from tools.demo_probe import write_demo_probe

    probes_dir = REPO / ".cache" / "demo_probes"
    probe_name = write_demo_probe(probes_dir, Path(args.model))
    router = processes.router(processes.free_port(), probes_dir, log_to_file=False).start()
    engine = processes.engine(
        args.model, router.address, "--log-level", "WARNING", log_to_file=False
    ).start()
    try:
        asyncio.run(router.wait_health(timeout=60))
        print(f"router SERVING on {router.address}", flush=True)
        asyncio.run(engine.wait_health(timeout=args.startup_timeout))
        print(f"engine SERVING on {engine.address} over TLS (CA {engine.security.ca}; "
              f"client tokens in {engine.security.directory / 'client-tokens'})", flush=True)
        if args.norm_demo:
            asyncio.run(demo(engine, args.prompt, args.max_tokens, probe_name))
        else:
            from probe_lifecycle.demo import lifecycle_demo

            os.environ.update(engine.security.client_env())  # the lifecycle commands' credentials
            asyncio.run(lifecycle_demo(engine.address, router.address, REPO / ".cache" / "lifecycle"))
        if not args.exit_after_demo:
            print("Both services keep running; Ctrl-C stops them.", flush=True)
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
            signal.sigwait({signal.SIGINT, signal.SIGTERM})
    except KeyboardInterrupt:
        pass
    finally:
        for service in (engine, router):
            service.terminate(timeout=30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
