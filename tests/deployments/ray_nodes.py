"""A Ray cluster of several nodes on this machine, started the way docs/operations.md adds nodes:
`ray start --head` and `ray start --address=...`, each with `--block` so the test owns
every process a node starts (and only those: stopping it never touches another Ray
instance, such as the test session's own). Every port is picked free, and the cluster
keeps its files (and its `ray_current_cluster` address file) under its own temp dir, so
a plain `ray.init()` elsewhere on the machine never connects to it."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import ray

from loraplex.tools.check import processes

logger = logging.getLogger(__name__)

RAY = str(Path(sys.executable).with_name("ray"))
RAYLET = str(Path(ray.__file__).parent / "core/src/ray/raylet/raylet")


@dataclass
class LocalNode:
    process: subprocess.Popen
    metrics_port: int
    log: Path

    def raylet_pid(self) -> int:
        (raylet,) = processes.find(RAYLET, under=self.process.pid)
        return raylet.pid

    def metrics_text(self) -> str:
        """The node's metrics agent's Prometheus text (what Prometheus scrapes)."""
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.read().decode()


class LocalCluster:
    def __init__(self, temp_dir: Path, free_port: Callable[[], int], env: dict[str, str]):
        self.temp_dir = temp_dir
        self._free_port = free_port
        self._given: set[int] = set()
        self.env = {k: v for k, v in env.items() if k != "RAY_ADDRESS"}
        self.gcs_port = self.free_port()
        self.dashboard_port = self.free_port()
        self.nodes: list[LocalNode] = []

    def free_port(self) -> int:
        """A free port not handed out before: the OS may offer a port it just freed
        again, and Ray refuses to start when two of its components share one."""
        while True:
            port = self._free_port()
            if port not in self._given:
                self._given.add(port)
                return port

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.gcs_port}"

    @property
    def dashboard(self) -> str:
        return f"http://127.0.0.1:{self.dashboard_port}"

    def add_node(self, num_cpus: float, timeout_s: float = 120) -> LocalNode:
        """Starts the head (first call) or a node joining it; returns once the cluster
        counts it alive."""
        metrics_port = self.free_port()
        head = not self.nodes
        role = (
            [
                "--head",
                f"--port={self.gcs_port}",
                "--include-dashboard=true",
                f"--dashboard-port={self.dashboard_port}",
                f"--ray-client-server-port={self.free_port()}",
            ]
            if head
            else [f"--address={self.address}"]
        )
        log = self.temp_dir / f"node-{len(self.nodes)}.log"
        command = [
            RAY,
            "start",
            "--block",
            *role,
            f"--num-cpus={num_cpus}",
            f"--temp-dir={self.temp_dir}",
            f"--metrics-export-port={metrics_port}",
            f"--dashboard-agent-listen-port={self.free_port()}",
            f"--dashboard-agent-grpc-port={self.free_port()}",
            f"--runtime-env-agent-port={self.free_port()}",
            "--disable-usage-stats",
        ]
        with log.open("w") as out:
            process = subprocess.Popen(command, env=self.env, stdout=out, stderr=subprocess.STDOUT)
        node = LocalNode(process, metrics_port, log)
        self.nodes.append(node)
        self._wait(lambda: len(self.alive_nodes()) == len(self.nodes), timeout_s, node)
        return node

    def _wait(self, predicate: Callable[[], bool], timeout_s: float, node: LocalNode) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if node.process.poll() is not None:
                raise RuntimeError(f"ray start exited: {node.log.read_text()[-3000:]}")
            try:
                if predicate():
                    return
            except OSError:
                pass  # the dashboard is not up yet
            time.sleep(0.5)
        raise TimeoutError(f"node not up after {timeout_s}s: {node.log.read_text()[-3000:]}")

    def get(self, path: str) -> dict:
        """A dashboard REST answer (state API, Serve API), as JSON."""
        with urllib.request.urlopen(f"{self.dashboard}{path}", timeout=30) as response:
            return json.loads(response.read())

    def state(self, resource: str) -> list[dict]:
        """`ray list <resource> --detail` through the state API."""
        return self.get(f"/api/v0/{resource}?detail=1&limit=1000")["data"]["result"]["result"]

    def alive_nodes(self) -> list[dict]:
        return [node for node in self.state("nodes") if node["state"] == "ALIVE"]

    def serve(self) -> dict:
        """Serve's details of every application (what `serve status` summarizes)."""
        return self.get("/api/serve/applications/")["applications"]

    def serve_deploy(self, config: Path) -> None:
        """`serve deploy` the config through the head's dashboard."""
        subprocess.run(
            [str(Path(RAY).with_name("serve")), "deploy", str(config), "-a", self.dashboard],
            env=self.env,
            check=True,
            capture_output=True,
            timeout=120,
        )

    def stop(self, timeout_s: float = 30) -> None:
        """SIGTERMs each node's `ray start` (it stops what it started), then SIGKILLs
        whatever of theirs is left (the same pid running the same command)."""
        started = {
            pid: _command(pid)
            for node in self.nodes
            for pid in processes.descendants(node.process.pid)
        }
        for node in reversed(self.nodes):
            if node.process.poll() is None:
                node.process.terminate()
        deadline = time.monotonic() + timeout_s
        for node in self.nodes:
            try:
                node.process.wait(max(deadline - time.monotonic(), 1))
            except subprocess.TimeoutExpired:
                node.process.kill()
                node.process.wait()
        for pid, command in started.items():
            if command and _command(pid) == command:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                logger.info("killed %d, left behind by its node: %r", pid, command[:80])


def _command(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""
