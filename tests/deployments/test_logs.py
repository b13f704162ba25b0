"""The platform's log records in a Serve replica: Serve's handlers, Serve's level when a
deployment's logging_config asks for DEBUG (the router's decisions), and each request's
lines in the replica's log file but not on the console."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import pytest

from loraplex.deployments.logs import PLATFORM_LOGGER, SERVE_LOGGER, send_platform_logs_to_serve
from loraplex.tools.check import processes

APP = "loraplex"


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


def _log_files(pid: int, deployment: str) -> tuple[Path, list[Path]]:
    """A replica process's stderr file (what Ray's log monitor forwards to the console)
    and its deployment's Serve log files."""
    stderr = Path(os.readlink(f"/proc/{pid}/fd/2"))
    return stderr, sorted((stderr.parent / "serve").glob(f"replica_{APP}_{deployment}_*.log"))


def _wait_for_line(files: list[Path], line: str, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(line in f.read_text(errors="replace") for f in files):
            return True
        time.sleep(0.2)
    return False


def test_a_requests_lines_reach_the_replica_log_files_and_not_the_console(client):
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    lines = {
        "OpenAIIngress": f"request {chat.id} tenant=",
        "model-tiny": f"request {chat.id} done:",
    }
    for deployment, line in lines.items():
        replicas = processes.find(processes.replica_title(APP, deployment))
        assert replicas, f"no {deployment} replica process found"
        logged = [_log_files(replica.pid, deployment) for replica in replicas]
        assert _wait_for_line([f for _, files in logged for f in files], line), line
        for stderr, files in logged:
            assert line not in stderr.read_text(errors="replace"), f"{line!r} on the console"
            if deployment == "model-tiny":
                text = "".join(f.read_text(errors="replace") for f in files)
                assert "CALL generate" not in text, "Serve's access line per ingress call"
