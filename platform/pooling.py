"""How a prompt's final hidden states become one embedding (/v1/embeddings).

A model folder says how it pools the way sentence-transformers writes it: `modules.json`
lists a `sentence_transformers.models.Pooling` module (its folder's `config.json` sets
one `pooling_mode_*` flag) and, optionally, a `Normalize` module. A folder without them
is a causal LM: its embedding is the last prompt token's hidden state, L2-normalized
(what vLLM and the e5/gte-style decoder embedders do).

Semantics: hidden [T, H] are the model's final hidden states (after its last norm) for
the T prompt tokens; `last` takes hidden[T-1], `cls` hidden[0], `mean` the mean over the
T rows; with `normalize` the result is divided by its L2 norm. The engine adds each
chunk's rows as they are computed (`rows_to_pool`), so a prompt split over several
steps pools the same as one step.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    import torch

    from loraplex.platform.request import Request

logger = logging.getLogger(__name__)

PoolingMode = Literal["last", "mean", "cls"]

_MODE_FLAGS: dict[str, PoolingMode] = {
    "pooling_mode_lasttoken": "last",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
}
_POOLING_MODULE = "sentence_transformers.models.Pooling"
_NORMALIZE_MODULE = "sentence_transformers.models.Normalize"


@dataclass(frozen=True)
class PoolingSpec:
    mode: PoolingMode = "last"
    normalize: bool = True

    @property
    def needs_every_position(self) -> bool:
        """Whether positions before the last count: then the prompt is computed in full,
        with no prefix-cache hit (a hit's positions are never computed here)."""
        return self.mode != "last"


def read_pooling(folder: str | Path) -> PoolingSpec:
    """The pooling `folder`'s sentence-transformers modules say (module docstring);
    last-token with normalization when it has none. ValueError for a Pooling module
    that asks for anything else (weighted mean, max, several modes at once)."""
    folder = Path(folder)
    modules_file = folder / "modules.json"
    if not modules_file.is_file():
        return PoolingSpec()
    modules = json.loads(modules_file.read_text())
    types = [module.get("type", "") for module in modules]
    normalize = _NORMALIZE_MODULE in types
    pooling = [module for module in modules if module.get("type") == _POOLING_MODULE]
    if not pooling:
        return PoolingSpec("last", normalize)
    config_file = folder / pooling[0].get("path", "") / "config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    chosen = [flag for flag, on in config.items() if flag.startswith("pooling_mode_") and on]
    if len(chosen) != 1 or chosen[0] not in _MODE_FLAGS:
        raise ValueError(
            f"{config_file}: pooling {chosen or 'none'} is not served; one of "
            f"{sorted(_MODE_FLAGS)} must be set"
        )
    spec = PoolingSpec(_MODE_FLAGS[chosen[0]], normalize)
    logger.info("%s: embeddings pool by %s%s", folder, spec.mode, " (normalized)" * normalize)
    return spec


def rows_to_pool(spec: PoolingSpec, start: int, stop: int, num_prompt_tokens: int) -> range:
    """The positions in [start, stop) of a prompt chunk whose hidden states the
    embedding adds up."""
    if spec.mode == "mean":
        return range(start, min(stop, num_prompt_tokens))
    wanted = 0 if spec.mode == "cls" else num_prompt_tokens - 1
    return range(wanted, wanted + 1) if start <= wanted < stop else range(0)


def add_pooled(request: Request, rows: torch.Tensor) -> None:
    """Adds a step's pooled sum [H] to an embedding request's."""
    request.pooled = rows if request.pooled is None else request.pooled + rows


def end_pooling(request: Request) -> bool:
    """For an embedding request whose whole prompt is computed: sets its embedding and
    returns True, or sets its `failure` when the embedding is not finite (NaN or Inf in
    the hidden states: the adapter's fault when it has one). False while prompt
    positions remain."""
    from loraplex.platform.request import RequestFailure  # request.py imports this module

    if request.num_computed_tokens < request.num_prompt_tokens:
        return False
    spec, pooled = request.pooling, request.pooled
    vector = pooled / request.num_prompt_tokens if spec.mode == "mean" else pooled
    request.pooled = None
    if not bool(vector.isfinite().all()):
        if request.lora is not None:
            request.failure = RequestFailure(
                f"adapter {request.lora.name!r} produced non-finite hidden states (NaN or "
                "Inf); its weights cannot be served",
                client_fault=True,
            )
        else:
            request.failure = RequestFailure("the model produced non-finite hidden states")
        return False
    if spec.normalize:
        vector = vector / vector.norm().clamp_min(1e-12)
    request.embedding = vector.tolist()
    return True
