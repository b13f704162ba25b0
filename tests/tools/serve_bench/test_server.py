"""`default_stop_signals`: a child started by a parent that ignores SIGINT still stops on
it (the parent here ignores SIGINT while it starts the child, as a background job of a
non-interactive shell does)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from loraplex.tools.serve_bench.server import default_stop_signals

SLEEPER = "import time; print('ready', flush=True); time.sleep(60)"


def start_sleeper(preexec_fn) -> subprocess.Popen:
    inherited = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        process = subprocess.Popen(
            [sys.executable, "-c", SLEEPER],
            stdout=subprocess.PIPE,
            text=True,
            preexec_fn=preexec_fn,
        )
    finally:
        signal.signal(signal.SIGINT, inherited)
    assert process.stdout.readline().strip() == "ready"
    return process


@pytest.mark.parametrize("stop_signal", [signal.SIGINT, signal.SIGTERM])
def test_child_stops_on_the_signal_although_the_parent_ignored_sigint(stop_signal):
    process = start_sleeper(default_stop_signals)
    try:
        process.send_signal(stop_signal)
        assert process.wait(timeout=20) != 0
    finally:
        process.kill()
        process.wait()


def test_without_it_the_child_inherits_the_ignored_sigint():
    """The failure the helper prevents (so the test above can fail)."""
    process = start_sleeper(None)
    try:
        process.send_signal(signal.SIGINT)
        time.sleep(1.0)
        assert process.poll() is None
    finally:
        process.kill()
        process.wait()
