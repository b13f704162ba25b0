"""The platform's configuration (the `args` of serve_config.yaml), parsed once.

Engine options are the keywords of `EngineConfig.create`; they are validated here, at
deploy time, so a typo fails `serve run` instead of a replica.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from loraplex.platform.config import EngineConfig


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
    max_ongoing_requests: int = Field(64, ge=1, description="requests a replica runs at once")
    max_queued_requests: int = Field(256, ge=-1, description="queue past which callers get 503")
    health_check_period_s: float = Field(10.0, gt=0)
    graceful_shutdown_timeout_s: float = Field(30.0, ge=0)


class ModelDeploymentConfig(StrictConfig):
    """One base model: its public name, its weights and its engine options."""

    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9._-]+$", description="public model id")
    model: str | None = Field(None, description="registered name or HF folder; default: name")
    engine: dict[str, int | float | str | bool | None] = Field(
        default_factory=dict, description="keywords of EngineConfig.create"
    )
    drain_timeout_s: float = Field(30.0, ge=0, description="wait for in-flight requests on stop")
    server: ServerOptions = Field(default_factory=ServerOptions)

    @model_validator(mode="after")
    def _engine_options_are_valid(self) -> ModelDeploymentConfig:
        try:
            self.engine_config()
        except TypeError as exc:
            known = ", ".join(EngineConfig.option_names())
            raise ValueError(
                f"model {self.name!r}: bad engine option ({exc}); known: {known}"
            ) from None
        return self

    def engine_config(self) -> EngineConfig:
        return EngineConfig.create(self.model or self.name, **self.engine)


class IngressOptions(StrictConfig):
    num_cpus: float = Field(0.1, gt=0)
    max_ongoing_requests: int = Field(256, ge=1)


class PlatformConfig(StrictConfig):
    models: list[ModelDeploymentConfig] = Field(min_length=1)
    ingress: IngressOptions = Field(default_factory=IngressOptions)

    @model_validator(mode="after")
    def _unique_names(self) -> PlatformConfig:
        names = [m.name for m in self.models]
        if len(names) != len(set(names)):
            raise ValueError(f"model names must be unique, got {names}")
        return self
