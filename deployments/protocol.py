"""OpenAI request/response schema, validated once at the edge.

Fields the OpenAI API defines but that change nothing on this server are accepted and
ignored (`IGNORED_FIELDS`, documented in docs/serving.md); any other unknown field is
rejected (400 naming it), so a client relying on a parameter we do not implement finds
out at once. Every number has bounds the engine can represent (NaN and Infinity are
refused everywhere); what depends on the model (top_k and token ids against its
vocabulary, lengths against the context and the KV cache) is checked by the model
server before the request reaches the engine.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from loraplex.deployments.catalog import ADAPTER_NAME
from loraplex.deployments.tool_calls import ToolCalling
from loraplex.platform.failpoints import NAMES as FAILPOINT_NAMES
from loraplex.platform.guided import GuidedSpec
from loraplex.platform.request import MAX_LOGPROBS, SamplingParams

INT32_MAX = 2**31 - 1


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class StreamOptions(StrictModel):
    include_usage: bool = False
    include_obfuscation: bool | None = None
    """Ignored: this server adds no obfuscation padding to stream events."""


MAX_LOGIT_BIAS = 1024
MAX_STOP_TOKEN_IDS = 64
MAX_PROMPTS = 64
"""Prompts in one /v1/completions batch."""
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]


class IgnoredFields(StrictModel):
    """OpenAI fields accepted and ignored: they change nothing on this server."""

    store: bool | None = None
    metadata: dict[str, str] | None = Field(default=None, max_length=16)
    service_tier: str | None = Field(default=None, max_length=64)
    prompt_cache_key: str | None = Field(default=None, max_length=1024)
    safety_identifier: str | None = Field(default=None, max_length=256)


IGNORED_FIELDS = {
    "store": "nothing is stored: no completion is kept after it is answered",
    "metadata": "only meaningful with `store`",
    "service_tier": "one tier; the response does not echo it",
    "prompt_cache_key": "prefix caching is automatic, per tenant",
    "safety_identifier": "no abuse monitoring here (use `user` for the request logs)",
    "stream_options.include_obfuscation": "stream events carry no padding",
    "reasoning_effort": "(chat) the served models do not reason in hidden tokens",
    "verbosity": "(chat) no effect on these models",
    "modalities": '(chat) only ["text"] is accepted',
    "prediction": "(chat) a predicted output changes only speed, not the answer",
}
"""Field -> why it changes nothing (docs/serving.md's list is this one)."""


MAX_CHOICES = 256
MAX_PATTERN_CHARS = 1 << 16


class StructuredOutputs(StrictModel):
    """vLLM's `structured_outputs`: exactly one of a JSON schema (an object or its text),
    a regex, a list of choices, or an EBNF grammar."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = Field(default=None, min_length=1, max_length=MAX_PATTERN_CHARS)
    choice: list[Annotated[str, Field(min_length=1)]] | None = Field(
        default=None, min_length=1, max_length=MAX_CHOICES
    )
    grammar: str | None = Field(default=None, min_length=1, max_length=MAX_PATTERN_CHARS)

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputs:
        given = [v for v in (self.json_, self.regex, self.choice, self.grammar) if v is not None]
        if len(given) != 1:
            raise ValueError("give exactly one of json, regex, choice and grammar")
        return self

    def spec(self) -> GuidedSpec:
        if self.json_ is not None:
            field = "structured_outputs.json"
            return GuidedSpec("json_schema", _schema_text(self.json_, field), field)
        if self.regex is not None:
            return GuidedSpec("regex", self.regex, "structured_outputs.regex")
        if self.choice is not None:
            return GuidedSpec.choice(self.choice, "structured_outputs.choice")
        return GuidedSpec("grammar", self.grammar or "", "structured_outputs.grammar")


def _schema_text(schema: dict[str, Any] | str, field: str) -> str:
    """A JSON schema's canonical text (so equal schemas share one compiled grammar);
    ValueError naming `field` when it is not a JSON object."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except (ValueError, RecursionError):
            raise ValueError(f"{field}: the JSON schema is not valid JSON") from None
    if not isinstance(schema, dict):
        raise ValueError(f"{field}: a JSON schema must be a JSON object")
    return json.dumps(schema, sort_keys=True)


class JsonSchemaFormat(StrictModel):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = Field(default=None, max_length=4096)
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = Field(
        default=None, description="outputs always follow the schema, strict or not"
    )


class ResponseFormat(StrictModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_when_json_schema(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema: required with type json_schema, and only then")
        return self

    def spec(self) -> GuidedSpec | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return GuidedSpec("json_object", origin="response_format")
        field = "response_format.json_schema.schema"
        schema = self.json_schema.schema_ if self.json_schema else None
        return GuidedSpec("json_schema", _schema_text(schema or {}, field), field)


class SamplingFields(IgnoredFields):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str = Field(min_length=1, max_length=256)
    max_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**63)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    user: str | None = Field(default=None, max_length=256)
    # Extensions vLLM users know.
    top_k: int = Field(default=0, ge=-1, le=INT32_MAX)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=10.0)
    ignore_eos: bool = False
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = Field(
        default=None, max_length=MAX_LOGIT_BIAS
    )
    stop_token_ids: list[TokenId] | None = Field(default=None, max_length=MAX_STOP_TOKEN_IDS)
    min_tokens: int = Field(default=0, ge=0, le=INT32_MAX)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    prompt_logprobs: int | None = Field(
        default=None,
        ge=0,
        le=MAX_LOGPROBS,
        description="each prompt token's logprob, rank and top k alternatives (not with stream)",
    )
    structured_outputs: StructuredOutputs | None = None
    response_format: ResponseFormat | None = None

    @model_validator(mode="after")
    def _prompt_logprobs_not_streamed(self) -> SamplingFields:
        if self.stream and self.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs: not available with stream=true")
        return self

    @property
    def scored_prompt_logprobs(self) -> int | None:
        """How many alternatives each prompt token's logprob carries; None: the prompt
        is not scored."""
        return self.prompt_logprobs

    @property
    def echo_logprobs(self) -> bool:
        """The choices' logprobs start with the prompt's (completions' echo)."""
        return False

    def guided_spec(self) -> GuidedSpec | None:
        """What the output must spell (`structured_outputs` or `response_format`; not
        both); None unguided. ValueError for a schema that is not a JSON object."""
        if self.structured_outputs is not None and self.response_format is not None:
            raise ValueError("give structured_outputs or response_format, not both")
        if self.structured_outputs is not None:
            return self.structured_outputs.spec()
        if self.response_format is not None:
            return self.response_format.spec()
        return None

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key in value or {}:
            if not key.isascii() or not key.isdigit() or int(key) > INT32_MAX:
                raise ValueError(f"keys must be token ids (non-negative integers), got {key!r}")
        return value

    @field_validator("stop")
    @classmethod
    def _at_most_four_stops(cls, value: str | list[str] | None) -> str | list[str] | None:
        if isinstance(value, list) and len(value) > 4:
            raise ValueError("at most 4 stop sequences are allowed")
        return value

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            n=self.n,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            seed=self.seed,
            max_tokens=max_tokens,
            stop=tuple(stop),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logprobs=logprobs,
            prompt_logprobs=self.scored_prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            min_tokens=self.min_tokens,
            logit_bias={int(t): b for t, b in (self.logit_bias or {}).items()},
            guided=self.guided_spec(),
        )


