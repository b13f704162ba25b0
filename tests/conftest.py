"""Shared fixtures: tiny random HF models (with a tiny tokenizer) made in-process."""

from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest
import torch

from loraplex.platform.cpu_allocator import release_freed_memory

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# The device the Triton kernel tests (tests/kernels, tests/platform/test_triton_path.py)
# run on, read by those modules: 'cuda' compiles the kernels for the GPU, 'cpu' runs them
# under the Triton interpreter. Default: 'cuda' where a GPU is visible, else 'cpu';
# LORAPLEX_TEST_DEVICE=cpu forces the interpreter on a GPU machine too.
TEST_DEVICE_ENV = "LORAPLEX_TEST_DEVICE"
os.environ.setdefault(TEST_DEVICE_ENV, "cuda" if torch.cuda.is_available() else "cpu")
if os.environ[TEST_DEVICE_ENV] not in ("cpu", "cuda"):
    raise RuntimeError(f"{TEST_DEVICE_ENV}={os.environ[TEST_DEVICE_ENV]!r}; use 'cpu' or 'cuda'")
if os.environ[TEST_DEVICE_ENV] == "cuda" and not torch.cuda.is_available():
    raise RuntimeError(f"{TEST_DEVICE_ENV}=cuda but torch sees no CUDA device")
# Triton kernels run under the interpreter on CPU; it must be on before any @triton.jit.
if os.environ[TEST_DEVICE_ENV] == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")
torch.set_num_threads(min(2, os.cpu_count() or 1))

SESSION_RAY_PREFIX = "tests/deployments/"
"""Tests on the session's Ray cluster and Serve app (tests/deployments/conftest.py), but
for OWN_RAY_CLUSTER's modules: one pytest-xdist worker runs them all, in order."""
OWN_RAY_CLUSTER = (
    "tests/deployments/test_faults.py",
    "tests/deployments/test_serve_run.py",
    "tests/platform/parallel/",
    "tests/deployments/test_multinode.py",
)
"""Modules that start a Ray cluster of their own (`serve run`, two nodes, a local one for
tensor-parallel workers), in the order they run: collected last and scheduled as one
unit, so the worker that ran the tests without Ray takes them once it is done, beside
the session's cluster on the other worker (one cluster of their own at a time). The
two-node test runs last: its deploy took 581 s under the other worker's torch-heavy
tests against 94 s alone."""


SESSION_RAY_FIRST = ("tests/deployments/test_day_one.py",)
"""Session Ray modules whose bounds are a few seconds (first-token and inter-token
timeouts): they run first, while the other worker runs the tests without Ray, never
beside OWN_RAY_CLUSTER's (a CI VM stalled a replica 3 s with both clusters busy)."""


def _collection_band(nodeid: str) -> tuple[int, int]:
    """Where a test goes in the collection: the session's Ray tests first (their worker
    is the suite's long pole), SESSION_RAY_FIRST's ahead of the rest; then the tests
    without Ray; then OWN_RAY_CLUSTER's."""
    for order, prefix in enumerate(OWN_RAY_CLUSTER):
        if nodeid.startswith(prefix):
            return 2, order
    if nodeid.startswith(SESSION_RAY_FIRST):
        return 0, 0
    return (0, 1) if nodeid.startswith(SESSION_RAY_PREFIX) else (1, 0)


def pytest_collection_modifyitems(items):
    items.sort(key=lambda item: _collection_band(item.nodeid))


@pytest.fixture(scope="module", autouse=True)
def release_memory_after_the_module():
    """Engines a module built and dropped leave freed memory in malloc's arenas (the
    engine keeps freed memory for its steps: platform/cpu_allocator.py); a long-lived
    xdist worker hands it back after each module, so the two workers and the Ray
    replicas fit in the machine's memory together."""
    yield
    gc.collect()
    release_freed_memory()


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """xdist's scope scheduling, scopes handed out in collection order (pyproject:
    `--no-loadscope-reorder`): the session's Ray tests are one scope, the first, so one
    worker takes them whole; OWN_RAY_CLUSTER's modules are one scope, the last; every
    other module is a scope of its own."""
    from xdist.scheduler import LoadScopeScheduling

    class RayTestsTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            band, _ = _collection_band(nodeid)
            if band == 0:
                return "ray-session"
            if band == 2:
                return "ray-own-clusters"
            return super()._split_scope(nodeid)

    return RayTestsTogether(config, log)


TINY_VOCAB = 512


