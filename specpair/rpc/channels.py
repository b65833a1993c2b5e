"""The one way anything here opens a gRPC channel: service to service, SDK, healthcheck.

Imports no torch: the SDK and the container healthcheck use it on machines without one.
"""

from __future__ import annotations

import grpc

from specpair.config import TLSConfig

# Large enough for sampling rounds that carry draft distributions [s, vocab] per request.
MESSAGE_LIMIT = 256 * 1024 * 1024
CHANNEL_OPTIONS: list[tuple[str, int | str]] = [
    ("grpc.max_send_message_length", MESSAGE_LIMIT),
    ("grpc.max_receive_message_length", MESSAGE_LIMIT),
]


def channel_credentials(tls: TLSConfig | None) -> grpc.ChannelCredentials | None:
    """Channel credentials, or None for plaintext. Presents our certificate when one is
    configured (what a server given a CA requires); without a CA the system roots verify the
    server."""
    if tls is None or not tls.enabled:
        return None
    return grpc.ssl_channel_credentials(
        root_certificates=tls.ca.read_bytes() if tls.ca else None,
        private_key=tls.key.read_bytes() if tls.key else None,
        certificate_chain=tls.cert.read_bytes() if tls.cert else None,
    )


def open_channel(
    address: str, tls: TLSConfig | None = None, *, authority: str | None = None
) -> grpc.aio.Channel:
    """An asyncio channel; it belongs to the event loop that is running when it is opened.
    `authority`: the name the server is known by when `address` is one of its IP addresses
    (a replica behind a name resolving to several): TLS checks the certificate against it."""
    options = list(CHANNEL_OPTIONS)
    if authority:
        options += [("grpc.default_authority", authority)]
    creds = channel_credentials(tls)
    if creds is None:
        return grpc.aio.insecure_channel(address, options=options)
    if authority:
        options += [("grpc.ssl_target_name_override", authority)]
    return grpc.aio.secure_channel(address, creds, options=options)


def open_blocking_channel(address: str, tls: TLSConfig | None = None) -> grpc.Channel:
    """A blocking channel with the same credentials and limits as `open_channel`."""
    creds = channel_credentials(tls)
    if creds is None:
        return grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    return grpc.secure_channel(address, creds, options=CHANNEL_OPTIONS)


def auth_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """The ops bearer token as call metadata (none without a token)."""
    return (("authorization", f"Bearer {token}"),) if token else ()


# The Round stream's metadata naming the target that opens it: the draft counts a target's
# slots over all its streams (`max_target_requests`) and shows them per target.
TARGET_METADATA = "x-specpair-target"


def target_metadata(identity: str) -> tuple[tuple[str, str], ...]:
    """A target's identity as call metadata (none when it has none)."""
    return ((TARGET_METADATA, identity),) if identity else ()
