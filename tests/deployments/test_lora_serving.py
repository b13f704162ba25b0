"""Tenants calling LoRA adapters through the real Serve app with the `openai` SDK:
outputs equal the offline engine's, concurrent mixed-adapter streams, aborts free KV
blocks, the admin API, tenant isolation, and /metrics."""

from __future__ import annotations

import shutil
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from http_calls import api_call

from loraplex.platform import LLM, SamplingParams

MAX_NEW = 8
ADMISSION_RETRIES = 5
"""Admission refusals (503 + Retry-After) one request of the 64-stream test may meet."""


@pytest.fixture(scope="module")
def offline(serve_setup):
    """The offline engine with the same base and shared adapters: the expected outputs."""
    llm = LLM(str(serve_setup.base), dtype="float32", max_model_len=128, max_lora_rank=8)
    for name, folder in serve_setup.shared.items():
        llm.register_adapter(name, str(folder))
    return llm


def offline_text(llm: LLM, prompt: list[int], adapter: str | None) -> str:
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW)
    return llm.generate([prompt], params, adapters=[adapter])[0].text


def completion_text(client, model: str, prompt: list[int]) -> str:
    response = client.completions.create(
        model=model, prompt=prompt, max_tokens=MAX_NEW, temperature=0
    )
    return response.choices[0].text


def test_shared_adapters_match_offline_and_differ_from_base(client, offline):
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    texts = {}
    for model, adapter in [("tiny", None), ("tiny:sa", "sa"), ("tiny:sb", "sb"), ("sc", "sc")]:
        texts[model] = completion_text(client, model, prompt)
        assert texts[model] == offline_text(offline, prompt, adapter), model
    assert len(set(texts.values())) == len(texts), "every adapter changes the output"


def test_sixteen_concurrent_mixed_adapter_streams_match_offline(client, offline):
    models = ["tiny", "tiny:sa", "tiny:sb", "tiny:sc"]
    jobs = [(models[i % 4], [7 + i, 2, 9, i % 5 + 1, 4] * (1 + i % 3)) for i in range(16)]

    def stream(job):
        model, prompt = job
        chunks = client.completions.create(
            model=model, prompt=prompt, max_tokens=MAX_NEW, temperature=0, stream=True
        )
        return "".join(c.choices[0].text for c in chunks if c.choices)

    with ThreadPoolExecutor(16) as pool:
        got = list(pool.map(stream, jobs))
    for (model, prompt), text in zip(jobs, got, strict=True):
        adapter = None if model == "tiny" else model.split(":")[1]
        assert text == offline_text(offline, prompt, adapter), (model, prompt)


