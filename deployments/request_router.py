"""The model deployments' request router: a request goes where its adapter already is.

Ray Serve's request-router extension point (`serve.request_router.RequestRouter`).
Each model replica publishes where its adapters sit through Serve's routing stats
(`ModelServer.record_routing_stats`: the multiplexed model ids in device slots and in
host memory, refreshed every `ROUTING_STATS_PERIOD_S`). For a request naming an adapter,
the candidates are ranked by that adapter's tier on them:

    1. device: the adapter is in one of the replica's LoRA slots (no load at all);
    2. host:   the replica holds it in host memory (a slot write away);
    3. cold:   the replica would read it from disk.

Serve tries the ranks in order and, within a rank, takes the replica with the shortest
queue that is not full. Two rules keep the preference from piling work onto one replica:
a replica whose queue is longer than the shortest known queue by more than
`queue_slack` goes to a last rank of its own, whatever its tier; and a rank of more than
two replicas offers two of them at random (power of two choices) so routing stays cheap
on a large fleet. A base-model request has one tier everywhere. Each decision is logged
at debug level with the tiers and queue lengths it saw.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ray.serve.request_router import (
    FIFOMixin,
    MultiplexMixin,
    PendingRequest,
    ReplicaID,
    RequestRouter,
    RunningReplica,
)

logger = logging.getLogger(__name__)

DEVICE, HOST, COLD = "device", "host", "cold"
TIERS = (DEVICE, HOST, COLD)
QUEUE_SLACK = 4
"""Requests a replica's queue may exceed the shortest one by and keep its tier's rank."""
ROUTING_STATS_PERIOD_S = 1.0
"""How often Serve asks each model replica for its residency (`record_routing_stats`)."""


@dataclass(frozen=True)
class ReplicaView:
    """What the router knows of one replica for one request."""

    replica_id: Any
    tier: str
    queue_len: int | None
    """Ongoing requests as last seen (None: not known yet)."""


def adapter_tier(stats: dict[str, Any], multiplexed_ids: set[str], model_id: str) -> str:
    """Where `model_id` sits on a replica, from its routing stats and the ids Serve's
    multiplexing reports for it; a base-model request (empty id) is COLD everywhere, so
    every replica shares one rank."""
    if not model_id:
        return COLD
    if model_id in stats.get(DEVICE, ()):
        return DEVICE
    if model_id in stats.get(HOST, ()) or model_id in multiplexed_ids:
        return HOST
    return COLD


def rank_replicas(
    views: Sequence[ReplicaView], queue_slack: int = QUEUE_SLACK, rng: random.Random = random
) -> list[list[Any]]:
    """Replica ids in ranks: device, host, cold, then the replicas whose queue exceeds
    the shortest known one by more than `queue_slack`; empty ranks dropped, a rank of
    more than two cut to two drawn at random (its others follow as the next rank)."""
    known = [view.queue_len for view in views if view.queue_len is not None]
    shortest = min(known, default=0)
    by_tier: dict[str, list[Any]] = {tier: [] for tier in TIERS}
    overloaded: list[Any] = []
    for view in views:
        if view.queue_len is not None and view.queue_len > shortest + queue_slack:
            overloaded.append(view.replica_id)
        else:
            by_tier[view.tier].append(view.replica_id)
    ranks: list[list[Any]] = []
    for members in [*by_tier.values(), overloaded]:
        if len(members) > 2:
            chosen = rng.sample(members, 2)
            ranks.append(chosen)
            members = [m for m in members if m not in chosen]
        if members:
            ranks.append(members)
    return ranks


class ResidencyRouter(FIFOMixin, MultiplexMixin, RequestRouter):
    """Ranks a model's replicas by where the request's adapter sits (module docstring)."""

    def initialize_state(self, queue_slack: int = QUEUE_SLACK) -> None:
        self.queue_slack = queue_slack

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        model_id = ""
        if pending_request is not None:
            model_id = pending_request.metadata.multiplexed_model_id or ""
        views = [self._view(replica, model_id) for replica in candidate_replicas]
        ranks = rank_replicas(views, getattr(self, "queue_slack", QUEUE_SLACK))
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug(
                "route %s: %s -> %s",
                model_id or "(base)",
                ", ".join(f"{_short(v.replica_id)}={v.tier}/q{v.queue_len}" for v in views),
                [[_short(r) for r in rank] for rank in ranks],
            )
        return [[self._replicas[r] for r in rank if r in self._replicas] for rank in ranks]

    def _view(self, replica: RunningReplica, model_id: str) -> ReplicaView:
        stats = replica.routing_stats or {}
        tier = adapter_tier(stats, set(replica.multiplexed_model_ids), model_id)
        queue_len = self.replica_queue_len_cache.get(replica.replica_id)
        return ReplicaView(replica.replica_id, tier, queue_len)


def _short(replica_id: ReplicaID) -> str:
    unique = getattr(replica_id, "unique_id", None)
    return str(unique if unique is not None else replica_id)[:8]
