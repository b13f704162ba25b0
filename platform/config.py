"""Engine configuration: frozen dataclasses parsed once at the edge.

Derived values are properties so nothing is stored twice, and each default lives in its
dataclass only. `EngineConfig.from_options` is the one place where flat user options
(CLI flags, `LLM(**options)`, a serve config's `engine`) become configs.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

DTYPE_NAMES = ("float32", "bfloat16", "float16")
"""The dtypes an engine computes in, by their torch names."""
_DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}

AUTO_DTYPE = "auto"
"""The dtype option that lets the engine choose (platform/dtype_choice.py)."""


def dtype_name(dtype: str | torch.dtype) -> str:
    """'float32' / 'bf16' / torch.bfloat16 -> the torch name ('bfloat16'); ValueError for
    anything else. Configs hold names, so reading one needs no torch (the ingress parses
    the engine options and imports no torch); the engine turns them into torch dtypes."""
    text = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
    name = _DTYPE_ALIASES.get(text.lower(), text.lower())
    if name not in DTYPE_NAMES:
        choices = sorted({*DTYPE_NAMES, *_DTYPE_ALIASES})
        raise ValueError(f"unsupported dtype {dtype!r}; use one of {choices}")
    return name


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """Maps 'float32' / 'bf16' / torch.dtype to a torch.dtype; rejects anything else."""
    import torch

    return getattr(torch, dtype_name(dtype))


def parse_dtype_option(dtype: str | torch.dtype) -> str:
    """The dtype option as a config holds it: 'auto', or the dtype's torch name."""
    if isinstance(dtype, str) and dtype.lower() == AUTO_DTYPE:
        return AUTO_DTYPE
    return dtype_name(dtype)


QUANTIZATIONS = {"int8": "dynamic", "int8_weight_only": "weight_only"}
"""`quantization` option -> the int8 projections' mode (kernels/int8_matmul.py)."""


def _quantized_folder(model: str) -> bool:
    """Whether `model` is a folder whose config.json carries a `quantization_config`."""
    config = Path(model) / "config.json"
    try:
        return config.is_file() and "quantization_config" in json.loads(config.read_text())
    except (OSError, ValueError):
        return False