def wait_idle(model_server, timeout_s: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        info = model_server.replica_info.remote().result()
        if not info["unfinished"] and info["free_blocks"] == info["total_blocks"]:
            return info
        if time.monotonic() > deadline:
            raise AssertionError(f"engine still busy: {info}")
        time.sleep(0.1)


def test_aborted_stream_frees_its_blocks(client, model_server):
    stream = client.completions.create(
        model="tiny:sb",
        prompt=[5] * 20,
        max_tokens=100,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    received = 0
    for _ in stream:
        received += 1
        if received == 2:
            break
    stream.close()
    info = wait_idle(model_server)
    assert info["streams"] == 0


def test_models_listing_is_per_tenant(tenant_client):
    acme = {m.id: m for m in tenant_client("acme").models.list().data}
    assert {"tiny", "tiny-qwen", "tiny:sa", "tiny:sb", "tiny:sc"} <= set(acme)
    assert acme["tiny:sa"].parent == "tiny"
    globex = {m.id for m in tenant_client("globex").models.list().data}
    assert {"tiny", "tiny:sa"} <= globex
    assert not globex & {"tiny-qwen", "tiny:sb", "tiny:sc"}


def install(serve_setup, peft_adapter_factory, tenant: str, folder: str, **options):
    """Puts a real PEFT adapter into a tenant's folder under the adapter root."""
    path = serve_setup.adapter_root / tenant / folder
    if path.exists():
        shutil.rmtree(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return peft_adapter_factory(serve_setup.base, path, **options)


def admin(serve_url: str, key: str, method: str, path: str, body: dict | None = None):
    status, payload, _ = api_call(serve_url, key, method, path, body)
    return status, payload


def test_admin_api_register_call_unload_delete(
    serve_setup, tenant_client, tenant_keys, peft_adapter_factory, offline
):
    url, key = serve_setup.url, tenant_keys["acme"]
    folder = install(serve_setup, peft_adapter_factory, "acme", "v1/mine", rank=8, seed=21)
    status, card = admin(
        url, key, "POST", "/v1/adapters", {"model": "tiny", "name": "mine", "path": "v1/mine"}
    )
    assert status == 201 and card["id"] == "tiny:mine", card
    listed = admin(url, key, "GET", "/v1/adapters")[1]["data"]
    assert "tiny:mine" in {entry["id"] for entry in listed}, listed
    client = tenant_client("acme")
    prompt = [8, 6, 7, 5, 3, 0, 9]
    assert "tiny:mine" in {m.id for m in client.models.list().data}
    first = completion_text(client, "tiny:mine", prompt)
    assert first == offline_text(offline, prompt, str(folder))

    # New weights under the same name: unload drops stale copies; new outputs follow.
    install(serve_setup, peft_adapter_factory, "acme", "v1/mine", rank=8, seed=22)
    status, unloaded = admin(url, key, "POST", "/v1/adapters/tiny/mine/unload")
    assert status == 200 and unloaded["version"] > card["version"]
    second = completion_text(client, "mine", prompt)
    assert second == offline_text(offline, prompt, str(folder)) and second != first

    status, _ = admin(url, key, "DELETE", "/v1/adapters/tiny/mine")
    assert status == 200
    with pytest.raises(openai.NotFoundError):
        completion_text(client, "tiny:mine", prompt)
    assert admin(url, key, "DELETE", "/v1/adapters/tiny/mine")[0] == 404


@pytest.mark.parametrize(
    "body, status, message",
    [
        ({"model": "tiny", "name": "x", "path": "../globex/secret"}, 400, "leaves your"),
        ({"model": "tiny", "name": "x", "path": "/etc"}, 400, "must be relative"),
        ({"model": "tiny", "name": "x", "path": "nowhere"}, 400, "not a directory"),
        ({"model": "tiny", "name": "../x", "path": "v1"}, 400, "adapter name"),
        ({"model": "nope", "name": "x", "path": "v1"}, 404, "does not exist"),
        ({"model": "tiny", "name": "x", "path": "big"}, 400, "exceeds max_lora_rank 8"),
        ({"model": "tiny", "name": "x"}, 400, "path"),
    ],
)
def test_admin_api_refuses_bad_registrations(
    serve_setup, tenant_keys, peft_adapter_factory, body, status, message
):
    install(serve_setup, peft_adapter_factory, "acme", "big", rank=16, seed=3)
    install(serve_setup, peft_adapter_factory, "globex", "secret", seed=4)
    got_status, payload = admin(serve_setup.url, tenant_keys["acme"], "POST", "/v1/adapters", body)
    assert got_status == status, payload
    assert message in payload["error"]["message"]


def test_tenants_cannot_reach_each_others_adapters(
    serve_setup, tenant_client, tenant_keys, peft_adapter_factory
):
    url = serve_setup.url
    install(serve_setup, peft_adapter_factory, "globex", "secret", seed=4)
    status, _ = admin(
        url,
        tenant_keys["globex"],
        "POST",
        "/v1/adapters",
        {"model": "tiny", "name": "secret", "path": "secret"},
    )
    assert status == 201
    acme = tenant_client("acme")
    prompt = [1, 2, 3]
    assert completion_text(tenant_client("globex"), "tiny:secret", prompt)
    # Calling, probing, listing, unloading or deleting it as acme: as if it did not exist.
    for model in ("tiny:secret", "secret"):
        with pytest.raises(openai.NotFoundError) as error:
            completion_text(acme, model, prompt)
        assert error.value.body["message"] == f"model {model!r} does not exist"
    assert "tiny:secret" not in {m.id for m in acme.models.list().data}
    assert all(
        a["name"] != "secret"
        for a in admin(url, tenant_keys["acme"], "GET", "/v1/adapters")[1]["data"]
    )
    assert admin(url, tenant_keys["acme"], "POST", "/v1/adapters/tiny/secret/unload")[0] == 404
    assert admin(url, tenant_keys["acme"], "DELETE", "/v1/adapters/tiny/secret")[0] == 404
    # Shared adapters outside a tenant's ACL are forbidden, not hidden.
    with pytest.raises(openai.PermissionDeniedError):
        completion_text(tenant_client("globex"), "tiny:sb", prompt)
    with pytest.raises(openai.PermissionDeniedError):
        completion_text(tenant_client("globex"), "tiny-qwen", prompt)


def test_metrics_endpoint_exposes_engine_adapter_and_tenant_metrics(
    serve_url, client, operator_key
):
    completion_text(client, "tiny:sa", [4, 4, 4])
    wanted = [
        "vllm:num_requests_running{",
        "vllm:kv_cache_usage_perc{",
        "vllm:time_to_first_token_seconds_bucket{",
        "vllm:e2e_request_latency_seconds_count{",
        "vllm:generation_tokens_total{",
        "vllm:prefix_cache_queries_total{",
        'loraplex_adapter_requests_total{adapter="tiny:sa"',
        'loraplex_tenant_requests_total{status="200",tenant="acme"}',
        "loraplex_resident_adapters{",
        "loraplex_adapter_load_seconds_count{",
        # The call's later steps and its end came in a frame (deployments/wire.py).
        "loraplex_ingress_frames_total{",
        "loraplex_ingress_frame_entries_total{",
    ]
    deadline = time.monotonic() + 60
    while True:
        scrape = urllib.request.Request(
            f"{serve_url}/metrics", headers={"Authorization": f"Bearer {operator_key}"}
        )
        with urllib.request.urlopen(scrape, timeout=30) as response:
            text = response.read().decode()
        missing = [w for w in wanted if w not in text]
        if not missing:
            break
        if time.monotonic() > deadline:
            raise AssertionError(f"missing from /metrics: {missing}")
        time.sleep(2)
    assert "ray_" not in text and "SessionName" not in text


def test_sixty_four_concurrent_streams_with_disconnects_lose_and_duplicate_nothing(
    serve_url, tenant_keys, offline, model_server
):
    """64 streams at once over the base model and three adapters (the replica runs 16 at
    a time, the rest queue), a seeded quarter of them dropped by the client after their
    first chunk: every other stream's text equals the offline engine's token for token,
    its chunks add up to its usage count (nothing lost or sent twice by the engine's
    coalescing of outputs a slow consumer has not read, nor by stream coalescing: the
    app streams 4 messages per step, so 16 running requests yield every 4th step), and
    every block comes back. A request the replica refuses at admission (503 with
    Retry-After: its estimated wait crossed the app's limit, as it can while the other
    test worker loads the machine) is sent again after the wait it names, as a client
    should; any other error fails the test."""
    import asyncio
    import random

    models = ["tiny", "tiny:sa", "tiny:sb", "tiny:sc"]
    rng = random.Random(64)
    jobs = [
        (models[i % 4], [rng.randrange(1, 500) for _ in range(4 + i % 9)], rng.random() < 0.25)
        for i in range(64)
    ]

    async def run_all() -> list[tuple[str, int, int] | None]:
        client = openai.AsyncOpenAI(
            base_url=f"{serve_url}/v1", api_key=tenant_keys["acme"], max_retries=0, timeout=300
        )

        async def create(model: str, prompt: list[int]):
            for _ in range(ADMISSION_RETRIES):
                try:
                    return await client.completions.create(
                        model=model,
                        prompt=prompt,
                        max_tokens=MAX_NEW,
                        temperature=0,
                        stream=True,
                        stream_options={"include_usage": True},
                    )
                except openai.InternalServerError as error:
                    if error.status_code != 503 or "at capacity" not in str(error):
                        raise
                    await asyncio.sleep(float(error.response.headers["retry-after"]))
            raise AssertionError(f"refused {ADMISSION_RETRIES} times at admission")

        async def one(model: str, prompt: list[int], drop: bool):
            stream = await create(model, prompt)
            text, chunks, usage = "", 0, 0
            async for chunk in stream:
                if chunk.usage is not None:
                    usage = chunk.usage.completion_tokens
                if chunk.choices and chunk.choices[0].text:
                    text += chunk.choices[0].text
                    chunks += 1
                    if drop:
                        await stream.close()
                        return None
            return text, chunks, usage

        try:
            return await asyncio.gather(*(one(*job) for job in jobs))
        finally:
            await client.close()

    results = asyncio.run(run_all())
    for (model, prompt, drop), result in zip(jobs, results, strict=True):
        if drop:
            assert result is None
            continue
        text, chunks, usage = result
        adapter = None if model == "tiny" else model.split(":")[1]
        assert text == offline_text(offline, prompt, adapter), (model, prompt)
        assert usage == MAX_NEW and 1 <= chunks <= MAX_NEW
    assert sum(drop for *_, drop in jobs) >= 8
    info = wait_idle(model_server)
    assert info["streams"] == 0
