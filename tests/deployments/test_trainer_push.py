"""A trainer on the session's Ray cluster pushes adapter tensors to the running app
(deployments/trainer.py): served token for token like the same adapter saved as files,
a second push is a new version under the same name, and bad pushes are refused with the
status a registration would get."""

from __future__ import annotations

import json

import pytest
from http_calls import api_call
from safetensors.numpy import load_file
from safetensors.torch import load_file as load_torch_file

from loraplex.adapters.peft_format import CONFIG_NAME, WEIGHTS_NAME
from loraplex.deployments.trainer import AdapterPushRefused, push_adapter

PROMPT = [7, 3, 9, 2, 5]


def greedy(client, model: str) -> str:
    reply = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0)
    return reply.choices[0].text


def saved(folder):
    return load_file(folder / WEIGHTS_NAME), json.loads((folder / CONFIG_NAME).read_text())


def test_pushed_tensors_serve_like_the_saved_adapter_and_a_second_push_replaces_them(
    serve_setup, client
):
    weights, config = saved(serve_setup.shared["sa"])
    card = push_adapter("loraplex", "acme", "tiny", "pushed", weights, config)
    assert card["id"] == "tiny:pushed" and card["source"] == "pushed"
    assert greedy(client, "tiny:pushed") == greedy(client, "tiny:sa")
    torch_weights = load_torch_file(serve_setup.shared["sb"] / WEIGHTS_NAME)
    sb_config = saved(serve_setup.shared["sb"])[1]
    again = push_adapter("loraplex", "acme", "tiny", "pushed", torch_weights, sb_config)
    assert again["version"] > card["version"]
    assert greedy(client, "tiny:pushed") == greedy(client, "tiny:sb")
    assert greedy(client, "tiny:pushed") != greedy(client, "tiny:sa")
    status, _, _ = api_call(serve_setup.url, client.api_key, "DELETE", "/v1/adapters/tiny/pushed")
    assert status == 200


@pytest.mark.parametrize(
    ("tenant", "base", "change", "status"),
    [
        ("nobody", "tiny", None, 404),
        ("globex", "tiny-bytes", None, 403),
        ("acme", "no-such-model", None, 404),
        ("acme", "tiny", "rank", 400),
        ("acme", "tiny", "empty", 400),
    ],
)
def test_a_bad_push_is_refused_with_a_registrations_status(
    serve_setup, tenant, base, change, status
):
    weights, config = saved(serve_setup.shared["sa"])
    if change == "rank":
        config = {**config, "r": 64}
    if change == "empty":
        weights = {}
    with pytest.raises(AdapterPushRefused) as refused:
        push_adapter("loraplex", tenant, base, "bad", weights, config)
    assert refused.value.status == status, refused.value
