"""Adapters registered by URI, black-box through a real Serve app and a real
S3-compatible server (moto, IAM authentication on, tests/s3_server.py): register, serve,
update and delete; three tenants with disjoint prefixes and their own credentials; no
credential in any answer, log, /metrics or the residency view."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from http_calls import api_call
from s3_server import s3_server

from loraplex.adapters.store import ADAPTER_FILES
from loraplex.deployments.tenants import hash_key

APP = "uris"
MODEL = "uri-tiny"
TENANTS = ("t1", "t2", "t3")
KEYS = {tenant: f"key-of-{tenant}" for tenant in TENANTS}
OPERATOR = "uri-operator-key"


@pytest.fixture(scope="module")
def uri_app(serve_setup, tmp_path_factory):
    """The app, its URL prefix, the S3 server and every credential value it was given.
    t3's secret is wrong (its fetches are refused by the server)."""
    from ray import serve

    from loraplex.deployments.app import build_app

    creds = tmp_path_factory.mktemp("uri-creds")
    with s3_server() as s3:
        for tenant in TENANTS:
            key, secret = s3.user_for_prefix(tenant, tenant)
            (creds / f"{tenant}.key").write_text(key)
            (creds / f"{tenant}.secret").write_text(secret if tenant != "t3" else "wrong" + secret)
        for prefix, name in (("t1/sa-copy", "sa"), ("t1/sb-copy", "sb"), ("t2/own", "sc")):
            for file in ADAPTER_FILES:
                s3.put(f"{prefix}/{file}", (serve_setup.shared[name] / file).read_bytes())
        config = {
            "adapter_root": str(tmp_path_factory.mktemp("uri-root")),
            "models": [
                {
                    "name": MODEL,
                    "model": str(serve_setup.base),
                    "engine": {
                        "dtype": "float32",
                        "max_model_len": 128,
                        "max_lora_rank": 8,
                        "kv_cache_memory_bytes": 1 << 26,
                    },
                    "adapters": {name: str(serve_setup.shared[name]) for name in ("sa", "sb")},
                    "server": {"num_cpus": 0.1},
                }
            ],
            "tenants": [
                {
                    "name": tenant,
                    "api_key_sha256": [hash_key(KEYS[tenant])],
                    "shared_adapters": ["*:*"],
                    "admin_requests_per_minute": None,
                    "adapter_sources": [
                        {
                            "prefix": f"s3://adapters/{tenant}",
                            "endpoint_url": s3.endpoint,
                            "access_key_id": {"file": str(creds / f"{tenant}.key")},
                            "secret_access_key": {"file": str(creds / f"{tenant}.secret")},
                        }
                    ],
                }
                for tenant in TENANTS
            ],
            "operator": {"api_key_sha256": [hash_key(OPERATOR)]},
        }
        serve.run(build_app(config), name=APP, route_prefix=f"/{APP}")
        secrets = [path.read_text() for path in sorted(creds.iterdir())]
        yield f"{serve_setup.url}/{APP}", s3, secrets
        serve.delete(APP)


def call(url: str, tenant: str, method: str, path: str, body: dict | None = None):
    status, answer, _ = api_call(url, KEYS.get(tenant, tenant), method, path, body)
    return status, answer


def register(url: str, tenant: str, name: str, uri: str, **extra: str):
    body = {"model": MODEL, "name": name, "uri": uri, **extra}
    return call(url, tenant, "POST", "/v1/adapters", body)


def greedy(url: str, tenant: str, model: str) -> tuple[int, list[str] | dict]:
    body = {"model": model, "prompt": [3, 1, 4, 1, 5], "max_tokens": 8, "temperature": 0}
    body["logprobs"] = 0
    status, answer = call(url, tenant, "POST", "/v1/completions", body)
    if status != 200:
        return status, answer
    return status, answer["choices"][0]["logprobs"]["tokens"]


