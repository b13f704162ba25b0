"""What serving costs per output token outside the engine's compute: CPU time read from
/proc for each thread of the server's processes, split by thread name.

An engine's compute threads are the thread that steps it and the OpenMP workers that
thread's parallel regions start. loraplex names its step thread `COMPUTE_THREAD_NAME`
(platform/thread_names.py) before its first parallel region, and Linux gives a new
thread its creator's name, so the workers carry it too. Every other thread's CPU (the
HTTP proxy, the ingress, Serve's and Ray's threads in the replica, Ray's daemons) is
the serving cost. Any server can be measured: give its PIDs, and `--compute-threads`
names its compute threads' prefix (a peer names its own).

Linux only: elsewhere nothing is read and the breakdown is empty.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from loraplex.platform.thread_names import COMPUTE_THREAD_NAME

RAY_DAEMONS = ("raylet", "gcs_server", "dashboard", "agent", "log_monitor", "monitor.py")
PROC = Path("/proc")


@dataclass(frozen=True)
class ThreadTime:
    pid: int
    tid: int
    name: str
    cpu_s: float


def _clock_ticks() -> int:
    return os.sysconf("SC_CLK_TCK")


def _thread_time(pid: int, task: Path, ticks: int) -> ThreadTime | None:
    try:
        stat = (task / "stat").read_text()
    except OSError:
        return None
    name = stat[stat.index("(") + 1 : stat.rindex(")")]
    fields = stat[stat.rindex(")") + 2 :].split()
    utime, stime = int(fields[11]), int(fields[12])
    return ThreadTime(pid, int(task.name), name, (utime + stime) / ticks)


def read_threads(pids: Iterable[int], proc: Path = PROC) -> dict[tuple[int, int], ThreadTime]:
    """Every thread of `pids` that is alive now, with its CPU time so far."""
    ticks = _clock_ticks()
    threads: dict[tuple[int, int], ThreadTime] = {}
    for pid in pids:
        try:
            tasks = list((proc / str(pid) / "task").iterdir())
        except OSError:
            continue
        for task in tasks:
            thread = _thread_time(pid, task, ticks)
            if thread is not None:
                threads[(pid, thread.tid)] = thread
    return threads


def process_name(pid: int, proc: Path = PROC) -> str:
    """The process's title (Ray sets `ray::ServeReplica:app:deployment` and the like)."""
    try:
        raw = (proc / str(pid) / "cmdline").read_bytes()
    except OSError:
        return "?"
    words = [w for w in raw.decode(errors="replace").split("\0") if w]
    if not words:
        return "?"
    first = words[0]
    if first.startswith("ray::"):
        return first.split()[0]
    program = Path(first.split()[0]).name
    script = next((w for w in words[1:] if not w.startswith("-")), None)
    if program.startswith("python") and script is not None:
        return f"{program} {Path(script).name}"
    return program


def ray_pids(proc: Path = PROC) -> list[int]:
    """This machine's Ray processes: its workers and actors (`ray::...`) and daemons."""
    found = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        name = process_name(int(entry.name), proc)
        if name.startswith("ray::") or any(daemon in name for daemon in RAY_DAEMONS):
            found.append(int(entry.name))
    return sorted(found)


@dataclass(frozen=True)
class ProcessCpu:
    pid: int
    name: str
    compute_s: float
    """CPU seconds of the threads named after the compute prefix."""
    serving_s: float
    """CPU seconds of every other thread."""


@dataclass(frozen=True)
class CpuBreakdown:
    """Semantics: CPU seconds per process between two `read_threads` snapshots; a thread
    born in between counts from 0, one that ended in between is lost (its time cannot be
    read any more)."""

    processes: tuple[ProcessCpu, ...]

    @classmethod
    def between(
        cls,
        before: dict[tuple[int, int], ThreadTime],
        after: dict[tuple[int, int], ThreadTime],
        names: dict[int, str],
        compute_prefix: str = COMPUTE_THREAD_NAME,
    ) -> CpuBreakdown:
        compute: dict[int, float] = {}
        serving: dict[int, float] = {}
        for key, thread in after.items():
            start = before.get(key)
            spent = thread.cpu_s - (start.cpu_s if start is not None else 0.0)
            bucket = compute if thread.name.startswith(compute_prefix) else serving
            bucket[thread.pid] = bucket.get(thread.pid, 0.0) + spent
        pids = sorted(set(compute) | set(serving))
        return cls(
            tuple(
                ProcessCpu(pid, names.get(pid, "?"), compute.get(pid, 0.0), serving.get(pid, 0.0))
                for pid in pids
            )
        )

    @property
    def serving_s(self) -> float:
        return sum(p.serving_s for p in self.processes)

    @property
    def compute_s(self) -> float:
        return sum(p.compute_s for p in self.processes)

    def lines(self, output_tokens: int) -> list[str]:
        """Per process (busiest first), then the total: CPU-µs per output token."""

        def per_token(seconds: float) -> str:
            return f"{1e6 * seconds / output_tokens:.0f}" if output_tokens else "n/a"

        rows = sorted(self.processes, key=lambda p: p.serving_s + p.compute_s, reverse=True)
        lines = [
            f"  cpu: serving {per_token(self.serving_s)} us/token outside the compute "
            f"threads ({self.serving_s:.2f} s), compute {per_token(self.compute_s)} us/token "
            f"({self.compute_s:.2f} s), over {output_tokens} output tokens"
        ]
        for p in rows:
            if p.serving_s + p.compute_s < 0.005:
                continue
            lines.append(
                f"    {p.name} ({p.pid}): serving {per_token(p.serving_s)} us/token, "
                f"compute {per_token(p.compute_s)} us/token"
            )
        return lines


def parse_pids(spec: str, proc: Path = PROC) -> Sequence[int]:
    """`auto` (this machine's Ray processes) or comma-separated PIDs."""
    if spec == "auto":
        return ray_pids(proc)
    return [int(p) for p in spec.split(",") if p.strip()]
