"""No tenant can take a model down for everyone, through the real Serve app.

Every attack below runs while another tenant streams on the same replica (each engine
step slowed to 30 ms, so the two surely overlap); that stream must finish normally,
and the replica must be the same one afterwards (no replacement, no engine restart).
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import threading
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import openai
import pytest
import torch
from fuzz_strategies import ANY_NUMBER, COMPLETION_BODY
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import load_file, save_file

BACKGROUND_TOKENS = 100
STEP_DELAY_S = 0.03


def call(url: str, method: str, path: str, key: str | None, body: bytes | dict | None = None):
    """(status, JSON body) of one HTTP call; `body` bytes go out as they are."""
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    request = urllib.request.Request(f"{url}{path}", data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


@pytest.fixture
def replica(model_server):
    """The `tiny` replica's identity before the test; after it: the same replica and
    engine (no restart), healthy, every failpoint disarmed."""
    before = model_server.replica_info.remote().result()
    yield before
    model_server.disarm_failpoints.remote().result()
    after = model_server.replica_info.remote().result()
    assert (after["replica"], after["pid"]) == (before["replica"], before["pid"])
    assert after["engine_restarts"] == before["engine_restarts"]


@pytest.fixture
def other_tenant_streaming(model_server, tenant_client):
    """Context manager: globex streams BACKGROUND_TOKENS tokens while the body runs."""

    @contextmanager
    def streaming():
        model_server.arm_failpoint.remote("engine.delay", delay_s=STEP_DELAY_S).result()
        client = tenant_client("globex")
        started = threading.Event()
        result: dict = {}

        def consume():
            try:
                stream = client.completions.create(
                    model="tiny",
                    prompt=[5, 6, 7],
                    max_tokens=BACKGROUND_TOKENS,
                    temperature=0,
                    stream=True,
                    stream_options={"include_usage": True},
                    extra_body={"ignore_eos": True},
                )
                chunks = []
                for chunk in stream:
                    started.set()
                    chunks.append(chunk)
                result["chunks"] = chunks
            except Exception as exc:
                result["error"] = exc
            finally:
                started.set()

        thread = threading.Thread(target=consume, daemon=True)
        thread.start()
        assert started.wait(60), "the other tenant's stream never started"
        try:
            yield
            assert thread.is_alive(), "the other stream ended before the attack was over"
        finally:
            thread.join(timeout=120)
            model_server.disarm_failpoints.remote().result()
        assert "error" not in result, result.get("error")
        chunks = result["chunks"]
        assert chunks[-1].usage.completion_tokens == BACKGROUND_TOKENS
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"

    return streaming


def tenant_folder(serve_setup, tenant: str, name: str, source: Path | None = None) -> Path:
    """A fresh copy of a real PEFT adapter (shared adapter `sa`) under a tenant's root."""
    folder = serve_setup.adapter_root / tenant / name
    if folder.exists() or folder.is_symlink():
        shutil.rmtree(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(source or serve_setup.shared["sa"], folder)
    return folder


def register(url: str, key: str, name: str, path: str) -> tuple[int, dict]:
    return call(url, "POST", "/v1/adapters", key, {"model": "tiny", "name": name, "path": path})


def complete(url: str, key: str, model: str, prompt: list[int], **fields) -> tuple[int, dict]:
    body = {"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0, **fields}
    return call(url, "POST", "/v1/completions", key, body)


# ---- acceptance 1: each attack refused while another tenant streams ------------------
@pytest.mark.parametrize(
    "raw",
    [
        b'{"model": "tiny", "prompt": [1, 2], "top_k": 9223372036854775808}',
        b'{"model": "tiny", "prompt": [1, 2], "top_k": 513}',
        b'{"model": "tiny", "prompt": [1, 2], "seed": 9223372036854775808}',
        b'{"model": "tiny", "prompt": [1, 2], "temperature": NaN}',
        b'{"model": "tiny", "prompt": [1, 2], "presence_penalty": -Infinity}',
        b'{"model": "tiny", "prompt": [1, 2], "max_tokens": 1e400}',
        b'{"model": "tiny", "prompt": [1, 2], "max_tokens": 99999999999}',
    ],
)
def test_values_the_engine_cannot_represent_are_400(
    serve_url, tenant_keys, replica, other_tenant_streaming, raw
):
    with other_tenant_streaming():
        status, payload = call(serve_url, "POST", "/v1/completions", tenant_keys["acme"], raw)
    assert status == 400, payload
    assert payload["error"]["type"] == "invalid_request_error"


def test_extreme_but_valid_seeds_are_served(serve_url, tenant_keys, replica):
    for seed in (-(2**63), 2**63 - 1, 0):
        status, payload = complete(
            serve_url, tenant_keys["acme"], "tiny", [1, 2], temperature=1.0, seed=seed, n=2
        )
        assert status == 200, payload


def test_infinite_alpha_adapter_is_refused_at_registration(
    serve_setup, serve_url, tenant_keys, replica, other_tenant_streaming
):
    folder = tenant_folder(serve_setup, "acme", "inf-alpha")
    config = json.loads((folder / "adapter_config.json").read_text())
    text = json.dumps({**config, "lora_alpha": "ALPHA"}).replace('"ALPHA"', "1e400")
    (folder / "adapter_config.json").write_text(text)
    with other_tenant_streaming():
        status, payload = register(serve_url, tenant_keys["acme"], "inf-alpha", "inf-alpha")
    assert status == 400, payload
    assert "adapter rejected" in payload["error"]["message"]


def test_an_adapter_whose_outputs_overflow_fails_only_its_own_request(
    serve_setup, serve_url, tenant_keys, replica, other_tenant_streaming
):
    folder = tenant_folder(serve_setup, "acme", "blowup")
    weights = load_file(folder / "adapter_model.safetensors")
    huge = {name: torch.full_like(tensor, 1e19) for name, tensor in weights.items()}
    save_file(huge, folder / "adapter_model.safetensors")
    key = tenant_keys["acme"]
    assert register(serve_url, key, "blowup", "blowup")[0] == 201, "finite weights pass"
    with other_tenant_streaming():
        status, payload = complete(serve_url, key, "tiny:blowup", [3, 4, 5])
        assert status == 400, payload
        assert "non-finite" in payload["error"]["message"]
        assert complete(serve_url, key, "tiny", [3, 4, 5])[0] == 200


def test_a_backtracking_regex_pattern_is_refused_fast_with_health_answering(
    serve_setup, serve_url, tenant_keys, replica, other_tenant_streaming
):
    folder = tenant_folder(serve_setup, "acme", "regex-bomb")
    config = json.loads((folder / "adapter_config.json").read_text())
    config["rank_pattern"] = {"(.*.*)*!" + "a" * 40: 4}
    config["alpha_pattern"] = {"(a|aa)*$" * 8: 8}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    health: list[float] = []
    done = threading.Event()

    def poll_health():
        while not done.is_set():
            started = time.monotonic()
            with urllib.request.urlopen(f"{serve_url}/health", timeout=10) as response:
                assert response.status == 200
            health.append(time.monotonic() - started)
            time.sleep(0.05)

    poller = threading.Thread(target=poll_health, daemon=True)
    poller.start()
    with other_tenant_streaming():
        started = time.monotonic()
        status, payload = register(serve_url, tenant_keys["acme"], "regex-bomb", "regex-bomb")
        elapsed = time.monotonic() - started
    done.set()
    poller.join(timeout=15)
    assert status == 400, payload
    assert "regular expressions" in payload["error"]["message"]
    assert elapsed < 1.0
    assert health and max(health) < 1.0


def _peak_rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


@pytest.mark.parametrize("bomb", ["trailing", "declared"])
def test_an_oversized_safetensors_is_refused_without_reading_it(
    serve_setup, serve_url, tenant_keys, replica, other_tenant_streaming, bomb
):
    folder = tenant_folder(serve_setup, "acme", f"bomb-{bomb}")
    weights = folder / "adapter_model.safetensors"
    size = 3 << 30
    if bomb == "trailing":
        with open(weights, "r+b") as out:  # a valid file with 3 GiB of sparse garbage
            out.truncate(weights.stat().st_size + size)
    else:  # a header declaring one [rows, 64] tensor of 3 GiB, data sparse
        rows = size // (64 * 4)
        name = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
        header = {name: {"dtype": "F32", "shape": [rows, 64], "data_offsets": [0, rows * 256]}}
        encoded = json.dumps(header).encode()
        with open(weights, "wb") as out:
            out.write(struct.pack("<Q", len(encoded)) + encoded)
            out.truncate(8 + len(encoded) + rows * 256)
    pid = replica["pid"]
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # resets the peak RSS (VmHWM)
    baseline = _peak_rss_bytes(pid)
    with other_tenant_streaming():
        status, payload = register(serve_url, tenant_keys["acme"], f"bomb-{bomb}", f"bomb-{bomb}")
    grown = _peak_rss_bytes(pid) - baseline
    assert status == 400, payload
    assert grown < 256 << 20, f"the replica's peak RSS rose by {grown >> 20} MiB"
    os.remove(weights)


def test_a_symlink_swapped_in_after_registration_is_refused_at_load(
    serve_setup, serve_url, tenant_keys, replica, other_tenant_streaming
):
    key = tenant_keys["acme"]
    secret = tenant_folder(serve_setup, "globex", "secret-weights", serve_setup.shared["sb"])
    inside = tenant_folder(serve_setup, "acme", "own-other")
    for target in (secret, inside):
        folder = tenant_folder(serve_setup, "acme", "swap")
        assert register(serve_url, key, "swap", "swap")[0] == 201
        assert complete(serve_url, key, "tiny:swap", [6, 7])[0] == 200
        weights = folder / "adapter_model.safetensors"
        weights.unlink()
        weights.symlink_to(target / "adapter_model.safetensors")
        assert call(serve_url, "POST", "/v1/adapters/tiny/swap/unload", key)[0] == 200
        with other_tenant_streaming():
            status, payload = complete(serve_url, key, "tiny:swap", [6, 7])
        assert status == 400, payload
        assert "link" in payload["error"]["message"]
    assert call(serve_url, "DELETE", "/v1/adapters/tiny/swap", key)[0] == 200


def test_unload_rereads_an_adapter_rewritten_with_the_same_size_and_mtime(
    serve_setup, serve_url, tenant_keys, replica
):
    key = tenant_keys["acme"]
    folder = tenant_folder(serve_setup, "acme", "rewritten")
    assert register(serve_url, key, "rewritten", "rewritten")[0] == 201
    prompt = [8, 9, 10, 11]
    before = complete(serve_url, key, "tiny:rewritten", prompt, max_tokens=8)[1]
    weights = folder / "adapter_model.safetensors"
    stat = weights.stat()
    tensors = load_file(weights)
    with safe_open(weights, framework="pt") as original:
        metadata = original.metadata()
    save_file({k: (v * -3.0).contiguous() for k, v in tensors.items()}, weights, metadata)
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert weights.stat().st_size == stat.st_size
    pinned = complete(serve_url, key, "tiny:rewritten", prompt, max_tokens=8)[1]
    assert pinned["choices"][0]["text"] == before["choices"][0]["text"], "pinned per version"
    assert call(serve_url, "POST", "/v1/adapters/tiny/rewritten/unload", key)[0] == 200
    after = complete(serve_url, key, "tiny:rewritten", prompt, max_tokens=8)[1]
    tenant_folder(serve_setup, "acme", "fresh", folder)
    assert register(serve_url, key, "fresh", "fresh")[0] == 201
    fresh = complete(serve_url, key, "tiny:fresh", prompt, max_tokens=8)[1]
    assert after["choices"][0]["text"] == fresh["choices"][0]["text"]
    assert after["choices"][0]["text"] != before["choices"][0]["text"]
    for name in ("rewritten", "fresh"):
        call(serve_url, "DELETE", f"/v1/adapters/tiny/{name}", key)


# ---- acceptance 3: injected faults ------------------------------------------------------
def test_a_fault_in_one_requests_sampling_ends_only_that_request(
    serve_url, tenant_keys, model_server, replica, other_tenant_streaming
):
    poison = [9, 9, 9, 9, 9, 9]
    with other_tenant_streaming():
        model_server.arm_failpoint.remote("sampler.row", prompt=poison).result()
        status, payload = complete(serve_url, tenant_keys["acme"], "tiny", poison)
        assert status == 500, payload
        assert payload["error"]["type"] == "server_error"
        assert "sampling failed" in payload["error"]["message"]
        assert complete(serve_url, tenant_keys["acme"], "tiny", [9, 9, 9])[0] == 200


def test_a_shared_state_fault_restarts_the_engine_in_place(
    serve_url, tenant_keys, model_server, client
):
    before = model_server.replica_info.remote().result()
    model_server.arm_failpoint.remote("engine.step", times=1).result()
    with pytest.raises(openai.APIStatusError) as error:
        client.completions.create(model="tiny", prompt=[4, 2], max_tokens=4)
    assert error.value.status_code == 503
    assert error.value.response.headers["retry-after"] == "1"
    failed_at = time.monotonic()
    while True:
        try:
            client.completions.create(model="tiny", prompt=[4, 2], max_tokens=4)
            break
        except openai.APIError:
            assert time.monotonic() - failed_at < 10, "not serving again within 10 s"
            time.sleep(0.2)
    assert time.monotonic() - failed_at < 10
    after = model_server.replica_info.remote().result()
    assert (after["replica"], after["pid"]) == (before["replica"], before["pid"])
    assert after["engine_restarts"] == before["engine_restarts"] + 1
    assert after["free_blocks"] == after["total_blocks"]


# ---- acceptance 4: operator surfaces ------------------------------------------------------
def test_failpoints_are_the_operators_and_only_where_the_config_allows(
    serve_url, tenant_keys, operator_key
):
    path = "/v1/admin/failpoints"
    delay = {"model": "tiny", "name": "engine.delay", "times": 1, "delay_s": 0.01}
    assert call(serve_url, "POST", path, tenant_keys["acme"], delay)[0] == 401
    assert call(serve_url, "POST", path, None, delay)[0] == 401
    status, payload = call(serve_url, "POST", path, operator_key, {**delay, "model": "tiny-qwen"})
    assert status == 403 and "fault injection is off" in payload["error"]["message"]
    assert call(serve_url, "POST", path, operator_key, {**delay, "model": "nope"})[0] == 404
    status, payload = call(serve_url, "POST", path, operator_key, {**delay, "name": "rm.rf"})
    assert status == 400 and "unknown failpoint" in payload["error"]["message"]
    status, payload = call(serve_url, "POST", path, operator_key, delay)
    assert status == 200, payload
    armed = payload.pop("replicas")
    assert payload == {
        "object": "failpoint",
        "model": "tiny",
        "name": "engine.delay",
        "armed": True,
    }
    assert len(armed) == 1 and isinstance(armed[0], str), armed
    status, payload = call(serve_url, "DELETE", f"{path}/tiny", operator_key)
    assert status == 200 and payload["replicas"] == armed, payload
    assert call(serve_url, "DELETE", f"{path}/tiny", tenant_keys["acme"])[0] == 401


def test_metrics_need_the_operator_key(serve_url, tenant_keys, operator_key):
    for key in (None, tenant_keys["acme"], "sk-wrong"):
        request = urllib.request.Request(f"{serve_url}/metrics")
        if key:
            request.add_header("Authorization", f"Bearer {key}")
        with pytest.raises(urllib.error.HTTPError) as error:
            urllib.request.urlopen(request, timeout=30)
        assert error.value.code == 401
    request = urllib.request.Request(
        f"{serve_url}/metrics", headers={"Authorization": f"Bearer {operator_key}"}
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        assert response.status == 200


def test_one_tenants_prefix_cache_hits_never_count_anothers_prompts(tenant_client):
    prompt = [
        int(t) for t in torch.randint(2, 500, (48,), generator=torch.Generator().manual_seed(7))
    ]

    def cached_tokens(tenant: str) -> int:
        reply = tenant_client(tenant).completions.create(
            model="tiny", prompt=prompt, max_tokens=1, temperature=0
        )
        return reply.usage.prompt_tokens_details.cached_tokens

    assert cached_tokens("acme") == 0
    assert cached_tokens("acme") > 0, "the same tenant hits its own prefix"
    assert cached_tokens("globex") == 0, "another tenant's prompt must not be a hit"
    assert cached_tokens("globex") > 0


def test_a_request_over_the_tenants_whole_budget_is_400(tenant_client):
    limited = tenant_client("limited")
    with pytest.raises(openai.BadRequestError) as error:
        limited.completions.create(model="tiny", prompt=[1, 2], max_tokens=60, n=2)
    assert "tokens_per_minute budget of 100" in error.value.body["message"]


# ---- acceptance 2: fuzz over HTTP ------------------------------------------------------------


@settings(
    max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(body=COMPLETION_BODY)
def test_fuzzed_sampling_fields_are_served_or_400(serve_url, tenant_keys, replica, body):
    """Every draw is served to the end or refused with a 400; `replica` checks that
    the engine never restarted and the replica is the same one afterwards."""
    raw = json.dumps(body, allow_nan=True).encode()
    status, payload = call(serve_url, "POST", "/v1/completions", tenant_keys["acme"], raw)
    assert status in (200, 400), (status, payload)
    if status == 400:
        assert payload["error"]["type"] == "invalid_request_error"
    else:
        assert all(c["finish_reason"] in ("length", "stop") for c in payload["choices"])


_CONFIG_VALUE = st.one_of(
    ANY_NUMBER, st.booleans(), st.none(), st.text(max_size=6), st.lists(st.integers(), max_size=2)
)
_PATTERN_KEY = st.one_of(
    st.sampled_from(["q_proj", "v_proj", "self_attn.q_proj", "layers.1.self_attn.v_proj"]),
    st.sampled_from(["layers.*.q_proj", "*", "(.*)*!", "q_proj|v_proj", "[a-z]+_proj", "\\d"]),
    st.text(max_size=12),
)
_CONFIG = {
    "r": st.one_of(st.just(4), _CONFIG_VALUE),
    "lora_alpha": st.one_of(st.floats(0.5, 64), _CONFIG_VALUE),
    "use_rslora": _CONFIG_VALUE,
    "rank_pattern": st.one_of(
        _CONFIG_VALUE, st.dictionaries(_PATTERN_KEY, _CONFIG_VALUE, max_size=3)
    ),
    "alpha_pattern": st.one_of(
        _CONFIG_VALUE, st.dictionaries(_PATTERN_KEY, _CONFIG_VALUE, max_size=3)
    ),
}


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(changes=st.fixed_dictionaries({}, optional=_CONFIG))
def test_fuzzed_adapter_configs_are_served_or_400(
    serve_setup, serve_url, tenant_keys, replica, changes
):
    key = tenant_keys["acme"]
    folder = tenant_folder(serve_setup, "acme", "fuzzed")
    config = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**config, **changes}, allow_nan=True))
    status, payload = register(serve_url, key, "fuzzed", "fuzzed")
    assert status in (201, 400), (status, payload)
    if status == 201:
        status, payload = complete(serve_url, key, "tiny:fuzzed", [2, 3])
        assert status in (200, 400), (status, payload)
        assert call(serve_url, "DELETE", "/v1/adapters/tiny/fuzzed", key)[0] == 200
