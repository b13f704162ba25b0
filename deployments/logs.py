"""Puts the platform's own log records (`loraplex.*`) into a Serve replica's log file,
next to Serve's, with the same format and request context.

Ray Serve configures only its `ray.serve` logger in a replica; records of other loggers
stop at the root logger's default WARNING level, so the engine's and the servers' INFO
lines (request ids, tenants, sizes, timings, warm-up, restarts) would never be seen."""

from __future__ import annotations

import logging
from typing import Final

PLATFORM_LOGGER = "loraplex"
SERVE_LOGGER = "ray.serve"

PER_REQUEST: Final = {"log_to_stderr": False}
"""`extra` of a line logged for every request: it goes to the replica's log file
(`logs/serve/replica_*.log`, the dashboard's Serve logs) but not to the replica's
stderr, which Ray's log monitor tails and forwards to the `serve run` terminal. At tens
of requests a second that forwarding cost the log monitor, the GCS and the driver more
CPU than the lines are worth on a console; warnings and errors still go to both."""


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
