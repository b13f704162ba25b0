"""The processes of a running app, found the way an operator finds them: Ray names its
workers by what they run (`ray::ServeReplica:<app>:<deployment>`, `ray::ServeController`,
`ray::TPWorker`), so a fault drill reads `/proc` for those titles, optionally only under
one process tree (the `serve run` that started the app), and signals them."""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")
CONTROLLER = "ray::ServeController"
TP_WORKER = "ray::TPWorker"


def replica_title(app: str, deployment: str) -> str:
    return f"ray::ServeReplica:{app}:{deployment}"


@dataclass(frozen=True)
class Process:
    pid: int
    title: str


def _title(pid: int) -> str:
    try:
        raw = (PROC / str(pid) / "cmdline").read_bytes()
    except OSError:
        return ""
    return raw.replace(b"\0", b" ").decode("utf-8", "replace").strip()


def _parent(pid: int) -> int:
    try:
        stat = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return -1
    # pid (comm) state ppid ...: comm may hold spaces and parentheses.
    return int(stat.rsplit(")", 1)[1].split()[1])


def descendants(root: int) -> set[int]:
    """Every live process under `root` (children, their children, ...)."""
    children: dict[int, list[int]] = {}
    for entry in PROC.iterdir():
        if entry.name.isdigit():
            children.setdefault(_parent(int(entry.name)), []).append(int(entry.name))
    found, todo = set(), [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def find(title: str, under: int | None = None) -> list[Process]:
    """Live processes whose title is `title`: exactly, followed by arguments, or by the
    method an actor is running (`ray::ServeController.listen_for_change`); only
    descendants of `under` when given; oldest pid first."""
    pids = (
        descendants(under)
        if under is not None
        else {int(e.name) for e in PROC.iterdir() if e.name.isdigit()}
    )
    matches = []
    for pid in sorted(pids):
        name = _title(pid)
        if name == title or name.startswith((title + " ", title + ".")):
            matches.append(Process(pid, name))
    return matches


def kill_one(title: str, under: int | None = None) -> Process:
    """SIGKILLs the first live process titled `title`; LookupError when there is none."""
    processes = find(title, under)
    if not processes:
        raise LookupError(f"no live process titled {title!r}")
    os.kill(processes[0].pid, signal.SIGKILL)
    return processes[0]
