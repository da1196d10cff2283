"""python -m engine_service.worker_node --model PATH --nnodes N --node-rank R --master-addr ADDR [vLLM flags]

One more node of a multi-node engine whose node 0 is the engine service
(`python -m engine_service ... --nnodes N --node-rank 0 --master-addr ADDR`).
It runs only vLLM workers (vLLM's headless mode) with the capture extension;
give it the same model and parallelism flags as node 0. Its workers' captured
rows reach the engine service through vLLM's collective_rpc.
"""

from __future__ import annotations

import os
import socket
import sys

from engine_service.__main__ import engine_parser, parse_engine_args

PROG = "engine_service.worker_node"


def main(argv: list[str] | None = None) -> int:
    parser = engine_parser(PROG, __doc__.splitlines()[0])
    args = parse_engine_args(parser, argv, worker_node=True)
    from engine_service.capture.controller import CaptureUnavailable, enable_capture
    from engine_service.capture.push import NODE_IDENTITY_ENV

    try:
        enable_capture(args)
    except CaptureUnavailable as err:
        parser.error(str(err))
    # Inherited by the workers this process spawns: they never push to node 0's sink.
    os.environ[NODE_IDENTITY_ENV] = f"{socket.gethostname()}/node-{args.node_rank}"
    print(f"{PROG}: node {args.node_rank} of {args.nnodes}, joining {args.master_addr}:"
          f"{args.master_port}", flush=True)
    from vllm.entrypoints.cli.serve import run_headless

    # run_headless reads two flags of `vllm serve` that an engine-only parser lacks.
    args.api_server_count = 0
    args.reasoning_parser_plugin = None
    run_headless(args)  # returns when the engine shuts down or a worker dies
    return 0


if __name__ == "__main__":
    sys.exit(main())
