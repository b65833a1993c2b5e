"""Container healthcheck: exit 0 when a server's grpc.health.v1 reports SERVING, else 1.

    python -m specpair.healthcheck 127.0.0.1:50051 [--service NAME] [--timeout S] [--tls-ca PEM]

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


def check(address: str, *, service: str = "", timeout: float = 3.0, ca: Path | None = None) -> bool:
    """Whether the server at `address` reports `service` ("" = the whole server) SERVING."""
    if ca is None:
        channel = grpc.insecure_channel(address)
    else:
        creds = grpc.ssl_channel_credentials(root_certificates=ca.read_bytes())
        channel = grpc.secure_channel(address, creds)
    with channel:
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
    parser = argparse.ArgumentParser(prog="python -m specpair.healthcheck", description=__doc__)
    parser.add_argument("address", help="HOST:PORT or unix:PATH of a specpair server")
    parser.add_argument("--service", default="", help="service name; default: the whole server")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds")
    parser.add_argument("--tls-ca", type=Path, default=None, help="CA certificate (PEM) for TLS")
    args = parser.parse_args(argv)
    return (
        0 if check(args.address, service=args.service, timeout=args.timeout, ca=args.tls_ca) else 1
    )


if __name__ == "__main__":
    sys.exit(main())