TokenIds = Annotated[list[TokenId], Field(min_length=1)]
PromptBatch = (
    Annotated[str, Field(min_length=1)]
    | TokenIds
    | Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1)]
    | Annotated[list[TokenIds], Field(min_length=1)]
)
"""A string, token ids, or a batch of either (completions' `prompt`, embeddings' `input`)."""


def as_batch(given: str | list) -> list[str] | list[list[int]]:
    """A PromptBatch as a list: one string or one list of token ids is a batch of one."""
    if isinstance(given, str) or (given and isinstance(given[0], int)):
        return [given]
    return list(given)


def check_batch_size(batch: list, field: str) -> None:
    if len(batch) > MAX_PROMPTS:
        raise ValueError(f"{field}: at most {MAX_PROMPTS} entries in one request")


class CompletionRequest(SamplingFields):
    prompt: PromptBatch = Field(description="a string, token ids, or a batch of either")
    logprobs: int | None = Field(default=None, ge=0, le=5)
    echo: bool = False
    suffix: None = Field(default=None, description="not supported: must be absent or null")

    @property
    def prompts(self) -> list[str] | list[list[int]]:
        """The batch: one prompt per entry."""
        return as_batch(self.prompt)

    @model_validator(mode="after")
    def _batch_size(self) -> CompletionRequest:
        check_batch_size(self.prompts, "prompt")
        return self

    @property
    def echo_logprobs(self) -> bool:
        return self.echo and self.logprobs is not None

    @property
    def scored_prompt_logprobs(self) -> int | None:
        """`prompt_logprobs`, or with `echo` and `logprobs`, `logprobs` (vLLM's rule)."""
        if self.prompt_logprobs is not None:
            return self.prompt_logprobs
        return self.logprobs if self.echo_logprobs else None


