"""Admission by estimated wait (deployments/admission.py): the estimate against a
stepped clock, then a real ModelServer (engine slowed by a failpoint) refusing what it
could not start in time while the admitted requests complete."""

from __future__ import annotations

import asyncio
import time

import pytest

from loraplex.deployments.admission import SMOOTHING, AdmissionControl, FleetAdmission


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def measured(
    max_wait_s: float | None = 5.0, max_num_seqs: int = 2, fair: bool = False
) -> AdmissionControl:
    """Admission control that watched a full batch of 2 lose 4 sequences in 8 s (0.5/s)
    and is now empty."""
    clock = Clock()
    control = AdmissionControl(max_wait_s, max_num_seqs, clock, fair=fair)
    for i in range(6):
        assert control.admit(f"w{i}", 1) is None
    for i in range(4):
        control.started(f"w{i}")
        clock.now += 2.0
        control.finish(f"w{i}")
    assert control.departure_rate == pytest.approx(0.5)
    control.finish("w4")
    control.finish("w5")
    assert control.in_flight == 0
    return control


def test_nothing_is_refused_before_a_departure_rate_was_measured():
    control = AdmissionControl(0.001, 1, Clock())
    assert all(control.admit(f"r{i}", 1, waited_s=100.0) is None for i in range(50))
    assert control.in_flight == 50 and control.refused == 0


def test_a_request_that_can_start_now_is_admitted_however_long_it_waited_before():
    control = measured()
    assert control.admit("a", 1, waited_s=1000.0) is None
    assert control.admit("b", 1, waited_s=1000.0) is None


def test_the_wait_is_the_queue_ahead_over_the_departure_rate():
    control = measured(max_wait_s=5.0)
    assert control.admit("a", 1) is None
    assert control.admit("b", 1) is None
    # The batch (2) is full: the next sequence waits for one departure, 2 s.
    assert control.estimated_wait_s(1) == pytest.approx(2.0)
    assert control.admit("c", 1) is None
    assert control.estimated_wait_s(1) == pytest.approx(4.0)
    # n=2 counts as two sequences: 3 + 2 - 2 -> 6 s > 5 s.
    refusal = control.admit("d", 2)
    assert refusal is not None and refusal.wait_s == pytest.approx(6.0)
    assert refusal.retry_after_s == 1 and "about 6 s" in refusal.message
    assert control.admit("e", 1) is None
    # Time already spent queued before the replica counts: 1.5 + 6 s > 5 s.
    assert control.admit("f", 1, waited_s=1.5) is not None
    assert control.refused == 2 and control.in_flight == 4


def test_the_refusal_window_is_how_long_a_one_sequence_request_would_be_refused():
    control = measured(max_wait_s=5.0)
    for name in "abcd":
        assert control.admit(name, 1) is None
    # 4 in flight, batch 2: one more sequence waits 3 / 0.5 = 6 s, 1 s past the limit.
    assert control.refusing_for_s() == pytest.approx(1.0)
    control.finish("a")
    assert control.refusing_for_s() == 0.0
    assert measured(max_wait_s=None).refusing_for_s() == 0.0


def test_under_fair_share_a_light_tenant_is_not_refused_for_a_heavy_queue():
    control = measured(max_wait_s=5.0, fair=True)
    for i in range(4):
        assert control.admit(f"h{i}", 1, tenant="heavy") is None
    # heavy: 4 in flight + 1 new, batch of 2 -> 3 ahead at 0.5/s = 6 s > 5 s.
    assert control.admit("h4", 1, tenant="heavy") is not None
    # light's first sequence passes all but one of heavy's: 1 + 1 - 2 -> starts now.
    assert control.estimated_wait_s(1, "light") == 0.0
    assert control.admit("l0", 1, tenant="light") is None
    # its second: 2 own + 2 of heavy's - 2 -> 2 ahead, 4 s.
    assert control.estimated_wait_s(1, "light") == pytest.approx(4.0)
    # a tenant of weight 1/4 lets 4 of every other tenant's pass per own one:
    # 1 + min(4, 4) of heavy's + min(1, 4) of light's - 2 -> 4 ahead, 8 s.
    assert control.estimated_wait_s(1, "bronze", weight=0.25) == pytest.approx(8.0)
    for request_id in ("h0", "h1", "h2", "h3", "l0"):
        control.finish(request_id)
    assert control.in_flight == 0 and control.estimated_wait_s(1, "heavy") == 0.0


