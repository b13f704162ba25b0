"""Compressed-tensors checkpoints written by `loraplex quantize`, int8 W8A8 and int4
W4A16 (groups of 32 with zero points), each served by a real Serve app (an app of its
own beside the session's, under /int8 or /int4) with a shared PEFT adapter, through
the official OpenAI SDK: the base model's and the adapter's prompt logprobs stay within
the tolerance of transformers + PEFT on the checkpoint's dequantized weights, and
streamed completions run."""

from __future__ import annotations

import random

import openai
import pytest
import torch

from loraplex.deployments.tenants import hash_key
from loraplex.tools.quantize import quantize_folder

KEY = "sk-quantized-test"
MAX_LOGPROB_ERROR = 0.06


@pytest.fixture(scope="module", params=["int8", "int4"])
def quantized_app(request, serve_setup, tmp_path_factory):
    """(the app's base URL, its model name, the checkpoint folder); removed after it."""
    from ray import serve

    from loraplex.deployments.app import build_app

    kind = request.param
    root = tmp_path_factory.mktemp(kind)
    if kind == "int8":
        folder = quantize_folder(serve_setup.base, root / "tiny-w8a8")
    else:
        folder = quantize_folder(
            serve_setup.base, root / "tiny-w4a16", "W4A16", group_size=32, symmetric=False
        )
    name = f"tiny-{kind}"
    config = {
        "models": [
            {
                "name": name,
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
    serve.run(build_app(config), name=kind, route_prefix=f"/{kind}")
    yield f"{serve_setup.url}/{kind}", name, folder
    serve.delete(kind)


def test_a_quantized_checkpoint_serves_base_and_adapter_within_tolerance(
    quantized_app, serve_setup, quantized_checkpoint_oracle, hf_prompt_logprobs
):
    url, name, folder = quantized_app
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=120)
    rng = random.Random(4)
    prompt = [rng.randrange(512) for _ in range(24)]
    for model, adapter in ((name, None), (f"{name}:sa", serve_setup.shared["sa"])):
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
        want = hf_prompt_logprobs(quantized_checkpoint_oracle(folder, adapter), prompt)
        assert (got - want).abs().max().item() < MAX_LOGPROB_ERROR, model
        assert reply.usage.completion_tokens == 4
    chunks = client.completions.create(
        model=f"{name}:sa", prompt="w1 w2 w3", max_tokens=6, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices).strip()
