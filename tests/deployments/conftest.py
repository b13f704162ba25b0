"""One real Ray Serve app for the whole test session (starting one costs ~15 s).

The app serves four tiny base models: `tiny` (Llama, with three shared adapters, and
adapters' vocabularies resized up to 520 tokens allowed),
`tiny-tight` (the same weights and one adapter, with a KV cache of 24 blocks: running
requests get preempted), `tiny-bytes` (Llama with a byte-level tokenizer that can spell
JSON and a Hermes-style chat template, 1024 tokens of context, and its adapter `sj`:
structured output, tool calls, client libraries) and `tiny-qwen` (one replica that takes
one request at a time and queues one, so it overloads on purpose). Three tenants: `acme` (everything), `globex` (key from an
environment variable; `tiny` and its shared adapter `sa` only) and `limited`
(one request at a time, 100 tokens a minute). Tenant adapters live under a temporary
adapter root. An operator key unlocks /metrics, and `tiny` allows fault injection
(its failpoints are armed through the deployment handle).
"""

from __future__ import annotations

import json
import os
import socket
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from loraplex.deployments.tenants import hash_key

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

KEYS = {"acme": "sk-acme-test", "globex": "sk-globex-test", "limited": "sk-limited-test"}
OPERATOR_KEY = "sk-operator-test"
GLOBEX_KEY_ENV = "LORAPLEX_TEST_GLOBEX_KEY"
REPO = Path(__file__).resolve().parents[2]
ALL_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SHARED = {
    "sa": dict(rank=4, target_modules=("q_proj", "v_proj"), seed=11),
    "sb": dict(rank=8, target_modules=ALL_MODULES, seed=12),
    "sc": dict(rank=2, target_modules=("o_proj", "down_proj"), seed=13),
}


def serve_config_controller_options() -> dict:
    """serve_config.yaml's `controller_options`: the test app's controller and proxy run
    with the same Serve settings and middleware as `serve run serve_config.yaml`."""
    config = yaml.safe_load((REPO / "serve_config.yaml").read_text())
    return config["controller_options"]


def serve_config_replica_env() -> dict[str, str]:
    """The environment serve_config.yaml gives the application's replicas: the test
    session's job carries it, and Serve makes the job's runtime_env every deployment's
    default."""
    config = yaml.safe_load((REPO / "serve_config.yaml").read_text())
    (application,) = config["applications"]
    return application["runtime_env"]["env_vars"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="session")
def pick_port():
    """`free_port` for test modules (they cannot import a conftest by name)."""
    return free_port


@dataclass(frozen=True)
class ServeSetup:
    url: str
    base: Path
    shared: dict[str, Path]
    adapter_root: Path