def save_tiny_tokenizer(folder: Path, vocab_size: int = TINY_VOCAB) -> None:
    """A word-level tokenizer whose every id decodes: 'w0' ... 'w{V-1}'; no EOS token."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(vocab_size)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="w0")
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}w1"
    tokenizer.save_pretrained(folder)


BYTE_EOS = "<|endoftext|>"
BYTE_CORPUS = [
    '{"name": "Ada", "age": 36, "tags": ["math", "code"], "ok": true, "score": -1.5e3}',
    '[1, 2, 3, null, false, {"a": {"b": [0.25, "x y z"]}}]',
    "yes no maybe 0123456789 abc-def_ghi ABC XYZ",
    "The quick brown fox jumps over the lazy dog. Le café, déjà vu: 中文 🙂",
] * 4


BYTE_CHAT_TEMPLATE = (
    "{% if tools %}{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}"
    'Call one with <tool_call>{"name": ..., "arguments": ...}</tool_call>\n{% endif %}'
    "{% for m in messages %}{% if m.tool_calls %}{% for call in m.tool_calls %}"
    "<tool_call>{{ {'name': call.function.name, 'arguments': call.function.arguments}"
    " | tojson }}</tool_call>\n{% endfor %}{% else %}{{ m['content'] }}\n{% endif %}"
    "{% endfor %}"
)
"""Text messages one per line; with tools, Hermes-style: each tool's JSON, and calls as
`<tool_call>` blocks (so `tool_choice: auto` is read back as tool calls)."""


def save_byte_tokenizer(folder: Path, vocab_size: int = TINY_VOCAB) -> None:
    """A byte-level BPE tokenizer trained in-process (so it can spell any text, JSON
    included) with `<|endoftext|>` as id 0 and EOS, and a Hermes-style chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BYTE_EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(BYTE_CORPUS, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=BYTE_EOS)
    tokenizer.chat_template = BYTE_CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)


def make_tiny_model(
    folder: Path, kind: str, seed: int = 0, tokenizer: str = "words", **overrides
) -> Path:
    """Saves a seeded random HF model of `kind` ('llama', 'llama3', 'qwen2', 'mistral')
    with a word-level tokenizer ('words': no EOS) or a byte-level one ('bytes': EOS is
    id 0, set as the model's EOS too)."""
    from transformers import (
        AutoModelForCausalLM,
        LlamaConfig,
        MistralConfig,
        Qwen2Config,
    )

    common = dict(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        tie_word_embeddings=False,
    )
    if tokenizer == "bytes":
        common["eos_token_id"] = 0
    common.update(overrides)
    if kind == "llama":
        config = LlamaConfig(**common)
    elif kind == "llama3":
        config = LlamaConfig(
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            **common,
        )
    elif kind == "qwen2":
        config = Qwen2Config(**common)
    elif kind == "mistral":
        config = MistralConfig(**common)
    else:
        raise ValueError(kind)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Random init is tiny and biases start at zero: widen the logits spread so greedy
    # picks are not near-ties, and give Qwen2's q/k/v biases real values to load.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("weight") and param.dim() == 2:
                param.normal_(0.0, 0.08)
            elif name.endswith("bias"):
                param.normal_(0.0, 0.1)
    model.save_pretrained(folder)
    if tokenizer == "bytes":
        save_byte_tokenizer(folder, config.vocab_size)
    else:
        save_tiny_tokenizer(folder, config.vocab_size)
    return folder


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory):
    cache: dict[tuple, Path] = {}

    def factory(kind: str = "llama", tokenizer: str = "words", **overrides) -> Path:
        key = (kind, tokenizer, tuple(sorted(overrides.items())))
        if key not in cache:
            folder = tmp_path_factory.mktemp(f"tiny-{kind}")
            cache[key] = make_tiny_model(folder, kind, tokenizer=tokenizer, **overrides)
        return cache[key]

    return factory


