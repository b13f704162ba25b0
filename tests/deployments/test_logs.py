"""The platform's log records in a Serve replica: Serve's handlers, and Serve's level
when a deployment's logging_config asks for DEBUG (the router's decisions)."""

from __future__ import annotations

import logging

import pytest

from loraplex.deployments.logs import PLATFORM_LOGGER, SERVE_LOGGER, send_platform_logs_to_serve


@pytest.fixture
def loggers():
    platform, serve = logging.getLogger(PLATFORM_LOGGER), logging.getLogger(SERVE_LOGGER)
    saved = (platform.level, platform.propagate, list(platform.handlers), serve.level)
    serve_handlers = list(serve.handlers)
    yield platform, serve
    platform.setLevel(saved[0])
    platform.propagate = saved[1]
    platform.handlers[:] = saved[2]
    serve.setLevel(saved[3])
    serve.handlers[:] = serve_handlers


def test_platform_records_go_to_serves_handlers_at_info_or_serves_debug(loggers):
    platform, serve = loggers
    handler = logging.NullHandler()
    serve.addHandler(handler)
    serve.setLevel(logging.WARNING)
    send_platform_logs_to_serve()
    send_platform_logs_to_serve()
    assert platform.handlers.count(handler) == 1 and not platform.propagate
    assert platform.level == logging.INFO, "a quiet Serve does not silence the platform"
    serve.setLevel(logging.DEBUG)
    send_platform_logs_to_serve()
    router = logging.getLogger("loraplex.deployments.request_router")
    assert router.isEnabledFor(logging.DEBUG), "routing decisions reach the replica log"
