"""What every service's server takes: its address, metrics address, ops token and TLS."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from specpair.config.addresses import check_grpc_address, split_address


@dataclass(frozen=True, slots=True)
class TLSConfig:
    cert: Path | None = None  # server certificate (servers) / client certificate (mTLS)
    key: Path | None = None
    ca: Path | None = None  # CA that signs the peer's certificate

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise ValueError("TLS needs both a certificate and a key (--tls-cert, --tls-key)")
        for p in (self.cert, self.key, self.ca):
            if p is not None and not Path(p).is_file():
                raise ValueError(f"TLS file {p} does not exist")

    @property
    def enabled(self) -> bool:
        return self.cert is not None or self.ca is not None


@dataclass(frozen=True, slots=True)
class ServerConfig:
    address: str
    metrics_address: str = ""  # "" disables /metrics
    ops_token: str | None = None
    tls: TLSConfig = field(default_factory=TLSConfig)

    def __post_init__(self) -> None:
        check_grpc_address(self.address)
        if self.metrics_address:
            split_address(self.metrics_address)
