"""Puts the platform's own log records (`loraplex.*`) into a Serve replica's log file,
next to Serve's, with the same format and request context.

Ray Serve configures only its `ray.serve` logger in a replica; records of other loggers
stop at the root logger's default WARNING level, so the engine's and the servers' INFO
lines (request ids, tenants, sizes, timings, warm-up, restarts) would never be seen."""

from __future__ import annotations

import logging

PLATFORM_LOGGER = "loraplex"
SERVE_LOGGER = "ray.serve"


def send_platform_logs_to_serve() -> None:
    """Gives the `loraplex` logger Serve's handlers (once; idempotent) and Serve's level
    for the replica when that is DEBUG (a deployment's `logging_config: {log_level:
    DEBUG}`), INFO otherwise."""
    platform = logging.getLogger(PLATFORM_LOGGER)
    serve_level = logging.getLogger(SERVE_LOGGER).getEffectiveLevel()
    platform.setLevel(min(logging.INFO, serve_level))
    platform.propagate = False
    for handler in logging.getLogger(SERVE_LOGGER).handlers:
        if handler not in platform.handlers:
            platform.addHandler(handler)
