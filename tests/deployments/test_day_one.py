"""Issue 31, what an operator meets in the first week, against a real Serve app: a
second application ("dayone", under /dayone) beside the session's, whose replicas this
module kills, poisons and stalls without touching the session app's. Its ingress gives
a first token 2 s (so a cold start longer than that shows) and a silent stream 6 s.

- readiness: /health is computed from Serve's replica states, turns 503 within 5 s of
  a model replica's death and 200 once its replacement is warm; a request sent during
  the cold start waits for it and is served; one that cannot wait gets 503
  `model_loading` with Retry-After;
- supervision: a permanent step fault gets the replica replaced and the app serves
  again; a stalled engine ends open streams with an inter-token timeout error;
- budgets: a batch is charged the sum of its prompts' worst cases and counts prompts x
  n toward concurrency;
- early disconnects release the tenant's slots;
- tokenize, detokenize and the adapter admin calls count against rates of their own,
  and registration validates without a model replica;
- the tokenizer of a folder whose saved class differs from its model type encodes.
"""

from __future__ import annotations

import json
import os
import random
import socket
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from http_calls import api_call

from loraplex.deployments.tenants import hash_key

APP, PREFIX = "dayone", "/dayone"
KEY = "sk-dayone-test"
BUDGET_KEY = "sk-dayone-budget-test"
ADMIN_KEY = "sk-dayone-admin-test"
BULK_KEY = "sk-dayone-bulk-test"
"""A tenant without limits (the ingress admission test fills the batch with it)."""
INGRESS_BOUND = 8
DROPPED_STREAMS = int(os.environ.get("LORAPLEX_DROPPED_STREAMS", "300"))
"""Streams the early-disconnect test drops (300 in CI; the issue's run is 10,000)."""
DEPLOYED: dict = {}
"""The day-one app's config as deployed (the redeploy test changes it)."""
CALL_RATES = {"tokenize_requests_per_minute": 3, "admin_requests_per_minute": 3}
LIMITS = {"max_concurrent_requests": 4, "tokens_per_minute": 2000}


@pytest.fixture(scope="module")
def base_folder(tiny_model_factory):
    return tiny_model_factory("llama", max_position_embeddings=2048)


@pytest.fixture(scope="module")
def dayone(serve_setup, base_folder):
    """The day-one app's base URL; removed after the module."""
    from ray import serve

    from loraplex.deployments.app import build_app

    base = str(base_folder)
    engine = {
        "dtype": "float32",
        "max_model_len": 2048,
        "max_num_seqs": 8,
        "max_loras": 0,
        "kv_cache_memory_bytes": 1 << 25,
    }
    server = {"num_cpus": 0.05, "health_check_period_s": 1, "graceful_shutdown_timeout_s": 5}
    config = {
        "adapter_root": str(serve_setup.adapter_root),
        "ingress": {
            "num_cpus": 0.05,
            "first_token_timeout_s": 2,
            # Twice the slowest armed step (the redeploy test's 1 s, with replicas
            # starting beside it) and then some: a 2-core CI VM stalled a replica 3 s.
            "inter_token_timeout_s": 6,
            "max_ongoing_requests": INGRESS_BOUND,
        },
        "models": [
            {
                "name": "tiny",
                "model": base,
                "engine": engine,
                "server": server,
                "fault_injection": True,
                "max_engine_restarts": 2,
                "admission_max_wait_s": 1,
            },
            {
                "name": "pair",
                "model": base,
                "engine": engine,
                # Serve's graceful shutdown as the platform sets it (the redeploy test).
                "server": {"num_cpus": 0.05, "health_check_period_s": 1, "num_replicas": 2},
                "fault_injection": True,
            },
            {
                "name": "impatient",
                "model": base,
                "engine": {**engine, "max_loras": 1},
                "server": server,
                "cold_start_wait_s": 0.5,
            },
        ],
        "tenants": [
            {"name": "dayone", "api_key_sha256": [hash_key(KEY)], **LIMITS},
            {"name": "budget", "api_key_sha256": [hash_key(BUDGET_KEY)], **LIMITS},
            {"name": "admin", "api_key_sha256": [hash_key(ADMIN_KEY)], **LIMITS, **CALL_RATES},
            {"name": "bulk", "api_key_sha256": [hash_key(BULK_KEY)]},
        ],
    }
    serve.run(build_app(config), name=APP, route_prefix=PREFIX)
    DEPLOYED["config"] = config
    yield f"{serve_setup.url}{PREFIX}"
    serve.delete(APP)