@pytest.fixture(scope="session")
def serve_setup(tiny_model_factory, tmp_path_factory, peft_adapter_factory):
    import ray
    from ray import serve

    from loraplex.deployments.app import build_app

    base = tiny_model_factory("llama")
    shared_root = tmp_path_factory.mktemp("shared-adapters")
    shared = {
        name: peft_adapter_factory(base, shared_root / name, **options)
        for name, options in SHARED.items()
    }
    byte_base = tiny_model_factory("llama", tokenizer="bytes", max_position_embeddings=1024)
    byte_adapter = peft_adapter_factory(
        byte_base, shared_root / "sj", rank=4, target_modules=("q_proj", "v_proj"), seed=14
    )
    adapter_root = tmp_path_factory.mktemp("tenant-adapters")
    os.environ[GLOBEX_KEY_ENV] = KEYS["globex"]
    engine = {
        "dtype": "float32",
        "max_model_len": 128,
        "max_num_seqs": 16,
        "max_loras": 4,
        "max_lora_rank": 8,
    }
    config = {
        "adapter_root": str(adapter_root),
        "models": [
            {
                "name": "tiny",
                "model": str(base),
                "engine": {
                    **engine,
                    "max_cpu_loras": 8,
                    "kv_cache_memory_bytes": 1 << 26,
                    "max_adapter_vocab_size": 520,
                },
                "adapters": {name: str(folder) for name, folder in shared.items()},
                "server": {"num_cpus": 0.1},
                "stream_messages_per_step": 4,
                "fault_injection": True,
            },
            {
                "name": "tiny-tight",
                "model": str(base),
                "engine": {**engine, "num_blocks_override": 24},
                "adapters": {"sa": str(shared["sa"])},
                "server": {"num_cpus": 0.1},
            },
            {
                "name": "tiny-bytes",
                "model": str(byte_base),
                "engine": {**engine, "max_model_len": 1024, "kv_cache_memory_bytes": 1 << 26},
                "adapters": {"sj": str(byte_adapter)},
                "server": {"num_cpus": 0.1},
            },
            {
                "name": "tiny-qwen",
                "model": str(tiny_model_factory("qwen2")),
                "engine": {
                    "dtype": "float32",
                    "max_model_len": 1024,
                    "max_loras": 0,
                    "kv_cache_memory_bytes": 1 << 26,
                },
                "server": {"num_cpus": 0.1, "max_ongoing_requests": 1, "max_queued_requests": 1},
            },
        ],
        "tenants": [
            {
                "name": "acme",
                "api_key_sha256": [hash_key(KEYS["acme"])],
                "shared_adapters": ["*:*"],
                # The fuzz and soak suites call tokenize and the admin API as acme,
                # far above the default rates (the day-one suite tests those).
                "tokenize_requests_per_minute": None,
                "admin_requests_per_minute": None,
            },
            {
                "name": "globex",
                "api_key_env": [GLOBEX_KEY_ENV],
                "models": ["tiny"],
                "shared_adapters": ["tiny:sa"],
            },
            {
                "name": "limited",
                "api_key_sha256": [hash_key(KEYS["limited"])],
                "max_concurrent_requests": 1,
                "tokens_per_minute": 100,
            },
        ],
        "operator": {"api_key_sha256": [hash_key(OPERATOR_KEY)]},
    }
    port = free_port()
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": serve_config_replica_env()},
    )
    serve.start(
        http_options={"host": "127.0.0.1", "port": port},
        controller_options=serve_config_controller_options(),
    )
    serve.run(build_app(config), name="loraplex", route_prefix="/")
    yield ServeSetup(f"http://127.0.0.1:{port}", base, shared, adapter_root)
    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="session")
def serve_url(serve_setup) -> str:
    return serve_setup.url


def make_client(serve_url: str, tenant: str | None):
    import openai

    key = KEYS[tenant] if tenant else "no-such-key"
    return openai.OpenAI(base_url=f"{serve_url}/v1", api_key=key, max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def client(serve_url):
    """The `acme` tenant's OpenAI client."""
    return make_client(serve_url, "acme")


@pytest.fixture(scope="session")
def model_server(serve_setup):
    """Handle of the `tiny` model deployment (replica_info, direct calls)."""
    from ray import serve

    return serve.get_deployment_handle("model-tiny", app_name="loraplex")


@pytest.fixture(scope="session")
def model_handles(serve_setup):
    """Model name -> its deployment handle."""
    from ray import serve

    return lambda name: serve.get_deployment_handle(f"model-{name}", app_name="loraplex")


@pytest.fixture(scope="session")
def tenant_client(serve_url):
    """tenant name (or None: a bad key) -> that tenant's OpenAI client."""
    return lambda tenant: make_client(serve_url, tenant)


@pytest.fixture(scope="session")
def tenant_keys() -> dict[str, str]:
    return dict(KEYS)


@pytest.fixture(scope="session")
def operator_key() -> str:
    return OPERATOR_KEY


def post_json(serve_url: str, path: str, body: dict, key: str = KEYS["acme"]) -> tuple[int, dict]:
    """POSTs `body` as JSON with a bearer key; (status, parsed JSON answer)."""
    request = urllib.request.Request(
        f"{serve_url}{path}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


@pytest.fixture(scope="session")
def post(serve_url):
    """(path, body, key=acme's) -> (status, JSON answer) against the session's app."""
    return lambda path, body, key=KEYS["acme"]: post_json(serve_url, path, body, key)
