"""Structured output: what a guided request's tokens must spell (a JSON schema, any JSON
object, a regex, one of several strings, an EBNF grammar), compiled with xgrammar.

`GuidedSpec` is what a request asks for; it is plain data, part of `SamplingParams`.
`GrammarCompiler` turns a spec into xgrammar's compiled grammar for one tokenizer
(compiling can take tens of milliseconds: AsyncEngine runs it on a worker thread, off
the engine loop) and keeps the most recent ones by tenant and the spec's content, so a
schema that many of a tenant's requests share is compiled once for that tenant. No
tenant gets a grammar another tenant's request compiled: its first token's latency
would tell it that the other used that schema or tool definition recently. Each of a
request's completions gets its own `GrammarMatcher` (the parse state): the sampler
masks the tokens it does not allow, the runner feeds it the sampled token, and
`check_stop` ends the completion once the grammar is complete and the model chose to
end it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import numpy as np

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

GuidedKind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]
ANY_OBJECT = '{"type": "object"}'
"""json_object means a JSON object (OpenAI's rule), not any JSON value."""
SOURCE_LOCATION = re.compile(r"\[[0-9:]+\] \S+:\d+: ")
"""xgrammar's '[hh:mm:ss] file.cc:123: ' prefix on its error messages."""
CACHE_SIZE = 256
"""Compiled grammars kept per engine, every tenant's together (least recently used
dropped first)."""


@dataclass(frozen=True)
class GuidedSpec:
    """`value`: the JSON schema's text (json_schema), the regex, the EBNF grammar, or
    the choices as a JSON list of strings; empty for json_object."""

    kind: GuidedKind
    value: str = ""
    origin: str = field(default="", compare=False)
    """The request field the spec came from, for error messages (not part of its key)."""

    @property
    def key(self) -> str:
        return hashlib.sha256(f"{self.kind}\0{self.value}".encode()).hexdigest()

    @classmethod
    def choice(cls, options: list[str], origin: str = "") -> GuidedSpec:
        return cls("choice", json.dumps(list(options)), origin)


def _choice_grammar(value: str) -> str:
    options = json.loads(value)
    if not options:
        raise ValueError("choice needs at least one option")
    return "root ::= " + " | ".join(json.dumps(option) for option in options)


class GrammarCompiler:
    """Compiles GuidedSpecs for one tokenizer; thread-safe; ValueError for a spec that
    does not compile (a bad schema, regex or grammar: the caller's fault)."""

    def __init__(self, tokenizer: object, vocab_size: int, stop_token_ids: list[int]) -> None:
        import xgrammar

        self._xgrammar = xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids or None
        )
        self._compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        control = [i for i, text in enumerate(info.decoded_vocab) if any(b < 0x20 for b in text)]
        self._json_bits = _bits_without(control, vocab_size)
        self.vocab_size = vocab_size
        self.has_stop_tokens = bool(stop_token_ids)
        self._cache: OrderedDict[tuple[str, str], object] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, spec: GuidedSpec, tenant: str = "") -> object:
        """`spec` compiled, from the cache when `tenant` compiled it recently; another
        tenant's entry is never used (the cache is per tenant, its bound shared)."""
        key = (tenant, spec.key)
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
                return compiled
        compiled = self._compile(spec)
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, spec: GuidedSpec) -> object:
        compiler = self._compiler
        try:
            if spec.kind == "json_schema":
                return compiler.compile_json_schema(spec.value, any_whitespace=False)
            if spec.kind == "json_object":
                return compiler.compile_json_schema(ANY_OBJECT, any_whitespace=False)
            if spec.kind == "regex":
                return compiler.compile_regex(spec.value)
            if spec.kind == "choice":
                return compiler.compile_grammar(_choice_grammar(spec.value))
            return compiler.compile_grammar(spec.value)
        except (RuntimeError, ValueError, TypeError) as exc:
            reason = SOURCE_LOCATION.sub("", str(exc)).strip()
            what = spec.origin or f"the {spec.kind}"
            raise ValueError(f"{what} does not compile: {reason}") from None

    def state(self, compiled: object, spec: GuidedSpec) -> GuidedState:
        """A fresh parse state for one completion. Without stop tokens (a model with
        no EOS) the matcher ends as soon as the grammar is complete."""
        matcher = self._xgrammar.GrammarMatcher(
            compiled, terminate_without_stop_token=not self.has_stop_tokens
        )
        json_kind = spec.kind in ("json_schema", "json_object")
        return GuidedState(matcher, self._json_bits if json_kind else None)


@dataclass
class GuidedState:
    """One completion's parse state, and the tokens never allowed on top of what the
    grammar allows. For JSON these are the tokens holding a control character
    (U+0000-U+001F): xgrammar's JSON strings admit them raw, which JSON forbids (a
    strict parser such as Python's json.loads refuses the output); outside strings the
    compact JSON grammar needs no whitespace but the space."""

    matcher: object
    allowed_bits: torch.Tensor | None = None
    """int32 [ceil(V / 32)], packed like xgrammar's bitmask: a clear bit bans its token
    whatever the grammar allows (None: nothing banned)."""

    def accept_token(self, token: int) -> bool:
        return bool(self.matcher.accept_token(token))

    def is_terminated(self) -> bool:
        return bool(self.matcher.is_terminated())


def _bits_without(banned: list[int], vocab_size: int) -> torch.Tensor:
    """int32 [ceil(V / 32)] with every bit set but those of `banned` (bit t % 32 of word
    t // 32, as xgrammar packs its masks). Torch is imported here, in the engine: the
    ingress reads this module for `GuidedSpec` alone."""
    import torch

    words = np.full((vocab_size + 31) // 32, 0xFFFFFFFF, dtype=np.uint32)
    for token in banned:
        words[token // 32] &= np.uint32(~(1 << (token % 32)) & 0xFFFFFFFF)
    return torch.from_numpy(words.view(np.int32).copy())


def mask_disallowed_tokens(
    logits: torch.Tensor, guided_rows: list[tuple[int, GuidedState]]
) -> None:
    """Semantics: logits[R, V] (float32, bfloat16 or float16), in place: for each
    (row, state) of `guided_rows`, the tokens its matcher does not allow next, and those
    its `allowed_bits` clear, become -inf in that row; other rows are untouched."""
    import xgrammar

    bitmask = xgrammar.allocate_token_bitmask(logits.shape[0], logits.shape[-1])
    rows = []
    for row, state in guided_rows:
        state.matcher.fill_next_token_bitmask(bitmask, row)
        if state.allowed_bits is not None:
            bitmask[row] &= state.allowed_bits
        rows.append(row)
    xgrammar.apply_token_bitmask_inplace(
        logits, bitmask.to(logits.device), vocab_size=logits.shape[-1], indices=rows
    )
