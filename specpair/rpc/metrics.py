"""Prometheus metrics; one registry per service so several can live in one test process."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterable
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

from specpair.rpc.gc_heap import GcPauses
from specpair.rpc.serving import BindError

# The families each service exports: a draft has no requests, hence no TTFT, and no tier of
# its own (it drafts at the tier each round names), so neither reads a misleading 0.
FAMILIES = {
    "target": None,  # all
    "draft": {"stage_latency"},
    "controller": {"accept_length", "active_tier", "tier_switches"},
}
LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
REQUEST_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)


class ServiceMetrics:
    """Every metric specpair exports; each service updates the ones that concern it."""

    def __init__(self, service: str) -> None:
        self.registry = CollectorRegistry()
        r, p = None, f"specpair_{service}"  # registered below, those of FAMILIES[service]
        self.accept_length = Histogram(
            f"{p}_accept_length",
            "Accepted draft tokens per request per round (bonus excluded)",
            buckets=(0, 1, 2, 3, 4, 5, 6, 7, 8),
            registry=r,
        )
        self.active_tier = Gauge(f"{p}_speculative_num_steps", "Active tier", registry=r)
        self.tier_switches = Counter(f"{p}_tier_switches", "Tier switches applied", registry=r)
        self.stage_latency = Histogram(
            f"{p}_stage_seconds",
            "Per-stage round latency",
            ["stage"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            f"{p}_time_to_first_token_seconds",
            "Time to first token",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            f"{p}_inter_token_latency_seconds",
            "Time between streamed tokens",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        # vLLM's and SGLang's headline families, under our prefix.
        self.prompt_tokens = Counter(
            f"{p}_prompt_tokens", "Prompt tokens of admitted requests", registry=r
        )
        self.generation_tokens = Counter(
            f"{p}_generation_tokens", "Tokens generated and streamed to clients", registry=r
        )
        self.request_latency = Histogram(
            f"{p}_request_latency_seconds",
            "End-to-end request latency: arrival to last token",
            buckets=REQUEST_BUCKETS,
            registry=r,
        )
        self.kv_cache_usage = Gauge(
            f"{p}_kv_cache_usage",
            "Share of the KV cache's pages in use (0 to 1), read when scraped",
            registry=r,
        )
        self.running = Gauge(f"{p}_running_requests", "Requests in the batch", registry=r)
        self.queued = Gauge(f"{p}_queued_requests", "Requests waiting for admission", registry=r)
        self.requests = Counter(
            f"{p}_requests", "Finished requests by outcome", ["outcome"], registry=r
        )
        self.joins = Counter(
            f"{p}_joins",
            "Requests admitted into the batch by how their prompt ran (prefill: a forward of "
            "its own; ride: in the verify of the round it joined during)",
            ["how"],
            registry=r,
        )
        self.fallback_rounds = Counter(
            f"{p}_plain_rounds", "Rounds decoded without speculation", ["reason"], registry=r
        )
        self.accepts = Counter(
            f"{p}_accepts",
            "Verifies by where their accept ran (greedy: the argmax; graph / "
            "device: a sampled batch in an accept graph / batched eagerly; host: per request)",
            ["path"],
            registry=r,
        )
        exported = FAMILIES.get(service)
        for name, metric in vars(self).items():
            if name != "registry" and (exported is None or name in exported):
                self.registry.register(metric)
        self.registry.register(GcPauses(p))  # the process's, whichever service it runs

    def serve(self, host: str, port: int) -> None:
        """Exposes /metrics over HTTP on a daemon thread (port 0: disabled)."""
        if not port:
            return

        class Server(ThreadingWSGIServer):
            address_family = socket.AF_INET6 if ":" in host else socket.AF_INET

        try:
            httpd = make_server(
                host, port, _only_metrics(make_wsgi_app(self.registry)), Server, _QuietHandler
            )
        except OSError as exc:
            raise BindError(
                f"cannot serve metrics on {host}:{port}: {exc.strerror or exc}"
            ) from None
        threading.Thread(target=httpd.serve_forever, name="metrics", daemon=True).start()


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # scrapes are not worth a log line
        pass


def _only_metrics(app: Callable[..., Iterable[bytes]]) -> Callable[..., Iterable[bytes]]:
    """The exporter answers every path; a typo'd scrape target should get 404, not metrics."""

    def serve(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if environ.get("PATH_INFO") in ("/metrics", "/metrics/"):
            return app(environ, start_response)
        start_response("404 Not Found", [("Content-Type", "text/plain; charset=utf-8")])
        return [b"not found: the metrics are at /metrics\n"]

    return serve
