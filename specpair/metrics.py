"""Prometheus metrics; one registry per service so several can live in one test process."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from specpair.serving import BindError

LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)


class ServiceMetrics:
    """Every metric specpair exports; each service updates the ones that concern it."""

    def __init__(self, service: str) -> None:
        self.registry = CollectorRegistry()
        r, p = self.registry, f"specpair_{service}"
        self.accept_length = Histogram(
            f"{p}_accept_length", "Accepted draft tokens per request per round (bonus excluded)",
            buckets=(0, 1, 2, 3, 4, 5, 6, 7, 8), registry=r,
        )  # fmt: skip
        self.active_tier = Gauge(f"{p}_speculative_num_steps", "Active tier", registry=r)
        self.tier_switches = Counter(f"{p}_tier_switches", "Tier switches applied", registry=r)
        self.stage_latency = Histogram(
            f"{p}_stage_seconds", "Per-stage round latency", ["stage"],
            buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.ttft = Histogram(
            f"{p}_time_to_first_token_seconds", "Time to first token",
            buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.itl = Histogram(
            f"{p}_inter_token_latency_seconds", "Time between streamed tokens",
            buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.running = Gauge(f"{p}_running_requests", "Requests in the batch", registry=r)
        self.queued = Gauge(f"{p}_queued_requests", "Requests waiting for admission", registry=r)
        self.requests = Counter(
            f"{p}_requests", "Finished requests by outcome", ["outcome"], registry=r
        )
        self.fallback_rounds = Counter(
            f"{p}_plain_rounds", "Rounds decoded without speculation", ["reason"], registry=r
        )

    def serve(self, host: str, port: int) -> None:
        """Exposes /metrics over HTTP (port 0: disabled)."""
        if port:
            try:
                start_http_server(port, addr=host, registry=self.registry)
            except OSError as exc:
                raise BindError(
                    f"cannot serve metrics on {host}:{port}: {exc.strerror or exc}"
                ) from None
