"""The model deployments' request router: a request goes where its adapter already is.

Ray Serve's request-router extension point (`serve.request_router.RequestRouter`).
Each model replica publishes where its adapters sit through Serve's routing stats
(`ModelServer.record_routing_stats`: the multiplexed model ids in device slots and in
host memory, refreshed every `ROUTING_STATS_PERIOD_S`). For a request naming an adapter,
the candidates are ranked by that adapter's tier on them:

    1. device: the adapter is in one of the replica's LoRA slots (no load at all);
    2. host:   the replica holds it in host memory (a slot write away);
    3. cold:   the replica would read it from disk.

A replica the router itself sent the adapter to (a call that loads it: a generation,
a prefetch, a replication) within the last `PLACEMENT_TTL_S` counts as host tier before its routing stats say so (a burst for a cold adapter goes
where its first request went, not to every replica before the first load is reported).
When the adapter is cold everywhere, its home replica comes first: the one that ranks
highest for it by rendezvous hashing, so each cold adapter has one stable place and
the fleet's host memory holds more distinct adapters instead of copies.

Within a tier, the replica that last served the longest prefix of the request's prompt
comes first, in a rank of its own (prefix affinity: its prefix cache likely still holds
that prefix's KV blocks). Prefixes are chained hashes of full chunks of the prompt
(`PREFIX_CHUNK_TOKENS` token ids, or `PREFIX_CHUNK_CHARS` characters of text or chat
messages), namespaced by adapter and by the tenant's prefix-cache salt, as the engine's
prefix cache is; the router learns them from where Serve actually sent each request
(`on_request_routed`) and keeps the newest `MAX_PREFIX_ENTRIES`.

An operator call pinned to one replica (`PINNED_METHODS`, keyword `replica`: its
unique id; the ingress sends failpoint arms and disarms to every running replica this
way) goes to that replica alone while it is a candidate, and anywhere otherwise (the
replica then answers that it was not the one meant).

A hot-adapter replication call (`ModelServer.replicate_adapter`, sent by the residency
registry's replicator, deployments/replication.py) goes the other way: to a replica that
does not hold the adapter, its home first.

Serve tries the ranks in order and, within a rank, takes the replica with the shortest
queue that is not full. Two rules keep the preference from piling work onto one replica:
a replica whose queue is longer than the shortest known queue by more than
`queue_slack` (a model deployment's `max_num_seqs`: one full batch) goes to a last rank
of its own, whatever its tier; and a rank of more than
two replicas offers two of them at random (power of two choices) so routing stays cheap
on a large fleet. A base-model request has one tier everywhere. Each decision is logged
at debug level with the tiers and queue lengths it saw.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import time
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
"""Requests a replica's queue may exceed the shortest one by and keep its tier's rank
(the model deployments pass their engine's `max_num_seqs`, deployments/app.py)."""
ROUTING_STATS_PERIOD_S = 1.0
"""How often Serve asks each model replica for its residency (`record_routing_stats`)."""
PREFIX_CHUNK_TOKENS = 16
"""Token ids per prefix chunk (one KV block at the engine's default block size)."""
PREFIX_CHUNK_CHARS = 64
"""Characters per prefix chunk of a text prompt or of chat messages (about 16 tokens)."""
MAX_PREFIX_CHUNKS = 64
MAX_PREFIX_ENTRIES = 65536
PLACEMENT_TTL_S = 10.0
"""How long a replica the router sent an adapter to counts as holding it without its
routing stats confirming it (a load, and the next stats report, take less)."""
MAX_PLACEMENTS = 65536
REPLICATE_METHOD = "replicate_adapter"
"""ModelServer's hot-adapter replication call (deployments/replication.py): it goes to a
replica that does not hold the adapter yet."""
PINNED_METHODS = frozenset({"arm_failpoint", "disarm_failpoints", "replica_info"})
"""ModelServer calls that name the replica they are meant for (keyword `replica`)."""
LOADING_METHODS = frozenset({"generate", "prefetch_adapter", REPLICATE_METHOD})
"""ModelServer calls that load their multiplexed model id's adapter where they run (the
others, such as `replica_info`, leave no placement behind)."""


@dataclass(frozen=True)
class ReplicaView:
    """What the router knows of one replica for one request."""

    replica_id: Any
    tier: str
    queue_len: int | None
    """Ongoing requests as last seen (None: not known yet)."""


def adapter_tier(stats: dict[str, Any], model_id: str) -> str:
    """Where `model_id` sits on a replica, from its routing stats; a base-model request
    (empty id) is COLD everywhere, so every replica shares one rank."""
    if not model_id:
        return COLD
    if model_id in stats.get(DEVICE, ()):
        return DEVICE
    if model_id in stats.get(HOST, ()):
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


def home_replica(model_id: str, replica_ids: Collection[Any]) -> Any:
    """The replica that ranks highest for `model_id` by rendezvous (highest random
    weight) hashing: stable while it lives, and a replica leaving or joining moves only
    the adapters whose home it was or becomes. None for no replicas."""
    if not replica_ids:
        return None
    return max(replica_ids, key=lambda r: _stable_hash(f"{model_id}\x00{_unique(r)}"))


class RecentPlacements:
    """(adapter, replica) pairs the router sent requests to, for `ttl_s` after the last
    one (oldest first, at most `capacity`)."""

    def __init__(self, ttl_s: float = PLACEMENT_TTL_S, capacity: int = MAX_PLACEMENTS) -> None:
        self.ttl_s = ttl_s
        self.capacity = capacity
        self._until: OrderedDict[tuple[str, Any], float] = OrderedDict()

    def record(self, model_id: str, replica_id: Any, now: float) -> None:
        key = (model_id, replica_id)
        self._until[key] = now + self.ttl_s
        self._until.move_to_end(key)
        while self._until and (
            len(self._until) > self.capacity or next(iter(self._until.values())) <= now
        ):
            self._until.popitem(last=False)

    def holds(self, model_id: str, replica_id: Any, now: float) -> bool:
        return self._until.get((model_id, replica_id), 0.0) > now

    def __len__(self) -> int:
        return len(self._until)


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


def rank_for_replication(views: Sequence[ReplicaView], home: Any = None) -> list[list[Any]]:
    """Replica ids for a replication call: those without the adapter (`home` first in a
    rank alone, then the rest), then those holding it (only if every replica does)."""
    lacking = [v.replica_id for v in views if v.tier == COLD]
    holding = [v.replica_id for v in views if v.tier != COLD]
    ranks = [[home]] if home in lacking else []
    ranks += [[r for r in lacking if r != home], holding]
    return [rank for rank in ranks if rank]


def rank_replicas(
    views: Sequence[ReplicaView],
    queue_slack: int = QUEUE_SLACK,
    rng: random.Random = random,
    affine: Any = None,
    home: Any = None,
) -> list[list[Any]]:
    """Replica ids in ranks: device, host, cold, then the replicas whose queue exceeds
    the shortest known one by more than `queue_slack`; empty ranks dropped, a rank of
    more than two cut to two drawn at random (its others follow as the next rank).
    `affine` (the prefix's replica), unless overloaded, leads its tier in a rank alone;
    then `home` (the adapter's home replica) leads the cold tier in a rank alone."""
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
    for tier, members in [*by_tier.items(), (None, overloaded)]:
        leaders = [affine] if tier is not None else []
        if tier == COLD:
            leaders.append(home)
        for leader in leaders:
            if leader is not None and leader in members:
                ranks.append([leader])
                members = [m for m in members if m != leader]
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
        self,
        queue_slack: int = QUEUE_SLACK,
        prefix_entries: int = MAX_PREFIX_ENTRIES,
        prefix_affinity: bool = True,
    ) -> None:
        self.queue_slack = queue_slack
        self.prefix_affinity = prefix_affinity
        self._prefixes = PrefixOwners(prefix_entries)
        self._placements = RecentPlacements()

    @property
    def prefixes(self) -> PrefixOwners:
        if getattr(self, "_prefixes", None) is None:
            self._prefixes = PrefixOwners()
        return self._prefixes

    @property
    def placements(self) -> RecentPlacements:
        if getattr(self, "_placements", None) is None:
            self._placements = RecentPlacements()
        return self._placements

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        pinned = _pinned_replica(pending_request)
        if pinned is not None:
            chosen = [r for r in candidate_replicas if _unique(r.replica_id) == pinned]
            return [chosen or candidate_replicas]
        model_id = ""
        if pending_request is not None:
            model_id = pending_request.metadata.multiplexed_model_id or ""
        now = time.monotonic()
        views = [self._view(replica, model_id, now) for replica in candidate_replicas]
        hashes = _request_prefix(pending_request) if self._affinity else []
        alive = {view.replica_id for view in views}
        affine, depth = self.prefixes.owner(hashes, alive)
        home = home_replica(model_id, alive) if model_id else None
        if pending_request is not None and pending_request.metadata.call_method == REPLICATE_METHOD:
            ranks = rank_for_replication(views, home)
        else:
            slack = getattr(self, "queue_slack", QUEUE_SLACK)
            ranks = rank_replicas(views, slack, affine=affine, home=home)
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug(
                "route %s: %s; prefix %d/%d chunks on %s; home %s -> %s",
                model_id or "(base)",
                ", ".join(f"{_short(v.replica_id)}={v.tier}/q{v.queue_len}" for v in views),
                depth,
                len(hashes),
                _short(affine) if affine is not None else "-",
                _short(home) if home is not None else "-",
                [[_short(r) for r in rank] for rank in ranks],
            )
        return [[self._replicas[r] for r in rank if r in self._replicas] for rank in ranks]

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any
    ) -> None:
        """Serve sent the request to `replica_id`: its prompt's prefixes are there now,
        and its adapter is, or soon will be."""
        model_id = pending_request.metadata.multiplexed_model_id or ""
        if model_id and pending_request.metadata.call_method in LOADING_METHODS:
            self.placements.record(model_id, replica_id, time.monotonic())
        if pending_request.metadata.call_method in PINNED_METHODS | {REPLICATE_METHOD}:
            return
        hashes = _request_prefix(pending_request) if self._affinity else []
        if hashes:
            self.prefixes.record(hashes, replica_id)

    @property
    def _affinity(self) -> bool:
        return getattr(self, "prefix_affinity", True)

    def _view(self, replica: RunningReplica, model_id: str, now: float) -> ReplicaView:
        stats = replica.routing_stats or {}
        tier = adapter_tier(stats, model_id)
        if tier == COLD and model_id and self.placements.holds(model_id, replica.replica_id, now):
            tier = HOST
        queue_len = self.replica_queue_len_cache.get(replica.replica_id)
        return ReplicaView(replica.replica_id, tier, queue_len)


def _pinned_replica(pending_request: PendingRequest | None) -> str | None:
    """The unique id of the replica a pinned call names (None: not a pinned call)."""
    if pending_request is None or pending_request.metadata.call_method not in PINNED_METHODS:
        return None
    replica = (pending_request.kwargs or {}).get("replica")
    return str(replica) if replica is not None else None


def _request_prefix(pending_request: PendingRequest | None) -> list[int]:
    if pending_request is None or not pending_request.args:
        return []
    model_id = pending_request.metadata.multiplexed_model_id or ""
    return prompt_prefix_hashes(pending_request.args[0], model_id)


def _unique(replica_id: Any) -> str:
    unique = getattr(replica_id, "unique_id", None)
    return str(unique if unique is not None else replica_id)


def _short(replica_id: ReplicaID) -> str:
    return _unique(replica_id)[:8]


def _stable_hash(text: str) -> int:
    """A hash every router process agrees on (Python's `hash` of a str is salted)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")
