"""Load a PEFT LoRA adapter directory and check it can be served on a given base model.

A PEFT adapter directory holds `adapter_config.json` and `adapter_model.safetensors`
with one `lora_A` [r, in] and one `lora_B` [out, r] tensor per adapted projection, named
like `base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight`. Everything is
validated before a `LoRAAdapter` is returned; anything we cannot serve exactly raises
`AdapterError` naming the problem and the offending value.

PEFT's `modules_to_save` for `lm_head` and `embed_tokens` is served too: the adapter
then carries whole copies of those matrices, `base_model.model.lm_head.weight` and
`base_model.model.model.embed_tokens.weight`, each [vocab, hidden]. Their vocabulary may
be larger than the base's (a resized vocabulary) up to `max_vocab_size`.

The returned B already carries the module's scaling (alpha / r, or alpha / sqrt(r) with
rsLoRA, after PEFT's `rank_pattern` / `alpha_pattern`), so the delta is `x @ A.T @ B.T`.

Adapters come from tenants, so a file can be hostile; loading one must never hurt the
server:
- files: with a `root` (a tenant's adapter root) the folder is reached from `root` and
  both files are opened without following any symbolic link (adapters/safe_files.py),
  and are read only through those descriptors, so what is checked is what is read;
- adapter_config.json: at most 1 MiB, strict JSON (no NaN / Infinity, no number that
  overflows to infinity, bounded nesting); `r` and the `rank_pattern` values are
  integers >= 1, `lora_alpha` and the `alpha_pattern` values finite numbers > 0;
- pattern keys are never run as regexes: a key matches a module name when it is the
  name or a dotted suffix of it, or, with `*`, `?` or `[`, when it globs the name or a
  dotted suffix (fnmatch's semantics, matched by adapters/module_globs.py without
  compiling a regex); keys with regex-only syntax are refused;
- adapter_model.safetensors: the header (at most 16 MiB) is parsed and checked first:
  dtypes, shapes, offsets that tile the data region, the file's exact size, then tensor
  names, shapes and ranks (<= max_rank, = the config's r). Only then is the data region,
  whose size those checks bound, read;
- the tensors, and each B after scaling, must be finite.

`validate_peft_adapter` runs every check without building the engine's tensors: it reads
and converts with numpy and imports no torch, for the ingress, which validates a
registration in its own process.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import re
import reprlib
from collections.abc import Mapping
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from loraplex.adapters import safe_files
from loraplex.adapters.module_globs import ModuleGlob

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
PICKLED_WEIGHTS_NAME = "adapter_model.bin"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)
"""What an adapter with a resized vocabulary ships its tokenizer as (tokenizer.json
required: a fast tokenizer, read without running code)."""
_TOKENIZER_FILE_LIMIT = 64 << 20

SUPPORTED_MODULES: tuple[str, ...] = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
)
_ATTENTION_MODULES = SUPPORTED_MODULES[:4]
_PARENT = {m: "self_attn" if m in _ATTENTION_MODULES else "mlp" for m in SUPPORTED_MODULES}
SAVED_MODULES: dict[str, str] = {
    "embed_tokens": "base_model.model.model.embed_tokens.weight",
    "lm_head": "base_model.model.lm_head.weight",
}
"""`modules_to_save` entries loraplex serves -> the tensor PEFT saves each as."""
_SAVED_MODULE_OF = {tensor: module for module, tensor in SAVED_MODULES.items()}
_SAVED_TENSOR = re.compile(
    r"base_model\.model\.(?P<module>model\.embed_tokens|lm_head)"
    r"(?P<part>\.modules_to_save|\.original_module)?\.weight"
)
_TENSOR_NAME = re.compile(
    r"base_model\.model\.(?P<key>model\.layers\.(?P<layer>0|[1-9]\d{0,8})\."
    r"(?P<parent>self_attn|mlp)\.(?P<module>\w+))\.lora_(?P<ab>[AB])\.weight"
)

# Config fields that change the forward math in ways we do not implement: field -> the
# values that are harmless (PEFT's defaults, plus their empty spellings).
_REJECTED_UNLESS: dict[str, tuple[Any, ...]] = {
    "use_dora": (False, None),
    "fan_in_fan_out": (False, None),
    "bias": ("none", None),
    "lora_bias": (False, None),
    "trainable_token_indices": (None, [], {}),
    "use_qalora": (False, None),
    "alora_invocation_tokens": (None, []),
    "layer_replication": (None, []),
    "target_parameters": (None, []),
    "use_bdlora": (None, {}),
    "arrow_config": (None, {}),
    "kasa_config": (None, {}),
}
# Initialisations that rewrite the base weights (W - B A, quantised residual...): such an
# adapter only fits the modified base unless PEFT converted it back when saving.
_BASE_MODIFYING_INITS = ("pissa", "olora", "corda", "loftq", "lora_ga")
# What PEFT's LoraConfig assumes when a key is absent from the file.
_PEFT_DEFAULTS = {"r": 8, "lora_alpha": 8}

_CONFIG_SIZE_LIMIT = 1 << 20
_HEADER_SIZE_LIMIT = 16 << 20
_PATTERN_KEYS_LIMIT = 1024
_PATTERN_KEY_LENGTH_LIMIT = 256
_GLOB_CHARS = frozenset("*?[")
_REGEX_ONLY_CHARS = frozenset("\\(){}+^$|")
# safetensors dtype -> (torch dtype name, bytes per element); only _SERVABLE ones load.
_DTYPES: dict[str, tuple[str, int]] = {
    "BOOL": ("torch.bool", 1),
    "U8": ("torch.uint8", 1),
    "I8": ("torch.int8", 1),
    "F8_E5M2": ("torch.float8_e5m2", 1),
    "F8_E4M3": ("torch.float8_e4m3fn", 1),
    "I16": ("torch.int16", 2),
    "U16": ("torch.uint16", 2),
    "F16": ("torch.float16", 2),
    "BF16": ("torch.bfloat16", 2),
    "I32": ("torch.int32", 4),
    "U32": ("torch.uint32", 4),
    "F32": ("torch.float32", 4),
    "I64": ("torch.int64", 8),
    "U64": ("torch.uint64", 8),
    "F64": ("torch.float64", 8),
}
# The servable safetensors dtypes, as little-endian numpy dtypes of their bits; BF16 has
# no numpy dtype and becomes float32 by its bits (_as_float32).
_SERVABLE = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype("<u2")}
_NEED_FLOAT = "need floating point (torch.float32, torch.float16 or torch.bfloat16)"
_TENSOR_FIELDS = frozenset({"dtype", "shape", "data_offsets"})


class AdapterError(ValueError):
    """An adapter directory that cannot be served; the message says why."""


@dataclass(frozen=True)
class LoRAModuleWeights:
    """One adapted projection: delta(x) = x @ a.T @ b.T (b already scaled)."""

    a: torch.Tensor
    b: torch.Tensor
    scaling: float

    @property
    def rank(self) -> int:
        return self.a.shape[0]


@dataclass(frozen=True)
class LoRAAdapter:
    """A validated adapter; `key` identifies its content, not its name or location."""

    name: str
    path: Path
    key: bytes
    modules: Mapping[tuple[int, str], LoRAModuleWeights]
    saved_modules: Mapping[str, torch.Tensor] = dataclasses.field(
        default_factory=lambda: MappingProxyType({})
    )
    """`modules_to_save` name ('embed_tokens', 'lm_head') -> the adapter's float32 copy of
    that matrix, [vocab_size, hidden]; a module absent here is the base model's."""
    tokenizer: Any = None
    """The adapter's own HF tokenizer, when its vocabulary is resized (None: the base
    model's tokenizer serves it)."""

    @property
    def rank(self) -> int:
        return max(m.rank for m in self.modules.values())

    @property
    def vocab_size(self) -> int | None:
        """Rows of the adapter's saved embedding / LM head (None: it saves neither)."""
        return next((t.shape[0] for t in self.saved_modules.values()), None)

    @property
    def target_modules(self) -> frozenset[str]:
        return frozenset(module for _, module in self.modules)

    @property
    def num_bytes(self) -> int:
        """Host memory of its tensors: the LoRA pairs and the saved modules."""
        pairs = sum(t.numel() * t.element_size() for m in self.modules.values() for t in (m.a, m.b))
        return pairs + sum(t.numel() * t.element_size() for t in self.saved_modules.values())

    @property
    def key_hex(self) -> str:
        return self.key.hex()

    def __reduce__(self) -> tuple[object, tuple[object, ...]]:
        """Picklable (the read-only module map is rebuilt): tensor-parallel workers get
        the adapters rank 0 writes into its slots."""
        return _rebuild_adapter, (
            self.name,
            self.path,
            self.key,
            dict(self.modules),
            dict(self.saved_modules),
            self.tokenizer,
        )


