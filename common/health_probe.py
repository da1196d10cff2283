"""gRPC health for container checks and Kubernetes probes (no grpcurl needed).

  python -m common.health_probe HOST:PORT TLS-FLAGS         exit 0 when the server reports SERVING
  python -m common.health_probe --live HOST:PORT TLS-FLAGS  exit 0 when the server answers at all

SERVING is readiness: a router reports NOT_SERVING until it has probes, an engine
until vLLM is up. `--live` is liveness: a process that answers health, whatever
the status, is alive and must not be restarted for being unready.

For a TLS service pass `--tls-ca` (and, for a router, which requires a client
certificate from every caller, `--tls-cert` and `--tls-key`: the router's own
pair serves); `--server-name` is the name the certificate must carry when it
is not HOST. `--insecure` checks a plaintext service. Health needs no token.
"""

from __future__ import annotations

import sys
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.cli import OneLineErrorParser


def parse_args(argv: list[str]):
    parser = OneLineErrorParser(prog="python -m common.health_probe", description=__doc__.splitlines()[0])
    parser.add_argument("address", help="HOST:PORT")
    parser.add_argument("--tls-ca", type=Path, help="CA bundle the server's certificate must chain to")
    parser.add_argument("--tls-cert", type=Path, help="client certificate (routers require one)")
    parser.add_argument("--tls-key", type=Path, help="private key of --tls-cert")
    parser.add_argument("--server-name", help="name the server's certificate must carry (default: HOST)")
    parser.add_argument("--insecure", action="store_true", help="plaintext")
    parser.add_argument("--live", action="store_true", help="exit 0 on any answer (liveness)")
    args = parser.parse_args(argv)
    if args.insecure == (args.tls_ca is not None):
        parser.error("give --tls-ca for a TLS service or --insecure for a plaintext one")
    if (args.tls_cert is None) != (args.tls_key is None):
        parser.error("--tls-cert and --tls-key go together")
    return args


def open_channel(args) -> grpc.Channel:
    if args.insecure:
        return grpc.insecure_channel(args.address)
    credentials = grpc.ssl_channel_credentials(
        args.tls_ca.read_bytes(),
        args.tls_key.read_bytes() if args.tls_key else None,
        args.tls_cert.read_bytes() if args.tls_cert else None,
    )
    options = [("grpc.ssl_target_name_override", args.server_name)] if args.server_name else []
    return grpc.secure_channel(args.address, credentials, options=options)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        with open_channel(args) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=3)
    except OSError as err:
        sys.stderr.write(f"{args.address}: {err}\n")
        return 2
    except grpc.RpcError as err:
        sys.stderr.write(f"{args.address}: {err.code().name}\n")
        return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(f"{args.address}: {status}")
    return 0 if args.live or reply.status == health_pb2.HealthCheckResponse.SERVING else 1


if __name__ == "__main__":
    sys.exit(main())
