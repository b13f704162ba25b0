"""Tenant fair share (platform/fair_share.py) and the scheduler's `fair` policy, driven
without a model: the scheduler tests' helpers make up the sampled tokens.

The policy's promises: a light tenant's request is not queued behind a heavy tenant's
backlog; a tenant alone gets every place; weights split the places in their ratio;
credit is not banked while idle.
"""

import itertools

import pytest
from test_scheduler import adapter, make_group, make_scheduler, run_to_completion, step

from loraplex.platform.fair_share import FairShare


def admissions(scheduler, steps):
    """Request ids in the order they first ran, over `steps` steps."""
    seen: list[str] = []
    for _ in range(steps):
        if not scheduler.num_unfinished:
            break
        output, _ = step(scheduler)
        for item in output.scheduled:
            if item.request.request_id not in seen:
                seen.append(item.request.request_id)
    return seen


def test_charge_divides_by_the_weight_and_the_lowest_counter_goes_next():
    share = FairShare()
    share.charge("a", 30)
    share.charge("b", 30, weight=2.0)
    assert share.counter("a") == 30.0 and share.counter("b") == 15.0
    assert share.next_tenant({"a": 0.0, "b": 5.0}) == "b"
    share.charge("b", 30, weight=2.0)
    assert share.next_tenant({"a": 0.0, "b": 5.0}) == "a", "tie: the earlier head goes first"


def test_a_tenant_becoming_active_is_lifted_to_the_lowest_active_counter():
    share = FairShare()
    share.charge("a", 100)
    share.charge("b", 40)
    share.activate("c", ["a", "b"])
    assert share.counter("c") == 40.0
    share.charge("d", 70)
    share.activate("d", ["a", "b"])
    assert share.counter("d") == 70.0, "a counter above the floor is kept"
    share.clear()
    assert share.counters() == {}


def heavy_then_light(policy):
    """Tenant 'heavy' queues 6 requests, then 'light' one, with one batch place."""
    scheduler = make_scheduler(num_blocks=32, max_num_seqs=1, budget=64, policy=policy)
    for i in range(6):
        scheduler.add(make_group(f"h{i}", [1, 2, 3], max_tokens=3, arrival=i, tenant="heavy"))
    scheduler.add(make_group("l0", [4, 5, 6], max_tokens=3, arrival=6, tenant="light"))
    return admissions(scheduler, 200)


def test_a_light_tenant_is_not_queued_behind_a_heavy_backlog():
    assert heavy_then_light("fcfs") == ["h0", "h1", "h2", "h3", "h4", "h5", "l0"]
    assert heavy_then_light("fair") == ["h0", "l0", "h1", "h2", "h3", "h4", "h5"]


def test_a_tenant_alone_gets_every_place():
    scheduler = make_scheduler(num_blocks=32, max_num_seqs=4, budget=64, policy="fair")
    for i in range(6):
        scheduler.add(make_group(f"h{i}", [1, 2], max_tokens=4, arrival=i, tenant="heavy"))
    output, _ = step(scheduler)
    assert len(output.scheduled) == 4


def test_counters_last_while_a_tenant_is_active_and_go_when_all_are_idle():
    scheduler = make_scheduler(num_blocks=32, max_num_seqs=1, budget=64, policy="fair")
    scheduler.add(make_group("a0", [1, 2, 3], max_tokens=3, tenant="a"))
    scheduler.add(make_group("b0", [1, 2, 3], max_tokens=3, tenant="b"))
    admissions(scheduler, 4)  # a0 done (prompt step + 2 decodes), b0 running
    assert scheduler.num_unfinished and set(scheduler.policy.fair_share.counters()) == {"a", "b"}
    admissions(scheduler, 100)
    assert not scheduler.num_unfinished and scheduler.policy.fair_share.counters() == {}


def test_weights_split_the_places_in_their_ratio():
    scheduler = make_scheduler(num_blocks=32, max_num_seqs=1, budget=64, policy="fair")
    for i in range(12):
        for tenant, weight in (("gold", 2.0), ("basic", 1.0)):
            group = make_group(f"{tenant}{i}", [1, 2, 3], max_tokens=3, arrival=i, tenant=tenant)
            for request in group:
                request.tenant_weight = weight
            scheduler.add(group)
    order = admissions(scheduler, 400)[:12]
    gold = sum(request_id.startswith("gold") for request_id in order)
    assert gold == 8, f"2:1 weights should give 8 of 12 places to gold, got {order}"


