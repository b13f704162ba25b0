"""The deploy-time placement check (deployments/placement.py) on node resource tables, and
the config rules around it. The two-node test (test_multinode.py) runs it on a cluster."""

from __future__ import annotations

import pytest

from loraplex.deployments.config import ModelDeploymentConfig
from loraplex.deployments.placement import unplaceable_reason

TWO_SMALL_NODES = [{"CPU": 1.0, "memory": 1e9}, {"CPU": 1.0, "memory": 1e9}]


def test_strict_pack_needs_the_sum_of_the_bundles_on_one_node():
    fits = [{"CPU": 0.1}, {"CPU": 0.4}]
    assert unplaceable_reason(fits, "STRICT_PACK", TWO_SMALL_NODES) is None
    too_big = [{"CPU": 0.6}, {"CPU": 0.6}]
    reason = unplaceable_reason(too_big, "STRICT_PACK", TWO_SMALL_NODES)
    assert reason == (
        "its 2 bundle(s) need 1.2 CPU together on one node (placement_group_strategy "
        "STRICT_PACK); the largest of the 2 node(s) offering them has 1 CPU"
    )
    assert unplaceable_reason(too_big, "PACK", TWO_SMALL_NODES) is None, "PACK may split them"


def test_fractions_that_sum_to_a_node_fit():
    tenths = [{"CPU": 0.1}] * 10
    assert unplaceable_reason(tenths, "STRICT_PACK", [{"CPU": 1.0}]) is None


def test_every_bundle_must_fit_some_node_whatever_the_strategy():
    for strategy in ("PACK", "SPREAD", "STRICT_SPREAD"):
        reason = unplaceable_reason([{"CPU": 0.5}, {"CPU": 2.0}], strategy, TWO_SMALL_NODES)
        assert reason is not None and reason.startswith("bundle 1 needs 2 CPU"), strategy


def test_strict_spread_needs_a_node_per_bundle():
    three = [{"CPU": 0.5}] * 3
    assert "need 3 different nodes" in unplaceable_reason(three, "STRICT_SPREAD", TWO_SMALL_NODES)
    assert unplaceable_reason(three[:2], "STRICT_SPREAD", TWO_SMALL_NODES) is None


def test_gpus_count_on_nodes_that_have_them():
    bundles = [{"CPU": 0.1, "GPU": 1.0}, {"CPU": 0.1, "GPU": 1.0}]
    nodes = [{"CPU": 8.0, "GPU": 1.0}, {"CPU": 8.0, "GPU": 1.0}, {"CPU": 64.0}]
    reason = unplaceable_reason(bundles, "STRICT_PACK", nodes)
    assert "need 0.2 CPU, 2 GPU together" in reason and "of the 2 node(s)" in reason
    assert unplaceable_reason(bundles, "STRICT_PACK", [*nodes, {"CPU": 8, "GPU": 2}]) is None


def test_no_judgement_before_a_node_offers_what_the_replica_needs():
    """A KubeRay head (num-cpus 0) before its workers join; GPU nodes still at zero."""
    assert unplaceable_reason([{"CPU": 1.5}], "STRICT_PACK", [{"memory": 1e9}]) is None
    assert unplaceable_reason([{"GPU": 1.0}], "STRICT_PACK", TWO_SMALL_NODES) is None


def test_max_replicas_per_node_is_refused_with_tensor_parallelism(tiny_model_factory):
    base = str(tiny_model_factory("llama"))
    spread = ModelDeploymentConfig(name="m", model=base, server={"max_replicas_per_node": 1})
    assert spread.server.max_replicas_per_node == 1
    with pytest.raises(ValueError, match="max_replicas_per_node cannot be set"):
        ModelDeploymentConfig(
            name="m",
            model=base,
            engine={"tensor_parallel_size": 2},
            server={"max_replicas_per_node": 1},
        )