def test_an_adapter_registered_by_uri_serves_updates_and_deletes(uri_app):
    url, _, _ = uri_app
    status, card = register(url, "t1", "mine", "s3://adapters/t1/sa-copy/")
    assert status == 201, card
    assert card["source"] == "s3://adapters/t1/sa-copy" and card["id"] == f"{MODEL}:mine"
    _, as_shared = greedy(url, "t1", f"{MODEL}:sa")
    _, base = greedy(url, "t1", MODEL)
    assert greedy(url, "t1", f"{MODEL}:mine") == (200, as_shared), "the same files, same tokens"
    assert as_shared != base

    status, updated = call(
        url, "t1", "PUT", f"/v1/adapters/{MODEL}/mine", {"uri": "s3://adapters/t1/sb-copy"}
    )
    assert status == 200 and updated["version"] > card["version"], updated
    assert updated["source"] == "s3://adapters/t1/sb-copy"
    _, as_sb = greedy(url, "t1", f"{MODEL}:sb")
    assert greedy(url, "t1", f"{MODEL}:mine") == (200, as_sb), "new requests: new weights"
    listed = call(url, "t1", "GET", "/v1/adapters")[1]["data"]
    assert [(a["name"], a["source"]) for a in listed] == [("mine", "s3://adapters/t1/sb-copy")]

    assert call(url, "t1", "DELETE", f"/v1/adapters/{MODEL}/mine")[0] == 200
    assert greedy(url, "t1", f"{MODEL}:mine")[0] == 404
    status, missing = call(
        url, "t1", "PUT", f"/v1/adapters/{MODEL}/mine", {"uri": "s3://adapters/t1/sa-copy"}
    )
    assert status == 404, missing


def test_tenants_reach_only_their_own_prefix(uri_app):
    url, _, _ = uri_app
    for tenant, uri in itertools.product(("t2", "t3"), ("s3://adapters/t1/sa-copy",)):
        status, refused = register(url, tenant, "x", uri)
        assert status == 403 and "not under any adapter source" in refused["error"]["message"]
    status, card = register(url, "t2", "own", "s3://adapters/t2/own")
    assert status == 201, card
    assert greedy(url, "t2", f"{MODEL}:own")[0] == 200
    assert greedy(url, "t1", f"{MODEL}:own")[0] == 404, "another tenant's adapter is invisible"
    for bad, expected in (
        ("s3://adapters/t1/../t2/own", 400),
        ("file:///etc/passwd", 400),
        ("s3://adapters/t1/nothing", 404),
    ):
        status, answer = register(url, "t1", "y", bad)
        assert status == expected, (bad, answer)
    status, both = register(url, "t1", "y", "s3://adapters/t1/sa-copy", path="x")
    assert status == 400, both


def test_no_credential_appears_in_answers_logs_metrics_or_the_residency_view(uri_app):
    import ray

    url, _, secrets = uri_app
    status, denied = register(url, "t3", "z", "s3://adapters/t3/a")
    assert status == 403 and denied["error"]["code"] == "source_denied", denied
    assert register(url, "t1", "seen", "s3://adapters/t1/sa-copy")[0] == 201
    texts = {"the refusal": str(denied)}
    status, residency = call(url, OPERATOR, "GET", f"/v1/admin/residency?model={MODEL}")
    assert status == 200
    texts["residency"] = str(residency)
    for tenant in TENANTS:
        texts[f"{tenant}'s list"] = str(call(url, tenant, "GET", "/v1/adapters")[1])
    import urllib.request

    metrics = urllib.request.Request(
        f"{url}/metrics", headers={"Authorization": f"Bearer {OPERATOR}"}
    )
    with urllib.request.urlopen(metrics, timeout=60) as response:
        texts["/metrics"] = response.read().decode()
    logs = Path(ray._private.worker.global_worker.node.get_logs_dir_path())
    log_text = "\n".join(
        path.read_text(errors="replace") for path in logs.rglob("*") if path.is_file()
    )
    assert "s3://adapters/t1/sa-copy fetched" in log_text, "the ingress's log was searched"
    texts["Ray's logs"] = log_text
    for where, text in texts.items():
        for secret in secrets:
            assert secret not in text, f"a credential appears in {where}"
