"""A trainer on the same Ray cluster pushes an adapter's tensors to a running app: no
files to write, no HTTP. `push_adapter` puts the tensors in Ray's object store and calls
the app's ingress (`OpenAIIngress.push_adapter`), which writes them as a PEFT folder in
the tenant's content-addressed folders, validates them like any registration and
records a new version under the name: requests already running finish on the old
weights, later ones get the new ones.

Callers on the Ray cluster are trusted as the operator is: the call names the tenant.

    from peft import get_peft_model_state_dict
    push_adapter("loraplex", "acme", "smollm2-135m-instruct", "rl-policy",
                 get_peft_model_state_dict(model), model.peft_config["default"])
"""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping
from typing import Any

import numpy as np

from loraplex.adapters.peft_format import CONFIG_NAME, WEIGHTS_NAME

INGRESS_DEPLOYMENT = "OpenAIIngress"
PUSHED_SOURCE = "pushed"
"""The `source` of a pushed adapter's card."""


class AdapterPushRefused(Exception):
    """The app refused the push; `status` is the HTTP status the same registration
    would have got."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message

    def __reduce__(self) -> tuple[type, tuple[int, str]]:
        return type(self), (self.status, self.message)


def push_adapter(
    app: str,
    tenant: str,
    base: str,
    name: str,
    state_dict: Mapping[str, Any],
    config: Mapping[str, Any] | Any,
) -> dict[str, Any]:
    """Registers `state_dict` (PEFT's names, torch tensors or numpy arrays; bf16 goes as
    float32) with `config` (a LoraConfig or its dict) as `base:name` of `tenant` in Serve
    application `app`; returns the adapter's card. AdapterPushRefused when refused."""
    import ray
    from ray import serve

    arrays = {key: _as_numpy(value) for key, value in state_dict.items()}
    # The weights go by object reference, so the call is a Ray actor call even where
    # the app's calls default to Serve's gRPC transport (serve_config.yaml): that would
    # pickle the reference out of band, which pins the weights in the object store for
    # the life of the calling process.
    handle = serve.get_deployment_handle(INGRESS_DEPLOYMENT, app_name=app).options(
        _by_reference=True
    )
    card = handle.push_adapter.remote(tenant, base, name, ray.put(arrays), _config_dict(config))
    return card.result()


def adapter_files(
    weights: Mapping[str, np.ndarray], config: Mapping[str, Any], max_bytes: int
) -> dict[str, bytes]:
    """The PEFT folder's two files; AdapterPushRefused for what cannot be one."""
    from safetensors.numpy import save

    if not isinstance(weights, Mapping) or not weights:
        raise AdapterPushRefused(400, "the push carries no tensors")
    size = 0
    for key, value in weights.items():
        if not isinstance(key, str) or not isinstance(value, np.ndarray):
            raise AdapterPushRefused(400, f"tensor {key!r} is not a named numpy array")
        size += value.nbytes
    if size > max_bytes:
        raise AdapterPushRefused(413, f"the tensors hold {size} bytes, over {max_bytes}")
    try:
        config_text = json.dumps(dict(config))
    except (TypeError, ValueError) as exc:
        raise AdapterPushRefused(400, f"the adapter config is not JSON: {exc}") from None
    contiguous = {key: np.ascontiguousarray(value) for key, value in weights.items()}
    return {CONFIG_NAME: config_text.encode(), WEIGHTS_NAME: save(contiguous)}


def _as_numpy(value: Any) -> np.ndarray:
    if isinstance(value, np.ndarray):
        return value
    tensor = value.detach().cpu()
    if str(tensor.dtype) == "torch.bfloat16":
        tensor = tensor.float()
    return tensor.numpy()


def _config_dict(config: Mapping[str, Any] | Any) -> dict[str, Any]:
    """A JSON-ready dict of a LoraConfig (sets as sorted lists, enums as values)."""
    raw = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    return json.loads(json.dumps(raw, default=_json_value))


def _json_value(value: Any) -> Any:
    if isinstance(value, set | frozenset):
        return sorted(value)
    if isinstance(value, enum.Enum):
        return value.value
    raise TypeError(f"{type(value).__name__} is not JSON")
