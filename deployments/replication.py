"""Hot-adapter replication: an adapter that takes more than its holders' share of a
model's demand is loaded on one more replica before its requests need it there.

The residency registry's view gives, per model replica, the adapters it holds in host
memory and the requests per adapter over the demand window. For a model with n live
replicas and D requests in the window, one replica's share is D / n. An adapter with
d >= HOT_MIN_REQUESTS requests should be held by min(n, ceil(d / (D / n))) replicas;
while fewer hold it, `replication_plan` names it, and `HotAdapterReplicator` asks the
model deployment to load it on one more replica (`ModelServer.replicate_adapter`; the
router sends that call to a replica that does not hold it, deployments/request_router.py),
at most once per adapter every `COOLDOWN_S` (only the cooldowns still running are kept:
every register or unload mints a new model id, and an expired cooldown holds nothing
back). The router then spreads the adapter's requests over its holders by queue length.
A load runs off the engine loop, as every adapter load does, so replication never holds
up requests.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

logger = logging.getLogger(__name__)

HOT_MIN_REQUESTS = 20
"""Requests within the demand window below which an adapter is never replicated."""
PERIOD_S = 5.0
COOLDOWN_S = 30.0
"""An adapter is sent to one more replica at most this often (the load, and the
residency reports that show it, come first)."""
RESULT_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Replication:
    """One adapter to load on one more replica of its model."""

    model: str
    model_id: str
    demand: int
    holders: int
    target: int


def replication_plan(view: Sequence[dict]) -> list[Replication]:
    """The adapters held by fewer replicas than their demand calls for (module
    docstring), hottest first; `view` is the registry's (`ResidencyRegistry.view`)."""
    by_model: dict[str, list[dict]] = {}
    for replica in view:
        by_model.setdefault(replica["model"], []).append(replica)
    plan = []
    for model, replicas in sorted(by_model.items()):
        live = len(replicas)
        if live < 2:
            continue
        demand: Counter[str] = Counter()
        holders: Counter[str] = Counter()
        for replica in replicas:
            demand.update(replica["demand"])
            holders.update(set(replica["host"]))
        share = sum(demand.values()) / live
        for model_id, count in demand.most_common():
            if not model_id or count < HOT_MIN_REQUESTS:
                continue
            target = min(live, math.ceil(count / share - 1e-9))
            if holders[model_id] < target:
                plan.append(Replication(model, model_id, count, holders[model_id], target))
    return plan


class HotAdapterReplicator:
    """Every PERIOD_S, reads the view and sends each planned replication (one thread)."""

    def __init__(
        self,
        read_view: Callable[[], list[dict]],
        replicate: Callable[[Replication], object],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._read_view = read_view
        self._replicate = replicate
        self._clock = clock
        self._sent_at: dict[tuple[str, str], float] = {}
        """(model, model id) -> when it was last sent, for the cooldowns still running."""
        self._stop = threading.Event()

    def start(self) -> None:
        threading.Thread(target=self._run, name="hot-adapter-replicator", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()

    def due(self) -> list[Replication]:
        """The planned replications whose adapter is out of its cooldown (marked sent)."""
        now = self._clock()
        self._sent_at = {k: t for k, t in self._sent_at.items() if now - t < COOLDOWN_S}
        due = []
        for replication in replication_plan(self._read_view()):
            key = (replication.model, replication.model_id)
            if key not in self._sent_at:
                self._sent_at[key] = now
                due.append(replication)
        return due

    def _run(self) -> None:
        while not self._stop.wait(PERIOD_S):
            try:
                for replication in self.due():
                    logger.info(
                        "replicating adapter %s of %s: %d requests in the window, held by "
                        "%d of the %d replicas it calls for",
                        replication.model_id,
                        replication.model,
                        replication.demand,
                        replication.holders,
                        replication.target,
                    )
                    self._replicate(replication)
            except Exception as exc:
                logger.warning("hot-adapter replication failed: %r", exc)
