"""gRPC health for container checks and Kubernetes probes (no grpcurl needed).

  python -m common.health_probe HOST:PORT         exit 0 when the server reports SERVING
  python -m common.health_probe --live HOST:PORT  exit 0 when the server answers at all

SERVING is readiness: a router reports NOT_SERVING until it has probes, an engine
until vLLM is up. `--live` is liveness: a process that answers health, whatever
the status, is alive and must not be restarted for being unready.
"""

from __future__ import annotations

import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

USAGE = "usage: python -m common.health_probe [--live] HOST:PORT\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    live = "--live" in argv
    if live:
        argv.remove("--live")
    if len(argv) != 1 or argv[0].startswith("-"):
        sys.stderr.write(USAGE)
        return 2
    try:
        with grpc.insecure_channel(argv[0]) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=3
            )
    except grpc.RpcError as err:
        sys.stderr.write(f"{argv[0]}: {err.code().name}\n")
        return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(f"{argv[0]}: {status}")
    return 0 if live or reply.status == health_pb2.HealthCheckResponse.SERVING else 1


if __name__ == "__main__":
    sys.exit(main())
