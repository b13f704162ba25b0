"""Offline API: `LLM(model=..., **engine options).generate(prompts, sampling_params)`, and
`.embed(prompts)` for embeddings."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from tqdm.auto import tqdm

from loraplex.adapters.peft_format import LoRAAdapter
from loraplex.platform.config import EngineConfig
from loraplex.platform.engine import LLMEngine
from loraplex.platform.request import RequestOutput, SamplingParams
from loraplex.platform.request_limits import EMBEDDING_PARAMS
from loraplex.platform.sleep_mode import SleepReport
from loraplex.platform.tokenizer import apply_chat_template

Prompt = str | Sequence[int]
Message = dict[str, str]


class LLM:
    """Runs an LLMEngine to completion over a list of prompts.

    Keyword options are the engine options of `EngineConfig.from_options` (dtype,
    max_model_len, max_num_seqs, max_num_batched_tokens, block_size,
    kv_cache_memory_bytes, ...); an unknown option is a TypeError.
    """

    def __init__(self, model: str = "smollm2-135m-instruct", **engine_options: object) -> None:
        self.engine = LLMEngine(EngineConfig.from_options(model, engine_options))
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        adapters: Sequence[str | None] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Generates for every prompt (a string or a list of token ids); outputs come back
        in prompt order. `adapters` gives each prompt's LoRA adapter: a registered name,
        an adapter folder, or None for the base model. Adapters load in parallel first,
        so an invalid one raises before anything runs."""
        prompts = self._prompt_list(prompts)
        params = self._expand_params(sampling_params, len(prompts))
        loras = self._load_adapters(adapters, len(prompts))
        request_ids = [f"offline-{next(self._ids)}" for _ in prompts]
        groups = [
            self.engine.make_request_group(request_id, prompt, p, lora=lora)
            for request_id, prompt, p, lora in zip(request_ids, prompts, params, loras, strict=True)
        ]
        for group in groups:
            self.engine.add_group(group)
        return self._run(request_ids, use_tqdm)

    def embed(
        self,
        prompts: Prompt | Sequence[Prompt],
        adapters: Sequence[str | None] | None = None,
        use_tqdm: bool = False,
    ) -> list[list[float]]:
        """The embedding of every prompt, pooled as the model folder says
        (platform/pooling.py), in prompt order; `adapters` as in `generate`. Embedding
        requests batch with each other like generation requests. ValueError when one
        failed (its message)."""
        prompts = self._prompt_list(prompts)
        loras = self._load_adapters(adapters, len(prompts))
        request_ids = [f"offline-{next(self._ids)}" for _ in prompts]
        groups = [
            self.engine.make_request_group(
                request_id, prompt, EMBEDDING_PARAMS, lora=lora, embed=True
            )
            for request_id, prompt, lora in zip(request_ids, prompts, loras, strict=True)
        ]
        for group in groups:
            self.engine.add_group(group)
        outputs = self._run(request_ids, use_tqdm)
        failed = next((output.error for output in outputs if output.error is not None), None)
        if failed is not None:
            raise ValueError(failed.message)
        return [output.embedding for output in outputs]

    @staticmethod
    def _prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
        """One prompt (a string or token ids) as a list of one; a list of them as is."""
        if isinstance(prompts, str) or (
            isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)
        ):
            return [prompts]
        return list(prompts)

    def sleep(self) -> SleepReport:
        """Releases the KV cache and, on a GPU, moves the weights to host memory, for a
        job that shares the machine meanwhile (platform/sleep_mode.py)."""
        return self.engine.sleep()

    def wake_up(self) -> SleepReport:
        """Takes the memory `sleep` gave back; generation goes on as before."""
        return self.engine.wake_up()

    def register_adapter(self, name: str, folder: str) -> None:
        """Names an adapter folder; later `generate(..., adapters=[name])` may use it."""
        self.engine.register_adapter(name, folder)

    def unregister_adapter(self, name: str) -> None:
        self.engine.unregister_adapter(name)

    def _load_adapters(
        self, adapters: Sequence[str | None] | None, count: int
    ) -> list[LoRAAdapter | None]:
        if adapters is None:
            return [None] * count
        adapters = list(adapters)
        if len(adapters) != count:
            raise ValueError(f"{len(adapters)} adapters for {count} prompts")
        specs = {spec for spec in adapters if spec is not None}
        if specs and self.engine.adapters is None:
            raise ValueError("LoRA is disabled on this engine (max_loras=0)")
        futures = {spec: self.engine.adapters.load_async(spec) for spec in specs}
        loaded = {spec: future.result() for spec, future in futures.items()}
        return [None if spec is None else loaded[spec] for spec in adapters]

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        adapters: Sequence[str | None] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Applies the tokenizer's chat template (with the generation prompt) and generates;
        `adapters` as in `generate`, one per conversation."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.chat_prompt_ids(conversation) for conversation in conversations]
        return self.generate(prompts, sampling_params, adapters, use_tqdm=use_tqdm)

    def chat_prompt_ids(self, conversation: Sequence[Message]) -> list[int]:
        """The prompt ids `chat` generates from for one conversation."""
        return apply_chat_template(self.tokenizer, conversation)

    @staticmethod
    def _expand_params(
        sampling_params: SamplingParams | Sequence[SamplingParams] | None, count: int
    ) -> list[SamplingParams]:
        if sampling_params is None:
            return [SamplingParams()] * count
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * count
        params = list(sampling_params)
        if len(params) != count:
            raise ValueError(f"{len(params)} sampling params for {count} prompts")
        return params

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        with tqdm(total=len(request_ids), disable=not use_tqdm, desc="generate") as bar:
            while self.engine.has_unfinished():
                for output in self.engine.step():
                    if output.finished:
                        finished[output.request_id] = output
                        bar.update(1)
        return [finished[request_id] for request_id in request_ids]
