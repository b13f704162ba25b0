"""What a serve benchmark reads from a serve config: the benchmarked model's weights,
engine options and shared adapters (for the offline baseline), validated by the
platform's own `PlatformConfig`; and a copy of the config with synthetic adapters."""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import yaml

from loraplex.adapters.peft_format import SUPPORTED_MODULES
from loraplex.deployments.config import PlatformConfig

logger = logging.getLogger(__name__)

SYNTHETIC_RANK = 8


@contextmanager
def _working_dir(folder: Path) -> Iterator[None]:
    """Relative paths in a serve config are relative to where `serve run` starts."""
    previous = Path.cwd()
    os.chdir(folder)
    try:
        yield
    finally:
        os.chdir(previous)


def _app_with_model(data: dict, base: str) -> dict:
    for app in data.get("applications", []):
        models = (app.get("args") or {}).get("models", [])
        if any(m.get("name") == base for m in models):
            return app
    raise ValueError(f"no application in the serve config serves a model named {base!r}")


@dataclass(frozen=True)
class BenchServeConfig:
    path: Path
    """The config file `serve run` gets."""
    cwd: Path
    """Where `serve run` starts: the original config's folder."""
    raw: dict
    base: str
    model_spec: str
    """The model's registered name or folder."""
    engine: dict
    adapters: dict[str, str]
    """Shared adapter name -> absolute folder."""
    synthetic_names: tuple[str, ...] = ()

    @classmethod
    def load(cls, path: Path, base: str) -> BenchServeConfig:
        path = Path(path).resolve()
        data = yaml.safe_load(path.read_text())
        app = _app_with_model(data, base)
        with _working_dir(path.parent):
            config = PlatformConfig.model_validate(app["args"])
        model = next(m for m in config.models if m.name == base)
        return cls(
            path=path,
            cwd=path.parent,
            raw=data,
            base=base,
            model_spec=model.model or model.name,
            engine=dict(model.engine),
            adapters=dict(model.adapters),
        )

    def adapter_folder(self, model_name: str) -> str | None:
        """'base' -> None; 'base:name' -> the shared adapter's folder."""
        if ":" not in model_name:
            return None
        name = model_name.split(":", 1)[1]
        if name not in self.adapters:
            raise ValueError(f"{model_name!r} is not a shared adapter of the serve config")
        return self.adapters[name]

    def with_synthetic_adapters(self, count: int, workdir: Path) -> BenchServeConfig:
        """A copy of the config (written under `workdir`) whose model also serves `count`
        seeded random PEFT adapters, rank 8 on every projection, named bench-lora-<i>."""
        from loraplex.platform.model_files import resolve_model_folder
        from loraplex.tools.engine_bench.offline import make_bench_adapters

        names = tuple(f"bench-lora-{i}" for i in range(count))
        folders = make_bench_adapters(
            resolve_model_folder(self.model_spec),
            Path(workdir) / "adapters",
            names,
            SYNTHETIC_RANK,
            SUPPORTED_MODULES,
        )
        data = copy.deepcopy(self.raw)
        model = next(
            m for m in _app_with_model(data, self.base)["args"]["models"] if m["name"] == self.base
        )
        model.setdefault("adapters", {}).update({n: str(f) for n, f in folders.items()})
        if int(self.engine.get("max_loras", 8)) < count:
            logger.warning(
                "the model's max_loras (%s) is below the %d synthetic adapters: requests will "
                "wait for adapter slots",
                self.engine.get("max_loras"),
                count,
            )
        derived = Path(workdir) / "serve_config.bench.yaml"
        derived.write_text(yaml.safe_dump(data, sort_keys=False))
        return dataclasses.replace(
            self,
            path=derived,
            raw=data,
            adapters={**self.adapters, **{n: str(f) for n, f in folders.items()}},
            synthetic_names=names,
        )