def test_without_fair_share_every_tenant_queues_behind_the_whole_queue():
    control = measured(max_wait_s=5.0)
    for i in range(4):
        assert control.admit(f"h{i}", 1, tenant="heavy") is None
    assert control.admit("l0", 1, tenant="light") is not None


def test_retry_after_grows_with_the_excess_wait():
    control = measured(max_wait_s=None)
    for i in range(12):
        assert control.admit(f"r{i}", 1) is None
    control.max_wait_s = 1.0
    refusal = control.admit("late", 1)
    assert refusal is not None
    assert refusal.wait_s == pytest.approx(11 / 0.5)
    assert refusal.retry_after_s == 21


def test_no_limit_never_refuses():
    control = measured(max_wait_s=None)
    assert all(control.admit(f"r{i}", 1) is None for i in range(100))


def test_only_departures_from_a_full_batch_of_started_requests_count():
    clock = Clock()
    control = AdmissionControl(5.0, 4, clock)
    for i in range(3):  # never full: nothing is measured however many leave
        control.admit(f"a{i}", 1)
        control.started(f"a{i}")
    clock.now += 60.0
    for i in range(3):
        control.finish(f"a{i}")
    assert control.departure_rate is None
    for i in range(16):
        control.admit(f"q{i}", 1)
    clock.now += 10.0
    for i in range(8, 16):  # aborted while queued: left no place in the batch
        control.finish(f"q{i}")
    assert control.departure_rate is None
    for i in range(4):  # the batch stays full while these leave
        control.started(f"q{i}")
        control.finish(f"q{i}")
    assert control.departure_rate == pytest.approx(4 / 10.0)
    control.finish("q0")  # twice: ignored
    control.started("nobody")
    assert control.in_flight == 4


def test_the_rate_follows_a_slower_batch():
    control = measured(max_wait_s=None)
    clock = control._clock
    for i in range(6):
        control.admit(f"s{i}", 1)
    for i in range(4):
        control.started(f"s{i}")
        clock.now += 8.0
        control.finish(f"s{i}")
    assert control.departure_rate == pytest.approx(0.5 + SMOOTHING * (4 / 32 - 0.5))


def measured_fleet(max_wait_s: float = 5.0) -> tuple[FleetAdmission, Clock]:
    """The ingress's view of one replica with a batch of 2 that lost 4 sequences in 8 s
    (0.5/s), now empty."""
    clock = Clock()
    fleet = FleetAdmission(max_wait_s, 2, clock=clock)
    for i in range(6):
        assert fleet.admit(f"w{i}", 1, "t", 1.0, serving=True) is None
    for i in range(4):
        fleet.started(f"w{i}")
        clock.now += 2.0
        fleet.finish(f"w{i}")
    fleet.finish("w4")
    fleet.finish("w5")
    assert fleet.control.departure_rate == pytest.approx(0.5)
    return fleet, clock


