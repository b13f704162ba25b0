"""The serve bench's server counters, read from Prometheus text as loraplex's /metrics
serves it (deployments/metrics.py render_prometheus), without a server."""

from __future__ import annotations

from loraplex.deployments.metrics import render_prometheus
from loraplex.tools.serve_bench.server_counters import ServerCounters, parse_counters

RAY_TEXT = """\
# HELP ray_loraplex_adapter_loads_total Adapter loads
# TYPE ray_loraplex_adapter_loads_total counter
ray_loraplex_adapter_loads_total{model="m",replica="r1",result="ok",WorkerId="w1"} 5.0
ray_loraplex_adapter_loads_total{model="m",replica="r2",result="ok",WorkerId="w2"} 2.0
ray_loraplex_adapter_loads_total{model="m",replica="r2",result="error",WorkerId="w2"} 4.0
# HELP ray_vllm_prefix_cache_queries_total Prompt tokens looked up
# TYPE ray_vllm_prefix_cache_queries_total counter
ray_vllm_prefix_cache_queries_total{model_name="m",replica="r1"} 1000.0
ray_vllm_prefix_cache_queries_total{model_name="m",replica="r2"} 600.0
# HELP ray_vllm_prefix_cache_hits_total Prompt tokens found
# TYPE ray_vllm_prefix_cache_hits_total counter
ray_vllm_prefix_cache_hits_total{model_name="m",replica="r1"} 800.0
ray_vllm_prefix_cache_hits_total{model_name="m",replica="r2"} 400.0
# HELP ray_other_total Not ours
# TYPE ray_other_total counter
ray_other_total 3.0
"""


def test_counters_sum_the_replicas_and_count_only_successful_loads():
    counters = parse_counters(render_prometheus(RAY_TEXT))
    assert counters == ServerCounters(adapter_loads=7, prefix_queries=1600, prefix_hits=1200)
    assert counters.prefix_hit_rate == 0.75
    assert parse_counters("") == ServerCounters()
    assert ServerCounters().prefix_hit_rate is None


def test_a_burst_is_the_difference_and_reads_per_1000_requests():
    before = ServerCounters(3, 100, 50)
    burst = ServerCounters(11, 500, 350).minus(before)
    assert burst == ServerCounters(8, 400, 300)
    line = burst.line(requests=400)
    assert "8 adapter loads (20.0 per 1000 requests)" in line and "(75.0%)" in line
