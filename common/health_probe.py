"""Exit 0 when a gRPC server reports SERVING: `python -m common.health_probe HOST:PORT`.

Used by container health checks and Kubernetes probes (no grpcurl needed).
"""

from __future__ import annotations

import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        sys.stderr.write("usage: python -m common.health_probe HOST:PORT\n")
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
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


if __name__ == "__main__":
    sys.exit(main())
