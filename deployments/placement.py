"""Whether the cluster's nodes can ever hold a model replica, checked when the app is built.

A replica reserves its resources (`server.num_cpus` / `num_gpus`); a tensor-parallel one
reserves one placement-group bundle per rank, and under STRICT_PACK (the default) all of
them on one node. Ray Serve queues a replica that no node can hold and waits for a node
that never comes: the app stays DEPLOYING, and `serve run` never returns. So the build
fails instead, naming what the replica needs and what the largest node has.

The check reads each live node's total resources (not what is free: other replicas come
and go). It only refuses what cannot fit on the nodes there are: when no node offers a
resource the replica needs yet (a KubeRay head with `num-cpus: 0` before its workers have
joined, GPU nodes an autoscaler has not started), it does not judge. Each test is a
necessary condition for Ray's placement, never stricter than Ray.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

logger = logging.getLogger(__name__)

Resources = Mapping[str, float]
TOLERANCE = 1e-6
"""Ray keeps resource amounts to 1e-4; sums of fractions must not fail on rounding."""


class PlacementError(ValueError):
    """A replica that no node of the cluster can hold."""


def _fits(need: Resources, node: Resources) -> bool:
    return all(node.get(name, 0.0) + TOLERANCE >= amount for name, amount in need.items())


def _total(bundles: Sequence[Resources]) -> dict[str, float]:
    total: dict[str, float] = {}
    for bundle in bundles:
        for name, amount in bundle.items():
            total[name] = total.get(name, 0.0) + amount
    return total


def _show(resources: Resources) -> str:
    return ", ".join(f"{amount:g} {name}" for name, amount in sorted(resources.items())) or "none"


def unplaceable_reason(
    bundles: Sequence[Resources], strategy: str, nodes: Sequence[Resources]
) -> str | None:
    """Why `bundles` (a replica's, bundle 0 holding the replica itself) cannot be placed
    with `strategy` on `nodes` (each live node's total resources); None when they may be,
    or when no node offers every resource they need (nothing to judge yet)."""
    wanted = {name for bundle in bundles for name, amount in bundle.items() if amount > 0}
    offering = [node for node in nodes if all(node.get(name, 0.0) > 0 for name in wanted)]
    if not offering:
        return None
    largest = max(offering, key=lambda node: tuple(node.get(name, 0.0) for name in sorted(wanted)))
    has = {name: largest.get(name, 0.0) for name in wanted}
    shown = f"the largest of the {len(offering)} node(s) offering them has {_show(has)}"
    if strategy == "STRICT_PACK" and not any(_fits(_total(bundles), n) for n in offering):
        return (
            f"its {len(bundles)} bundle(s) need {_show(_total(bundles))} together on one "
            f"node (placement_group_strategy STRICT_PACK); {shown}"
        )
    for index, bundle in enumerate(bundles):
        if not any(_fits(bundle, node) for node in offering):
            return f"bundle {index} needs {_show(bundle)} on one node; {shown}"
    if strategy == "STRICT_SPREAD":
        smallest = min(bundles, key=lambda bundle: sum(bundle.values()))
        hosts = sum(_fits(smallest, node) for node in offering)
        if hosts < len(bundles):
            return (
                f"its {len(bundles)} bundles need {len(bundles)} different nodes "
                f"(placement_group_strategy STRICT_SPREAD); {hosts} can hold one"
            )
    return None


def live_node_resources() -> list[dict[str, float]] | None:
    """Each live node's total resources, or None outside a Ray cluster (`serve run` of an
    import path builds the app before it connects)."""
    import ray

    if not ray.is_initialized():
        return None
    return [dict(node["Resources"]) for node in ray.nodes() if node["Alive"]]


def check_placement(model: str, bundles: Sequence[Resources], strategy: str) -> None:
    """PlacementError naming `model` when no node of the connected cluster can hold its
    replica; nothing outside a cluster or when it may fit."""
    nodes = live_node_resources()
    if nodes is None:
        logger.debug("not connected to Ray: placement of model %s not checked", model)
        return
    reason = unplaceable_reason(bundles, strategy, nodes)
    if reason is not None:
        raise PlacementError(
            f"model {model!r}: no node of this Ray cluster can hold a replica: {reason}. "
            "Lower server.num_cpus / engine.worker_num_cpus (or num_gpus), or add a node "
            "large enough (ray start --address=... --num-cpus=...)"
        )