@dataclass(frozen=True)
class ModelConfig:
    """Which weights to run and how.

    `model` is a registered name (e.g. 'smollm2-135m-instruct') or a local folder in
    Hugging Face layout (config.json + *.safetensors + tokenizer files).
    `dtype` is 'auto', a dtype's torch name ('bfloat16') or a torch dtype. 'auto': bf16 on
    a GPU, on a CPU the dtype `loraplex probe dtype` recorded as fastest here, else bf16
    with AMX and fp32 without (platform/dtype_choice.py). The engine's own config holds
    the resolved torch dtype.
    `max_model_len` caps prompt + generated tokens; None means the model's own
    `max_position_embeddings`. `num_threads` is torch's intra-op thread count on a CPU;
    None means every core this process may run on. (Ray sets OMP_NUM_THREADS to an
    actor's whole CPUs, 1 for a replica reserving 0.5: left alone, a served engine
    would compute on one core while the offline one uses all.) On a GPU, decode steps
    replay CUDA graphs captured when the engine starts (platform/decode_graphs.py), and
    on a CPU every step runs the layers as one native call (platform/models/native_stack.py);
    `enforce_eager` runs the model's Python modules layer by layer instead.
    `quantization` (CPU): 'int8' holds the decoder layers' projections as int8 per
    output channel and multiplies them with activations quantized per token (W8A8,
    dynamic); 'int8_weight_only' keeps the activations in bf16. The embedding table
    and LoRA adapters stay in `dtype` (kernels/int8_matmul.py), and so does the LM head
    unless `quantize_lm_head` (a batch-1 decode step reads it whole: a sixth of the
    default model's weights). A quantized checkpoint (platform/models/compressed_tensors.py)
    runs as stored; `quantize_lm_head` puts its LM head in int8 too (W8A8 for an int4
    one).
    """

    model: str = "smollm2-135m-instruct"
    dtype: torch.dtype | str = AUTO_DTYPE
    device: str = "cpu"
    max_model_len: int | None = None
    seed: int = 0
    num_threads: int | None = None
    enforce_eager: bool = False
    quantization: str | None = None
    quantize_lm_head: bool = False

    def __post_init__(self) -> None:
        if (
            self.quantize_lm_head
            and self.quantization is None
            and not _quantized_folder(self.model)
        ):
            raise ValueError(
                f"quantize_lm_head needs a quantization (one of {tuple(QUANTIZATIONS)}) or a "
                "quantized checkpoint"
            )
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"quantization must be one of {tuple(QUANTIZATIONS)} or None, "
                f"got {self.quantization!r}"
            )
        if not isinstance(self.dtype, str):
            dtype_name(self.dtype)  # a torch dtype the engine computes in, or ValueError
        elif self.dtype != AUTO_DTYPE and self.dtype not in DTYPE_NAMES:
            raise ValueError(
                f"dtype must be one of {DTYPE_NAMES}, a torch dtype or {AUTO_DTYPE!r}, "
                f"got {self.dtype!r}"
            )
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {self.num_threads}")


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache sizing.

    The number of blocks is derived from a memory budget: `kv_cache_memory_bytes` if
    given, else `kv_cache_memory_fraction` of the device's total memory (host RAM on
    CPU). `num_blocks_override` pins the count whatever the budget (as vLLM's
    `num_gpu_blocks_override`: to reproduce another machine's cache, or a small one).
    """

    block_size: int = 16
    kv_cache_memory_bytes: int | None = None
    kv_cache_memory_fraction: float = 0.1
    num_blocks_override: int | None = None
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError(f"kv_cache_memory_bytes must be > 0, got {self.kv_cache_memory_bytes}")
        if not 0.0 < self.kv_cache_memory_fraction <= 1.0:
            raise ValueError(
                f"kv_cache_memory_fraction must be in (0, 1], got {self.kv_cache_memory_fraction}"
            )
        if self.num_blocks_override is not None and self.num_blocks_override < 1:
            raise ValueError(f"num_blocks_override must be >= 1, got {self.num_blocks_override}")


POLICIES = ("fcfs", "priority", "fair")


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous-batching limits.

    `max_num_batched_tokens` is the per-step token budget shared by prefill chunks and
    decodes. With chunked prefill off a prompt must fit the budget in one step.
    `policy` is 'fcfs', 'priority' (lower `priority` value runs first, ties FCFS) or
    'fair' (the waiting tenant with the fewest weighted tokens served runs first, FCFS
    within a tenant; platform/fair_share.py).
    """

    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    policy: str = "fcfs"

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")


@dataclass(frozen=True)
class LoRAConfig:
    """Multi-LoRA serving limits.

    `max_loras` device slots hold the adapters a step may use (at most that many distinct
    adapters run at once; 0 disables LoRA). `max_lora_rank` sizes each slot; adapters of
    a higher rank are refused. `max_cpu_loras` adapters stay loaded in host memory (LRU).
    `adapter_root` is the folder whose subfolders are registered by name at start.
    `max_cpu_lora_bytes` bounds their memory too (None: only their count): an adapter
    that saves its own embedding and LM head (`modules_to_save`) costs their size.
    `max_adapter_vocab_size` is the largest vocabulary those may have; None: the base's,
    no resized vocabulary.
    """

    max_loras: int = 8
    max_lora_rank: int = 16
    max_cpu_loras: int = 64
    adapter_root: str | None = None
    max_cpu_lora_bytes: int | None = None
    max_adapter_vocab_size: int | None = None

    def __post_init__(self) -> None:
        if self.max_loras < 0:
            raise ValueError(f"max_loras must be >= 0, got {self.max_loras}")
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be >= 1, got {self.max_lora_rank}")
        if self.max_cpu_lora_bytes is not None and self.max_cpu_lora_bytes < 1:
            raise ValueError(f"max_cpu_lora_bytes must be >= 1, got {self.max_cpu_lora_bytes}")
        if self.max_adapter_vocab_size is not None and self.max_adapter_vocab_size < 1:
            raise ValueError(
                f"max_adapter_vocab_size must be >= 1, got {self.max_adapter_vocab_size}"
            )
        if self.max_cpu_loras < max(self.max_loras, 1):
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be >= max(max_loras, 1) "
                f"({max(self.max_loras, 1)})"
            )

    @property
    def enabled(self) -> bool:
        return self.max_loras > 0


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor parallelism: `tensor_parallel_size` ranks each hold a shard of the model and
    of the KV cache. Rank 0 runs in the engine's process and drives every step; ranks
    1.. run in Ray worker actors (platform/tp_workers.py), each reserving
    `worker_num_cpus` (and a GPU on CUDA). A collective that waits longer than
    `distributed_timeout_s` (a dead or stuck rank) fails the engine instead of hanging."""

    tensor_parallel_size: int = 1
    distributed_timeout_s: float = 60.0
    worker_num_cpus: float = 0.1

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.distributed_timeout_s <= 0:
            raise ValueError(f"distributed_timeout_s must be > 0, got {self.distributed_timeout_s}")
        if self.worker_num_cpus < 0:
            raise ValueError(f"worker_num_cpus must be >= 0, got {self.worker_num_cpus}")


SPECULATIVE_METHODS = ("ngram",)
SPECULATIVE_OPTION = "speculative_config"
"""The engine option that holds the speculative section as one mapping (vLLM's name)."""


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding, off by default (`method` None). vLLM's names and its option
    shape: the engine option `speculative_config={"method": "ngram",
    "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}`.

    'ngram' is prompt lookup (platform/spec_decode.py): the longest suffix of a
    request's tokens, from `prompt_lookup_max` down to `prompt_lookup_min` tokens, found
    earlier in its prompt + output proposes the up to `num_speculative_tokens` tokens
    that followed it there; one forward pass verifies them. When only one of the two
    lookup bounds is given the other takes its value; neither given: both are 3.
    """

    method: str | None = None
    num_speculative_tokens: int = 0
    prompt_lookup_min: int = 3
    prompt_lookup_max: int = 3

    def __post_init__(self) -> None:
        if self.method is None:
            return
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative_config.method must be one of {list(SPECULATIVE_METHODS)}, "
                f"got {self.method!r}"
            )
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"speculative_config.{name} must be an int >= 1, got {value!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"speculative_config.prompt_lookup_min ({self.prompt_lookup_min}) must be <= "
                f"prompt_lookup_max ({self.prompt_lookup_max})"
            )

    @property
    def enabled(self) -> bool:
        return self.method is not None

    @classmethod
    def from_option(cls, value: object) -> SpeculativeConfig:
        """The `speculative_config` engine option (None, a mapping, its JSON text as
        vLLM's command line takes it, or a config) -> a config; ValueError naming the
        key for unknown keys, a missing method or num_speculative_tokens, and bad
        values."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value or cls()
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                value = None
        if not isinstance(value, Mapping):
            raise ValueError(
                "speculative_config must be a mapping or its JSON text, e.g. "
                '{"method": "ngram", "num_speculative_tokens": 4}'
            )
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = [key for key in value if key not in names]
        if unknown:
            raise ValueError(
                f"unknown speculative_config key(s) {', '.join(map(repr, unknown))}; "
                f"valid keys: {', '.join(names)}"
            )
        for key in ("method", "num_speculative_tokens"):
            if value.get(key) is None:
                raise ValueError(f"speculative_config.{key} is required")
        given = dict(value)
        low, high = given.get("prompt_lookup_min"), given.get("prompt_lookup_max")
        if low is None and high is not None:
            given["prompt_lookup_min"] = high
        if high is None and low is not None:
            given["prompt_lookup_max"] = low
        return cls(**{key: item for key, item in given.items() if item is not None})


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)

    @classmethod
    def from_options(cls, model: str, options: Mapping[str, object]) -> EngineConfig:
        """The configs of `model` with flat user options (the `LLM(...)` keywords, a
        serve config's `engine` table): each option sets the field of that name in its
        section (`option_names()`), every other field keeps its dataclass default, and
        `dtype` goes through `parse_dtype_option`; `speculative_config` (one option, a
        mapping, as in vLLM) is the speculative section (`SpeculativeConfig.from_option`).
        TypeError names the options that are not fields (and lists the valid ones); a
        bad value raises its section's error."""
        valid = [name for name in cls.option_names() if name != "model"]
        unknown = [name for name in options if name not in valid]
        if unknown:
            raise TypeError(
                f"unknown engine option(s) {', '.join(map(repr, unknown))}; "
                f"valid options: {', '.join(valid)}"
            )
        values = {**options, "model": model}
        if "dtype" in values:
            values["dtype"] = parse_dtype_option(values["dtype"])
        sections = {
            "speculative": SpeculativeConfig.from_option(values.pop(SPECULATIVE_OPTION, None))
        }
        for section in cls._flat_sections():
            names = {f.name for f in dataclasses.fields(section.default_factory)}
            given = {name: value for name, value in values.items() if name in names}
            sections[section.name] = section.default_factory(**given)
        return cls(**sections)

    @classmethod
    def _flat_sections(cls) -> list[dataclasses.Field]:
        """The sections whose fields are options of their own name."""
        return [f for f in dataclasses.fields(cls) if f.name != "speculative"]

    @classmethod
    def option_names(cls) -> tuple[str, ...]:
        """Every field name of every flat section, then `speculative_config`, for CLI
        flags and error messages: the options `from_options` takes, and `model`, its
        own argument."""
        flat = tuple(
            f.name
            for section in cls._flat_sections()
            for f in dataclasses.fields(section.default_factory)
        )
        return (*flat, SPECULATIVE_OPTION)
