"""Prometheus metrics endpoint per service, off unless a port is given (`--metrics-port`)."""

from __future__ import annotations

from prometheus_client import start_http_server

from shared.logs import get_logger

log = get_logger(__name__)


def start_metrics(port: int, host: str = "0.0.0.0") -> None:  # noqa: S104 - scraped from outside the pod
    """Serve /metrics on `port`; 0 means metrics are off."""
    if port <= 0:
        return
    start_http_server(port, addr=host)
    log.info("metrics endpoint up", port=port)
