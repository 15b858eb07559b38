"""Request bodies of the OpenAI API plus vLLM's extras. Unknown fields are accepted and logged."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from llmserve.server.errors import APIError


class _Base(BaseModel):
    model_config = ConfigDict(extra="allow")

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data):
        """OpenAI's schema makes most fields nullable, and its SDK sends null for them: null means the default."""
        if isinstance(data, dict):
            return {k: v for k, v in data.items()
                    if not (v is None and k in cls.model_fields and cls.model_fields[k].default is not None)}
        return data


class StreamOptions(_Base):
    include_usage: bool = False
    # vLLM's: with include_usage, every chunk carries the usage so far
    continuous_usage_stats: bool = False


class _SamplingFields(_Base):
    model: str | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    seed: int | None = None
    user: str | None = None
    # vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    allowed_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    priority: int = 0
    cache_salt: str | None = None
    timeout: float | None = Field(default=None, gt=0)
    # vLLM's: the prompt's and the output's token ids in the response (what RL rollouts train on)
    return_token_ids: bool = False
    # vLLM's: each prompt token's logprob and the top ones, in the response (not streamed)
    prompt_logprobs: int | None = Field(default=None, ge=0)
    # vLLM's beam search: n beams, ranked by cumulative logprob over length ** length_penalty (beam_search.py)
    use_beam_search: bool = False
    length_penalty: float = 1.0


class JsonSchemaFormat(_Base):
    name: str = Field(default="response", max_length=64)
    description: str | None = None
    # OpenAI calls the field `schema`; pydantic reserves the name on models, hence the alias
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Base):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Base):
    """vLLM's extra field: exactly one of these."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    disable_any_whitespace: bool = True


class _Structured(_SamplingFields):
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None


class CompletionRequest(_Structured):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0)  # at most --max-logprobs (20 by default)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    # vLLM's disaggregated-serving field: a decode instance's order to a prefill instance (kv_transfer/connector.py)
    kv_transfer_params: dict[str, Any] | None = None


class TextPart(_Base):
    type: Literal["text"]
    text: str


class FunctionCall(_Base):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCall(_Base):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Base):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class ChatCompletionRequest(_Structured):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0)  # at most --max-logprobs (20 by default)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's: the answer starts with the last message's content when that message has the answer's role (a
    # continued assistant message comes back whole)
    echo: bool = False


class TokenizeRequest(_Base):
    model: str | None = None
    return_token_strs: bool = False  # vLLM's: each token's text too
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    tools: list[dict[str, Any]] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class _PoolingInput(_Base):
    """What a pooling request (embeddings, classification) reads: OpenAI's `input`, or vLLM's chat form `messages`."""

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]] | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    user: str | None = None
    # vLLM extras
    truncate_prompt_tokens: int | None = None  # keep each input's last k tokens (-1: as many as the context holds)
    add_special_tokens: bool = True  # for input's strings (messages get the template's)
    add_generation_prompt: bool = False
    priority: int = 0
    timeout: float | None = Field(default=None, gt=0)


class EmbeddingRequest(_PoolingInput):
    """OpenAI's /v1/embeddings body, with vLLM's extras."""

    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    normalize: bool | None = None


class ClassificationRequest(_PoolingInput):
    """vLLM's /classify body."""

    activation: bool | None = None  # probabilities (softmax/sigmoid); false: the head's raw scores


class ScoreRequest(_Base):
    """vLLM's /score: how alike each text_1 is to its text_2 (one to one, one to many, or pairwise lists)."""

    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]
    activation: bool | None = None  # a cross-encoder's: its score as a probability (default) or raw
    truncate_prompt_tokens: int | None = None
    priority: int = 0
    timeout: float | None = Field(default=None, gt=0)


