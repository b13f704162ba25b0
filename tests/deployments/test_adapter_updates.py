"""In-place updates of one adapter under load, through the session's Serve app: 100
`PUT /v1/adapters/{model}/{name}` while 32 streams run on it, on the base model and on a
shared adapter. No request is lost, every answer comes entirely from one version (four
adapter versions with distinct greedy outputs, cycled), and no answer reuses another
version's prefix-cache blocks (the prompt spans several blocks, and cache hits are
seen)."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time

import openai
import pytest
from http_calls import api_call

VERSIONS = 4
UPDATES = 100
STREAMS = 32
PROMPT = list(range(5, 5 + 40))
"""Two full 16-token KV blocks and part of a third: prefix-cache hits are likely."""
TOKENS = 10
LIVE_ANSWER_WAIT_S = 60


@pytest.fixture(scope="module")
def versions(serve_setup, peft_adapter_factory, tenant_keys):
    """Folder names (under acme's root) of the versions, and each one's greedy answer,
    from the adapter registered alone under a name of its own."""
    root = serve_setup.adapter_root / "acme"
    folders = []
    for seed in range(VERSIONS):
        name = f"fingerprint-v{seed}"
        peft_adapter_factory(serve_setup.base, root / name, rank=8, seed=100 + seed, std=0.4)
        folders.append(name)
    answers = []
    key = tenant_keys["acme"]
    for name in folders:
        body = {"model": "tiny", "name": f"ref-{name}", "path": name}
        status, answer, _ = api_call(serve_setup.url, key, "POST", "/v1/adapters", body)
        assert status == 201, answer
        answers.append(complete(serve_setup.url, key, f"tiny:ref-{name}")[0])
        api_call(serve_setup.url, key, "DELETE", f"/v1/adapters/tiny/ref-{name}")
    assert len(set(answers)) == VERSIONS, "the versions must answer apart"
    return folders, answers


def complete(url: str, key: str, model: str) -> tuple[str, int]:
    """(streamed text, cached prompt tokens) of one greedy completion."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=120)
    stream = client.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    text, cached = "", 0
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].text
        if chunk.usage is not None:
            details = chunk.usage.prompt_tokens_details
            cached = details.cached_tokens if details else 0
    return text, cached


def test_100_updates_under_32_streams_lose_nothing_and_never_mix_versions(
    serve_setup, versions, tenant_keys
):
    folders, answers = versions
    url, key = serve_setup.url, tenant_keys["acme"]
    body = {"model": "tiny", "name": "live", "path": folders[0]}
    assert api_call(url, key, "POST", "/v1/adapters", body)[0] == 201
    others = {model: complete(url, key, model)[0] for model in ("tiny", "tiny:sa")}
    stop = threading.Event()
    results: list[tuple[str, str, int]] = []
    errors: list[BaseException] = []

    refusals: list[str] = []
    live_answered = threading.Semaphore(0)
    """Released once per answer on the updated adapter: each update waits for one, so
    the updates are spread over the streams' answers on a fast machine or a slow one."""

    def stream(model: str) -> None:
        """Streams until stopped; a 503 `overloaded` (admission refusing what it could
        not start in time: an answer, not a loss) is retried after its Retry-After."""
        while not stop.is_set():
            try:
                text, cached = complete(url, key, model)
            except openai.APIStatusError as exc:
                if exc.status_code != 503 or exc.code != "overloaded":
                    errors.append(exc)
                    return
                refusals.append(model)
                time.sleep(min(float(exc.response.headers.get("retry-after", 1)), 2.0))
                continue
            except BaseException as exc:
                errors.append(exc)
                return
            results.append((model, text, cached))
            if model == "tiny:live":
                live_answered.release()

    models = ["tiny:live"] * (STREAMS // 2) + ["tiny", "tiny:sa"] * (STREAMS // 4)
    threads = [threading.Thread(target=stream, args=(m,)) for m in models]
    for thread in threads:
        thread.start()
    try:
        for update, folder in zip(range(UPDATES), itertools.cycle(folders[1:] + folders[:1])):
            status, card, _ = api_call(url, key, "PUT", "/v1/adapters/tiny/live", {"path": folder})
            assert status == 200, (update, card)
            assert live_answered.acquire(timeout=LIVE_ANSWER_WAIT_S), (
                f"no answer on the adapter within {LIVE_ANSWER_WAIT_S} s of update {update}"
            )
    finally:
        stop.set()
        for thread in threads:
            thread.join(120)
    assert not errors, errors[:3]
    logging.getLogger(__name__).warning(
        "%d answers, %d refusals for load (retried)", len(results), len(refusals)
    )
    live = [(text, cached) for model, text, cached in results if model == "tiny:live"]
    assert len(live) >= UPDATES, "an answer on the adapter after every update"
    for text, _ in live:
        assert text in answers, f"an answer from no single version: {text!r}"
    assert len({text for text, _ in live}) > 1, "answers came from several versions"
    assert any(cached for _, cached in live), "prefix-cache hits happened"
    for model, text, _ in results:
        if model != "tiny:live":
            assert text == others[model], model
    api_call(url, key, "DELETE", "/v1/adapters/tiny/live")


def test_a_call_for_a_replaced_version_is_told_so_by_the_replica(
    serve_setup, versions, model_server, tenant_keys
):
    """A version the catalog no longer holds, and the replica never loaded, comes back
    as `adapter_replaced` (the ingress then resends the call with the current one)."""
    from loraplex.deployments.wire import ADAPTER_REPLACED, GenerateCall, GenerateError
    from loraplex.platform.request import SamplingParams

    folders, _ = versions
    url, key = serve_setup.url, tenant_keys["acme"]
    body = {"model": "tiny", "name": "moved", "path": folders[0]}
    status, card, _ = api_call(url, key, "POST", "/v1/adapters", body)
    assert status == 201, card
    stale = f"acme/moved@{card['version'] - 1}"
    call = GenerateCall("replaced-1", SamplingParams(max_tokens=2), prompt=[1, 2, 3])
    handle = model_server.options(stream=True, multiplexed_model_id=stale)
    first = next(iter(handle.generate.remote(call)))
    assert isinstance(first, GenerateError) and first.code == ADAPTER_REPLACED, first
    current = model_server.options(
        stream=True, multiplexed_model_id=f"acme/moved@{card['version']}"
    )
    steps = list(current.generate.remote(dataclasses.replace(call, request_id="replaced-2")))
    assert not isinstance(steps[0], GenerateError) and steps[-1].deltas[-1].finish_reason
    api_call(url, key, "DELETE", "/v1/adapters/tiny/moved")
