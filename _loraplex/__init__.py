"""loraplex: one fleet serving many base LLMs and thousands of per-tenant LoRA adapters.

The runtime lives in four top-level folders mapped into this namespace by pyproject:
`loraplex.platform` (engine), `loraplex.adapters`, `loraplex.kernels` and
`loraplex.deployments`; the tooling (benchmarks, checks, probes and the `loraplex`
command) in a fifth, `loraplex.tools`, which the runtime never imports. Those folders
carry no `__init__.py` (`platform` is a stdlib module, `kernels`/`adapters`/`tools` are
PyPI names: an `__init__.py` there would shadow them whenever the repo root is on
sys.path). Their public names are exported lazily here,
so `from loraplex.platform import LLM, SamplingParams` works without importing torch
until a name is used.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

_SUBPACKAGES = ("platform", "adapters", "kernels", "deployments", "tools")

_EXPORTS: dict[str, dict[str, str]] = {
    "platform": {
        "LLM": "loraplex.platform.llm",
        "LLMEngine": "loraplex.platform.engine",
        "AsyncEngine": "loraplex.platform.async_engine",
        "EngineDeadError": "loraplex.platform.async_engine",
        "EngineConfig": "loraplex.platform.config",
        "SamplingParams": "loraplex.platform.request",
        "RequestOutput": "loraplex.platform.request",
        "CompletionOutput": "loraplex.platform.request",
    },
}


def _folder_of(name: str) -> Path:
    """An installed wheel puts the folder beside this file; a source checkout (editable
    install) keeps it at the repo root, one level up."""
    here = Path(__file__).resolve().parent
    installed = here / name
    return installed if installed.is_dir() else here.parent / name


def _namespace_package(name: str, exports: dict[str, str]) -> ModuleType:
    """Creates loraplex.<name> as a package over its folder, with lazy re-exports."""
    full_name = f"{__name__}.{name}"
    spec = importlib.machinery.ModuleSpec(full_name, None, is_package=True)
    spec.submodule_search_locations = [str(_folder_of(name))]
    package = importlib.util.module_from_spec(spec)

    def __getattr__(attr: str) -> object:
        if attr in exports:
            value = getattr(importlib.import_module(exports[attr]), attr)
            setattr(package, attr, value)
            return value
        raise AttributeError(f"module {full_name!r} has no attribute {attr!r}")

    package.__getattr__ = __getattr__
    package.__all__ = sorted(exports)
    return package


for _name in _SUBPACKAGES:
    if f"{__name__}.{_name}" not in sys.modules:
        _package = _namespace_package(_name, _EXPORTS.get(_name, {}))
        sys.modules[_package.__name__] = _package
        setattr(sys.modules[__name__], _name, _package)
