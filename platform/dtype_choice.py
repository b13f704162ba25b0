"""`dtype: auto`: the dtype an engine runs in when its config leaves the choice to it.

Building an engine never runs a benchmark. The choice is:
- on a GPU, bf16 (fp16 where the GPU has no bf16);
- on a CPU, the dtype that `loraplex probe dtype` measured and recorded for this CPU,
  torch build, thread count and model shape. That command
  (tools/engine_bench/ceiling.py) times each candidate dtype's projections on the
  reference workload (64 x 128 -> 64, 64 sequences a step) and writes the winner to a small JSON record under the cache
  folder (`dtype_choice/`); the engine only reads it;
- on a CPU without a record, the CPU's own word: bf16 where it has AMX tiles for bf16
  (bf16 ran at about 2x fp32 there), fp32 otherwise (bf16 ran at 0.6x fp32 on an
  AVX512-BF16 CPU without AMX, and is emulated where the CPU has no bf16 matmul).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from loraplex.kernels.cache_dir import cache_base
from loraplex.kernels.cpu_matmul import cpu_lacks_half_matmul
from loraplex.kernels.cpu_ops import cpu_identity
from loraplex.platform.arch import ModelArch
from loraplex.platform.config import AUTO_DTYPE, EngineConfig, parse_dtype

logger = logging.getLogger(__name__)

PROBE_COMMAND = "loraplex probe dtype --model MODEL"
"""What measures and records the choice (tools/cli.py)."""


@dataclass(frozen=True)
class DtypeChoice:
    dtype: torch.dtype
    reason: str
    """Why, for the engine's log: the record's figures or the rule that decided."""


def record_path(arch: ModelArch, num_threads: int) -> Path:
    """Where the measured choice for this machine, model shape and thread count is
    recorded (a changed CPU, torch build or shape is a different file)."""
    digest = hashlib.sha256()
    for part in (
        cpu_identity(),
        torch.__version__,
        str(num_threads),
        repr(dataclasses.astuple(arch)),
    ):
        digest.update(part.encode())
        digest.update(b"\0")
    return cache_base() / "dtype_choice" / f"{digest.hexdigest()[:20]}.json"


def write_record(path: Path, dtype: torch.dtype, seconds: dict[str, float]) -> None:
    """Records `dtype` as the measured choice, with each candidate's projection seconds
    on the reference workload (written whole, then renamed into place)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    body = {"dtype": str(dtype).removeprefix("torch."), "seconds": seconds}
    partial.write_text(json.dumps(body, indent=1))
    partial.replace(path)


def read_record(path: Path) -> tuple[torch.dtype, dict[str, float]] | None:
    """The recorded dtype and figures, or None where there is no usable record."""
    if not path.is_file():
        return None
    try:
        body = json.loads(path.read_text())
        return parse_dtype(body["dtype"]), {k: float(v) for k, v in body["seconds"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        logger.warning("ignoring unreadable dtype record %s", path)
        return None


@functools.cache
def cpu_has_amx_bf16() -> bool:
    """Whether this CPU multiplies bf16 on AMX tiles (its `amx_bf16` flag)."""
    return "amx_bf16" in cpu_identity().partition("|")[2].split()


def choose_dtype(arch: ModelArch, device: torch.device) -> DtypeChoice:
    """'auto' for this model on `device` (see the module docstring); reads at most one
    small file."""
    if device.type == "cuda":
        dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return DtypeChoice(dtype, "the GPU's half dtype")
    if device.type != "cpu":
        return DtypeChoice(torch.float32, f"no rule for {device.type}")
    path = record_path(arch, torch.get_num_threads())
    record = read_record(path)
    if record is not None and not cpu_lacks_half_matmul(record[0]):
        figures = ", ".join(f"{name} {s:.2f}s" for name, s in record[1].items())
        return DtypeChoice(record[0], f"measured by `{PROBE_COMMAND}` ({figures})")
    if cpu_has_amx_bf16() and not cpu_lacks_half_matmul(torch.bfloat16):
        rule = "the CPU has AMX bf16"
        dtype = torch.bfloat16
    else:
        rule = "the CPU has no AMX bf16"
        dtype = torch.float32
    return DtypeChoice(dtype, f"{rule}; `{PROBE_COMMAND}` measures it on this machine")


def resolve_dtype(config: EngineConfig, arch: ModelArch, device: torch.device) -> EngineConfig:
    """`config` with its dtype as a torch dtype: 'auto' becomes `choose_dtype`'s pick,
    logged with why; a dtype's name becomes that dtype."""
    if config.model.dtype != AUTO_DTYPE:
        dtype = parse_dtype(config.model.dtype)
        return dataclasses.replace(config, model=dataclasses.replace(config.model, dtype=dtype))
    choice = choose_dtype(arch, device)
    logger.info("dtype auto -> %s: %s", str(choice.dtype).removeprefix("torch."), choice.reason)
    return dataclasses.replace(config, model=dataclasses.replace(config.model, dtype=choice.dtype))