class RerankRequest(_Base):
    """The rerank API of Jina and Cohere, as vLLM serves it (/rerank, /v1/rerank, /v2/rerank)."""

    model: str | None = None
    query: str
    documents: list[str] = Field(min_length=1)
    top_n: int = Field(default=0, ge=0)  # 0: all of them
    return_documents: bool = True  # Cohere's: the document's text with each result
    activation: bool | None = None  # a cross-encoder's: its score as a probability (default) or raw
    truncate_prompt_tokens: int | None = None
    priority: int = 0
    timeout: float | None = Field(default=None, gt=0)


class DetokenizeRequest(_Base):
    model: str | None = None
    tokens: list[int]


class ChatPathExtras(_Base):
    """The sampling fields (and vLLM's extras) that the Responses and Messages APIs pass to the chat request they run
    as, unchanged."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop_token_ids: list[int] | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    priority: int = 0
    cache_salt: str | None = None
    timeout: float | None = Field(default=None, gt=0)
    chat_template_kwargs: dict[str, Any] | None = None
    structured_outputs: StructuredOutputs | None = None

    def chat_fields(self) -> dict[str, Any]:
        """These fields, where set, for the chat request."""
        return {name: value for name in ChatPathExtras.model_fields if (value := getattr(self, name)) is not None}


class ResponsesRequest(ChatPathExtras):
    """POST /v1/responses (OpenAI's Responses API). `input` items and `tools` stay plain dicts here: responses_api.py
    reads them into chat messages and chat tools, naming the item that is wrong."""

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = None
    top_logprobs: int | None = Field(default=None, ge=0)  # at most --max-logprobs (20 by default)
    include: list[str] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    truncation: Literal["auto", "disabled"] = "disabled"
    store: bool = True
    background: bool = False
    stream: bool = False
    metadata: dict[str, str] | None = None
    user: str | None = None
    service_tier: str | None = None
    logit_bias: dict[str, float] | None = None  # vLLM's extras too, as in chat
    stop: str | list[str] | None = None

    @field_validator("metadata")
    @classmethod
    def _check_metadata(cls, metadata):
        # OpenAI's limits: 16 pairs, keys up to 64 characters, values up to 512
        if metadata is not None and (len(metadata) > 16 or any(len(k) > 64 or len(v) > 512 for k, v in metadata.items())):
            raise ValueError("at most 16 pairs, keys up to 64 characters and values up to 512")
        return metadata


class AnthropicMessage(_Base):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class MessagesRequest(ChatPathExtras):
    """POST /v1/messages (Anthropic's Messages API); content blocks and tools stay plain dicts here: messages_api.py
    reads them, naming the block that is wrong."""

    model: str | None = None
    messages: list[AnthropicMessage] = Field(min_length=1)
    max_tokens: int = Field(ge=1)
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None  # its `format` ({"type": "json_schema", "schema": ...}) is honoured
    service_tier: str | None = None


class CountTokensRequest(_Base):
    """POST /v1/messages/count_tokens."""

    model: str | None = None
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None


def content_text(content, where: str, param: str, text_types: tuple[str, ...], media_types: tuple[str, ...]) -> str:
    """The text of a message's content in the Responses or Messages API: a string, or a list of parts (strings or
    {"type", "text"} objects; a refusal's text is its "refusal") joined, or one such part. A part of a media type (an
    image, a file) is a 400: these models read text only."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    one = isinstance(content, dict)  # a single part, at `where`
    if not (one or isinstance(content, list)):
        raise APIError(400, f"{where} must be a string or a list of content parts", param=param)
    texts = []
    for j, part in enumerate([content] if one else content):
        at = where if one else f"{where}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        value = part if isinstance(part, str) else (part or {}).get("refusal" if kind == "refusal" else "text") \
            if isinstance(part, dict) else None
        if isinstance(part, str) or (kind in text_types and isinstance(value, str)):
            texts.append(value)
        elif kind in media_types:
            raise APIError(400, f"{at}: this server's models read text only; content of type {kind!r} is not supported",
                           param=param)
        else:
            raise APIError(400, f"{at}: expected a text part ({', '.join(text_types)}), got type {kind!r}", param=param)
    return "".join(texts)
