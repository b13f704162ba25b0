"""The fleet's residency registry: which model replica holds which adapter in which tier.

One small Serve deployment (`ResidencyRegistry`, one replica) per app. Every model
replica looks at its `ReplicaResidency` every `PUBLISH_PERIOD_S` (the adapters in its
device slots and in host memory, and the requests it served per adapter) and publishes
it when its tiers changed, or every `HEARTBEAT_S` when they did not (the request counts
as they are then); it withdraws it when it shuts down. A replica that stops publishing
(killed, its node lost) drops out after `STALE_AFTER_S`. The ingress reads the registry for `GET /v1/admin/residency`
(operator key), adding the disk tier (every adapter its catalog knows).

Demand: from the cumulative request counts of successive reports the registry keeps,
per replica and adapter, the requests of the last `DEMAND_WINDOW_S` seconds. A replica
counts an adapter only while it holds it (every register or unload mints a new model id),
so the registry keeps the reports of the window alone, and in them only the ids the
replica's newest report counts; a count lower than the one before restarted from zero.

The router does not read this registry: Serve hands it each replica's routing stats
directly (deployments/request_router.py); both come from the same replica state. The
registry's own `HotAdapterReplicator` (deployments/replication.py) reads it to load hot
adapters on more replicas.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, field

from ray import serve

from loraplex.deployments.config import model_deployment_name
from loraplex.deployments.logs import send_platform_logs_to_serve
from loraplex.deployments.replication import RESULT_TIMEOUT_S, HotAdapterReplicator, Replication

logger = logging.getLogger(__name__)

PUBLISH_PERIOD_S = 1.0
HEARTBEAT_S = 3.0
"""A report whose tiers did not change is sent again this often, so the registry knows
the replica lives and sees its request counts grow."""
STALE_AFTER_S = 10.0
"""A replica whose last report is older than this is gone from the view."""
DEMAND_WINDOW_S = 60.0


@dataclass(frozen=True)
class ReplicaResidency:
    """One model replica's adapters by tier, as it last reported them."""

    model: str
    replica: str
    node_id: str
    device: list[str]
    """Multiplexed model ids in the replica's LoRA device slots."""
    host: list[str]
    """Model ids loaded in its host memory (the device ones included)."""
    requests: dict[str, int] = field(default_factory=dict)
    """Requests it served per model id since it started ('' is the base model)."""


@dataclass
class _Entry:
    report: ReplicaResidency
    seen_at: float
    history: deque[tuple[float, dict[str, int]]] = field(default_factory=deque)

    def add(self, report: ReplicaResidency, now: float) -> None:
        """Takes a replica's newer report. An id whose count went down (to nothing: the
        replica let the adapter go; or restarted from zero) leaves the history, so its
        demand counts from zero and the history holds only the ids reported now."""
        counts = report.requests
        restarted = [m for m, count in self.report.requests.items() if counts.get(m, 0) < count]
        if restarted:
            for _, requests in self.history:
                for model_id in restarted:
                    requests.pop(model_id, None)
        self.report, self.seen_at = report, now
        self.history.append((now, dict(report.requests)))
        self._trim(now)

    def demand(self, now: float) -> dict[str, int]:
        """Requests per model id over the demand window (from the oldest report in it)."""
        self._trim(now)
        _, oldest = self.history[0]
        newest = self.report.requests
        return {
            model_id: count - oldest.get(model_id, 0)
            for model_id, count in newest.items()
            if count - oldest.get(model_id, 0) > 0
        }

    def _trim(self, now: float) -> None:
        """Drops the reports older than the oldest one the window needs."""
        while len(self.history) > 1 and self.history[1][0] <= now - DEMAND_WINDOW_S:
            self.history.popleft()


class ResidencyRegistry:
    """Semantics: `publish(report)` replaces the replica's entry; `withdraw(model,
    replica)` removes it; `view(model)` lists the live entries (one model, or all
    with None) with their age and windowed demand, and forgets stale ones."""

    def __init__(self, replicate_hot_adapters: bool = False) -> None:
        self._entries: dict[tuple[str, str], _Entry] = {}
        self._lock = threading.Lock()
        """publish / withdraw run on the replica's loop, the replicator's view in its thread."""
        if replicate_hot_adapters:  # deployed: in a Serve replica
            send_platform_logs_to_serve()
            self._app = serve.get_replica_context().app_name
            HotAdapterReplicator(self.view, self._replicate).start()

    def _replicate(self, replication: Replication) -> None:
        """Has one more replica of the model load the adapter (the router picks one that
        lacks it) and waits for the load."""
        handle = serve.get_deployment_handle(model_deployment_name(replication.model), self._app)
        call = handle.options(multiplexed_model_id=replication.model_id)
        call.replicate_adapter.remote().result(timeout_s=RESULT_TIMEOUT_S)

    def publish(self, report: ReplicaResidency) -> None:
        with self._lock:
            self._publish(report)

    def _publish(self, report: ReplicaResidency) -> None:
        now = time.monotonic()
        key = (report.model, report.replica)
        entry = self._entries.get(key)
        if entry is None:
            logger.info("replica %s of %s joined the residency view", report.replica, report.model)
            entry = self._entries[key] = _Entry(report, now)
        entry.add(report, now)

    def withdraw(self, model: str, replica: str) -> None:
        with self._lock:
            if self._entries.pop((model, replica), None) is not None:
                logger.info("replica %s of %s left the residency view", replica, model)

    def view(self, model: str | None = None) -> list[dict]:
        with self._lock:
            return self._view(model)

    def _view(self, model: str | None) -> list[dict]:
        now = time.monotonic()
        for key, entry in list(self._entries.items()):
            if now - entry.seen_at > STALE_AFTER_S:
                logger.info("replica %s of %s is stale: dropped from the view", *key[::-1])
                del self._entries[key]
        return [
            {
                **asdict(entry.report),
                "age_s": round(now - entry.seen_at, 3),
                "demand": entry.demand(now),
            }
            for (name, _), entry in sorted(self._entries.items())
            if model is None or name == model
        ]


REGISTRY_DEPLOYMENT = "residency-registry"

ResidencyRegistryDeployment = serve.deployment(
    ResidencyRegistry,
    name=REGISTRY_DEPLOYMENT,
    num_replicas=1,
    ray_actor_options={"num_cpus": 0.01},
    max_ongoing_requests=1000,
    # Every model replica publishes once a second: no access-log line per report.
    logging_config={"enable_access_log": False},
)
