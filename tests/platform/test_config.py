"""EngineConfig.from_options: flat user options to the frozen section configs."""

import dataclasses

import pytest
import torch

from loraplex.platform.config import (
    AUTO_DTYPE,
    CacheConfig,
    EngineConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    dtype_name,
    parse_dtype,
)


def test_no_options_means_every_dataclass_default():
    config = EngineConfig.from_options("m", {})
    assert config == EngineConfig(model=ModelConfig(model="m"))
    assert config.model.dtype == AUTO_DTYPE


def test_each_option_lands_in_the_section_that_has_its_field():
    config = EngineConfig.from_options(
        "m",
        {
            "dtype": "bf16",
            "num_threads": 3,
            "block_size": 8,
            "policy": "priority",
            "max_loras": 0,
            "worker_num_cpus": 0.5,
        },
    )
    assert config.model == ModelConfig(model="m", dtype="bfloat16", num_threads=3)
    assert config.cache == CacheConfig(block_size=8)
    assert config.scheduler == SchedulerConfig(policy="priority")
    assert config.lora == LoRAConfig(max_loras=0)
    assert config.parallel == ParallelConfig(worker_num_cpus=0.5)


def test_option_names_are_the_section_fields_each_once():
    names = EngineConfig.option_names()
    sections = (ModelConfig, CacheConfig, SchedulerConfig, LoRAConfig, ParallelConfig)
    flat = tuple(f.name for s in sections for f in dataclasses.fields(s))
    assert names == (*flat, "speculative_config")
    assert len(set(names)) == len(names)


def test_unknown_options_are_a_type_error_naming_them_and_the_valid_ones():
    with pytest.raises(TypeError, match=r"'max_num_seq', 'model'; valid options: dtype, "):
        EngineConfig.from_options("m", {"max_num_seq": 4, "model": "other"})


def test_bad_values_raise_their_section_error():
    with pytest.raises(ValueError, match="unsupported dtype"):
        EngineConfig.from_options("m", {"dtype": "int8"})
    with pytest.raises(ValueError, match="block_size must be a power of two"):
        EngineConfig.from_options("m", {"block_size": 3})


@pytest.mark.parametrize(
    ("given", "name", "dtype"),
    [
        ("fp32", "float32", torch.float32),
        ("BF16", "bfloat16", torch.bfloat16),
        ("float16", "float16", torch.float16),
        (torch.bfloat16, "bfloat16", torch.bfloat16),
    ],
)
def test_a_config_holds_the_dtype_by_name_and_the_engine_gets_the_torch_dtype(given, name, dtype):
    """Options become names (reading a config needs no torch: the ingress reads them);
    `parse_dtype` gives the engine the torch dtype of either."""
    config = EngineConfig.from_options("m", {"dtype": given})
    assert config.model.dtype == dtype_name(given) == name
    assert parse_dtype(config.model.dtype) is dtype
    assert ModelConfig(model="m", dtype=dtype).dtype is dtype


@pytest.mark.parametrize("dtype", ["fp32", "int8", torch.int8, 5])
def test_a_model_config_refuses_what_the_engine_cannot_compute_in(dtype):
    with pytest.raises(ValueError):
        ModelConfig(model="m", dtype=dtype)
