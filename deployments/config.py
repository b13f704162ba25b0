"""The platform's configuration (the `args` of serve_config.yaml), parsed once.

Engine options are those of `EngineConfig.from_options`; they are validated here, at
deploy time, so a typo fails `serve run` instead of a replica. Relative paths are made
absolute here too (`build_app` runs where `serve run` was started; replicas may not).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from loraplex.adapters.fetch import FetchLimits
from loraplex.adapters.peft_format import CONFIG_NAME
from loraplex.adapters.sources import AdapterSource
from loraplex.deployments.catalog import ADAPTER_NAME
from loraplex.deployments.tenants import OperatorConfig, TenantConfig
from loraplex.platform.config import SPECULATIVE_OPTION, EngineConfig
from loraplex.platform.model_files import cache_root


class StrictConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ServerOptions(StrictConfig):
    """Ray Serve options of one model deployment."""

    num_cpus: float = Field(0.1, gt=0, description="CPUs Ray reserves per replica")
    num_gpus: float = Field(0.0, ge=0, description="GPUs Ray reserves per replica")
    num_replicas: int | None = Field(1, ge=1, description="fixed replica count (no autoscaling)")
    autoscaling_config: dict[str, Any] | None = Field(
        None, description="Ray Serve autoscaling_config; replaces num_replicas when set"
    )
    max_ongoing_requests: int = Field(
        256,
        ge=1,
        description="requests a replica holds at once: its batch (engine.max_num_seqs) and "
        "its engine's waiting queue. Keep it well above max_num_seqs: a request waiting in "
        "the engine is refused at once when the replica estimates it could not start in "
        "time (admission_max_wait_s), while one waiting in Serve's queue in front of the "
        "replica waits blind and is refused only once it reaches the replica",
    )
    max_queued_requests: int = Field(
        64,
        ge=-1,
        description="Serve's queue in front of the replicas, past which callers get 503 "
        "at once (-1: unbounded); a safety bound, small because it waits blind",
    )
    health_check_period_s: float = Field(
        2.0,
        gt=0,
        description="how often Serve asks a replica's check_health: a dead or stalled "
        "replica leaves /health and is replaced within about this long",
    )

    @field_validator("max_queued_requests")
    @classmethod
    def _queue_bound(cls, value: int) -> int:
        if value == 0:
            raise ValueError("max_queued_requests must be -1 (unbounded) or at least 1")
        return value

    graceful_shutdown_timeout_s: float = Field(
        300.0,
        ge=0,
        description="a stopping replica (redeploy, downscale) keeps serving its requests in "
        "flight this long; then the engine fails what is still open (503, retry). The "
        "default covers a 2,048-token completion at 7 tokens/s per stream",
    )
    adapter_demand_window_s: float = Field(
        60.0,
        gt=0,
        description="autoscaling counts the adapters a replica served this recently as in "
        "demand (deployments/autoscaling.py)",
    )
    request_router: Literal["residency", "power_of_two"] = Field(
        "residency",
        description="residency: by adapter tier, prefix affinity and home replica "
        "(deployments/request_router.py); power_of_two: Ray Serve's default router, "
        "shortest of two queues (the replicas report no multiplexed model ids to it: the "
        "engine's adapter store is their one host LRU, so it has no adapter affinity)",
    )
    prefix_affinity: bool = Field(
        True, description="residency router: send a prompt where its prefix was served last"
    )
    placement_group_strategy: Literal["STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD"] = Field(
        "STRICT_PACK",
        description="how a tensor-parallel replica's bundles (one per rank) are placed",
    )
    max_replicas_per_node: int | None = Field(
        None,
        ge=1,
        description="at most this many replicas of the model on one Ray node (Serve's "
        "option): 1 spreads replicas over nodes, so losing a node loses one replica; "
        "not with tensor_parallel_size > 1 (Serve refuses it with placement groups)",
    )


SERVED_POLICY_OPTION, SERVED_POLICY = "policy", "fair"
"""Served engines share themselves among tenants (platform/fair_share.py) by default."""

EngineOptionValue = int | float | str | bool | None | dict[str, int | float | str | bool]
"""An engine option's value in the serve config: a scalar, or a flat mapping (the one
mapping option is `speculative_config`, also accepted as its JSON text)."""


class ModelDeploymentConfig(StrictConfig):
    """One base model: its public name, its weights and its engine options."""

    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9._-]+$", description="public model id")
    model: str | None = Field(None, description="registered name or HF folder; default: name")
    engine: dict[str, EngineOptionValue] = Field(
        default_factory=dict,
        description="options of EngineConfig.from_options (speculative_config: a mapping)",
    )
    cold_start_wait_s: float = Field(
        300.0,
        gt=0,
        description="a request for this model while its replicas are all starting waits "
        "this long for one (then 503 model_loading + Retry-After); covers a first start "
        "on a fresh machine (conversion, native build, warm-up: ~50 s on 2 vCPUs)",
    )
    max_engine_restarts: int = Field(
        3,
        ge=0,
        description="in-place engine restarts allowed within engine_restart_window_s; one "
        "more and the replica reports unhealthy, so Serve replaces it",
    )
    engine_restart_window_s: float = Field(60.0, gt=0)
    step_watchdog_s: float | None = Field(
        120.0,
        gt=0,
        description="no engine step finishing for this long while requests are queued "
        "fails them and makes the replica unhealthy (null: never)",
    )
    stream_messages_per_step: int = Field(
        16,
        ge=0,
        description="with more requests running than this, each streams every few steps "
        "so a step sends about this many messages (platform/async_engine.py _Coalescing); "
        "0: every token is its own event",
    )
    admission_max_wait_s: float | None = Field(
        10.0,
        gt=0,
        description="a request the replica estimates it could not start within this many "
        "seconds of its arrival at the ingress gets 503 + Retry-After at once "
        "(deployments/admission.py); null: never refused for load",
    )
    fault_injection: bool = Field(
        False,
        description="let callers of the deployment handle arm engine failpoints "
        "(platform/failpoints.py): for tests and chaos drills, never in production",
    )
    adapters: dict[str, str] = Field(
        default_factory=dict,
        description="shared LoRA adapters of this base: name -> PEFT adapter folder",
    )
    server: ServerOptions = Field(default_factory=ServerOptions)

    @field_validator("engine")
    @classmethod
    def _one_mapping_option(cls, engine: dict[str, EngineOptionValue]) -> dict:
        for key, value in engine.items():
            if isinstance(value, dict) and key != SPECULATIVE_OPTION:
                raise ValueError(
                    f"engine.{key} takes a scalar, not a mapping "
                    f"(only {SPECULATIVE_OPTION} is a mapping)"
                )
        return engine

    @field_validator("adapters")
    @classmethod
    def _absolute_adapter_folders(cls, adapters: dict[str, str]) -> dict[str, str]:
        resolved = {}
        for name, folder in adapters.items():
            if not ADAPTER_NAME.match(name):
                raise ValueError(f"adapter name {name!r}: use letters, digits, '.', '_', '-'")
            path = Path(folder).expanduser().resolve()
            if not (path / CONFIG_NAME).is_file():
                raise ValueError(f"adapter {name!r}: {path} has no {CONFIG_NAME}")
            resolved[name] = str(path)
        return resolved

    @field_validator("model")
    @classmethod
    def _absolute_model_folder(cls, model: str | None) -> str | None:
        if model is not None and Path(model).expanduser().is_dir():
            return str(Path(model).expanduser().resolve())
        return model

    @model_validator(mode="after")
    def _engine_options_are_valid(self) -> ModelDeploymentConfig:
        try:
            self.engine_config()
        except TypeError as exc:
            raise ValueError(f"model {self.name!r}: bad engine option ({exc})") from None
        return self

    @model_validator(mode="after")
    def _spread_without_placement_groups(self) -> ModelDeploymentConfig:
        size = self.engine_config().parallel.tensor_parallel_size
        if self.server.max_replicas_per_node is not None and size > 1:
            raise ValueError(
                f"model {self.name!r}: server.max_replicas_per_node cannot be set with "
                f"tensor_parallel_size {size} (Ray Serve refuses it for placement groups)"
            )
        return self

    def engine_config(self) -> EngineConfig:
        """The engine's config; a served engine schedules by tenant fair share unless
        `engine.policy` says otherwise."""
        options = {SERVED_POLICY_OPTION: SERVED_POLICY, **self.engine}
        return EngineConfig.from_options(self.model or self.name, options)


def model_deployment_name(name: str) -> str:
    """The Serve deployment (and Ray process title suffix) of model `name`."""
    return f"model-{name}"


class IngressOptions(StrictConfig):
    """Ray Serve options of the ingress. The model deployments bound their own queues
    (503 + Retry-After past their `max_queued_requests`), so the ingress admits more
    than they hold together: a request waiting for a model holds an ingress slot but
    no CPU, and `/health` must not wait behind them. Past `max_ongoing_requests` the
    ingress answers 503 `overloaded` in OpenAI error JSON at once (ingress_gate.py);
    Serve's own bound on the replica sits a little higher, and behind it the proxy
    queues up to `max_queued_requests` more and then answers 503 itself,
    which only happens when the ingress cannot take requests at all."""

    num_cpus: float = Field(0.1, gt=0)
    max_ongoing_requests: int = Field(1024, ge=1)
    max_queued_requests: int = Field(256, ge=1)
    first_token_timeout_s: float = Field(
        30.0,
        gt=0,
        description="a request without its first token by then (queued in the router or "
        "the engine under overload) ends with 503 + Retry-After instead of waiting on; "
        "counted from when its model has a running replica (see cold_start_wait_s)",
    )
    inter_token_timeout_s: float = Field(
        60.0,
        gt=0,
        description="a started request whose model sends nothing for this long ends with "
        "an inter_token_timeout error (504; an error event once streaming)",
    )
    graceful_shutdown_timeout_s: float = Field(
        300.0,
        ge=0,
        description="a stopping ingress replica keeps its streams in flight this long",
    )
    direct_http_port: int | None = Field(
        None,
        ge=1,
        le=65535,
        description="each ingress replica also serves HTTP itself on this port "
        "(deployments/direct_http.py): no Serve proxy and no Ray message per request or "
        "SSE event; None: only through Serve's proxy (http_options)",
    )
    direct_http_host: str = Field("127.0.0.1", description="where direct_http_port binds")
    frame_channel: bool = Field(
        True,
        description="model replicas send every step after a call's first as one frame per "
        "engine step per ingress replica over a socket to it (deployments/wire.py); "
        "false: each step of each call is its own Ray message",
    )


def default_adapter_root() -> str:
    """<cache dir>/tenant-adapters (next to the converted models)."""
    return str(cache_root().parent / "tenant-adapters")


class PlatformConfig(StrictConfig):
    models: list[ModelDeploymentConfig] = Field(min_length=1)
    ingress: IngressOptions = Field(default_factory=IngressOptions)
    tenants: list[TenantConfig] = Field(
        default_factory=list,
        description="API keys and ACLs; none is refused unless `auth: none` says so",
    )
    auth: Literal["api_keys", "none"] = Field(
        "api_keys",
        description="api_keys: every call needs a tenant's key (tenants must be listed); "
        "none: no authentication at all, adapter registration included (logged loudly)",
    )
    operator: OperatorConfig = Field(
        default_factory=OperatorConfig,
        description="operator keys for /metrics, the residency view and failpoints",
    )
    metrics_public: bool = Field(
        False,
        description="serve /metrics without an operator key (tenant and adapter names "
        "hidden while tenants are configured); false: /metrics needs the operator key",
    )
    adapter_root: str = Field(
        default_factory=default_adapter_root,
        description="tenant adapters are registered from <adapter_root>/<tenant>/...",
    )
    adapter_fetch: FetchLimits = Field(
        default_factory=FetchLimits,
        description="bounds on adapters registered by URI (adapters/fetch.py)",
    )
    adapter_sources: list[AdapterSource] = Field(
        default_factory=list,
        description="with `auth: none`: the URI prefixes anyone may register adapters "
        "from (with tenants, each tenant lists its own)",
    )
    log_prompts: bool = Field(
        False, description="log each request's prompt or messages (off: ids and sizes only)"
    )

    @field_validator("adapter_root")
    @classmethod
    def _absolute_root(cls, root: str) -> str:
        return str(Path(os.path.expandvars(root)).expanduser().resolve())

    @model_validator(mode="after")
    def _unique_names(self) -> PlatformConfig:
        names = [m.name for m in self.models]
        if len(names) != len(set(names)):
            raise ValueError(f"model names must be unique, got {names}")
        tenants = [t.name for t in self.tenants]
        if len(tenants) != len(set(tenants)):
            raise ValueError(f"tenant names must be unique, got {tenants}")
        for tenant in self.tenants:
            tenant.key_digests()
        self.operator.key_digests()
        return self

    @model_validator(mode="after")
    def _authentication_is_explicit(self) -> PlatformConfig:
        if self.auth == "api_keys" and not self.tenants:
            raise ValueError(
                "no tenants are configured: every endpoint, adapter registration included, "
                "would be open to anyone. List tenants with API keys, or set `auth: none` "
                "to serve without authentication"
            )
        if self.auth == "none" and self.tenants:
            raise ValueError("`auth: none` with tenants listed: remove one or the other")
        if self.adapter_sources and self.tenants:
            raise ValueError(
                "top-level adapter_sources is for `auth: none`; with tenants, list "
                "adapter_sources per tenant"
            )
        return self

    def shared_adapters(self) -> dict[str, dict[str, str]]:
        return {model.name: dict(model.adapters) for model in self.models}