def test_an_idle_tenant_does_not_bank_credit():
    scheduler = make_scheduler(num_blocks=32, max_num_seqs=1, budget=64, policy="fair")
    for i in range(10):
        scheduler.add(make_group(f"a{i}", [1, 2, 3], max_tokens=3, arrival=i, tenant="a"))
    assert admissions(scheduler, 20)[:4] == ["a0", "a1", "a2", "a3"]
    for i in range(3):
        scheduler.add(make_group(f"b{i}", [4, 5, 6], max_tokens=3, arrival=20 + i, tenant="b"))
    later = admissions(scheduler, 400)
    b_places = [i for i, request_id in enumerate(later) if request_id.startswith("b")]
    assert len(b_places) == 3 and all(
        second - first == 2 for first, second in itertools.pairwise(b_places)
    ), f"b arrived with a's counter, so the two alternate (b does not run 3 in a row): {later}"


def running_places(scheduler):
    """Tenant -> running requests."""
    places: dict[str, int] = {}
    for request in scheduler.running:
        places[request.tenant] = places.get(request.tenant, 0) + 1
    return places


def test_a_light_request_takes_a_place_from_a_full_batch_at_the_next_step():
    scheduler = make_scheduler(num_blocks=64, max_num_seqs=4, budget=64, policy="fair")
    for i in range(8):
        scheduler.add(make_group(f"h{i}", [1, 2, 3], max_tokens=8, arrival=i, tenant="heavy"))
    step(scheduler)
    step(scheduler)  # h0..h3 decode; h3 has as much work as the others
    scheduler.add(make_group("l0", [4, 5, 6], max_tokens=3, arrival=9, tenant="light"))
    output, _ = step(scheduler)
    ran = {item.request.request_id for item in output.scheduled}
    assert "l0" in ran and len(ran) == 4, f"light runs at once in a full batch: {ran}"
    assert scheduler.num_preemptions == 1
    assert running_places(scheduler) == {"heavy": 3, "light": 1}
    victim = scheduler.requests["h3"]
    assert victim.num_preemptions == 1, "the donor's latest request among equals goes"
    run_to_completion(scheduler)
    assert not scheduler.num_unfinished
    assert scheduler.num_preemptions == 1, "light alone at 1 of 4 places takes no more"


def test_the_donor_loses_its_request_with_the_least_computed_work():
    scheduler = make_scheduler(num_blocks=64, max_num_seqs=2, budget=64, policy="fair")
    scheduler.add(make_group("h0", [1, 2, 3], max_tokens=20, arrival=0, tenant="heavy"))
    for _ in range(5):
        step(scheduler)
    scheduler.add(make_group("h1", [1, 2, 3, 4, 5], max_tokens=20, arrival=-1, tenant="heavy"))
    step(scheduler)
    scheduler.add(make_group("l0", [7, 8], max_tokens=2, arrival=2, tenant="light"))
    before = {r.request_id: r.num_computed_tokens for r in scheduler.running}
    assert before["h1"] < before["h0"], before
    step(scheduler)
    assert scheduler.requests["h1"].num_preemptions == 1, "h1 arrived first but did less"
    assert scheduler.requests["h0"].num_preemptions == 0


def test_two_backlogged_tenants_split_the_places_without_churn():
    scheduler = make_scheduler(num_blocks=128, max_num_seqs=4, budget=64, policy="fair")
    for i in range(8):
        scheduler.add(make_group(f"a{i}", [1, 2], max_tokens=30, arrival=i, tenant="a"))
    step(scheduler)
    for i in range(8):
        scheduler.add(make_group(f"b{i}", [3, 4], max_tokens=30, arrival=10 + i, tenant="b"))
    step(scheduler)
    assert running_places(scheduler) == {"a": 2, "b": 2}
    assert scheduler.num_preemptions == 2
    for _ in range(20):
        step(scheduler)
    assert scheduler.num_preemptions == 2, "an even split is never undone"


def test_weighted_places_follow_the_weights():
    scheduler = make_scheduler(num_blocks=128, max_num_seqs=3, budget=64, policy="fair")

    def add(tenant, weight, count, arrival):
        for i in range(count):
            group = make_group(
                f"{tenant}{i}", [1, 2], max_tokens=30, arrival=arrival + i, tenant=tenant
            )
            group[0].tenant_weight = weight
            scheduler.add(group)

    add("basic", 1.0, 6, 0)
    step(scheduler)
    add("gold", 2.0, 6, 10)
    step(scheduler)
    assert running_places(scheduler) == {"basic": 1, "gold": 2}