def _rebuild_adapter(
    name: str,
    path: Path,
    key: bytes,
    modules: dict[tuple[int, str], LoRAModuleWeights],
    saved_modules: dict[str, torch.Tensor],
    tokenizer: Any,
) -> LoRAAdapter:
    return LoRAAdapter(
        name, path, key, MappingProxyType(modules), MappingProxyType(saved_modules), tokenizer
    )


class BaseModelShape(Protocol):
    """The base model's sizes an adapter is checked against (the platform's
    `ModelArch` has them)."""

    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int


def expected_lora_shapes(arch: BaseModelShape) -> dict[str, tuple[int, int]]:
    """(out_features, in_features) of each supported base projection."""
    q_out = arch.num_heads * arch.head_dim
    kv_out = arch.num_kv_heads * arch.head_dim
    return {
        "q_proj": (q_out, arch.hidden_size),
        "k_proj": (kv_out, arch.hidden_size),
        "v_proj": (kv_out, arch.hidden_size),
        "o_proj": (arch.hidden_size, q_out),
        "gate_proj": (arch.intermediate_size, arch.hidden_size),
        "up_proj": (arch.intermediate_size, arch.hidden_size),
        "down_proj": (arch.hidden_size, arch.intermediate_size),
    }


@dataclass(frozen=True)
class _CheckedAdapter:
    """A folder's adapter after every check: float32 A and scaled B per module and the
    saved modules' float32 matrices, as numpy arrays, and the content key."""

    key: bytes
    modules: dict[tuple[int, str], tuple[np.ndarray, np.ndarray, float]]
    saved_modules: dict[str, np.ndarray]
    tokenizer_files: dict[str, bytes | bytearray]
    """TOKENIZER_FILES present in the folder, by name (read only for a resized
    vocabulary; empty otherwise)."""


