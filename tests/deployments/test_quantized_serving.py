"""An int8 compressed-tensors checkpoint written by `loraplex quantize` served by a real
Serve app (an app of its own beside the session's, under /int8) with a shared PEFT
adapter, through the official OpenAI SDK: the base model's and the adapter's prompt
logprobs stay within the tolerance of transformers + PEFT on the checkpoint's
dequantized weights, streamed completions run, and the replica reports the model as
int8."""

from __future__ import annotations

import random

import openai
import pytest
import torch

from loraplex.deployments.tenants import hash_key
from loraplex.tools.quantize import quantize_folder

APP, PREFIX = "int8", "/int8"
KEY = "sk-int8-test"
MAX_LOGPROB_ERROR = 0.06


@pytest.fixture(scope="module")
def int8_app(serve_setup, tmp_path_factory):
    """(the app's base URL, the checkpoint folder); removed after the module."""
    from ray import serve

    from loraplex.deployments.app import build_app

    folder = quantize_folder(serve_setup.base, tmp_path_factory.mktemp("int8") / "tiny-w8a8")
    config = {
        "models": [
            {
                "name": "tiny-int8",
                "model": str(folder),
                "engine": {
                    "dtype": "float32",
                    "max_model_len": 128,
                    "max_loras": 2,
                    "kv_cache_memory_bytes": 1 << 26,
                },
                "adapters": {"sa": str(serve_setup.shared["sa"])},
                "server": {"num_cpus": 0.05},
            }
        ],
        "ingress": {"num_cpus": 0.05},
        "tenants": [{"name": "t", "api_key_sha256": [hash_key(KEY)], "shared_adapters": ["*:*"]}],
    }
    serve.run(build_app(config), name=APP, route_prefix=PREFIX)
    yield f"{serve_setup.url}{PREFIX}", folder
    serve.delete(APP)


def test_an_int8_checkpoint_serves_base_and_adapter_within_tolerance(
    int8_app, serve_setup, int8_checkpoint_oracle, hf_prompt_logprobs
):
    url, folder = int8_app
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=120)
    rng = random.Random(4)
    prompt = [rng.randrange(512) for _ in range(24)]
    for model, adapter in (("tiny-int8", None), ("tiny-int8:sa", serve_setup.shared["sa"])):
        reply = client.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=4,
            temperature=0,
            extra_body={"prompt_logprobs": 0, "ignore_eos": True},
        )
        scored = reply.choices[0].model_extra["prompt_logprobs"]
        got = torch.tensor(
            [
                entry[str(token)]["logprob"]
                for entry, token in zip(scored[1:], prompt[1:], strict=True)
            ]
        )
        want = hf_prompt_logprobs(int8_checkpoint_oracle(folder, adapter), prompt)
        assert (got - want).abs().max().item() < MAX_LOGPROB_ERROR, model
        assert reply.usage.completion_tokens == 4
    chunks = client.completions.create(
        model="tiny-int8:sa", prompt="w1 w2 w3", max_tokens=6, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices).strip()