def test_no_place_moves_for_an_adapter_that_would_find_no_slot():
    scheduler = make_scheduler(num_blocks=64, max_num_seqs=2, budget=64, policy="fair", max_loras=1)
    for i in range(2):
        scheduler.add(
            make_group(f"h{i}", [1, 2], max_tokens=8, arrival=i, tenant="heavy", lora=adapter("x"))
        )
    step(scheduler)
    scheduler.add(
        make_group("l0", [3, 4], max_tokens=2, arrival=5, tenant="light", lora=adapter("y"))
    )
    step(scheduler)
    assert scheduler.num_preemptions == 0, "preempting one of two x requests frees no slot"
    assert running_places(scheduler) == {"heavy": 2}


def long_prompt_then_light(policy):
    """'heavy' runs one 40-token prompt in 16-token steps; 'light' comes after step 1.
    Returns the second step's chunks (request id -> tokens)."""
    scheduler = make_scheduler(num_blocks=64, max_num_seqs=4, budget=16, policy=policy)
    prompt = list(range(1, 41))
    scheduler.add(make_group("h0", prompt, max_tokens=4, arrival=0, tenant="heavy"))
    step(scheduler)
    scheduler.add(make_group("l0", [41, 42, 43, 44], max_tokens=2, arrival=1, tenant="light"))
    output, _ = step(scheduler)
    return {item.request.request_id: item.num_tokens for item in output.scheduled}


def test_a_placeless_tenant_starts_before_a_long_prompt_ends_its_prefill():
    assert long_prompt_then_light("fcfs") == {"h0": 16}
    assert long_prompt_then_light("fair") == {"l0": 4, "h0": 12}


def test_decodes_keep_their_tokens_when_a_placeless_tenant_starts():
    scheduler = make_scheduler(num_blocks=64, max_num_seqs=4, budget=8, policy="fair")
    for i in range(2):
        scheduler.add(make_group(f"h{i}", [1, 2, 3], max_tokens=6, arrival=i, tenant="heavy"))
    step(scheduler)
    scheduler.add(make_group("h2", list(range(1, 30)), max_tokens=2, arrival=2, tenant="heavy"))
    step(scheduler)  # h0, h1 decode; h2 takes the other 6 tokens of the budget
    scheduler.add(make_group("l0", list(range(30, 40)), max_tokens=2, arrival=3, tenant="light"))
    output, _ = step(scheduler)
    chunks = {item.request.request_id: item.num_tokens for item in output.scheduled}
    assert chunks == {"h0": 1, "h1": 1, "l0": 6}, "decodes first, then light; h2 waits"


@pytest.mark.parametrize("max_num_seqs", [4, 8])
@pytest.mark.parametrize("policy", ["fair", "fcfs"])
def test_a_tenant_holding_every_adapter_slot_cannot_starve_another_adapter(policy, max_num_seqs):
    """max_loras=2: 'heavy' sends one request a step, alternating its adapters x and y,
    so both slots always have a request running and another waiting; 'light' sends one
    request on adapter z at step 3. Bound: light is the request the policy serves next
    from the step after it arrives (fair share: heavy is charged for the request it
    starts at step 3), the heavy requests running then end within max_tokens - 1 more
    steps (no heavy request starts meanwhile), so light starts at most max_tokens steps
    after it arrived. With 4 places heavy keeps the batch full, with 8 it never does."""
    scheduler = make_scheduler(
        num_blocks=128, max_num_seqs=max_num_seqs, budget=64, policy=policy, max_loras=2
    )
    max_tokens, light_arrival, light_started = 4, 3, None
    for step_index in range(40):
        name = "xy"[step_index % 2]
        scheduler.add(
            make_group(
                f"h{step_index}",
                [1, 2, 3],
                max_tokens,
                arrival=step_index,
                tenant="heavy",
                lora=adapter(name),
            )
        )
        if step_index == light_arrival:
            scheduler.add(
                make_group(
                    "l0",
                    [4, 5, 6],
                    max_tokens,
                    arrival=step_index + 0.5,
                    tenant="light",
                    lora=adapter("z"),
                )
            )
        output, _ = step(scheduler)
        if light_started is None and any(s.request.request_id == "l0" for s in output.scheduled):
            light_started = step_index
    assert light_started is not None, "the adapter-z request starved"
    assert light_started - light_arrival <= max_tokens, light_started
    run_to_completion(scheduler)