def _check_adapter(
    path: Path,
    arch: BaseModelShape,
    max_rank: int,
    root: str | Path | None,
    max_vocab_size: int | None,
) -> _CheckedAdapter:
    follow_links = root is None
    with ExitStack() as stack:
        folder_fd = _enter_folder(stack, path, root)
        config = _read_config(stack, folder_fd, path, follow_links)
        weights_fd = _enter_weights(stack, folder_fd, path, follow_links)
        _check_config_is_plain_lora(config)
        header = _read_header(weights_fd, path / WEIGHTS_NAME)
        saved = _saved_module_tensors(config, header.entries, arch, max_vocab_size)
        lora_entries = {n: e for n, e in header.entries.items() if n not in saved.names}
        pairs = _pair_lora_tensors(lora_entries, arch)
        scalings = _module_scalings(config, pairs, header.entries, max_rank)
        vocab = next((header.entries[n].shape[0] for n in saved.weights.values()), None)
        tokenizer_files = {}
        if vocab is not None and vocab != arch.vocab_size:
            tokenizer_files = _read_tokenizer_files(stack, folder_fd, path, follow_links)
            _check_tokenizer_fits(tokenizer_files, vocab, path)
        data = _read_tensor_data(weights_fd, header, path / WEIGHTS_NAME)
    modules = {
        key: (*_module_arrays(header.entries, data, *pairs[key], scaling), scaling)
        for key, scaling in scalings.items()
    }
    saved_arrays = {}
    for module, tensor_name in saved.weights.items():
        saved_arrays[module] = _as_float32(header.entries[tensor_name], data[tensor_name])
        _check_finite(tensor_name, saved_arrays[module])
    for copy, original in saved.copies.items():
        if header.entries[copy].dtype != header.entries[original].dtype or bytes(
            data[copy]
        ) != bytes(data[original]):
            raise AdapterError(f"tensor {copy!r} does not repeat {original!r}")
    key = _identity_key(scalings, header.entries, data)
    return _CheckedAdapter(key, modules, saved_arrays, tokenizer_files)


def validate_peft_adapter(
    path: str | Path,
    arch: BaseModelShape,
    max_rank: int,
    root: str | Path | None = None,
    max_vocab_size: int | None = None,
) -> None:
    """Every check of `load_peft_adapter`, with the same AdapterError, and no torch: the
    ingress validates a registration with it and leaves loading to the replicas."""
    _check_adapter(Path(path), arch, max_rank, root, max_vocab_size)


def load_peft_adapter(
    path: str | Path,
    arch: BaseModelShape,
    max_rank: int,
    name: str | None = None,
    root: str | Path | None = None,
    max_vocab_size: int | None = None,
) -> LoRAAdapter:
    """Reads and validates a PEFT LoRA directory; AdapterError if it cannot be served.

    `root`: a tenant's adapter root; `path` must then lie under it, and neither the
    folder nor its files may be (or be reached through) a symbolic link. Without a root
    `path` is opened as given. `max_vocab_size`: the most rows a saved embedding or LM
    head may have (None: the base's vocabulary, no resizing)."""
    import torch

    path = Path(path)
    checked = _check_adapter(path, arch, max_rank, root, max_vocab_size)
    modules = {
        key: LoRAModuleWeights(a=torch.from_numpy(a), b=torch.from_numpy(b), scaling=scaling)
        for key, (a, b, scaling) in checked.modules.items()
    }
    adapter = LoRAAdapter(
        name=name if name is not None else path.name,
        path=path,
        key=checked.key,
        modules=MappingProxyType(modules),
        saved_modules=MappingProxyType(
            {module: torch.from_numpy(array) for module, array in checked.saved_modules.items()}
        ),
        tokenizer=_build_tokenizer(checked.tokenizer_files, path)
        if checked.tokenizer_files
        else None,
    )
    logger.info(
        "loaded adapter %r from %s: %d modules, rank %d, saved modules %s, %d bytes, key %s",
        adapter.name,
        path,
        len(modules),
        adapter.rank,
        sorted(adapter.saved_modules) or "none",
        adapter.num_bytes,
        adapter.key_hex,
    )
    return adapter


def _layer_then_module(key: tuple[int, str]) -> tuple[int, int]:
    layer, module = key
    return layer, SUPPORTED_MODULES.index(module)


def _module_arrays(
    entries: Mapping[str, _TensorEntry],
    data: dict[str, bytes | bytearray],
    a_name: str,
    b_name: str,
    scaling: float,
) -> tuple[np.ndarray, np.ndarray]:
    """float32 A and scaled B, both checked finite (the scaling can overflow B)."""
    a32 = _as_float32(entries[a_name], data[a_name])
    b32 = _as_float32(entries[b_name], data[b_name])
    _check_finite(a_name, a32)
    _check_finite(b_name, b32)
    with np.errstate(over="ignore", invalid="ignore"):  # refused just below, by name
        b32 = b32 * np.float32(scaling)
    if not np.isfinite(b32).all():
        raise AdapterError(
            f"tensor {b_name!r} times its scaling {scaling!r} (lora_alpha / r) overflows "
            "float32 to NaN or Inf"
        )
    return a32, b32


