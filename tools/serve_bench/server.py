"""Starts `serve run CONFIG` for a benchmark and stops it afterwards.

The app runs in its own process session (so a terminal's Ctrl-C reaches the bench, not
the app) with SIGINT and SIGTERM at their default dispositions whatever the bench
inherited (`default_stop_signals`), and is stopped with SIGTERM; a process group still
alive after the grace period is killed. Ready means `/health` answers and `/v1/models`
lists the models."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from loraplex.tools.check.probes import http_status

logger = logging.getLogger(__name__)

STOP_GRACE_S = 60.0
PORT_FREE_TIMEOUT_S = 120.0
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def default_stop_signals() -> None:
    """`preexec_fn` for a child that must stop on SIGINT and SIGTERM: resets both to
    their default disposition in the child. A process started with a signal ignored
    keeps ignoring it (a background job of a non-interactive shell ignores SIGINT, and
    Python then installs no KeyboardInterrupt handler), so a `serve run` started from
    such a parent would never stop on Ctrl-C."""
    for stop_signal in STOP_SIGNALS:
        signal.signal(stop_signal, signal.SIG_DFL)


@dataclass
class ServeApp:
    """`with ServeApp(config, url, log_path): ...` runs the app for the block."""

    config: Path
    url: str
    log_path: Path
    api_key: str | None = None
    cwd: Path | None = None
    """Where `serve run` starts (relative paths in the config resolve there); default:
    the config's folder."""
    start_timeout_s: float = 600.0
    process: subprocess.Popen | None = None

    def __enter__(self) -> ServeApp:
        if http_status(f"{self.url}/health", None):
            raise RuntimeError(f"something already answers on {self.url}; stop it first")
        serve_cli = Path(sys.executable).with_name("serve")
        env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
        env.setdefault("RAY_AUTH_MODE", "disabled")
        env.pop("RAY_ADDRESS", None)
        log = Path(self.log_path).open("w")
        logger.info("starting serve run %s (log: %s)", self.config, self.log_path)
        self.process = subprocess.Popen(
            [str(serve_cli), "run", str(self.config)],
            cwd=self.cwd or Path(self.config).resolve().parent,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=default_stop_signals,
        )
        log.close()
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self) -> None:
        started = time.monotonic()
        while True:
            if self.process.poll() is not None:
                tail = Path(self.log_path).read_text()[-3000:]
                raise RuntimeError(f"serve run exited with {self.process.returncode}:\n{tail}")
            if http_status(f"{self.url}/health", None) == 200:
                if http_status(f"{self.url}/v1/models", self.api_key) == 200:
                    logger.info("app ready after %.1fs", time.monotonic() - started)
                    return
            if time.monotonic() - started > self.start_timeout_s:
                raise TimeoutError(f"serve run was not ready within {self.start_timeout_s:.0f}s")
            time.sleep(1.0)

    def stop(self) -> None:
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            logger.warning("serve run did not stop within %.0fs; killing it", STOP_GRACE_S)
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()


def wait_until_stopped(url: str, timeout_s: float = PORT_FREE_TIMEOUT_S) -> None:
    """Waits until nothing answers `url`/health: a stopped app's Ray processes let go of
    its port a little after `serve run` exits, and the next app needs it."""
    deadline = time.monotonic() + timeout_s
    while http_status(f"{url}/health", None) and time.monotonic() < deadline:
        time.sleep(2)
