"""Registration's validation load, in the ingress's own process: off every model
replica's request path.

Registering an adapter reads and checks its folder (PEFT format, tensor shapes against
the base model, rank against the engine's `max_lora_rank`, finite values;
`validate_peft_adapter` in adapters/peft_format.py, numpy only: the ingress imports no
torch) on
a worker thread of the ingress, at most `MAX_CONCURRENT_VALIDATIONS` at a time per
ingress replica, so a burst of registrations neither holds a model replica's
`max_ongoing_requests` places nor blocks the ingress's event loop. What an adapter must
fit comes from one `adapter_shape` call per base model per ingress replica, made when
the ingress starts and remembered (a base model's shape does not change while the app
runs); until a model replica has answered it, a registration waits up to
`SHAPE_WAIT_S` and then gets 503 `model_loading`.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from pathlib import Path

from ray.exceptions import RayError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError
from ray.serve.handle import DeploymentHandle

from loraplex.adapters.peft_format import AdapterError, validate_peft_adapter
from loraplex.deployments.errors import OpenAIError
from loraplex.platform.arch import ModelArch

logger = logging.getLogger(__name__)

MAX_CONCURRENT_VALIDATIONS = 2
SHAPE_WAIT_S = 30.0
SHAPE_RETRY_S = 2.0
RETRY_AFTER_S = 2


@dataclass(frozen=True)
class AdapterShape:
    """What an adapter must fit to be served by a base model's engine."""

    arch: ModelArch
    max_rank: int
    lora_enabled: bool
    max_vocab_size: int | None = None
    """The engine's `max_adapter_vocab_size` (None: no resized vocabulary)."""


class AdapterValidator:
    """Validates adapter folders for the ingress's base models (see the module doc)."""

    def __init__(self, servers: dict[str, DeploymentHandle]) -> None:
        self._servers = servers
        self._shapes: dict[str, asyncio.Future[AdapterShape]] = {}
        self._slots = asyncio.Semaphore(MAX_CONCURRENT_VALIDATIONS)
        self._fetchers = [asyncio.ensure_future(self._fetch(base)) for base in servers]

    def _future(self, base: str) -> asyncio.Future[AdapterShape]:
        return self._shapes.setdefault(base, asyncio.get_running_loop().create_future())

    async def _fetch(self, base: str) -> None:
        """Asks `base`'s deployment for its shape until one replica answers."""
        future = self._future(base)
        while not future.done():
            try:
                shape = await self._servers[base].adapter_shape.remote()
            except (RayError, BackPressureError, DeploymentUnavailableError) as exc:
                logger.info("adapter shape of %s not yet known (%r); retrying", base, exc)
                await asyncio.sleep(SHAPE_RETRY_S)
                continue
            future.set_result(shape)
            logger.info("adapter shape of %s known: max rank %d", base, shape.max_rank)

    async def shape(self, base: str) -> AdapterShape:
        """`base`'s shape; 503 `model_loading` when no replica told it within
        SHAPE_WAIT_S."""
        try:
            return await asyncio.wait_for(asyncio.shield(self._future(base)), SHAPE_WAIT_S)
        except TimeoutError:
            raise OpenAIError(
                503,
                f"model {base!r} is loading: no replica could describe it for adapter "
                "validation yet; retry later",
                code="model_loading",
                retry_after_s=RETRY_AFTER_S,
            ) from None

    async def check(self, base: str, folder: Path, root: Path) -> None:
        """Reads and validates the adapter `folder` (under the tenant's `root`, without
        following links) for `base`; 400 with the reason when it cannot be served."""
        shape = await self.shape(base)
        if not shape.lora_enabled:
            raise OpenAIError(
                400, f"adapter rejected: LoRA is disabled on model {base!r} (max_loras=0)"
            )
        async with self._slots:
            try:
                await asyncio.to_thread(
                    validate_peft_adapter,
                    folder,
                    shape.arch,
                    shape.max_rank,
                    root,
                    shape.max_vocab_size,
                )
            except AdapterError as exc:
                raise OpenAIError(400, f"adapter rejected: {exc}") from None
