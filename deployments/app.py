"""`serve run serve_config.yaml` entry point: one ModelServer deployment per base model
behind one OpenAI ingress, and the residency registry they share. `build_app(args)` takes serve_config.yaml's `args`."""

from __future__ import annotations

from typing import Any

from ray import serve
from ray.serve import Application
from ray.serve.config import BackpressureConfig, RequestRouterConfig

from loraplex.deployments.autoscaling import with_adapter_policy
from loraplex.deployments.config import (
    ModelDeploymentConfig,
    PlatformConfig,
    model_deployment_name,
)
from loraplex.deployments.ingress import OVERLOAD_RETRY_AFTER_S, OpenAIIngress
from loraplex.deployments.ingress_gate import INGRESS_HEADROOM
from loraplex.deployments.model_server import ModelServer
from loraplex.deployments.placement import check_placement
from loraplex.deployments.request_router import ROUTING_STATS_PERIOD_S, ResidencyRouter
from loraplex.deployments.residency import ResidencyRegistryDeployment


def replica_bundles(config: ModelDeploymentConfig) -> list[dict[str, float]]:
    """What one replica reserves: one bundle per rank, the replica (rank 0) in bundle 0 and
    worker r in bundle r (tp_workers.py); one bundle for one rank."""
    parallel = config.engine_config().parallel
    server = config.server

    def bundle(cpus: float) -> dict[str, float]:
        resources = {"CPU": cpus, "GPU": server.num_gpus}
        return {name: amount for name, amount in resources.items() if amount > 0}

    workers = [bundle(parallel.worker_num_cpus)] * (parallel.tensor_parallel_size - 1)
    return [bundle(server.num_cpus), *workers]


def rank_bundles(config: ModelDeploymentConfig) -> dict[str, Any]:
    """Serve placement-group options of a tensor-parallel model (`replica_bundles`);
    nothing for one rank."""
    bundles = replica_bundles(config)
    if len(bundles) == 1:
        return {}
    return {
        "placement_group_bundles": bundles,
        "placement_group_strategy": config.server.placement_group_strategy,
    }


def spread(config: ModelDeploymentConfig) -> dict[str, Any]:
    """Serve's `max_replicas_per_node` when the config sets it."""
    limit = config.server.max_replicas_per_node
    return {} if limit is None else {"max_replicas_per_node": limit}


def bind_model_server(
    config: ModelDeploymentConfig, adapter_root: str, registry: Application | None = None
) -> Application:
    server = config.server
    check_placement(config.name, replica_bundles(config), server.placement_group_strategy)
    scaling: dict[str, Any] = (
        {"autoscaling_config": with_adapter_policy(server.autoscaling_config)}
        if server.autoscaling_config is not None
        else {"num_replicas": server.num_replicas}
    )
    deployment = serve.deployment(
        ModelServer,
        name=model_deployment_name(config.name),
        ray_actor_options={"num_cpus": server.num_cpus, "num_gpus": server.num_gpus},
        **rank_bundles(config),
        **spread(config),
        max_ongoing_requests=server.max_ongoing_requests,
        max_queued_requests=server.max_queued_requests,
        health_check_period_s=server.health_check_period_s,
        graceful_shutdown_timeout_s=server.graceful_shutdown_timeout_s,
        request_router_config=request_router_config(config),
        # The ingress's calls: the model server logs each request's own line (request
        # id, tenant, adapter, tokens, time) to the replica's file; Serve's access line
        # per call would repeat it under Serve's internal id, on the console too. A
        # config's `deployments: [{name: model-..., logging_config: ...}]` turns it on.
        logging_config={"enable_access_log": False},
        **scaling,
    )
    return deployment.bind(config, adapter_root, registry)


def request_router_config(config: ModelDeploymentConfig) -> RequestRouterConfig:
    """The residency router with its options, or Serve's default router (the baseline
    of scripts/bench_adapter_routing.py); both poll the replicas' routing stats.

    The residency router's queue guard lets a replica's queue exceed the shortest by one
    full batch (`max_num_seqs`) before it loses its adapter's or prefix's preference:
    below that, the request joins the holder's running batch; above it, it would wait
    there for a place while another replica could start it after one adapter load."""
    server = config.server
    if server.request_router == "power_of_two":
        return RequestRouterConfig(request_routing_stats_period_s=ROUTING_STATS_PERIOD_S)
    return RequestRouterConfig(
        request_router_class=ResidencyRouter,
        request_router_kwargs={
            "prefix_affinity": server.prefix_affinity,
            "queue_slack": config.engine_config().scheduler.max_num_seqs,
        },
        request_routing_stats_period_s=ROUTING_STATS_PERIOD_S,
    )


def build_app(args: dict[str, Any]) -> Application:
    config = PlatformConfig.model_validate(args)
    registry = ResidencyRegistryDeployment.bind(replicate_hot_adapters=True)
    servers = [bind_model_server(model, config.adapter_root, registry) for model in config.models]
    return OpenAIIngress.options(
        ray_actor_options={"num_cpus": config.ingress.num_cpus},
        max_ongoing_requests=config.ingress.max_ongoing_requests + INGRESS_HEADROOM,
        max_queued_requests=config.ingress.max_queued_requests,
        graceful_shutdown_timeout_s=config.ingress.graceful_shutdown_timeout_s,
        backpressure_config=BackpressureConfig(retry_after_s=OVERLOAD_RETRY_AFTER_S),
    ).bind(config, servers, registry)
