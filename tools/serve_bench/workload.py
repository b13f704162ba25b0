"""The requests a serve benchmark sends: what each asks for and when it is sent.

Prompts are either exact-length random token ids (sent as a token list, so no server
re-tokenizes them and every side sees the same lengths) or a JSONL dataset. Random
prompts may start with a shared prefix (prefix-cache hits), one of `prefix_groups`
drawn at random per request. Requests go round-robin over the models given (`base` and
`base:adapter` names), or draw a model per request with Zipf popularity (the first
model the most popular), and are sent at once (closed loop, bounded by the client's
concurrency) or at Poisson arrival times.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class BenchRequest:
    """One request of the workload."""

    index: int
    model: str
    prompt: list[int] | str
    output_len: int
    send_at_s: float
    """Offset from the start of the burst at which the request is sent."""

    @property
    def prompt_len(self) -> int | None:
        """Exact for token-id prompts; None for text (the server counts it)."""
        return len(self.prompt) if isinstance(self.prompt, list) else None


@dataclass(frozen=True)
class WorkloadSpec:
    """What `build_requests` makes; parsed once from the command line."""

    num_prompts: int
    prompt_len: int
    output_len: int
    models: tuple[str, ...]
    prefix_len: int = 0
    request_rate: float = math.inf
    """Mean requests per second (Poisson arrivals); inf sends everything at once."""
    seed: int = 0
    dataset: Path | None = None
    """JSONL with a "prompt" (text or token ids) and optionally "output_len" per line."""
    zipf_s: float | None = None
    """Zipf exponent of the models' popularity (model k drawn with weight 1 / k**s);
    None: round-robin."""
    prefix_groups: int = 1
    """Distinct shared prefixes of `prefix_len` tokens; each request takes one at random."""

    def __post_init__(self) -> None:
        if self.num_prompts < 1:
            raise ValueError(f"num_prompts must be >= 1, got {self.num_prompts}")
        if self.output_len < 1:
            raise ValueError(f"output_len must be >= 1, got {self.output_len}")
        if self.dataset is None and self.prompt_len < 1:
            raise ValueError(f"prompt_len must be >= 1, got {self.prompt_len}")
        if self.prefix_len < 0:
            raise ValueError(f"prefix_len must be >= 0, got {self.prefix_len}")
        if not self.request_rate > 0:
            raise ValueError(f"request_rate must be > 0, got {self.request_rate}")
        if not self.models:
            raise ValueError("no model to send requests to")
        if self.zipf_s is not None and not self.zipf_s > 0:
            raise ValueError(f"zipf exponent must be > 0, got {self.zipf_s}")
        if self.prefix_groups < 1:
            raise ValueError(f"prefix_groups must be >= 1, got {self.prefix_groups}")


def model_names(base: str, adapters: Sequence[str]) -> tuple[str, ...]:
    """'base' and adapters ['a', 'base:b'] -> ('base:a', 'base:b'); no adapters -> ('base',)."""
    if not adapters:
        return (base,)
    return tuple(name if ":" in name else f"{base}:{name}" for name in adapters)


def arrival_offsets(count: int, rate: float, rng: random.Random) -> list[float]:
    """Send times of a Poisson process of `rate` per second (all 0 for an infinite rate)."""
    if math.isinf(rate):
        return [0.0] * count
    offsets, now = [], 0.0
    for _ in range(count):
        offsets.append(now)
        now += rng.expovariate(rate)
    return offsets


def zipf_weights(count: int, s: float) -> list[float]:
    """Probabilities of ranks 1..count under Zipf's law with exponent `s`."""
    weights = [1.0 / rank**s for rank in range(1, count + 1)]
    total = sum(weights)
    return [w / total for w in weights]


def parse_popularity(text: str) -> float | None:
    """'uniform' -> None (round-robin); 'zipf:S' -> S."""
    if text == "uniform":
        return None
    kind, _, exponent = text.partition(":")
    try:
        if kind == "zipf":
            return float(exponent)
    except ValueError:
        pass
    raise ValueError(f"popularity {text!r}: use 'uniform' or 'zipf:S' (e.g. zipf:1.1)")


def read_dataset(path: Path, default_output_len: int) -> list[tuple[list[int] | str, int]]:
    """(prompt, output_len) per JSONL line; a bad line is a ValueError naming it."""
    entries = []
    for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            prompt = row["prompt"]
            output_len = int(row.get("output_len", default_output_len))
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}:{number}: not a {{'prompt': ...}} object ({exc})") from None
        valid_ids = isinstance(prompt, list) and all(isinstance(t, int) for t in prompt)
        if not (isinstance(prompt, str) or valid_ids) or not prompt or output_len < 1:
            raise ValueError(f"{path}:{number}: prompt must be text or token ids, output_len >= 1")
        entries.append((prompt, output_len))
    if not entries:
        raise ValueError(f"{path} holds no prompts")
    return entries


def build_requests(spec: WorkloadSpec, token_pool: Sequence[int]) -> list[BenchRequest]:
    """The workload, seeded: the same spec and pool always give the same requests."""
    rng = random.Random(spec.seed)
    if spec.dataset is not None:
        rows = read_dataset(spec.dataset, spec.output_len)
        prompts = [rows[i % len(rows)] for i in range(spec.num_prompts)]
    else:
        if not token_pool:
            raise ValueError("no token ids to draw random prompts from")
        prefixes = [rng.choices(token_pool, k=spec.prefix_len) for _ in range(spec.prefix_groups)]

        def prefix() -> list[int]:
            return prefixes[0] if len(prefixes) == 1 else rng.choice(prefixes)

        prompts = [
            (prefix() + rng.choices(token_pool, k=spec.prompt_len), spec.output_len)
            for _ in range(spec.num_prompts)
        ]
    offsets = arrival_offsets(spec.num_prompts, spec.request_rate, rng)
    if spec.zipf_s is None:
        models = [spec.models[i % len(spec.models)] for i in range(spec.num_prompts)]
    else:
        weights = zipf_weights(len(spec.models), spec.zipf_s)
        models = rng.choices(spec.models, weights, k=spec.num_prompts)
    return [
        BenchRequest(i, models[i], prompt, output_len, offsets[i])
        for i, (prompt, output_len) in enumerate(prompts)
    ]