def client(url: str, timeout: float = 60, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=timeout)


def health(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def wait_for(predicate, timeout_s: float, what: str, period_s: float = 0.2) -> float:
    """Seconds until `predicate()` held; fails after `timeout_s`."""
    started = time.monotonic()
    while not predicate():
        assert time.monotonic() - started < timeout_s, f"not within {timeout_s} s: {what}"
        time.sleep(period_s)
    return time.monotonic() - started


def running_replica(model: str) -> dict:
    """The running replica of `model` in the day-one app, as Serve's controller lists
    it (actor_name, pid, ...)."""
    from ray.serve.context import _get_global_client

    details = _get_global_client().get_serve_details()
    replicas = details["applications"][APP]["deployments"][f"model-{model}"]["replicas"]
    running = [r for r in replicas if r["state"] == "RUNNING"]
    assert len(running) == 1, replicas
    return running[0]


def kill_replica(model: str) -> None:
    import ray
    from ray.serve._private.constants import SERVE_NAMESPACE

    actor = ray.get_actor(running_replica(model)["actor_name"], namespace=SERVE_NAMESPACE)
    ray.kill(actor, no_restart=True)


def complete(url: str, model: str = "tiny", max_tokens: int = 4, **options):
    return client(url).completions.create(
        model=model, prompt="w1 w2 w3", max_tokens=max_tokens, temperature=0, **options
    )


def test_health_follows_a_dead_replica_and_a_cold_start_request_is_served(dayone):
    """Acceptance 3: /health turns 503 within 5 s of `ray.kill` of the model replica and
    200 once the replacement is warm; a completion sent meanwhile waits for the
    replacement instead of getting 503 'overloaded' after the first-token timeout (2 s
    here, shorter than a replica's start)."""
    wait_for(lambda: health(dayone)[0] == 200, 120, "the day-one app is ready")
    kill_replica("tiny")
    killed = time.monotonic()
    wait_for(lambda: health(dayone)[0] == 503, 5, "/health turns 503 after the kill")
    status, body = health(dayone)
    assert status == 503 and "tiny" in body["waiting_for"], body
    answer = complete(dayone)
    assert answer.choices[0].text and answer.usage.completion_tokens == 4
    wait_for(lambda: health(dayone)[0] == 200, 120, "/health back to 200 once warm")
    assert time.monotonic() - killed > 2, "the replacement cannot have started this fast"


def test_a_request_that_cannot_wait_for_a_cold_start_gets_model_loading(dayone):
    """Item 2: a model whose `cold_start_wait_s` (0.5 s) is shorter than its replica's
    start answers 503 `model_loading` with a Retry-After, not 'overloaded'."""
    wait_for(lambda: health(dayone)[0] == 200, 120, "the day-one app is ready")
    kill_replica("impatient")
    wait_for(lambda: "impatient" in health(dayone)[1].get("waiting_for", []), 5, "not ready")
    with pytest.raises(openai.APIStatusError) as refused:
        complete(dayone, model="impatient")
    error = refused.value
    assert error.status_code == 503
    assert error.body["code"] == "model_loading", error.body
    assert int(error.response.headers["Retry-After"]) >= 1
    wait_for(lambda: health(dayone)[0] == 200, 120, "the replacement is warm")
    assert complete(dayone, model="impatient").choices[0].text


def test_a_permanent_step_fault_gets_the_replica_replaced(dayone):
    """Acceptance 4: with `engine.step` armed for good, the replica gives up after its
    restart budget (2), Serve replaces it within 60 s and the app serves again; no
    request hangs meanwhile. A request sent while the replacement starts waits for it
    (the model's `cold_start_wait_s`, as the cold-start test above checks), so each
    request's client timeout runs to the 60 s deadline (and 5 s past it), not beyond:
    a 2-vCPU machine running the suite took 44 s to start the replacement."""
    from ray import serve

    wait_for(lambda: health(dayone)[0] == 200, 120, "the day-one app is ready")
    before = running_replica("tiny")["pid"]
    handle = serve.get_deployment_handle("model-tiny", app_name=APP)
    handle.arm_failpoint.remote("engine.step").result(timeout_s=30)
    deadline = time.monotonic() + 60
    statuses = []
    while time.monotonic() < deadline:
        try:
            client(dayone, timeout=deadline - time.monotonic() + 5).completions.create(
                model="tiny", prompt="w1 w2", max_tokens=2, temperature=0
            )
        except openai.APIStatusError as exc:
            statuses.append(exc.status_code)
            assert exc.status_code == 503, exc.body
            time.sleep(0.5)
            continue
        break
    else:
        pytest.fail(f"no answer within 60 s of arming; statuses {statuses}")
    assert statuses, "the armed fault never failed a request"
    assert running_replica("tiny")["pid"] != before, "served by the poisoned replica"


def test_a_stalled_engine_ends_open_streams_with_an_inter_token_timeout(dayone):
    """Acceptance 4: with `engine.delay` at 10 s per step, an open stream ends with an
    inter-token timeout error event (6 s here) instead of hanging."""
    from ray import serve

    wait_for(lambda: health(dayone)[0] == 200, 120, "the day-one app is ready")
    handle = serve.get_deployment_handle("model-tiny", app_name=APP)
    stream = client(dayone).completions.create(
        model="tiny", prompt="w1 w2", max_tokens=200, temperature=0, stream=True
    )
    chunks = iter(stream)
    next(chunks)
    handle.arm_failpoint.remote("engine.delay", None, None, 10.0).result(timeout_s=30)
    try:
        started = time.monotonic()
        with pytest.raises(openai.APIError, match="inter-token timeout"):
            for _ in chunks:
                pass
        assert time.monotonic() - started < 15
    finally:
        handle.disarm_failpoints.remote().result(timeout_s=60)
    wait_for(lambda: served(dayone), 60, "served again once disarmed (the last slow step ends)")


def served(url: str) -> bool:
    try:
        return bool(complete(url).choices[0].text)
    except openai.APIStatusError as exc:
        assert exc.status_code == 503, exc.body
        return False


def test_a_batch_is_charged_the_sum_of_its_prompts(dayone):
    """Item 5: prompts x n x max_tokens over the tenant's budget (2,000 tokens a minute)
    is refused, although each prompt fits alone; prompts x n over its concurrency limit
    (4) too; and the exact worst case over text prompts, once counted. A tenant of its
    own, so no earlier usage stands in the window."""
    wait_for(lambda: health(dayone)[0] == 200, 120, "the day-one app is ready")
    api = client(dayone, key=BUDGET_KEY)
    cases = [
        ({"prompt": ["w1", "w2"], "n": 2, "max_tokens": 600}, "may generate up to 2400"),
        ({"prompt": ["w1", "w2", "w3"], "n": 2, "max_tokens": 2}, "runs 6 sequences"),
        ({"prompt": ["w5 " * 150, "w6 " * 150], "max_tokens": 900}, "over its prompts"),
    ]
    for options, message in cases:
        with pytest.raises(openai.BadRequestError, match=message):
            api.completions.create(model="tiny", temperature=0, stream=True, **options)
    answer = api.completions.create(model="tiny", prompt=["w1", "w2"], n=2, max_tokens=3)
    assert len(answer.choices) == 4


def _open_and_drop(host: str, port: int, path: str, delay_s: float) -> None:
    body = json.dumps(
        {"model": "tiny", "prompt": "w1 w2", "max_tokens": 50, "stream": True}
    ).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    with socket.create_connection((host, port), timeout=10) as sock:
        sock.sendall(head + body)
        time.sleep(delay_s)


def test_streams_dropped_right_after_sending_release_the_tenants_slots(dayone):
    """Item 8: streams whose clients go away 0-50 ms after sending (many before their
    first chunk) leave nothing in flight: afterwards the tenant still runs its full
    concurrency (4) without a 429 (a leaked slot or reservation would hold one)."""
    wait_for(lambda: health(dayone)[0] == 200, 120, "the day-one app is ready")
    host, port = dayone.split("//")[1].split("/")[0].split(":")
    rng = random.Random(31)
    delays = [rng.uniform(0.0, 0.05) for _ in range(DROPPED_STREAMS)]
    with ThreadPoolExecutor(8) as pool:
        list(
            pool.map(
                lambda d: _open_and_drop(host, int(port), f"{PREFIX}/v1/completions", d), delays
            )
        )
    api = client(dayone)

    def all_four_pass() -> bool:
        results = []

        def one():
            try:
                api.completions.create(model="tiny", prompt="w1", max_tokens=8, temperature=0)
                results.append(200)
            except openai.APIStatusError as exc:
                results.append(exc.status_code)

        threads = [threading.Thread(target=one) for _ in range(LIMITS["max_concurrent_requests"])]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return results == [200] * len(threads)

    # Tokens the dropped streams did use stay booked for a minute (no leak: they ran).
    wait_for(all_four_pass, 90, "the tenant runs 4 at once again", period_s=1.0)


def call(url: str, method: str, path: str, body: dict | None, key: str = ADMIN_KEY):
    """(status, JSON body) of one call with `key`."""
    status, payload, _ = call_with_headers(url, method, path, body, key)
    return status, payload


def call_with_headers(url: str, method: str, path: str, body: dict | None, key: str):
    return api_call(url, key, method, path, body)


def test_tokenize_detokenize_and_adapter_admin_calls_have_rates_of_their_own(
    dayone, serve_setup, base_folder, peft_adapter_factory
):
    """Item 6: the `admin` tenant may make 3 tokenize or detokenize calls and 3 adapter
    admin calls a minute: the 4th of each kind is a 429 in OpenAI error JSON with a
    Retry-After, and neither kind spends the other's rate or its completions."""
    wait_for(lambda: health(dayone)[0] == 200, 120, "the day-one app is ready")
    tokenize = {"model": "tiny", "prompt": "w1 w2"}
    statuses = [call(dayone, "POST", "/v1/tokenize", tokenize)[0] for _ in range(2)]
    statuses.append(call(dayone, "POST", "/v1/detokenize", {"model": "tiny", "tokens": [1]})[0])
    assert statuses == [200, 200, 200]
    status, body = call(dayone, "POST", "/tokenize", tokenize)
    assert status == 429 and "tokenize calls" in body["error"]["message"], body
    assert body["error"]["type"] == "rate_limit_error"

    peft_adapter_factory(base_folder, serve_setup.adapter_root / "admin" / "a1")
    register = {"model": "impatient", "name": "a1", "path": "a1"}
    assert call(dayone, "POST", "/v1/adapters", register)[0] == 201
    assert call(dayone, "POST", "/v1/adapters/impatient/a1/unload", None)[0] == 200
    assert call(dayone, "DELETE", "/v1/adapters/impatient/a1", None)[0] == 200
    status, body = call(dayone, "POST", "/v1/adapters", register)
    assert status == 429 and "adapter admin calls" in body["error"]["message"], body
    answer = client(dayone, key=ADMIN_KEY).completions.create(
        model="tiny", prompt="w1", max_tokens=2, temperature=0
    )
    assert answer.usage.completion_tokens == 2


def test_registration_validates_without_a_model_replica(
    dayone, serve_setup, base_folder, peft_adapter_factory
):
    """Item 6: registration's validation load runs in the ingress, off the model's
    request path: with the model's only replica killed, an adapter registers (and a
    bad one is refused with the reason) while the replacement is still starting."""
    wait_for(lambda: health(dayone)[0] == 200, 120, "the day-one app is ready")
    root = serve_setup.adapter_root / "dayone"
    peft_adapter_factory(base_folder, root / "ok")
    peft_adapter_factory(base_folder, root / "too-big", rank=128)
    kill_replica("impatient")
    wait_for(lambda: "impatient" in health(dayone)[1].get("waiting_for", []), 5, "not ready")
    started = time.monotonic()
    status, body = call(
        dayone, "POST", "/v1/adapters", {"model": "impatient", "name": "ok", "path": "ok"}, KEY
    )
    assert status == 201, body
    status, body = call(
        dayone,
        "POST",
        "/v1/adapters",
        {"model": "impatient", "name": "big", "path": "too-big"},
        KEY,
    )
    assert status == 400 and "rank" in body["error"]["message"], body
    assert time.monotonic() - started < 3
    assert "impatient" in health(dayone)[1].get("waiting_for", []), "replacement already warm"
    wait_for(lambda: health(dayone)[0] == 200, 120, "the replacement is warm")
    answer = client(dayone).completions.create(
        model="impatient:ok", prompt="w1", max_tokens=2, temperature=0
    )
    assert answer.usage.completion_tokens == 2


def test_failpoint_calls_reach_the_replica_they_name(dayone):
    """Item 11: the ingress arms and disarms a failpoint on every running replica, one
    call pinned to each (the router sends a call naming a replica there): over `pair`'s
    two replicas each pinned call lands on its replica, ten times out of ten."""
    from ray import serve
    from ray.serve.context import _get_global_client

    wait_for(lambda: health(dayone)[0] == 200, 120, "the day-one app is ready")
    details = _get_global_client().get_serve_details()
    replicas = details["applications"][APP]["deployments"]["model-pair"]["replicas"]
    ids = [r["replica_id"] for r in replicas if r["state"] == "RUNNING"]
    assert len(ids) == 2, replicas
    handle = serve.get_deployment_handle("model-pair", app_name=APP)
    for _ in range(5):
        for replica in ids:
            armed = handle.arm_failpoint.remote("engine.delay", None, 1, 0.0, replica=replica)
            assert armed.result(timeout_s=30) == replica
            assert handle.disarm_failpoints.remote(replica=replica).result(timeout_s=30) == replica


def test_past_its_bound_the_ingress_refuses_in_openai_json(dayone):
    """Item 11: with its 8 places held by slow streams (`pair` armed with a 0.25 s delay
    per step, so each first token comes well within the 2 s first-token timeout), the
    ingress answers the next request itself: 503 `overloaded` in OpenAI error JSON with
    Retry-After, not the HTTP proxy's plain text; /health still answers; once the
    streams end, requests pass again."""
    from ray import serve
    from ray.serve.context import _get_global_client

    wait_for(lambda: health(dayone)[0] == 200, 120, "the day-one app is ready")
    handle = serve.get_deployment_handle("model-pair", app_name=APP)
    details = _get_global_client().get_serve_details()
    replicas = details["applications"][APP]["deployments"]["model-pair"]["replicas"]
    ids = [r["replica_id"] for r in replicas if r["state"] == "RUNNING"]
    for replica in ids:
        handle.arm_failpoint.remote("engine.delay", None, None, 0.25, replica=replica).result(
            timeout_s=30
        )
    streams = []
    try:
        for key in (KEY, BUDGET_KEY):
            api = client(dayone, key=key)
            for _ in range(INGRESS_BOUND // 2):
                stream = api.completions.create(
                    model="pair", prompt="w1 w2", max_tokens=120, temperature=0, stream=True
                )
                streams.append(stream)
        for stream in streams:
            next(iter(stream))
        status, body, headers = call_with_headers(
            dayone, "POST", "/v1/completions", {"model": "tiny", "prompt": "w1"}, ADMIN_KEY
        )
        assert status == 503, body
        assert int(headers["Retry-After"]) >= 1
        assert body["error"]["code"] == "overloaded", body
        assert "at capacity" in body["error"]["message"], body
        assert health(dayone)[0] == 200
    finally:
        for replica in ids:
            handle.disarm_failpoints.remote(replica=replica).result(timeout_s=60)
        for stream in streams:
            stream.close()
    wait_for(lambda: served(dayone), 60, "served again once the streams ended")


def test_under_overload_the_ingress_refuses_before_calling_the_model(dayone):
    """Item 11 (refusals that cost little): once the ingress measured how fast `tiny`'s
    full batch (8 sequences) empties (`engine.delay` 0.05 s per step: at most 8
    sequences per 3.2 s), a request it could not start within `admission_max_wait_s`
    (1 s) gets 503 `overloaded` with Retry-After from the ingress itself: the model
    replica's own admission refused nothing, and the admitted requests complete."""
    from ray import serve

    wait_for(lambda: health(dayone)[0] == 200, 120, "the day-one app is ready")
    handle = serve.get_deployment_handle("model-tiny", app_name=APP)
    refused_before = handle.replica_info.remote().result(timeout_s=30)["admission_refused"]
    api = client(dayone, key=BULK_KEY)

    def run(max_tokens: int = 64):
        return api.completions.create(
            model="tiny",
            prompt="w1 w2",
            max_tokens=max_tokens,
            n=4,
            temperature=0,
            extra_body={"ignore_eos": True},
        )

    handle.arm_failpoint.remote("engine.delay", None, None, 0.05).result(timeout_s=30)
    try:
        # Two rounds of 8 sequences, each holding the batch full for over 3 s: the
        # departure rate measured, with nothing queued past the 2 s first-token timeout.
        for _ in range(2):
            with ThreadPoolExecutor(2) as pool:
                measured = [f.result() for f in [pool.submit(run) for _ in range(2)]]
            assert all(len(r.choices) == 4 for r in measured)
        with ThreadPoolExecutor(2) as pool:
            running = [pool.submit(run) for _ in range(2)]
            time.sleep(1.0)  # 8 sequences hold the batch: 4 more would wait >= 1.6 s
            started = time.monotonic()
            status, body, headers = call_with_headers(
                dayone,
                "POST",
                "/v1/completions",
                {"model": "tiny", "prompt": "w1", "n": 4, "max_tokens": 48},
                BULK_KEY,
            )
            took = time.monotonic() - started
            admitted = [f.result() for f in running]
    finally:
        handle.disarm_failpoints.remote().result(timeout_s=60)
    assert status == 503, body
    assert body["error"]["code"] == "overloaded" and "at capacity" in body["error"]["message"]
    assert int(headers["Retry-After"]) >= 1 and took < 1.0, (headers, took)
    assert all(len(r.choices) == 4 for r in admitted)
    info = handle.replica_info.remote().result(timeout_s=30)
    assert info["admission_refused"] == refused_before, info


def test_a_folder_whose_tokenizer_class_differs_from_its_model_encodes_text(serve_url, post):
    """Item 13: `tiny-qwen` saves a word-level tokenizer under a Qwen2 config; text must
    encode to its words' ids, not to nothing."""
    status, body = post("/v1/tokenize", {"model": "tiny-qwen", "prompt": "w3 w4 w5"})
    assert status == 200, body
    assert body["count"] >= 3 and body["tokens"][-3:] == [3, 4, 5], body


def test_an_app_without_tenants_refuses_to_start_unless_auth_none_says_so(tiny_model_factory):
    """Item 12: with no `tenants`, every endpoint (adapter registration included) would
    be open to anyone: the app refuses to build unless the config says `auth: none`."""
    from pydantic import ValidationError

    from loraplex.deployments.app import build_app

    models = [{"name": "tiny", "model": str(tiny_model_factory("llama"))}]
    with pytest.raises(ValidationError, match="no tenants are configured"):
        build_app({"models": models})
    with pytest.raises(ValidationError, match="auth: none. with tenants listed"):
        build_app(
            {
                "models": models,
                "auth": "none",
                "tenants": [{"name": "t", "api_key_sha256": [hash_key("k")]}],
            }
        )
    assert build_app({"models": models, "auth": "none"}) is not None


def test_metrics_without_an_operator_key_are_private_unless_public(dayone):
    """Item 12: the day-one app has no operator key and no `metrics_public`: /metrics
    answers 403 in OpenAI error JSON, to tenants and strangers alike."""
    for key in (KEY, None):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        request = urllib.request.Request(f"{dayone}/metrics", headers=headers)
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=30)
        assert refused.value.code == 403
        assert json.loads(refused.value.read())["error"]["code"] == "metrics_private"


def test_a_redeploy_lets_a_stream_in_flight_finish(dayone):
    """Item 9: a stream open while the app is redeployed (a model option changes, so
    Serve replaces the model's replicas and the ingress's) runs to its end on the old
    replicas: 60 tokens at 1 s each, longer than Serve's default graceful shutdown
    (20 s for the ingress, 30 s for a model replica) after the replacement is up."""
    from ray import serve
    from ray.serve.context import _get_global_client

    from loraplex.deployments.app import build_app

    wait_for(lambda: health(dayone)[0] == 200, 120, "the day-one app is ready")
    handle = serve.get_deployment_handle("model-pair", app_name=APP)
    details = _get_global_client().get_serve_details()
    replicas = details["applications"][APP]["deployments"]["model-pair"]["replicas"]
    for replica in [r["replica_id"] for r in replicas if r["state"] == "RUNNING"]:
        handle.arm_failpoint.remote("engine.delay", None, None, 1.0, replica=replica).result(
            timeout_s=30
        )
    stream = client(dayone, timeout=180).completions.create(
        model="pair",
        prompt="w1 w2",
        max_tokens=60,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
        stream_options={"include_usage": True},
    )
    chunks = iter(stream)
    next(chunks)
    config = DEPLOYED["config"]
    models = [
        {**m, "engine": {**m["engine"], "max_num_seqs": 9}} if m["name"] == "pair" else m
        for m in config["models"]
    ]
    redeployed = {**config, "models": models}
    redeploy = threading.Thread(
        target=lambda: serve.run(build_app(redeployed), name=APP, route_prefix=PREFIX)
    )
    redeploy.start()
    finish, usage = None, None
    for chunk in chunks:
        if chunk.choices:
            finish = chunk.choices[0].finish_reason or finish
        usage = chunk.usage or usage
    redeploy.join(timeout=300)
    DEPLOYED["config"] = redeployed
    assert finish == "length" and usage.completion_tokens == 60, (finish, usage)
    after = _get_global_client().get_serve_details()
    new = after["applications"][APP]["deployments"]["model-pair"]["replicas"]
    assert not {r["replica_id"] for r in new} & {r["replica_id"] for r in replicas}, new
    wait_for(lambda: served(dayone), 120, "the redeployed app serves")
