"""`dtype: auto` without a benchmark: the CPU's rule, a recorded pick, records that do not
count; building an engine probes nothing."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from loraplex.kernels.cache_dir import CACHE_DIR_ENV
from loraplex.kernels.cpu_matmul import cpu_lacks_half_matmul
from loraplex.platform import dtype_choice
from loraplex.platform.arch import ModelArch
from loraplex.platform.llm import LLM

CPU = torch.device("cpu")


@pytest.fixture
def cache(monkeypatch, tmp_path):
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path))
    return tmp_path


@pytest.fixture
def arch(tiny_model_factory) -> ModelArch:
    return ModelArch.from_folder(tiny_model_factory("llama"))


def rule_dtype() -> torch.dtype:
    amx = dtype_choice.cpu_has_amx_bf16() and not cpu_lacks_half_matmul(torch.bfloat16)
    return torch.bfloat16 if amx else torch.float32


def test_without_a_record_the_cpu_decides(cache, arch):
    choice = dtype_choice.choose_dtype(arch, CPU)
    assert choice.dtype == rule_dtype()
    assert "AMX bf16" in choice.reason and "loraplex probe dtype" in choice.reason


def test_a_record_is_read_back_for_the_same_shape_and_threads_only(cache, arch):
    path = dtype_choice.record_path(arch, torch.get_num_threads())
    dtype_choice.write_record(path, torch.float32, {"float32": 1.5})
    choice = dtype_choice.choose_dtype(arch, CPU)
    assert (
        choice.dtype == torch.float32 and "measured" in choice.reason and "1.50s" in choice.reason
    )
    assert path != dtype_choice.record_path(arch, torch.get_num_threads() + 1)
    wider = ModelArch.from_hf_config({**arch_config(arch), "hidden_size": arch.hidden_size * 2})
    assert dtype_choice.record_path(wider, torch.get_num_threads()) != path


def arch_config(arch: ModelArch) -> dict:
    return {
        "architectures": [arch.architecture],
        "vocab_size": arch.vocab_size,
        "hidden_size": arch.hidden_size,
        "intermediate_size": arch.intermediate_size,
        "num_hidden_layers": arch.num_layers,
        "num_attention_heads": arch.num_heads,
        "num_key_value_heads": arch.num_kv_heads,
        "head_dim": arch.head_dim,
        "max_position_embeddings": arch.max_position_embeddings,
    }


def test_a_record_this_cpu_cannot_multiply_natively_is_not_followed(cache, arch):
    lacking = [d for d in (torch.bfloat16, torch.float16) if cpu_lacks_half_matmul(d)]
    if not lacking:
        pytest.skip("this CPU multiplies bf16 and fp16 natively")
    path = dtype_choice.record_path(arch, torch.get_num_threads())
    dtype_choice.write_record(path, lacking[0], {"float32": 2.0})
    assert dtype_choice.choose_dtype(arch, CPU).dtype == rule_dtype()


def test_an_unreadable_record_is_ignored_with_a_warning(cache, arch, caplog):
    path = dtype_choice.record_path(arch, torch.get_num_threads())
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"dtype": "int3"}))
    with caplog.at_level(logging.WARNING, logger="loraplex.platform.dtype_choice"):
        assert dtype_choice.choose_dtype(arch, CPU).dtype == rule_dtype()
    assert "unreadable dtype record" in caplog.text


def test_an_auto_engine_is_built_without_probing(cache, tiny_model_factory, caplog):
    with caplog.at_level(logging.INFO, logger="loraplex.platform.dtype_choice"):
        llm = LLM(str(tiny_model_factory("llama")), max_model_len=64)
    assert llm.engine.config.model.dtype == rule_dtype()
    assert "dtype auto -> " in caplog.text
    assert not (cache / "gemm_probe").exists() and not (cache / "dtype_choice").exists()
