"""Autoscaling of the model deployments: Ray Serve's queue-length policy, raised to the
replicas needed to keep the adapters in demand in host memory.

Each model replica reports (`ModelServer.record_autoscaling_stats`, Serve's custom
autoscaling metrics) the distinct adapters it served within the model's
`server.adapter_demand_window_s` and how many it holds in host memory
(`max_cpu_loras`). With N_r distinct adapters on replica r and a capacity of C per
replica, the fleet needs ceil(sum_r N_r / C) replicas so that every adapter in demand
stays loaded somewhere: a working set larger than that is reloaded from disk over and
over. The residency router gives each adapter one home replica, so the sum counts each
adapter about once. The policy takes the larger of that and Serve's own queue-length
decision; Serve then applies the config's bounds and up/downscale delays, so the
count grows with adapter-spread load and shrinks after it once the window has passed.

`ADAPTER_POLICY` is every autoscaled model's policy unless its `autoscaling_config`
names another (`policy: {policy_function: ...}`).
"""

from __future__ import annotations

import logging
import math
from typing import Any

from ray.serve.autoscaling_policy import replica_queue_length_autoscaling_policy
from ray.serve.config import AutoscalingContext

logger = logging.getLogger("ray.serve.loraplex.autoscaling")
"""Under `ray.serve`: the policy runs in Serve's controller, whose log holds Serve's own
scaling decisions."""
LOGGED_KEY = "loraplex_adapter_decision"

ADAPTER_POLICY = "loraplex.deployments.autoscaling:adapter_working_set_policy"
ADAPTERS_IN_DEMAND = "adapters_in_demand"
"""Replica metric: distinct adapters it served within the demand window."""
HOST_ADAPTER_CAPACITY = "host_adapter_capacity"
"""Replica metric: adapters it holds in host memory (max_cpu_loras)."""


def replicas_for_adapters(in_demand: dict[Any, float], capacity: dict[Any, float]) -> int:
    """Replicas whose host memory holds the adapters in demand (0 when none reported)."""
    reporting = [r for r in in_demand if capacity.get(r, 0) > 0]
    if not reporting:
        return 0
    per_replica = sum(capacity[r] for r in reporting) / len(reporting)
    return math.ceil(sum(in_demand[r] for r in reporting) / per_replica - 1e-9)


def with_adapter_policy(autoscaling_config: dict[str, Any]) -> dict[str, Any]:
    """A model's `autoscaling_config` with `ADAPTER_POLICY` unless it names a policy."""
    if "policy" in autoscaling_config:
        return autoscaling_config
    return {**autoscaling_config, "policy": {"policy_function": ADAPTER_POLICY}}


def adapter_working_set_policy(ctx: AutoscalingContext) -> tuple[float, dict[str, Any]]:
    """Serve's queue-length decision, or the replicas the adapters in demand need when
    that is more (module docstring); within the deployment's replica bounds."""
    by_queue, _ = replica_queue_length_autoscaling_policy(ctx)
    metrics = ctx.aggregated_metrics or {}
    running = set(ctx.running_replicas)
    in_demand = {r: v for r, v in (metrics.get(ADAPTERS_IN_DEMAND) or {}).items() if r in running}
    capacity = metrics.get(HOST_ADAPTER_CAPACITY) or {}
    by_adapters = replicas_for_adapters(in_demand, capacity)
    desired = max(by_queue, by_adapters)
    low, high = ctx.capacity_adjusted_min_replicas, ctx.capacity_adjusted_max_replicas
    bounded = min(max(desired, low), high)
    decision = bounded if by_adapters > max(by_queue, low) else None
    if decision is not None and ctx.policy_state.get(LOGGED_KEY) != decision:
        logger.info(
            "%s: %.1f adapters in demand over %d replicas need %d replicas (queue alone: "
            "%.2f); asking for %d",
            ctx.deployment_name,
            sum(in_demand.values()),
            len(in_demand),
            by_adapters,
            by_queue,
            bounded,
        )
    return bounded, {LOGGED_KEY: decision}
