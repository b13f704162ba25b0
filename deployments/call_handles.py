"""The Serve handles the ingress starts a model's `generate` calls with: one per
(base model, adapter model id), made once and kept.

`handle.options(stream=True, multiplexed_model_id=...)` and the method lookup each copy
the handle's options and build a new handle; per request that was about a tenth of the
ingress's CPU for a short completion. The handles share their deployment's router, so
a kept one routes exactly as a new one would. The newest `capacity` ids are kept (a
fleet may name thousands of adapters); an id past them gets a new handle again."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

CAPACITY = 1024


class GenerateHandles:
    """`generate` handles of the model deployments, by (base model, model id)."""

    def __init__(self, servers: dict[str, Any], capacity: int = CAPACITY) -> None:
        """`servers`: base model name -> its deployment's handle."""
        self._servers = servers
        self._capacity = capacity
        self._handles: OrderedDict[tuple[str, str], Any] = OrderedDict()

    def __call__(self, base: str, model_id: str) -> Any:
        """The streaming `generate` method handle of `base`'s deployment that routes by
        `model_id` (the Serve multiplexed model id: "" for the base model)."""
        key = (base, model_id)
        handle = self._handles.get(key)
        if handle is not None:
            self._handles.move_to_end(key)
            return handle
        handle = self._servers[base].options(stream=True, multiplexed_model_id=model_id).generate
        self._handles[key] = handle
        if len(self._handles) > self._capacity:
            self._handles.popitem(last=False)
        return handle
