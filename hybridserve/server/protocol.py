"""The OpenAI-compatible request and response bodies (pydantic).

Requests are strict about types (`"1"` is not an int, `1.0` is not an int). Unknown top-level
fields are ignored with a warning naming them, as vLLM does (stock clients send extensions
through `extra_body`); unknown fields inside nested objects are refused. Fields of the OpenAI
API that this server cannot honour (`echo`, `best_of > 1`, `logit_bias`, `suffix`) are
accepted only at their neutral values. Limits that depend on the model (prompt length,
vocabulary, `max_tokens` against `max_model_len`) are checked by `serving.py`.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

log = logging.getLogger(__name__)
MAX_LOGPROBS = 20
MAX_BATCH = 64  # prompts in one completions request
INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class _Lenient(BaseModel):
    """A request body: unknown top-level fields are dropped, with a warning naming them."""

    model_config = ConfigDict(extra="ignore", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _warn_unknown(cls, data: Any) -> Any:
        if isinstance(data, dict):
            unknown = sorted(k for k in data if k not in cls.model_fields)
            if unknown:
                log.warning("%s: ignoring unknown fields %s", cls.__name__, unknown[:20])
        return data


def _neutral(value: Any, neutral: tuple[Any, ...], name: str) -> Any:
    if value not in neutral:
        raise ValueError(f"{name} is not supported (only {neutral[0]!r})")
    return value


class StreamOptions(_Strict):
    include_usage: bool = False


class KVTransferParams(BaseModel):
    """`kv_transfer_params` (disaggregated prefill/decode): `{"do_remote_decode": true}` for a
    prefill instance, or a prefill response's parameters for a decode instance. Known keys are
    type-checked; others pass through to the engine's connector."""

    model_config = ConfigDict(extra="allow", strict=True)

    do_remote_decode: bool | None = None
    do_remote_prefill: bool | None = None
    req_id: str | None = None
    engine_id: str | None = None
    host: str | None = None
    port: int | None = Field(None, ge=0, le=65535)
    block_tables: list[list[int]] | None = None
    num_tokens: int | None = Field(None, ge=0)
    lease_s: float | None = Field(None, gt=0)


class _SamplingRequest(_Lenient):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=100)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=-1, le=INT32_MAX)
    min_p: float = Field(0.0, ge=0, le=1)
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: str | list[str] | None = Field(None, max_length=16)
    stop_token_ids: list[int] | None = Field(None, max_length=64)
    n: int = Field(1, ge=1, le=128)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    skip_special_tokens: bool = True
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    repetition_penalty: float = Field(1.0, gt=0, le=100)  # vLLM's extension
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    return_token_ids: bool = False  # extension: choices[].token_ids and prompt_token_ids
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # vLLM's extension
    kv_transfer_params: KVTransferParams | None = None

    @field_validator("stop")
    @classmethod
    def _stop_not_empty(cls, stop: str | list[str] | None) -> str | list[str] | None:
        if stop == "" or (isinstance(stop, list) and "" in stop):
            raise ValueError("stop strings must not be empty")
        return stop

    @field_validator("logit_bias")
    @classmethod
    def _no_bias(cls, value: dict | None) -> dict | None:
        return _neutral(value or None, (None,), "logit_bias")

    @model_validator(mode="after")
    def _prompt_logprobs_not_streamed(self) -> _SamplingRequest:
        if self.stream and self.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs are not available when stream is true (as vLLM)")
        return self

    @property
    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class ReleaseRequest(_Strict):
    """`POST /v1/kv_transfer/release`: a prefill response's `kv_transfer_params`, whose held
    pages the prefill instance frees at once (the proxy sends it when the decode leg failed)."""

    kv_transfer_params: KVTransferParams


class CompletionRequest(_SamplingRequest):
    """`POST /v1/completions`. `prompt`: a string, a list of token ids, or a batch: a list of
    those (each prompt gets `n` choices, indexed prompt by prompt)."""

    prompt: Any
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, prompt: Any) -> str | list[int] | list[str | list[int]]:
        if _one_prompt(prompt):
            return prompt
        if isinstance(prompt, list) and prompt and all(_one_prompt(p) for p in prompt):
            if len(prompt) > MAX_BATCH:
                raise ValueError(f"a batch of {len(prompt)} prompts: at most {MAX_BATCH}")
            return prompt[0] if len(prompt) == 1 else prompt
        raise ValueError(
            "prompt must be a string, a list of token ids (integers), or a list of those"
        )

    @property
    def prompts(self) -> list[str | list[int]]:
        """The prompts of this request (one unless it is a batch)."""
        if isinstance(self.prompt, list) and self.prompt and not _is_ids(self.prompt):
            return list(self.prompt)
        return [self.prompt]

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, value: bool) -> bool:
        return _neutral(value, (False,), "echo")

    @field_validator("best_of")
    @classmethod
    def _no_best_of(cls, value: int | None) -> int | None:
        return _neutral(value, (None, 1), "best_of > 1")

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> str | None:
        return _neutral(value, (None,), "suffix")


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    )


def _one_prompt(value: Any) -> bool:
    """Is `value` one prompt: a string or a list of token ids?"""
    return isinstance(value, str) or (_is_ids(value) and bool(value) or value == [])


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ImageURL(_Strict):
    url: str  # a data URL: data:image/png;base64,...
    detail: Literal["auto", "low", "high"] | None = None


class ImagePart(_Strict):
    """An image as a base64 data URL (`hybridserve.media`: [0, 1] pixels)."""

    type: Literal["image_url"]
    image_url: ImageURL | str


class InputAudio(_Strict):
    data: str  # base64 of the file
    format: str  # "wav" (`chat_prompt.AUDIO_FORMATS`)


class AudioPart(_Strict):
    """A WAV file, base64, at the model's sample rate."""

    type: Literal["input_audio"]
    input_audio: InputAudio


ContentPart = Annotated[TextPart | ImagePart | AudioPart, Field(discriminator="type")]


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def text(self) -> str:
        """The text of the content (text parts joined by newlines; media parts left out)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content if isinstance(part, TextPart))

    def as_dict(self) -> dict[str, Any]:
        """`{"role", "content"}` as `chat_prompt.render_chat` takes it."""
        content = self.content
        if isinstance(content, list):
            content = [part.model_dump(exclude_none=True) for part in content]
        return {"role": self.role, "content": content}


class ChatCompletionRequest(_SamplingRequest):
    """`POST /v1/chat/completions`. `max_tokens` (or `max_completion_tokens`) defaults to what
    is left of `max_model_len` after the prompt."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True


# -- responses ------------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    """Legacy completions logprobs: per token its text, logprob and the top alternatives."""

    tokens: list[str] = []
    token_logprobs: list[float] = []
    top_logprobs: list[dict[str, float]] = []
    text_offset: list[int] = []


class PromptLogprob(BaseModel):
    """One token of a prompt_logprobs entry (vLLM's `Logprob`)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# per prompt token {token id (a string, as JSON keys are): PromptLogprob}; None for the first
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    prompt_logprobs: PromptLogprobs | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None
    kv_transfer_params: dict[str, Any] | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: PromptLogprobs | None = None
    kv_transfer_params: dict[str, Any] | None = None


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatStreamChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
    kv_transfer_params: dict[str, Any] | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "hybridserve"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    """The OpenAI error shape: `{"error": {"message", "type", "param", "code"}}`."""

    error: ErrorInfo
