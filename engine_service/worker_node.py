"""python -m engine_service.worker_node --model PATH --nnodes N --node-rank R --master-addr ADDR [vLLM flags]

One more node of a multi-node engine whose node 0 is the engine service
(`python -m engine_service ... --nnodes N --node-rank 0 --master-addr ADDR`).
It runs only vLLM workers (vLLM's headless mode) with the capture extension;
give it the same model and parallelism flags as node 0. Its workers' captured
rows reach the engine service through vLLM's collective_rpc.

vLLM's headless workers wait forever for a node 0 that went away, so a
restarted engine would wait for them in vain. This process watches node 0's
master port (the world process group's store, served by node 0's first worker)
and exits 1 once it stops answering, so a supervisor (Kubernetes, compose)
restarts the node and it joins node 0's next start.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import socket
import sys
import threading
import time

from engine_service.__main__ import engine_parser, parse_engine_args

PROG = "engine_service.worker_node"
log = logging.getLogger(PROG)

# Node 0 is gone after this many failed connections to its master port, this far apart.
NODE0_CHECK_INTERVAL_S = 5.0
NODE0_MISSES = 3
NODE0_GONE_EXIT_CODE = 1


def node0_answers(address: str, port: int, timeout_s: float = 2.0) -> bool:
    try:
        with socket.create_connection((address, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def watch_node0(address: str, port: int, interval_s: float = NODE0_CHECK_INTERVAL_S,
                misses: int = NODE0_MISSES) -> None:
    """Ends this process (and its workers) once node 0, seen up before, stops answering."""
    seen, missed = False, 0
    while True:
        time.sleep(interval_s)
        if node0_answers(address, port):
            seen, missed = True, 0
            continue
        missed += 1
        if seen and missed >= misses:
            log.error("node 0 (%s:%d) stopped answering %d times in a row; exiting so this node "
                      "rejoins the engine's next start", address, port, missed)
            for child in multiprocessing.active_children():
                child.kill()
            # Not sys.exit: vLLM's shutdown waits on the node that is gone.
            os._exit(NODE0_GONE_EXIT_CODE)


def main(argv: list[str] | None = None) -> int:
    parser = engine_parser(PROG, __doc__.splitlines()[0])
    args = parse_engine_args(parser, argv, worker_node=True)
    from engine_service.capture.driver.controller import CaptureUnavailable, enable_capture
    from engine_service.capture.channel import NODE_IDENTITY_ENV

    try:
        enable_capture(args)
    except CaptureUnavailable as err:
        parser.error(str(err))
    # Inherited by the workers this process spawns: they never push to node 0's sink.
    os.environ[NODE_IDENTITY_ENV] = f"{socket.gethostname()}/node-{args.node_rank}"
    print(f"{PROG}: node {args.node_rank} of {args.nnodes}, joining {args.master_addr}:"
          f"{args.master_port}", flush=True)
    from vllm.entrypoints.cli.serve import run_headless

    threading.Thread(target=watch_node0, args=(args.master_addr, args.master_port),
                     name="node0-watch", daemon=True).start()

    # run_headless reads two flags of `vllm serve` that an engine-only parser lacks.
    args.api_server_count = 0
    args.reasoning_parser_plugin = None
    run_headless(args)  # returns when the engine shuts down or a worker dies
    return 0


if __name__ == "__main__":
    sys.exit(main())
