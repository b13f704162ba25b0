"""The serving-cost breakdown (`bench serve --cpu-breakdown`) against a real process: a
child whose step thread is named as the engine names it (`name_this_thread`) and whose
other thread burns CPU as serving work; /proc must tell the two apart."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from loraplex.platform.thread_names import COMPUTE_THREAD_NAME
from loraplex.tools.serve_bench.cpu_breakdown import (
    CpuBreakdown,
    ThreadTime,
    parse_pids,
    process_name,
    ray_pids,
    read_threads,
)

CHILD = f"""
import sys, threading, time
from loraplex.platform.thread_names import name_this_thread

release = threading.Event()
burned = threading.Semaphore(0)

def burn(seconds):
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass
    burned.release()
    release.wait()

def compute():
    name_this_thread({COMPUTE_THREAD_NAME!r})
    # Started by the named thread, it inherits the name, as OpenMP's workers do.
    threading.Thread(target=burn, args=(0.3,)).start()
    burn(0.6)

print("ready", flush=True)
sys.stdin.readline()
threading.Thread(target=compute).start()
burn_main = threading.Thread(target=burn, args=(0.3,))
burn_main.start()
for _ in range(3):
    burned.acquire()
print("done", flush=True)
sys.stdin.readline()
release.set()
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_compute_threads_and_their_children_are_told_apart_from_serving_threads():
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout.readline().strip() == "ready"
        before = read_threads([child.pid])
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "done"
        after = read_threads([child.pid])
        child.stdin.write("end\n")
        child.stdin.flush()
    finally:
        child.stdin.close()
        child.wait(timeout=30)
    breakdown = CpuBreakdown.between(before, after, {child.pid: process_name(child.pid)})
    (process,) = breakdown.processes
    # The named thread's 0.6 s and its child's 0.3 s; the serving thread's 0.3 s (and
    # the interpreter's start-up on the main thread, before the first snapshot, not).
    assert 0.85 <= process.compute_s <= 1.1, process
    assert 0.28 <= process.serving_s <= 0.5, process
    lines = breakdown.lines(output_tokens=1000)
    assert "serving" in lines[0] and "us/token" in lines[0]


def test_a_thread_born_between_snapshots_counts_from_zero():
    before = {(1, 1): ThreadTime(1, 1, "python", 2.0)}
    after = {
        (1, 1): ThreadTime(1, 1, "python", 2.5),
        (1, 2): ThreadTime(1, 2, COMPUTE_THREAD_NAME, 1.0),
        (7, 7): ThreadTime(7, 7, "raylet", 0.25),
    }
    breakdown = CpuBreakdown.between(before, after, {1: "ray::ServeReplica", 7: "raylet"})
    assert breakdown.compute_s == pytest.approx(1.0)
    assert breakdown.serving_s == pytest.approx(0.75)
    assert [p.name for p in breakdown.processes] == ["ray::ServeReplica", "raylet"]
    assert "750 us/token" in breakdown.lines(1000)[0]


def test_pids_are_given_or_found():
    assert parse_pids("12, 34") == [12, 34]
    assert process_name(os.getpid()).split()[0] == Path(sys.executable).name


def test_a_daemon_started_with_interpreter_flags_is_named_by_its_script(tmp_path):
    """Ray starts its log monitor as `python -u .../log_monitor.py ...`: the flag must not
    hide the script, or the monitor's CPU is left out of the serving cost."""
    cmdlines = {
        "101": ["/venv/bin/python", "-u", "/venv/ray/_private/log_monitor.py", "--logs-dir=x"],
        "102": ["/venv/bin/python", "-u", "-c", "print(1)"],
        "103": ["ray::ServeController"],
    }
    for pid, words in cmdlines.items():
        (tmp_path / pid).mkdir()
        (tmp_path / pid / "cmdline").write_bytes("\0".join(words).encode() + b"\0")
    assert process_name(101, tmp_path) == "python log_monitor.py"
    assert ray_pids(tmp_path) == [101, 103]
