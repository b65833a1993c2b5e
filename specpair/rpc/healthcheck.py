"""Container healthcheck: exit 0 when a server's grpc.health.v1 reports SERVING, else 1.

    python -m specpair.rpc.healthcheck 127.0.0.1:50051 [--service NAME] [--timeout S]
        [--tls-ca PEM [--tls-cert PEM --tls-key PEM]]

Our servers report NOT_SERVING until the model is loaded and every runtime state is built, so
this is what docker-compose's `depends_on: service_healthy` waits on. Imports no torch: it runs
every few seconds inside the serving container.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specpair.config import TLSConfig
from specpair.rpc.channels import open_blocking_channel


def check(
    address: str, *, service: str = "", timeout: float = 3.0, tls: TLSConfig | None = None
) -> bool:
    """Whether the server at `address` reports `service` ("" = the whole server) SERVING.

    A server given a CA takes only clients with a certificate: pass the service's own in `tls`.
    """
    with open_blocking_channel(address, tls) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError as e:
            print(f"{address}: {e.code().name}: {e.details()}", file=sys.stderr)
            return False
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(f"{address}: {status}")
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specpair.rpc.healthcheck", description=__doc__)
    parser.add_argument("address", help="HOST:PORT or unix:PATH of a specpair server")
    parser.add_argument("--service", default="", help="service name; default: the whole server")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds")
    parser.add_argument("--tls-ca", type=Path, default=None, help="CA certificate (PEM) for TLS")
    parser.add_argument("--tls-cert", type=Path, default=None, help="client certificate (mTLS)")
    parser.add_argument("--tls-key", type=Path, default=None, help="its private key")
    args = parser.parse_args(argv)
    try:
        tls = TLSConfig(args.tls_cert, args.tls_key, args.tls_ca)
    except ValueError as exc:
        parser.error(str(exc))
    return 0 if check(args.address, service=args.service, timeout=args.timeout, tls=tls) else 1


if __name__ == "__main__":
    sys.exit(main())