def _as_float32(entry: _TensorEntry, data: bytes | bytearray) -> np.ndarray:
    """A (servable) tensor's stored bytes as a new, writable float32 array of its shape;
    bf16 widens by its bits (the upper half of a float32), like every conversion exact."""
    stored = np.frombuffer(data, dtype=_SERVABLE[entry.dtype])
    if entry.dtype == "BF16":
        values = (stored.astype(np.uint32) << 16).view(np.float32)
    else:
        values = stored.astype(np.float32)
    return values.reshape(entry.shape)


# --- files ---------------------------------------------------------------------------


def _enter_folder(stack: ExitStack, path: Path, root: str | Path | None) -> int:
    try:
        return stack.enter_context(safe_files.open_folder(path, root))
    except FileNotFoundError:
        raise AdapterError(f"adapter directory {str(path)!r} does not exist") from None
    except NotADirectoryError:
        raise AdapterError(f"adapter path {str(path)!r} is not a directory") from None
    except OSError as err:  # safe_files.UnsafePathError among them
        raise AdapterError(f"adapter directory {str(path)!r} refused: {err}") from None


def _enter_file(stack: ExitStack, folder_fd: int, file_name: str, follow_links: bool) -> int:
    return stack.enter_context(safe_files.open_regular_file(folder_fd, file_name, follow_links))


def _read_config(
    stack: ExitStack, folder_fd: int, path: Path, follow_links: bool
) -> dict[str, Any]:
    try:
        fd = _enter_file(stack, folder_fd, CONFIG_NAME, follow_links)
        size = os.fstat(fd).st_size
        if size > _CONFIG_SIZE_LIMIT:
            raise AdapterError(
                f"{CONFIG_NAME} in {str(path)!r} is {size} bytes, over the "
                f"{_CONFIG_SIZE_LIMIT}-byte limit"
            )
        raw = safe_files.read_at(fd, 0, size)
    except FileNotFoundError:
        raise AdapterError(f"{CONFIG_NAME} is missing in {str(path)!r}") from None
    except OSError as err:  # safe_files.UnsafePathError among them
        raise AdapterError(f"cannot read {CONFIG_NAME} in {str(path)!r}: {err}") from None
    config_path = path / CONFIG_NAME
    try:
        config = _strict_json(raw)
    except ValueError as err:
        raise AdapterError(f"{config_path} is not valid JSON: {err}") from None
    if not isinstance(config, dict):
        raise AdapterError(f"{config_path} must hold a JSON object, got {type(config).__name__}")
    return config


def _enter_weights(stack: ExitStack, folder_fd: int, path: Path, follow_links: bool) -> int:
    try:
        return _enter_file(stack, folder_fd, WEIGHTS_NAME, follow_links)
    except FileNotFoundError:
        if safe_files.exists(folder_fd, PICKLED_WEIGHTS_NAME):
            raise AdapterError(
                f"{str(path)!r} has only {PICKLED_WEIGHTS_NAME}: pickled .bin adapters are not "
                f"supported, convert it to {WEIGHTS_NAME}"
            ) from None
        raise AdapterError(f"{WEIGHTS_NAME} is missing in {str(path)!r}") from None
    except OSError as err:  # safe_files.UnsafePathError among them
        raise AdapterError(f"cannot read {WEIGHTS_NAME} in {str(path)!r}: {err}") from None


class _NonFiniteNumber(ValueError):
    """A NaN / Infinity literal, or a number literal beyond the float range."""


def _refuse_constant(literal: str) -> float:
    raise _NonFiniteNumber(f"{literal} is not a finite number")


def _finite_float(literal: str) -> float:
    value = float(literal)
    if not math.isfinite(value):
        raise _NonFiniteNumber(f"{reprlib.repr(literal)} overflows to {value}")
    return value


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise ValueError(f"duplicate key {reprlib.repr(key)}")
        result[key] = value
    return result


def _strict_json(raw: bytes | bytearray, unique_keys: bool = False) -> Any:
    """JSON without NaN / Infinity literals or numbers that overflow to infinity;
    ValueError (with the reason) for anything else, deep nesting included."""
    try:
        return json.loads(
            raw.decode("utf-8"),
            parse_constant=_refuse_constant,
            parse_float=_finite_float,
            object_pairs_hook=_unique_keys if unique_keys else None,
        )
    except RecursionError:
        raise ValueError("nested too deeply") from None


# --- config --------------------------------------------------------------------------


@dataclass(frozen=True)
class _SavedTensors:
    """Where a file holds its saved modules: each module's weights, the copies PEFT
    saves beside them (`<module>.modules_to_save.weight`, which must be equal), and the
    base's own resized matrices (`<module>.original_module.weight`, unused by an enabled
    adapter)."""

    weights: dict[str, str]
    """module -> tensor name"""
    copies: dict[str, str]
    """copy tensor name -> the weights' tensor name it repeats"""
    names: frozenset[str]
    """Every tensor name above, the ignored originals included."""


