"""OpenAI-compatible request and response shapes for ``/v1/completions`` and ``/v1/chat/completions``.

Requests are pydantic models that accept unknown fields. An unknown field is
ignored unless it is one we know would change the output (`OUTPUT_CHANGING`) and
its value is not the neutral one — then the request is refused with 400 naming the
field (``repetition_penalty: 1.0``, as ``vllm bench serve`` sends, passes;
``repetition_penalty: 1.2`` does not). Errors use OpenAI's shape
``{"error": {"message", "type", "param", "code"}}`` (`error_body`).
"""

from __future__ import annotations

import math
import time
import uuid
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

MAX_STOP_STRINGS = 8
MAX_STOP_CHARS = 256

# extra fields that would change the output, and the values that leave it unchanged
OUTPUT_CHANGING: dict[str, tuple[Any, ...]] = {
    "repetition_penalty": (1, 1.0, None),
    "frequency_penalty": (0, 0.0, None),
    "presence_penalty": (0, 0.0, None),
    "length_penalty": (1, 1.0, None),
    "min_p": (0, 0.0, None),
    "min_tokens": (0, None),
    "best_of": (1, None),
    "use_beam_search": (False, None),
    "logit_bias": (None, {}),
    "logprobs": (None, False, 0),
    "top_logprobs": (None, 0),
    "prompt_logprobs": (None, 0),
    "echo": (False, None),
    "suffix": (None, ""),
    "stop_token_ids": (None, []),
    "bad_words": (None, []),
    "guided_json": (None,), "guided_regex": (None,), "guided_choice": (None,), "guided_grammar": (None,),
    "structured_outputs": (None,),
    "response_format": (None, {"type": "text"}),
    "tools": (None, []),
    "tool_choice": (None, "none", "auto"),
    "functions": (None, []),
    "function_call": (None, "none", "auto"),
    "skip_special_tokens": (True, None),
    "include_stop_str_in_output": (False, None),
}


def _is_neutral(value: Any, neutral: tuple[Any, ...]) -> bool:
    """``value`` equals one of the neutral values (a bool only matches a bool)."""
    return any(value is v or (value == v and isinstance(value, bool) == isinstance(v, bool)) for v in neutral)


class ProtocolError(ValueError):
    """A client mistake: answered with ``status`` and OpenAI's error shape, naming ``param``."""

    def __init__(self, message: str, param: str | None = None, *, status: int = 400,
                 type_: str = "invalid_request_error", code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.type = type_
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool = False


class _Common(BaseModel):
    """Fields shared by both endpoints (OpenAI's names and defaults)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    ignore_eos: bool = False
    metadata: dict[str, str] | None = None

    def check(self) -> None:
        """Raise `ProtocolError` naming the field for what pydantic cannot express."""
        if self.n != 1:
            raise ProtocolError("only n=1 is supported", "n")
        if self.temperature is not None and not math.isfinite(self.temperature):
            raise ProtocolError("temperature must be a finite number in [0, 2]", "temperature")
        if self.top_k is not None and self.top_k not in (-1, 0) and self.top_k < 1:
            raise ProtocolError("top_k must be -1 or 0 (off) or an integer >= 1", "top_k")
        if self.seed is not None and not -(2 ** 63) <= self.seed < 2 ** 64:
            raise ProtocolError("seed must fit in 64 bits", "seed")
        for text in self.stop_list():
            if not text:
                raise ProtocolError("stop strings must be non-empty", "stop")
            if len(text) > MAX_STOP_CHARS:
                raise ProtocolError(f"stop strings must be at most {MAX_STOP_CHARS} characters", "stop")
        if len(self.stop_list()) > MAX_STOP_STRINGS:
            raise ProtocolError(f"at most {MAX_STOP_STRINGS} stop strings", "stop")
        if self.stream_options is not None and not self.stream:
            raise ProtocolError("stream_options is only allowed with stream: true", "stream_options")
        for name, value in (self.model_extra or {}).items():
            neutral = OUTPUT_CHANGING.get(name)
            if neutral is not None and not _is_neutral(value, neutral):
                raise ProtocolError(f"{name}={value!r} is not supported (it would change the output); "
                                    f"omit it or send {neutral[0]!r}", name)

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def effective_temperature(self) -> float:
        return 1.0 if self.temperature is None else float(self.temperature)

    @property
    def effective_top_k(self) -> int | None:
        return None if self.top_k is None or self.top_k <= 0 else self.top_k

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options is not None and self.stream_options.include_usage)


class CompletionRequest(_Common):
    """``POST /v1/completions``: a prompt string or a list of token ids (one prompt, n=1)."""

    prompt: Union[str, list[int], list[str], list[list[int]]]

    def prompt_value(self) -> str | list[int]:
        p = self.prompt
        if isinstance(p, str):
            return p
        if not p:
            raise ProtocolError("prompt is empty", "prompt")
        if all(isinstance(x, str) for x in p):
            if len(p) != 1:
                raise ProtocolError("only one prompt per request is supported", "prompt")
            return p[0]
        if all(isinstance(x, list) for x in p):
            if len(p) != 1:
                raise ProtocolError("only one prompt per request is supported", "prompt")
            return list(p[0])
        return list(p)  # type: ignore[arg-type]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[dict[str, Any]], None] = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for i, part in enumerate(self.content):
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ProtocolError("only text content parts are supported", f"messages.content[{i}]")
            parts.append(part["text"])
        return "".join(parts)


class ChatCompletionRequest(_Common):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)

    def check(self) -> None:
        super().check()
        if self.max_tokens is not None and self.max_completion_tokens is not None \
                and self.max_tokens != self.max_completion_tokens:
            raise ProtocolError("max_tokens and max_completion_tokens disagree; send one", "max_completion_tokens")

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now_s() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_body(rid: str, model: str, created: int, text: str, finish_reason: str | None,
                    prompt_tokens: int, completion_tokens: int, specops: dict[str, Any]) -> dict[str, Any]:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}],
            "usage": usage(prompt_tokens, completion_tokens), "specops": specops}


def completion_chunk(rid: str, model: str, created: int, text: str, finish_reason: str | None,
                     specops: dict[str, Any] | None = None, with_usage: bool = False) -> dict[str, Any]:
    body: dict[str, Any] = {"id": rid, "object": "text_completion", "created": created, "model": model,
                            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}]}
    if with_usage:
        body["usage"] = None
    if specops is not None:
        body["specops"] = specops
    return body


def chat_body(rid: str, model: str, created: int, text: str, finish_reason: str | None,
              prompt_tokens: int, completion_tokens: int, specops: dict[str, Any]) -> dict[str, Any]:
    return {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                         "finish_reason": finish_reason}],
            "usage": usage(prompt_tokens, completion_tokens), "specops": specops}


def chat_chunk(rid: str, model: str, created: int, delta: dict[str, Any], finish_reason: str | None,
               specops: dict[str, Any] | None = None, with_usage: bool = False) -> dict[str, Any]:
    body: dict[str, Any] = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]}
    if with_usage:
        body["usage"] = None
    if specops is not None:
        body["specops"] = specops
    return body


def usage_chunk(rid: str, model: str, created: int, obj: str, prompt_tokens: int, completion_tokens: int,
                specops: dict[str, Any]) -> dict[str, Any]:
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [],
            "usage": usage(prompt_tokens, completion_tokens), "specops": specops}
