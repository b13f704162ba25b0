"""Puts the platform's own log records (`loraplex.*`) into a Serve replica's log file,
next to Serve's, with the same format and request context.

Ray Serve configures only its `ray.serve` logger in a replica; records of other loggers
stop at the root logger's default WARNING level, so the engine's and the servers' INFO
lines (request ids, tenants, sizes, timings, warm-up, restarts) would never be seen."""

from __future__ import annotations

import logging

PLATFORM_LOGGER = "loraplex"
SERVE_LOGGER = "ray.serve"


def send_platform_logs_to_serve(level: int = logging.INFO) -> None:
    """Gives the `loraplex` logger Serve's handlers (once; idempotent)."""
    platform = logging.getLogger(PLATFORM_LOGGER)
    platform.setLevel(level)
    platform.propagate = False
    for handler in logging.getLogger(SERVE_LOGGER).handlers:
        if handler not in platform.handlers:
            platform.addHandler(handler)