def _saved_module_tensors(
    config: dict[str, Any],
    entries: Mapping[str, _TensorEntry],
    arch: BaseModelShape,
    max_vocab_size: int | None,
) -> _SavedTensors:
    """The file's saved modules, after checking `modules_to_save`, the tensors' shapes
    and their vocabulary against the cap. As PEFT loads them: a module's weights in the
    file are this adapter's, listed in `modules_to_save` or not (PEFT saves a resized
    base's embedding layers unlisted); a listed module without them keeps the base's."""
    listed = config.get("modules_to_save") or []
    if not isinstance(listed, list) or not all(m in SAVED_MODULES for m in listed):
        raise AdapterError(
            f"modules_to_save={reprlib.repr(listed)} is not supported: only "
            f"{sorted(SAVED_MODULES)} can be saved modules"
        )
    weights: dict[str, str] = {}
    copies: dict[str, str] = {}
    names: set[str] = set()
    for tensor_name, entry in entries.items():
        match = _SAVED_TENSOR.fullmatch(tensor_name)
        if match is None:
            continue
        names.add(tensor_name)
        if entry.dtype not in _SERVABLE:
            raise AdapterError(
                f"tensor {tensor_name!r} has dtype {entry.torch_dtype_name}, {_NEED_FLOAT}"
            )
        if len(entry.shape) != 2 or entry.shape[1] != arch.hidden_size:
            raise AdapterError(
                f"tensor {tensor_name!r} has shape {reprlib.repr(list(entry.shape))}, expected "
                f"[vocab, {arch.hidden_size}] for this base model"
            )
        module = _SAVED_MODULE_OF[f"base_model.model.{match['module']}.weight"]
        if match["part"] == ".modules_to_save":
            copies[tensor_name] = SAVED_MODULES[module]
        elif match["part"] is None:
            weights[module] = tensor_name
    for copy, original in copies.items():
        if original not in entries or entries[original].shape != entries[copy].shape:
            raise AdapterError(f"tensor {copy!r} does not repeat {original!r}")
    sizes = {entries[name].shape[0] for name in weights.values()}
    if len(sizes) > 1:
        raise AdapterError(
            f"the saved embed_tokens and lm_head have different vocabularies ({sorted(sizes)})"
        )
    vocab = sizes.pop() if sizes else arch.vocab_size
    cap = max(arch.vocab_size, max_vocab_size or 0)
    if not arch.vocab_size <= vocab <= cap:
        raise AdapterError(
            f"the saved modules have a vocabulary of {vocab} tokens; this model serves "
            f"{arch.vocab_size} to {cap} (max_adapter_vocab_size)"
        )
    if vocab != arch.vocab_size and len(weights) != len(SAVED_MODULES):
        raise AdapterError(
            f"a resized vocabulary ({vocab} tokens, the base has {arch.vocab_size}) needs "
            "the adapter's own embed_tokens and lm_head"
        )
    return _SavedTensors(weights, copies, frozenset(names))


def _read_tokenizer_files(
    stack: ExitStack, folder_fd: int, path: Path, follow_links: bool
) -> dict[str, bytes | bytearray]:
    """The TOKENIZER_FILES the folder holds (tokenizer.json at least), each read through
    its own descriptor, like the weights."""
    files: dict[str, bytes | bytearray] = {}
    for name in TOKENIZER_FILES:
        try:
            fd = _enter_file(stack, folder_fd, name, follow_links)
        except FileNotFoundError:
            continue
        except OSError as err:  # safe_files.UnsafePathError among them
            raise AdapterError(f"cannot read {name} in {str(path)!r}: {err}") from None
        size = os.fstat(fd).st_size
        if size > _TOKENIZER_FILE_LIMIT:
            raise AdapterError(
                f"{name} in {str(path)!r} is {size} bytes, over the "
                f"{_TOKENIZER_FILE_LIMIT}-byte limit"
            )
        files[name] = safe_files.read_at(fd, 0, size)
    if "tokenizer.json" not in files:
        raise AdapterError(
            f"{str(path)!r} resizes the vocabulary but ships no tokenizer.json: its new "
            "tokens could not be read or written as text"
        )
    return files


def _check_tokenizer_fits(files: dict[str, bytes | bytearray], vocab: int, path: Path) -> None:
    """The shipped tokenizer parses (the Rust library, no code run) and every id it
    makes has a row in the adapter's embedding and LM head."""
    from tokenizers import Tokenizer

    try:
        size = Tokenizer.from_str(bytes(files["tokenizer.json"]).decode()).get_vocab_size(
            with_added_tokens=True
        )
    except Exception as err:  # the library raises plain Exceptions for a bad file
        raise AdapterError(f"tokenizer.json in {str(path)!r} cannot be read: {err}") from None
    if size > vocab:
        raise AdapterError(
            f"the tokenizer in {str(path)!r} has {size} tokens, more than the {vocab} rows "
            "of the adapter's saved embedding and LM head"
        )


def _build_tokenizer(files: dict[str, bytes | bytearray], path: Path) -> Any:
    """The HF tokenizer of checked TOKENIZER_FILES: written to a private folder and
    loaded from there, from local files, running no code the folder ships."""
    import tempfile

    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory(prefix="loraplex-adapter-tokenizer-") as folder:
        for name, data in files.items():
            Path(folder, name).write_bytes(data)
        try:
            return AutoTokenizer.from_pretrained(
                folder, local_files_only=True, trust_remote_code=False
            )
        except (OSError, ValueError, KeyError) as err:
            raise AdapterError(f"the tokenizer in {str(path)!r} cannot be loaded: {err}") from None