class EmbeddingRequest(StrictModel):
    """/v1/embeddings: one embedding per input, pooled as the model folder says
    (platform/pooling.py), of the base model or of `base:adapter`."""

    model: str = Field(min_length=1, max_length=256)
    input: PromptBatch = Field(description="a string, token ids, or a batch of either")
    encoding_format: Literal["float", "base64"] = Field(
        "float", description="base64: the little-endian float32 bytes of each embedding"
    )
    dimensions: None = Field(
        default=None,
        description="not supported (the models served are not trained to be truncated): "
        "must be absent or null",
    )
    user: str | None = Field(default=None, max_length=256)

    @property
    def inputs(self) -> list[str] | list[list[int]]:
        """The batch: one input per entry."""
        return as_batch(self.input)

    @model_validator(mode="after")
    def _batch_size(self) -> EmbeddingRequest:
        check_batch_size(self.inputs, "input")
        return self


class TextPart(StrictModel):
    type: Literal["text"]
    text: str


class RefusalPart(StrictModel):
    """An assistant message's refusal, as a previous answer carried it."""

    type: Literal["refusal"]
    refusal: str


ContentPart = Annotated[TextPart | RefusalPart, Field(discriminator="type")]
TEXT_PART_TYPES = ("text", "refusal")


class FunctionCall(StrictModel):
    name: str = Field(min_length=1, max_length=256)
    arguments: str = Field(max_length=1 << 20, description="JSON text, as the model wrote it")


class ToolCall(StrictModel):
    id: str = Field(min_length=1, max_length=256)
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(StrictModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | Annotated[list[ContentPart], Field(max_length=1024)] | None = None
    name: str | None = Field(default=None, max_length=256)
    tool_calls: list[ToolCall] | None = Field(default=None, max_length=128)
    tool_call_id: str | None = Field(default=None, min_length=1, max_length=256)
    refusal: str | None = None
    """An assistant message's refusal from a previous answer; not shown to the model."""

    @model_validator(mode="before")
    @classmethod
    def _text_parts_only(cls, data: Any) -> Any:
        parts = data.get("content") if isinstance(data, dict) else None
        if isinstance(parts, list):
            for part in parts:
                kind = part.get("type") if isinstance(part, dict) else None
                if isinstance(kind, str) and kind not in TEXT_PART_TYPES:
                    raise ValueError(
                        f"content part type {kind!r} is not supported: the models served "
                        "here read text parts only"
                    )
        return data

    @model_validator(mode="after")
    def _role_fields(self) -> ChatMessage:
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("tool_calls: only an assistant message carries tool calls")
        if (self.tool_call_id is not None) != (self.role == "tool"):
            raise ValueError("tool_call_id: a tool message needs one, other roles have none")
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(
                "content: required (only an assistant's tool-call message may omit it)"
            )
        return self

    @property
    def text(self) -> str:
        """The content as one string (text parts joined by newlines)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(p.text if isinstance(p, TextPart) else p.refusal for p in self.content)

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates read it: text content; tool calls with their
        arguments as an object when they are a JSON object."""
        message: dict[str, Any] = {"role": self.role, "content": self.text}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            message["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {
                        "name": call.function.name,
                        "arguments": _arguments(call.function.arguments),
                    },
                }
                for call in self.tool_calls
            ]
        return message


def _arguments(text: str) -> dict[str, Any] | str:
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return text
    return value if isinstance(value, dict) else text


MAX_TOOLS = 128


class FunctionDefinition(StrictModel):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = Field(default=None, max_length=1 << 16)
    parameters: dict[str, Any] | None = Field(
        default=None, description="a JSON schema of the arguments object"
    )
    strict: bool | None = Field(
        default=None, description="forced calls always follow the schema, strict or not"
    )

    @field_validator("parameters")
    @classmethod
    def _object_schema(cls, schema: dict[str, Any] | None) -> dict[str, Any] | None:
        kind = (schema or {}).get("type", "object")
        if kind != "object":
            raise ValueError(f"a function's parameters must be an object schema, got {kind!r}")
        return schema