def make_peft_adapter(
    base_folder: Path,
    out_folder: Path,
    *,
    rank: int = 4,
    alpha: float = 8.0,
    target_modules: tuple[str, ...] = ("q_proj", "v_proj"),
    seed: int = 0,
    use_rslora: bool = False,
    rank_pattern: dict[str, int] | None = None,
    alpha_pattern: dict[str, float] | None = None,
    std: float = 0.05,
    modules_to_save: tuple[str, ...] = (),
    vocab_size: int | None = None,
) -> Path:
    """Saves a real PEFT LoRA adapter for the HF model in `base_folder` with seeded random
    A and B (PEFT starts B at zero, which would make the adapter a no-op). With
    `modules_to_save` ('lm_head', 'embed_tokens') the adapter also saves its own copies
    of those matrices, perturbed by seeded noise; `vocab_size` resizes the base's
    vocabulary first (new rows random too) and saves a tokenizer of that many words
    beside the adapter."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_folder, dtype=torch.float32)
    if vocab_size is not None:
        base.resize_token_embeddings(vocab_size, mean_resizing=False)
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        target_modules=list(target_modules),
        lora_dropout=0.0,
        use_rslora=use_rslora,
        rank_pattern=rank_pattern or {},
        alpha_pattern=alpha_pattern or {},
        modules_to_save=list(modules_to_save) or None,
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(base, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * std)
            elif "modules_to_save" in name:
                param.add_(torch.randn(param.shape, generator=generator) * 0.08)
    model.save_pretrained(out_folder)
    if vocab_size is not None:
        save_tiny_tokenizer(out_folder, vocab_size)
    return out_folder


def load_peft_oracle(base_folder: Path, adapter_folder: Path | None):
    """The oracle: PEFT's unmerged adapter (or the bare base) on HF transformers, in
    eval mode; the base's vocabulary resized first to the adapter's saved modules'."""
    from peft import PeftModel
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_folder, dtype=torch.float32)
    if adapter_folder is not None:
        with safe_open(str(adapter_folder / "adapter_model.safetensors"), "pt") as weights:
            rows = [
                weights.get_slice(name).get_shape()[0]
                for name in weights.keys()  # noqa: SIM118 (safe_open is not a mapping)
                if name.endswith(("lm_head.weight", "embed_tokens.weight"))
            ]
        if rows and rows[0] != model.config.vocab_size:
            model.resize_token_embeddings(rows[0], mean_resizing=False)
        model = PeftModel.from_pretrained(model, adapter_folder)
    return model.eval()


@pytest.fixture(scope="session")
def peft_adapter_factory():
    """`make_peft_adapter` as a fixture (test modules can't import a conftest by name)."""
    return make_peft_adapter


def greedy_continuations(model, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    """An HF model's greedy continuation of each prompt, one at a time, exactly
    `max_new` tokens (no EOS)."""
    outputs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            generated = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
            outputs.append(generated[0, len(prompt) :].tolist())
    return outputs


def load_quantized_checkpoint_oracle(folder: Path, adapter_folder: Path | None = None):
    """transformers on a compressed-tensors checkpoint's dequantized weights (each int8
    projection's weight times its `weight_scale`; each packed one's unpacked groups
    (kernels/int_packing.py) minus their zero points times their scales:
    kernels/int4_matmul.py), PEFT's adapter on top."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from loraplex.kernels.int4_matmul import dequantize_int4
    from loraplex.kernels.int_packing import unpack_ints

    config = AutoConfig.from_pretrained(folder)
    packed = config.quantization_config.get("format") == "pack-quantized"
    weight_args = config.quantization_config["config_groups"]["group_0"]["weights"]
    group_size, bits = weight_args["group_size"], weight_args["num_bits"]
    del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    stored = load_file(folder / "model.safetensors")
    weights: dict[str, torch.Tensor] = {}
    for name, tensor in stored.items():
        if name.endswith("_packed"):
            stem = name.removesuffix("_packed")
            rows, columns = stored[stem + "_shape"].tolist()
            zero = stored.get(stem + "_zero_point")
            if zero is not None:
                zero = unpack_ints(zero.t().contiguous(), rows, bits).t()
            quantized = unpack_ints(tensor, columns, bits)
            scale = stored[stem + "_scale"].float()
            weights[stem] = dequantize_int4(quantized, scale, zero, group_size or columns)
        elif packed and name.endswith(("_scale", "_shape", "_zero_point")):
            continue
        elif name + "_scale" in stored:
            weights[name] = tensor.float() * stored[name + "_scale"].float()
        elif not name.endswith("_scale"):
            weights[name] = tensor.float()
    model.load_state_dict(weights)
    if adapter_folder is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter_folder)
    return model.eval()


def teacher_forced_logprobs(model, prompt: list[int]) -> torch.Tensor:
    """[len - 1] each prompt token's logprob given the ones before it, from an HF model."""
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([prompt])).logits[0].float()
    return logits.log_softmax(-1)[:-1].gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]


@pytest.fixture(scope="session")
def peft_oracle():
    """`load_peft_oracle` as a fixture."""
    return load_peft_oracle


@pytest.fixture(scope="session")
def hf_greedy():
    """`greedy_continuations` as a fixture."""
    return greedy_continuations


@pytest.fixture(scope="session")
def quantized_checkpoint_oracle():
    """`load_quantized_checkpoint_oracle` as a fixture."""
    return load_quantized_checkpoint_oracle


@pytest.fixture(scope="session")
def hf_prompt_logprobs():
    """`teacher_forced_logprobs` as a fixture."""
    return teacher_forced_logprobs
