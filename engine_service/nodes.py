"""Engines that span nodes, through vLLM's own `mp` executor.

vLLM's `mp` executor runs one engine over several machines itself: every node
starts with the same engine arguments plus `--nnodes N --node-rank R
--master-addr A --master-port P`. Node 0 runs the engine core, its scheduler
and its local workers: here that is the engine service, so clients, routers and
capture stay in one process. Nodes 1..N-1 run only workers (vLLM's headless
mode); `python -m engine_service.worker_node` starts one with the capture
extension. vLLM's default master address is 127.0.0.1, which only works when
every node is this host, so both commands require it explicitly.
"""

from __future__ import annotations

from argparse import Namespace

# vLLM's ParallelConfig.master_addr default, used when one node needs none.
SINGLE_NODE_MASTER_ADDR = "127.0.0.1"
WORKER_NODE_COMMAND = "python -m engine_service.worker_node"


class NodeFlagsError(ValueError):
    """The multi-node flags contradict each other; the message names the flag."""


def check_node_flags(args: Namespace, worker_node: bool) -> None:
    """Checks --nnodes/--node-rank/--master-addr for the engine service (node 0)
    or a worker node, and fills the master address a single node needs.

    The parser must leave --master-addr at None when it is not given.
    """
    nnodes, rank = args.nnodes, args.node_rank
    if worker_node:
        if nnodes < 2:
            raise NodeFlagsError(
                f"--nnodes {nnodes}: a worker node is part of a multi-node engine; set --nnodes "
                "to the number of nodes (2 or more), the same on every node"
            )
        if rank == 0:
            raise NodeFlagsError(
                "--node-rank 0: node 0 is the engine service itself (python -m engine_service); "
                f"a worker node takes --node-rank {_other_ranks(nnodes)}"
            )
    elif nnodes > 1 and rank != 0:
        raise NodeFlagsError(
            f"--node-rank {rank}: the engine service is node 0 of a multi-node engine; start "
            f"node {_other_ranks(nnodes)} with `{WORKER_NODE_COMMAND}`"
        )
    if not 0 <= rank < nnodes:
        raise NodeFlagsError(f"--node-rank {rank}: must be below --nnodes {nnodes}")
    if args.master_addr is None:
        if nnodes > 1:
            raise NodeFlagsError(
                f"--master-addr: required with --nnodes {nnodes}: the address of node 0 (the "
                "engine service's host) that every node can reach"
            )
        args.master_addr = SINGLE_NODE_MASTER_ADDR


def _other_ranks(nnodes: int) -> str:
    return "1" if nnodes == 2 else f"1 to {nnodes - 1}"