def _check_config_is_plain_lora(config: dict[str, Any]) -> None:
    """Rejects other PEFT methods and LoRA variants whose forward we do not implement."""
    peft_type = config.get("peft_type")
    if peft_type != "LORA":
        raise AdapterError(f"peft_type {peft_type!r} is not supported; only 'LORA' adapters are")
    if config.get("use_dora"):
        raise AdapterError("DoRA is not supported (use_dora=true)")
    for field, harmless in _REJECTED_UNLESS.items():
        value = config.get(field)
        if not any(value == ok and type(value) is type(ok) for ok in harmless):
            raise AdapterError(f"{field}={value!r} is not supported (need one of {harmless})")
    init = config.get("init_lora_weights", True)
    if isinstance(init, str) and init.startswith(_BASE_MODIFYING_INITS):
        raise AdapterError(
            f"init_lora_weights={init!r} adapters were trained on modified base weights; "
            "save them with path_initial_model_for_weight_conversion first"
        )
    _check_scaling_fields(config)


def _check_scaling_fields(config: dict[str, Any]) -> None:
    """r and the rank_pattern values are integer ranks >= 1, lora_alpha and the
    alpha_pattern values finite numbers > 0, use_rslora a boolean; pattern keys are
    module-name suffixes or globs."""
    _check_rank("r", config.get("r", _PEFT_DEFAULTS["r"]))
    _check_alpha("lora_alpha", config.get("lora_alpha", _PEFT_DEFAULTS["lora_alpha"]))
    use_rslora = config.get("use_rslora")
    if use_rslora is not None and not isinstance(use_rslora, bool):
        raise AdapterError(
            f"use_rslora={reprlib.repr(use_rslora)} in {CONFIG_NAME} must be true or false"
        )
    for field, check in (("rank_pattern", _check_rank), ("alpha_pattern", _check_alpha)):
        pattern = config.get(field)
        if pattern is None:
            continue
        if not isinstance(pattern, dict):
            raise AdapterError(
                f"{field}={reprlib.repr(pattern)} in {CONFIG_NAME} must be an object"
            )
        if len(pattern) > _PATTERN_KEYS_LIMIT:
            raise AdapterError(
                f"{field} in {CONFIG_NAME} has {len(pattern)} keys, over the limit of "
                f"{_PATTERN_KEYS_LIMIT}"
            )
        for key, value in pattern.items():
            _check_pattern_key(field, key)
            check(f"{field}[{reprlib.repr(key)}]", value)


