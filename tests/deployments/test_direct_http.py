"""The ingress serving HTTP itself (`ingress.direct_http_port`, deployments/direct_http.py)
in a real Serve app of its own beside the session's: the official OpenAI SDK gets the
same greedy answers on the replica's own port as through Serve's proxy, streamed and
not, and a client that leaves mid-stream on that port has its request aborted (the
model replica's KV blocks come back)."""

from __future__ import annotations

import json
import socket
import time

import httpx
import openai
import pytest

APP, PREFIX = "direct", "/direct"
PROMPT = [5, 9, 13, 2, 7]


@pytest.fixture(scope="module")
def direct_app(serve_setup, pick_port):
    """(the proxy's base URL, the ingress's own base URL, the model's handle)."""
    from ray import serve

    from loraplex.deployments.app import build_app

    port = pick_port()
    config = {
        "auth": "none",
        "models": [
            {
                "name": "tiny-direct",
                "model": str(serve_setup.base),
                "engine": {
                    "dtype": "float32",
                    "max_model_len": 256,
                    "max_loras": 0,
                    "kv_cache_memory_bytes": 1 << 26,
                },
                "server": {"num_cpus": 0.05},
                "fault_injection": True,
            }
        ],
        "ingress": {"num_cpus": 0.05, "direct_http_port": port},
    }
    serve.run(build_app(config), name=APP, route_prefix=PREFIX)
    handle = serve.get_deployment_handle("model-tiny-direct", app_name=APP)
    yield f"{serve_setup.url}{PREFIX}", f"http://127.0.0.1:{port}", handle
    serve.delete(APP)


def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=60)


def test_the_ingress_port_answers_as_the_proxy_does(direct_app):
    proxied, direct, _ = direct_app
    answers = []
    for base_url in (proxied, direct):
        reply = client(base_url).completions.create(
            model="tiny-direct", prompt=PROMPT, max_tokens=12, temperature=0
        )
        stream = client(base_url).completions.create(
            model="tiny-direct",
            prompt=PROMPT,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(stream)
        streamed = "".join(c.choices[0].text for c in chunks if c.choices)
        assert chunks[-1].usage.completion_tokens == 12
        answers.append((reply.choices[0].text, streamed))
    assert answers[0] == answers[1]
    assert answers[0][0] == answers[0][1]
    with httpx.Client() as http:
        assert http.get(f"{direct}/health", timeout=30).status_code == 200
        models = http.get(f"{direct}/v1/models", timeout=30).json()
    assert [m["id"] for m in models["data"]] == ["tiny-direct"]


def test_a_client_leaving_mid_stream_on_the_ingress_port_aborts_its_request(direct_app):
    """Steps slowed to 50 ms: the 240 tokens would take 12 s, the abort frees the
    request's blocks within a few."""
    _, direct, handle = direct_app
    handle.arm_failpoint.remote("engine.delay", delay_s=0.05).result()
    body = {
        "model": "tiny-direct",
        "prompt": PROMPT,
        "max_tokens": 240,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    try:
        with httpx.Client(timeout=60) as http:
            with http.stream("POST", f"{direct}/v1/completions", json=body) as response:
                assert response.status_code == 200
                lines = response.iter_lines()
                assert next(lines).startswith("data: ")
                assert handle.replica_info.remote().result()["streams"] == 1
        left = time.monotonic()
        while True:
            info = handle.replica_info.remote().result()
            if info["streams"] == 0 and info["block_refs"] == 0:
                break
            assert time.monotonic() - left < 5, info
            time.sleep(0.1)
    finally:
        handle.disarm_failpoints.remote().result()


def test_a_body_past_the_limit_gets_413_unread_on_the_ingress_port(direct_app):
    """No proxy refuses it first: a request announcing 64 MiB gets 413 in OpenAI error
    JSON with none of its body sent, and one that sends 1.5 MiB in chunks, without a
    length, gets it too."""
    _, direct, _ = direct_app
    host, port = direct.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as connection:
        connection.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 67108864\r\n\r\n"
        )
        reply = connection.makefile("rb")
        status = reply.readline()
        headers = {}
        while (line := reply.readline().strip()) != b"":
            name, _, value = line.partition(b":")
            headers[name.strip().lower()] = value.strip()
        body = reply.read(int(headers[b"content-length"]))
    assert status.startswith(b"HTTP/1.1 413"), status
    assert json.loads(body)["error"]["message"], body
    sent = json.dumps({"model": "tiny-direct", "prompt": "w1 " * 500_000}).encode()
    chunks = (sent[i : i + 65536] for i in range(0, len(sent), 65536))
    with httpx.Client(timeout=30) as http:
        response = http.post(f"{direct}/v1/completions", content=chunks)
    assert response.status_code == 413
    assert response.json()["error"]["message"]


def test_an_idle_server_ticks_once_a_second_refreshes_its_date_and_stops_at_once(pick_port):
    """Off Ray: the ingress's own HTTP server wakes once a second while idle (uvicorn's
    loop woke ten times), still refreshes its Date header, and `aclose` returns without
    waiting for the next tick."""
    import asyncio

    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route

    from loraplex.deployments.direct_http import DirectHTTP

    async def hello(_):
        return PlainTextResponse("ok")

    async def main() -> tuple[int, list[str], float]:
        port = pick_port()
        server = DirectHTTP(Starlette(routes=[Route("/", hello)]), "127.0.0.1", port, 5.0)
        ticks = 0
        on_tick = server._server.on_tick

        async def counted(counter: int) -> bool:
            nonlocal ticks
            ticks += 1
            return await on_tick(counter)

        server._server.on_tick = counted
        dates = []
        async with httpx.AsyncClient() as http:
            for _ in range(50):
                try:
                    reply = await http.get(f"http://127.0.0.1:{port}/", timeout=5)
                    break
                except httpx.ConnectError:
                    await asyncio.sleep(0.05)
            assert reply.text == "ok"
            dates.append(reply.headers["date"])
            before = ticks
            await asyncio.sleep(2.5)
            idle_ticks = ticks - before
            dates.append((await http.get(f"http://127.0.0.1:{port}/", timeout=5)).headers["date"])
        started = time.monotonic()
        await server.aclose()
        return idle_ticks, dates, time.monotonic() - started

    idle_ticks, dates, close_s = asyncio.run(main())
    assert 1 <= idle_ticks <= 4, idle_ticks
    assert dates[0] != dates[1], dates
    assert close_s < 0.5, close_s
