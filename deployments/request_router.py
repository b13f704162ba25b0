"""The model deployments' request router: a request goes where its adapter already is.

Ray Serve's request-router extension point (`serve.request_router.RequestRouter`).
Each model replica publishes where its adapters sit through Serve's routing stats
(`ModelServer.record_routing_stats`: the multiplexed model ids in device slots and in
host memory, refreshed every `ROUTING_STATS_PERIOD_S`). For a request naming an adapter,
the candidates are ranked by that adapter's tier on them:

    1. device: the adapter is in one of the replica's LoRA slots (no load at all);
    2. host:   the replica holds it in host memory (a slot write away);
    3. cold:   the replica would read it from disk.

Within a tier, the replica that last served the longest prefix of the request's prompt
comes first, in a rank of its own (prefix affinity: its prefix cache likely still holds
that prefix's KV blocks). Prefixes are chained hashes of full chunks of the prompt
(`PREFIX_CHUNK_TOKENS` token ids, or `PREFIX_CHUNK_CHARS` characters of text or chat
messages), namespaced by adapter and by the tenant's prefix-cache salt, as the engine's
prefix cache is; the router learns them from where Serve actually sent each request
(`on_request_routed`) and keeps the newest `MAX_PREFIX_ENTRIES`.

Serve tries the ranks in order and, within a rank, takes the replica with the shortest
queue that is not full. Two rules keep the preference from piling work onto one replica:
a replica whose queue is longer than the shortest known queue by more than
`queue_slack` goes to a last rank of its own, whatever its tier; and a rank of more than
two replicas offers two of them at random (power of two choices) so routing stays cheap
on a large fleet. A base-model request has one tier everywhere. Each decision is logged
at debug level with the tiers and queue lengths it saw.
"""

from __future__ import annotations

import json
import logging
import random
from collections import OrderedDict
from collections.abc import Collection, Sequence
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
PREFIX_CHUNK_TOKENS = 16
"""Token ids per prefix chunk (one KV block at the engine's default block size)."""
PREFIX_CHUNK_CHARS = 64
"""Characters per prefix chunk of a text prompt or of chat messages (about 16 tokens)."""
MAX_PREFIX_CHUNKS = 64
MAX_PREFIX_ENTRIES = 65536


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


def prompt_prefix_hashes(call: object, model_id: str) -> list[int]:
    """Chained hashes of the full prefix chunks of a GenerateCall's prompt (token ids,
    text, or chat messages as JSON), seeded by the adapter and the cache salt; [] for
    anything else (calls that are not generations)."""
    prompt = getattr(call, "prompt", None)
    messages = getattr(call, "messages", None)
    chunks: list[object]
    if isinstance(prompt, list):
        size = PREFIX_CHUNK_TOKENS
        chunks = [tuple(prompt[i : i + size]) for i in range(0, len(prompt) - size + 1, size)]
    else:
        text = prompt if isinstance(prompt, str) else None
        if text is None and messages:
            text = json.dumps(messages, sort_keys=True, default=str)
        if text is None:
            return []
        size = PREFIX_CHUNK_CHARS
        chunks = [text[i : i + size] for i in range(0, len(text) - size + 1, size)]
    running = hash((model_id, getattr(call, "cache_salt", None)))
    hashes = []
    for chunk in chunks[:MAX_PREFIX_CHUNKS]:
        running = hash((running, chunk))
        hashes.append(running)
    return hashes


