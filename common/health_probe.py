"""gRPC health for container checks and Kubernetes probes (no grpcurl needed).

  python -m common.health_probe HOST:PORT TLS-FLAGS         exit 0 when the server reports SERVING
  python -m common.health_probe --live HOST:PORT TLS-FLAGS  exit 0 when the server answers at all

SERVING is readiness: a router reports NOT_SERVING until it has probes, an engine
until vLLM is up. `--live` is liveness: a process that answers health, whatever
the status, is alive and must not be restarted for being unready.

For a TLS service pass `--tls-ca` (and, for a router, which requires a client
certificate from every caller, `--tls-cert` and `--tls-key`: the router's own
pair serves); `--server-name` is the name the certificate must carry when it
is not HOST. Without --tls-ca the files come from UNDERCURRENT_TLS_CA,
UNDERCURRENT_TLS_CERT and UNDERCURRENT_TLS_KEY when set, so a container sets
them once; otherwise, or with `--insecure`, it speaks plaintext. Health needs no token.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.security.client import ENV_CA, ENV_CERT, ENV_KEY

USAGE = ("python -m common.health_probe [--live] HOST:PORT "
         "[--tls-ca CA [--tls-cert CERT --tls-key KEY] [--server-name NAME] | --insecure]")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        self.exit(2, f"usage: {USAGE}\n{self.prog}: error: {message}\n")


def parse_args(argv: list[str], environ=os.environ):
    """Without --tls-ca or --insecure, the TLS files come from UNDERCURRENT_TLS_CA,
    _CERT and _KEY when set (common.security.client), else plaintext."""
    parser = _Parser(prog="python -m common.health_probe", usage=USAGE, description=__doc__.splitlines()[0])
    parser.add_argument("address", help="HOST:PORT")
    parser.add_argument("--tls-ca", type=Path, help="CA bundle the server's certificate must chain to")
    parser.add_argument("--tls-cert", type=Path, help="client certificate (routers require one)")
    parser.add_argument("--tls-key", type=Path, help="private key of --tls-cert")
    parser.add_argument("--server-name", help="name the server's certificate must carry (default: HOST)")
    parser.add_argument("--insecure", action="store_true", help="plaintext")
    parser.add_argument("--live", action="store_true", help="exit 0 on any answer (liveness)")
    args = parser.parse_args(argv)
    if args.address.startswith("-"):
        parser.error(f"{args.address}: expected HOST:PORT")
    if args.insecure and args.tls_ca is not None:
        parser.error("--insecure: conflicts with --tls-ca")
    if not args.insecure and args.tls_ca is None and environ.get(ENV_CA):
        args.tls_ca = Path(environ[ENV_CA])
        if args.tls_cert is None and environ.get(ENV_CERT) and environ.get(ENV_KEY):
            args.tls_cert, args.tls_key = Path(environ[ENV_CERT]), Path(environ[ENV_KEY])
    args.insecure = args.tls_ca is None
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