def test_the_ingress_refuses_past_the_wait_of_one_batch_per_running_replica():
    fleet, _ = measured_fleet(max_wait_s=5.0)
    admitted = [fleet.admit(f"a{i}", 1, "t", 1.0, serving=True) for i in range(4)]
    assert admitted == [None] * 4
    # 4 in flight, batch 2: a fifth waits (5 - 2) / 0.5 = 6 s > 5 s.
    refusal = fleet.admit("x", 1, "t", 1.0, serving=True)
    assert refusal is not None and refusal.wait_s == pytest.approx(6.0)
    # A second running replica doubles the batch and the departure rate:
    # (5 - 4) / 1.0 = 1 s.
    fleet.set_replicas(2)
    assert fleet.control.departure_rate == pytest.approx(1.0)
    assert fleet.admit("y", 1, "t", 1.0, serving=True) is None
    fleet.set_replicas(1)
    assert fleet.control.departure_rate == pytest.approx(0.5)
    assert fleet.control.max_num_seqs == 2


def test_the_ingress_refuses_nothing_while_no_replica_runs_but_counts_it():
    fleet, _ = measured_fleet(max_wait_s=1.0)
    fleet.set_replicas(0)
    assert fleet.replicas == 1
    assert all(fleet.admit(f"c{i}", 1, "t", 1.0, serving=False) is None for i in range(20))
    assert fleet.control.in_flight == 20
    assert fleet.admit("d", 1, "t", 1.0, serving=True) is not None
    for i in range(20):
        fleet.finish(f"c{i}")
    assert fleet.control.in_flight == 0


def test_a_slow_model_server_refuses_what_it_cannot_start_and_finishes_the_rest(
    tiny_model_factory, tmp_path
):
    """A real engine, slowed to ~12 steps/s, batch of 2: once five requests through the
    full batch measured its departure rate, of six concurrent requests two run and four
    are refused at once with Retry-After; the two complete, and an idle server admits
    again a request that waited long before it reached the replica."""
    from loraplex.deployments.config import ModelDeploymentConfig
    from loraplex.deployments.model_server import LocalPlace, ModelServer
    from loraplex.deployments.wire import GenerateCall, GenerateError
    from loraplex.platform.failpoints import FAILPOINTS
    from loraplex.platform.request import SamplingParams

    config = ModelDeploymentConfig(
        name="slow",
        model=str(tiny_model_factory("llama")),
        engine={
            "dtype": "float32",
            "max_model_len": 128,
            "max_num_seqs": 2,
            "max_loras": 0,
            "kv_cache_memory_bytes": 1 << 22,
        },
        admission_max_wait_s=1.0,
        fault_injection=True,
    )
    server = ModelServer(config, str(tmp_path / "adapters"), place=LocalPlace())
    server.arm_failpoint("engine.delay", delay_s=0.08)
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)

    async def run(request_id: str, received_at: float | None = None):
        call = GenerateCall(request_id, params, prompt=[1, 2, 3], received_at=received_at)
        started = time.perf_counter()
        items = [item async for item in server.generate(call)]
        return items, time.perf_counter() - started

    async def scenario():
        warm = await asyncio.gather(*(run(f"w{i}") for i in range(5)))
        assert all(not isinstance(items[-1], GenerateError) for items, _ in warm)
        assert server.admission.departure_rate is not None
        burst = await asyncio.gather(*(run(f"b{i}") for i in range(6)))
        after = await run("after", received_at=time.time() - 60.0)
        return burst, after

    try:
        burst, after = asyncio.run(scenario())
    finally:
        FAILPOINTS.disarm()
        server.engine.shutdown()
    refused = [(items, took) for items, took in burst if isinstance(items[0], GenerateError)]
    served = [items for items, _ in burst if not isinstance(items[0], GenerateError)]
    assert len(served) == 2 and len(refused) == 4
    for items, took in refused:
        error = items[0]
        assert len(items) == 1 and error.status == 503 and error.retry_after_s >= 1
        assert "at capacity" in error.message and took < 0.5
    for items in served:
        assert sum(d.num_new_tokens for step in items for d in step.deltas) == 32
        assert items[-1].deltas[-1].finish_reason == "length"
    assert not isinstance(after[0][0], GenerateError)
    assert server.admission.in_flight == 0 and server.admission.refused == 4