class ToolDefinition(StrictModel):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(StrictModel):
    name: str = Field(min_length=1, max_length=64)


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: FunctionName


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ToolDefinition] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    max_completion_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    parallel_tool_calls: bool | None = None
    reasoning_effort: str | None = Field(default=None, max_length=32)
    verbosity: str | None = Field(default=None, max_length=32)
    modalities: list[Literal["text"]] | None = Field(default=None, max_length=1)
    prediction: dict[str, Any] | None = None

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @model_validator(mode="after")
    def _tool_choice_names_a_tool(self) -> ChatCompletionRequest:
        names = [tool.function.name for tool in self.tools or ()]
        if len(set(names)) != len(names):
            raise ValueError("tools: function names must be unique")
        choice = self.tool_choice
        if choice not in (None, "none") and not names:
            raise ValueError("tool_choice: needs tools")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(f"tool_choice: no tool is named {choice.function.name!r}")
        return self

    def tool_calling(self) -> ToolCalling | None:
        """The tools and what `tool_choice` asks (`auto` when tools come without one);
        None without tools."""
        if not self.tools:
            return None
        choice = self.tool_choice or "auto"
        named = isinstance(choice, NamedToolChoice)
        return ToolCalling(
            tools=tuple(tool.model_dump(exclude_none=True) for tool in self.tools),
            choice="named" if named else choice,
            function=choice.function.name if named else None,
            parallel=self.parallel_tool_calls is not False,
        )

    def guided_spec(self) -> GuidedSpec | None:
        """`SamplingFields.guided_spec`, or the structure a forced tool call takes (not
        both: ValueError)."""
        spec = super().guided_spec()
        calling = self.tool_calling()
        forced = calling.guided_spec() if calling is not None else None
        if forced is not None and spec is not None:
            raise ValueError(
                "tool_choice: a forced tool call cannot be combined with response_format "
                "or structured_outputs"
            )
        return forced or spec


class TokenizeRequest(StrictModel):
    """/v1/tokenize (vLLM's /tokenize): a prompt, or chat messages through the model's
    chat template."""

    model: str = Field(min_length=1, max_length=256)
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool = Field(
        default=True, description="the tokenizer's special tokens around `prompt`"
    )
    add_generation_prompt: bool = Field(
        default=True, description="open the assistant's turn after `messages`"
    )

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        return self


class DetokenizeRequest(StrictModel):
    """/v1/detokenize (vLLM's /detokenize): the text of token ids."""

    model: str = Field(min_length=1, max_length=256)
    tokens: list[TokenId] = Field(max_length=1 << 17)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str
    """The vector, or with `encoding_format: base64` its little-endian float32 bytes."""


class EmbeddingList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "loraplex"
    parent: str | None = None
    root: str | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class AdapterFiles(StrictModel):
    """Where an adapter's files are: a folder under the tenant's root, or a URI under one
    of the tenant's adapter sources (fetched by the ingress, content-addressed)."""

    path: str | None = Field(
        None, min_length=1, max_length=1024, description="folder relative to the tenant's root"
    )
    uri: str | None = Field(
        None,
        min_length=1,
        max_length=2048,
        description="s3://, gs:// or https:// folder under one of the tenant's adapter_sources",
    )

    @model_validator(mode="after")
    def _one_location(self) -> AdapterFiles:
        if (self.path is None) == (self.uri is None):
            raise ValueError("give exactly one of `path` or `uri`")
        return self


class RegisterAdapterRequest(AdapterFiles):
    """Admin API: register one of the caller's adapters under a name (again: a new
    version under that name)."""

    model: str = Field(min_length=1, max_length=256, description="base model it adapts")
    name: str = Field(min_length=1, max_length=64, description="called as '<model>:<name>'")

    @field_validator("name")
    @classmethod
    def _adapter_name(cls, name: str) -> str:
        if not ADAPTER_NAME.match(name):
            raise ValueError(f"adapter name {name!r} must be letters, digits, '.', '_' or '-'")
        return name


class ArmFailpointRequest(StrictModel):
    """Operator API: arm a failpoint (platform/failpoints.py) in one replica of a model
    whose config allows fault injection, for a chaos drill."""

    model: str = Field(min_length=1, max_length=256, description="base model to fault")
    name: str = Field(min_length=1, max_length=64, description="sampler.row, engine.step, ...")
    prompt: list[Annotated[int, Field(ge=0, le=2**31 - 1)]] | None = Field(
        default=None, max_length=4096, description="fire only for requests with these token ids"
    )
    times: int | None = Field(default=None, ge=1, le=1_000_000, description="fire this often")
    delay_s: float = Field(default=0.0, ge=0.0, le=10.0, description="engine.delay's sleep")

    @field_validator("name")
    @classmethod
    def _known(cls, name: str) -> str:
        if name not in FAILPOINT_NAMES:
            raise ValueError(f"unknown failpoint {name!r}; known: {', '.join(FAILPOINT_NAMES)}")
        return name


class AdapterCard(BaseModel):
    id: str
    object: Literal["adapter"] = "adapter"
    parent: str
    name: str
    version: int
    source: str | None = None
    """The URI it was fetched from (without its query), None for a folder."""


class AdapterList(BaseModel):
    object: Literal["list"] = "list"
    data: list[AdapterCard]


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"