class PrefixOwners:
    """Prefix hash -> the replica that last served a prompt with that prefix (LRU)."""

    def __init__(self, capacity: int = MAX_PREFIX_ENTRIES) -> None:
        self.capacity = capacity
        self._owners: OrderedDict[int, Any] = OrderedDict()

    def owner(self, hashes: Sequence[int], alive: Collection[Any]) -> tuple[Any, int]:
        """(replica, matched chunks) of the longest known prefix held by a replica in
        `alive`; (None, 0) when none is."""
        for depth in range(len(hashes), 0, -1):
            replica = self._owners.get(hashes[depth - 1])
            if replica is not None and replica in alive:
                return replica, depth
        return None, 0

    def record(self, hashes: Sequence[int], replica: Any) -> None:
        for prefix in hashes:
            self._owners[prefix] = replica
            self._owners.move_to_end(prefix)
        while len(self._owners) > self.capacity:
            self._owners.popitem(last=False)

    def __len__(self) -> int:
        return len(self._owners)


def rank_replicas(
    views: Sequence[ReplicaView],
    queue_slack: int = QUEUE_SLACK,
    rng: random.Random = random,
    affine: Any = None,
) -> list[list[Any]]:
    """Replica ids in ranks: device, host, cold, then the replicas whose queue exceeds
    the shortest known one by more than `queue_slack`; empty ranks dropped, a rank of
    more than two cut to two drawn at random (its others follow as the next rank).
    `affine` (the prefix's replica), unless overloaded, leads its tier in a rank alone."""
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
        if affine is not None and affine in members and members is not overloaded:
            ranks.append([affine])
            members = [m for m in members if m != affine]
        if len(members) > 2:
            chosen = rng.sample(members, 2)
            ranks.append(chosen)
            members = [m for m in members if m not in chosen]
        if members:
            ranks.append(members)
    return ranks


class ResidencyRouter(FIFOMixin, MultiplexMixin, RequestRouter):
    """Ranks a model's replicas by where the request's adapter sits (module docstring)."""

    def initialize_state(
        self, queue_slack: int = QUEUE_SLACK, prefix_entries: int = MAX_PREFIX_ENTRIES
    ) -> None:
        self.queue_slack = queue_slack
        self._prefixes = PrefixOwners(prefix_entries)

    @property
    def prefixes(self) -> PrefixOwners:
        if getattr(self, "_prefixes", None) is None:
            self._prefixes = PrefixOwners()
        return self._prefixes

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        model_id = ""
        if pending_request is not None:
            model_id = pending_request.metadata.multiplexed_model_id or ""
        views = [self._view(replica, model_id) for replica in candidate_replicas]
        hashes = _request_prefix(pending_request)
        alive = {view.replica_id for view in views}
        affine, depth = self.prefixes.owner(hashes, alive)
        ranks = rank_replicas(views, getattr(self, "queue_slack", QUEUE_SLACK), affine=affine)
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug(
                "route %s: %s; prefix %d/%d chunks on %s -> %s",
                model_id or "(base)",
                ", ".join(f"{_short(v.replica_id)}={v.tier}/q{v.queue_len}" for v in views),
                depth,
                len(hashes),
                _short(affine) if affine is not None else "-",
                [[_short(r) for r in rank] for rank in ranks],
            )
        return [[self._replicas[r] for r in rank if r in self._replicas] for rank in ranks]

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any
    ) -> None:
        """Serve sent the request to `replica_id`: its prompt's prefixes are there now."""
        hashes = _request_prefix(pending_request)
        if hashes:
            self.prefixes.record(hashes, replica_id)

    def _view(self, replica: RunningReplica, model_id: str) -> ReplicaView:
        stats = replica.routing_stats or {}
        tier = adapter_tier(stats, set(replica.multiplexed_model_ids), model_id)
        queue_len = self.replica_queue_len_cache.get(replica.replica_id)
        return ReplicaView(replica.replica_id, tier, queue_len)


def _request_prefix(pending_request: PendingRequest | None) -> list[int]:
    if pending_request is None or not pending_request.args:
        return []
    model_id = pending_request.metadata.multiplexed_model_id or ""
    return prompt_prefix_hashes(pending_request.args[0], model_id)


def _short(replica_id: ReplicaID) -> str:
    unique = getattr(replica_id, "unique_id", None)
    return str(unique if unique is not None else replica_id)[:8]