def _check_rank(where: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise AdapterError(
            f"{where}={reprlib.repr(value)} in {CONFIG_NAME} must be a positive number: "
            "an integer rank >= 1"
        )


def _check_alpha(where: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        ok = False
    else:
        try:
            ok = math.isfinite(float(value))
        except OverflowError:  # an integer beyond the float range
            ok = False
    if not ok:
        raise AdapterError(
            f"{where}={reprlib.repr(value)} in {CONFIG_NAME} must be a positive number: "
            "finite and > 0"
        )


def _check_pattern_key(field: str, key: str) -> None:
    """Keys are dotted module-name suffixes or globs; regex-only syntax is refused here
    so that no key is ever run as a regular expression."""
    if not 1 <= len(key) <= _PATTERN_KEY_LENGTH_LIMIT:
        raise AdapterError(
            f"{field} key {reprlib.repr(key)} in {CONFIG_NAME} must be 1 to "
            f"{_PATTERN_KEY_LENGTH_LIMIT} characters long"
        )
    regex_only = sorted(_REGEX_ONLY_CHARS.intersection(key))
    if regex_only:
        raise AdapterError(
            f"{field} key {reprlib.repr(key)} in {CONFIG_NAME} uses {''.join(regex_only)!r}, "
            "so it is not a valid regex-free key: pattern keys are module-name suffixes or "
            "globs, not regular expressions"
        )


def _module_scalings(
    config: dict[str, Any],
    pairs: dict[tuple[int, str], tuple[str, str]],
    entries: Mapping[str, _TensorEntry],
    max_rank: int,
) -> dict[tuple[int, str], float]:
    """(layer, module) -> scaling, in layer-then-module order, checking each module's
    ranks against max_rank and against the config's r for it (all from the header)."""
    rank_rules = _pattern_rules(config.get("rank_pattern") or {})
    alpha_rules = _pattern_rules(config.get("alpha_pattern") or {})
    scalings: dict[tuple[int, str], float] = {}
    for key in sorted(pairs, key=_layer_then_module):
        a_name, b_name = pairs[key]
        _check_ranks(a_name, entries[a_name].shape, b_name, entries[b_name].shape, max_rank)
        module_key = _module_key(a_name)
        r = _pattern_value(rank_rules, module_key, config.get("r", _PEFT_DEFAULTS["r"]))
        alpha = _pattern_value(
            alpha_rules, module_key, config.get("lora_alpha", _PEFT_DEFAULTS["lora_alpha"])
        )
        scalings[key] = _scaling(module_key, entries[a_name].shape[0], r, alpha, config)
    return scalings


def _scaling(
    module_key: str, tensor_rank: int, r: int, alpha: float, config: dict[str, Any]
) -> float:
    if r != tensor_rank:
        raise AdapterError(
            f"{module_key} has rank {tensor_rank} in {WEIGHTS_NAME} but {CONFIG_NAME} "
            f"gives r={reprlib.repr(r)} for it"
        )
    if config.get("use_rslora"):
        return float(alpha) / math.sqrt(r)
    return float(alpha) / r


@dataclass(frozen=True)
class _PatternRule:
    """One rank_pattern / alpha_pattern key: a literal dotted suffix, or a glob that
    matches the module name or any of its dotted suffixes (adapters/module_globs.py:
    fnmatch's semantics, no regular expression compiled)."""

    literal: str | None
    glob: ModuleGlob | None
    value: Any

    def matches(self, suffixes: frozenset[str]) -> bool:
        if self.glob is not None:
            return any(self.glob.fullmatch(suffix) for suffix in suffixes)
        return self.literal in suffixes


def _pattern_rules(pattern: dict[str, Any]) -> list[_PatternRule]:
    """The keys in file order (PEFT's: the first key that matches wins)."""
    rules = []
    for key, value in pattern.items():
        if _GLOB_CHARS.isdisjoint(key):
            rules.append(_PatternRule(literal=key, glob=None, value=value))
        else:
            rules.append(_PatternRule(literal=None, glob=ModuleGlob.parse(key), value=value))
    return rules


def _pattern_value(rules: list[_PatternRule], module_key: str, default: Any) -> Any:
    """The value of the first key equal to the module name or to a dotted suffix of it,
    or globbing one of those; `default` when none does."""
    parts = module_key.split(".")
    suffixes = frozenset(".".join(parts[i:]) for i in range(len(parts)))
    for rule in rules:
        if rule.matches(suffixes):
            return rule.value
    return default


# --- safetensors -----------------------------------------------------------------------


@dataclass(frozen=True)
class _TensorEntry:
    """One tensor as the safetensors header declares it; offsets are into the data
    region, which starts after the header."""

    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def torch_dtype_name(self) -> str:
        return _DTYPES[self.dtype][0]


@dataclass(frozen=True)
class _Header:
    entries: dict[str, _TensorEntry]
    data_start: int


def _read_header(fd: int, file: Path) -> _Header:
    """Parses and checks the header and the file's size without reading tensor bytes."""
    try:
        file_size = os.fstat(fd).st_size
        if file_size < 8:
            raise _Corrupt(f"{file_size} bytes, shorter than the 8-byte header length")
        header_length = int.from_bytes(safe_files.read_at(fd, 0, 8), "little")
        if header_length > _HEADER_SIZE_LIMIT:
            raise _Corrupt(
                f"header length {header_length} is over the {_HEADER_SIZE_LIMIT}-byte limit"
            )
        if 8 + header_length > file_size:
            raise _Corrupt(f"header length {header_length} exceeds the file size {file_size}")
        raw = safe_files.read_at(fd, 8, header_length)
    except (OSError, _Corrupt) as err:
        raise _corrupt_error(file, str(err)) from None
    try:
        header = _parse_header(raw, file_size - 8 - header_length)
    except _Corrupt as err:
        raise _corrupt_error(file, str(err)) from None
    return _Header(entries=header, data_start=8 + header_length)


class _Corrupt(Exception):
    """A malformed safetensors file; becomes AdapterError "... is corrupt or truncated"."""


def _corrupt_error(file: Path, reason: str) -> AdapterError:
    return AdapterError(f"{file} is corrupt or truncated: {reason}")


def _parse_header(raw: bytearray, data_length: int) -> dict[str, _TensorEntry]:
    try:
        header = _strict_json(raw, unique_keys=True)
    except ValueError as err:
        raise _Corrupt(f"the header is not valid JSON: {err}") from None
    if not isinstance(header, dict):
        raise _Corrupt(f"the header is a JSON {type(header).__name__}, not an object")
    metadata = header.pop("__metadata__", None)
    if metadata is not None and not (
        isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())
    ):
        raise _Corrupt("__metadata__ must map strings to strings")
    entries = {name: _parse_entry(name, info, data_length) for name, info in header.items()}
    _check_tiling(entries, data_length)
    return entries


def _parse_entry(name: str, info: Any, data_length: int) -> _TensorEntry:
    if not isinstance(info, dict) or set(info) != _TENSOR_FIELDS:
        raise _Corrupt(f"tensor {reprlib.repr(name)} must have exactly {sorted(_TENSOR_FIELDS)}")
    dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if not isinstance(dtype, str):
        raise _Corrupt(f"tensor {reprlib.repr(name)} has dtype {reprlib.repr(dtype)}")
    if dtype not in _DTYPES:
        raise AdapterError(f"tensor {name!r} has dtype {reprlib.repr(dtype)}, {_NEED_FLOAT}")
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise _Corrupt(f"tensor {reprlib.repr(name)} has shape {reprlib.repr(shape)}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_is_count, offsets))):
        raise _Corrupt(f"tensor {reprlib.repr(name)} has data_offsets {reprlib.repr(offsets)}")
    begin, end = offsets
    nbytes = _numel(shape, data_length) * _DTYPES[dtype][1]
    if end - begin != nbytes:
        raise _Corrupt(
            f"tensor {reprlib.repr(name)} ({dtype} {reprlib.repr(shape)}) has data_offsets "
            f"{reprlib.repr(offsets)}, which do not hold its size"
        )
    return _TensorEntry(dtype=dtype, shape=tuple(shape), begin=begin, end=end)


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 63


def _numel(shape: list[int], limit: int) -> int:
    """The product of `shape`, or limit + 1 once it is known to exceed `limit` (so that a
    header of huge dimensions costs no big-number arithmetic)."""
    if 0 in shape:
        return 0
    numel = 1
    for dim in shape:
        numel *= dim
        if numel > limit:
            return limit + 1
    return numel


def _check_tiling(entries: dict[str, _TensorEntry], data_length: int) -> None:
    """The tensors' byte ranges, in offset order, cover the data region exactly."""
    position = 0
    for name, entry in sorted(entries.items(), key=lambda item: (item[1].begin, item[1].end)):
        if entry.begin != position:
            kind = "a gap before" if entry.begin > position else "an overlap with"
            raise _Corrupt(f"{kind} tensor {reprlib.repr(name)} at byte {entry.begin}")
        position = entry.end
    if position != data_length:
        raise _Corrupt(
            f"the tensors take {position} bytes but the data region after the header is "
            f"{data_length} bytes"
        )


def _read_tensor_data(fd: int, header: _Header, file: Path) -> dict[str, bytes | bytearray]:
    """Reads each (already checked) tensor's bytes through `fd`, as stored."""
    data: dict[str, bytes | bytearray] = {}
    try:
        for tensor_name, entry in header.entries.items():
            size = entry.end - entry.begin
            start = header.data_start + entry.begin
            data[tensor_name] = safe_files.read_at(fd, start, size) if size else b""
    except OSError as err:  # the file shrank or failed since its header was checked
        raise _corrupt_error(file, str(err)) from None
    return data


def _pair_lora_tensors(
    entries: Mapping[str, _TensorEntry], arch: BaseModelShape
) -> dict[tuple[int, str], tuple[str, str]]:
    """(layer, module) -> (A tensor name, B tensor name), checking names and shapes."""
    shapes = expected_lora_shapes(arch)
    found: dict[tuple[int, str], dict[str, str]] = {}
    for tensor_name, entry in entries.items():
        match = _TENSOR_NAME.fullmatch(tensor_name)
        module = match["module"] if match else None
        if match is None or _PARENT.get(module) != match["parent"]:
            raise AdapterError(
                f"unsupported target module in tensor {reprlib.repr(tensor_name)}; only LoRA "
                f"A/B of the decoder-layer projections {', '.join(SUPPORTED_MODULES)} are "
                "supported"
            )
        layer = int(match["layer"])
        if layer >= arch.num_layers:
            raise AdapterError(
                f"tensor {tensor_name!r} is for layer {layer} but the base model has "
                f"{arch.num_layers} layers (adapter made for another base model?)"
            )
        _check_shape(tensor_name, entry, match["ab"], shapes[module])
        found.setdefault((layer, module), {})[match["ab"]] = tensor_name
    if not found:
        raise AdapterError(f"{WEIGHTS_NAME} holds no LoRA tensors")
    for (layer, module), names in found.items():
        for missing, present in (("A", "B"), ("B", "A")):
            if missing not in names:
                raise AdapterError(
                    f"layers.{layer}.{module} has lora_{present} ({names[present]!r}) "
                    f"but no lora_{missing}"
                )
    return {k: (v["A"], v["B"]) for k, v in found.items()}


def _check_shape(tensor_name: str, entry: _TensorEntry, ab: str, out_in: tuple[int, int]) -> None:
    if entry.dtype not in _SERVABLE:
        raise AdapterError(
            f"tensor {tensor_name!r} has dtype {entry.torch_dtype_name}, {_NEED_FLOAT}"
        )
    out_features, in_features = out_in
    shape = entry.shape
    ok = len(shape) == 2 and (shape[1] == in_features if ab == "A" else shape[0] == out_features)
    if not ok:
        expected = f"[r, {in_features}]" if ab == "A" else f"[{out_features}, r]"
        raise AdapterError(
            f"tensor {tensor_name!r} has shape {reprlib.repr(list(shape))}, expected "
            f"{expected} for this base model (adapter made for another base architecture?)"
        )


def _check_ranks(
    a_name: str, a_shape: tuple[int, ...], b_name: str, b_shape: tuple[int, ...], max_rank: int
) -> None:
    if a_shape[0] != b_shape[1]:
        raise AdapterError(
            f"rank mismatch: {a_name!r} has rank {a_shape[0]} but {b_name!r} has rank {b_shape[1]}"
        )
    if a_shape[0] > max_rank:
        raise AdapterError(
            f"rank {a_shape[0]} of {_module_key(a_name)} exceeds max_lora_rank {max_rank}"
        )


def _check_finite(tensor_name: str, values: np.ndarray) -> None:
    if not np.isfinite(values).all():
        raise AdapterError(f"tensor {tensor_name!r} contains NaN or Inf values")


def _module_key(tensor_name: str) -> str:
    """The module's name inside the HF model, as PEFT matches patterns against it."""
    match = _TENSOR_NAME.fullmatch(tensor_name)
    assert match is not None
    return match["key"]


def _identity_key(
    scalings: dict[tuple[int, str], float],
    entries: Mapping[str, _TensorEntry],
    data: dict[str, bytes | bytearray],
) -> bytes:
    """blake2b over the per-module scalings (the config's whole effect on outputs) and
    every tensor's name, dtype, shape and stored bytes, in sorted order."""
    digest = hashlib.blake2b(digest_size=16)
    for (layer, module), scaling in sorted(scalings.items()):
        digest.update(f"scaling {layer} {module} {scaling.hex()}\n".encode())
    for tensor_name in sorted(entries):
        entry = entries[tensor_name]
        shape = list(entry.shape)
        digest.update(f"tensor {tensor_name} {entry.torch_dtype_name} {shape}\n".encode())
        digest.update(data[tensor_name])
    return digest.digest()
