"""The API contract of ``twin serve``: errors, resource limits and the request bodies.

Shared by the completions server (``trainer/serving/completions.py``), the LoRA slots
(``trainer/serving/lora.py``) and the HTTP layer (``trainer/serving/http.py``); nothing here
imports torch or an HTTP stack.

- :class:`ServeLimits`: every resource limit, with defaults, and the ``twin serve`` options that
  set them (``--max-n``, ``--max-tokens``, ``--read-timeout``, ...).
- :func:`completion_request_model`, :class:`LoadAdapterRequest`, :class:`UnloadAdapterRequest`:
  pydantic models of the request bodies; anything outside them is a 400 that names the field and
  what is allowed.
"""

from __future__ import annotations

import functools
import reprlib
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from twin.errors import TwinError

__all__ = [
    "API_KEY_ENV",
    "LoadAdapterRequest",
    "LogprobsMode",
    "ServeLimits",
    "ServerError",
    "UnloadAdapterRequest",
    "completion_request_model",
    "validate",
    "validation_message",
]

#: Environment variable holding the API key of ``twin serve`` (server and the trainer's clients).
API_KEY_ENV = "TWINRL_API_KEY"

#: ``processed_logprobs``: after temperature and top-p (the distribution sampled from);
#: ``raw_logprobs``: before them (vLLM's default).
LogprobsMode = Literal["processed_logprobs", "raw_logprobs"]


class ServerError(TwinError):
    """A request the server rejects, with the HTTP status it is answered with.

    ``code`` 400 is a bad request, 401 a missing or wrong API key, 403 an adapter outside the
    adapter root, 404 an unknown model or adapter path, 408 a body that did not arrive in time,
    413 a body over the size limit, 500 a failure while loading or generating, 503 busy or
    shutting down.
    """

    def __init__(self, message: str, code: int = 400) -> None:
        super().__init__(message)
        self.code = code

    @property
    def error_type(self) -> str:
        """The OpenAI/vLLM error type name of ``code``."""
        return {
            400: "BadRequestError",
            401: "AuthenticationError",
            403: "PermissionDeniedError",
            404: "NotFoundError",
            405: "MethodNotAllowedError",
            408: "RequestTimeoutError",
            413: "RequestTooLargeError",
            431: "RequestHeaderFieldsTooLargeError",
            503: "ServiceUnavailableError",
        }.get(self.code, "InternalServerError")

    def body(self) -> dict[str, Any]:
        """The JSON error body, as vLLM answers it."""
        return {
            "error": {
                "message": str(self),
                "type": self.error_type,
                "param": None,
                "code": self.code,
            }
        }


# -- limits ---------------------------------------------------------------------------------------
class ServeLimits(BaseModel):
    """What one client may ask of ``twin serve``; each field is a ``twin serve --option``.

    The defaults fit the trainer (a lot of a few hundred rows in one request, 64 sampling
    connections at once) with room to spare, and keep one request's memory bounded:
    ``max_rows x (prompt + max_tokens)`` tokens of KV cache.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_n: int = Field(256, ge=1, description="most completions per prompt (`n`)")
    max_prompts: int = Field(1024, ge=1, description="most prompts in one request")
    max_rows: int = Field(1024, ge=1, description="most sequences in one request (prompts x n)")
    max_tokens: int = Field(
        4096, ge=1, description="most completion tokens per sequence (`max_tokens`)"
    )
    max_prompt_tokens: int = Field(32768, ge=1, description="most tokens in one prompt")
    max_logprobs: int = Field(
        20, ge=0, description="most alternatives per token (`logprobs`, `prompt_logprobs`)"
    )
    max_stop_token_ids: int = Field(1024, ge=0, description="most `stop_token_ids`")
    max_body_bytes: int = Field(32 << 20, ge=1024, description="largest request body (bytes)")
    body_budget_bytes: int = Field(
        64 << 20,
        ge=1024,
        description="bytes of request bodies read or being answered at once, all connections",
    )
    read_timeout: float = Field(
        30.0,
        gt=0,
        allow_inf_nan=False,
        description="seconds a whole request (head and body) may take to arrive; also the idle "
        "limit",
    )
    http_threads: int = Field(128, ge=1, description="requests handled at once (handler threads)")
    max_connections: int = Field(
        1024, ge=1, description="open connections (served + waiting); more get 503"
    )

    @model_validator(mode="after")
    def _budget_holds_a_body(self) -> ServeLimits:
        if self.body_budget_bytes < self.max_body_bytes:
            raise ValueError(
                f"body_budget_bytes ({self.body_budget_bytes}) must be at least max_body_bytes "
                f"({self.max_body_bytes}), or the largest allowed body could never be read"
            )
        return self


_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = _REPR.maxlong = 60
_REPR.maxlist = _REPR.maxdict = _REPR.maxtuple = 8


def validation_message(exc: ValidationError, what: str = "request") -> str:
    """One line naming each invalid field, what was wrong and what is allowed."""
    parts = []
    for error in exc.errors()[:3]:
        # pydantic adds the union member's type to the location ("temperature.float"); drop it
        loc = ".".join(
            str(p)
            for p in error["loc"]
            if p not in ("float", "int", "str", "list", "bool", "function-after")
        )
        got = _REPR.repr(error.get("input"))  # bounded: the input may be a million-item list
        got = got if len(got) <= 60 else got[:57] + "..."
        msg = error["msg"].removeprefix("Value error, ")
        parts.append(
            f"{loc or 'body'}: {msg} (got {got})"
            if error["type"] != "missing"
            else f"{loc}: required"
        )
    more = len(exc.errors()) - len(parts)
    return f"invalid {what}: " + "; ".join(parts) + (f"; and {more} more" if more > 0 else "")


_StrictInt = Annotated[int, Field(strict=True)]


def _check_ids(ids: list[Any], limits: ServeLimits) -> list[int]:
    if not ids:
        raise ValueError("a prompt is empty; give at least one token")
    if len(ids) > limits.max_prompt_tokens:
        raise ValueError(
            f"a prompt has {len(ids)} tokens; at most {limits.max_prompt_tokens} are allowed"
        )
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ValueError("token ids must be integers")
    return ids


def _check_text(text: str, limits: ServeLimits) -> str:
    if not text:
        raise ValueError("a prompt is empty; give at least one character")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:  # JSON may escape a lone surrogate ("\\ud800")
        raise ValueError(
            f"a text prompt holds a lone surrogate at character {exc.start}; send valid Unicode"
        ) from None
    # characters, before tokenizing: a token is at least one character
    if len(text) > 8 * limits.max_prompt_tokens:
        raise ValueError(
            f"a text prompt has {len(text)} characters; at most {8 * limits.max_prompt_tokens}"
        )
    return text


@functools.lru_cache(maxsize=8)
def completion_request_model(limits: ServeLimits) -> type[BaseModel]:
    """The pydantic model of a ``/v1/completions`` body under ``limits``
    (unknown fields ignored)."""

    class CompletionRequest(BaseModel):
        """A ``/v1/completions`` body (vLLM's token-id extensions included)."""

        model_config = ConfigDict(extra="ignore")

        model: Annotated[str, Field(strict=True, max_length=512)] | None = None
        prompt: Any  # required; the validator below gives it its shape
        n: Annotated[int, Field(strict=True, ge=1, le=limits.max_n)] | None = None
        max_tokens: Annotated[int, Field(strict=True, ge=0, le=limits.max_tokens)] | None = None
        temperature: Annotated[float, Field(strict=True, ge=0.0, allow_inf_nan=False)] | None = None
        top_p: Annotated[float, Field(strict=True, gt=0.0, le=1.0, allow_inf_nan=False)] | None = (
            None
        )
        # torch generators take seeds in [-2**63, 2**64); rows add their index to it
        seed: Annotated[int, Field(strict=True, ge=-(1 << 63), lt=1 << 64)] | None = None
        logprobs: Annotated[int, Field(strict=True, ge=0, le=limits.max_logprobs)] | None = None
        prompt_logprobs: Annotated[int, Field(strict=True, ge=0, le=limits.max_logprobs)] | None = (
            None
        )
        stop_token_ids: (
            Annotated[list[_StrictInt], Field(max_length=limits.max_stop_token_ids)] | None
        ) = None
        stop: Any = None
        stream: Any = None
        ignore_eos: bool = False
        return_token_ids: bool = False
        return_tokens_as_token_ids: bool = False
        skip_special_tokens: bool = True

        @field_validator("prompt", mode="before")
        @classmethod
        def _prompt(cls, value: Any) -> list[str | list[int]]:
            if isinstance(value, str):
                return [_check_text(value, limits)]
            if isinstance(value, list) and value and all(isinstance(v, int) for v in value):
                return [_check_ids(value, limits)]
            if isinstance(value, list) and value and all(isinstance(v, (str, list)) for v in value):
                if len(value) > limits.max_prompts:
                    raise ValueError(
                        f"{len(value)} prompts in one request; at most {limits.max_prompts} are "
                        "allowed"
                    )
                return [
                    _check_text(v, limits) if isinstance(v, str) else _check_ids(v, limits)
                    for v in value
                ]
            raise ValueError(
                "prompt must be a string, a list of token ids, or a non-empty list of either"
            )

        @model_validator(mode="after")
        def _rows(self) -> CompletionRequest:
            if self.stream:
                raise ValueError("stream=true is not supported by twin serve; use stream=false")
            if self.stop:
                raise ValueError(
                    "'stop' strings are not supported by twin serve; pass 'stop_token_ids'"
                )
            rows = len(self.prompt) * (self.n or 1)
            if rows > limits.max_rows:
                raise ValueError(
                    f"{len(self.prompt)} prompts x n={self.n or 1} is {rows} sequences; at most "
                    f"{limits.max_rows} are allowed in one request"
                )
            return self

    return CompletionRequest


_AdapterName = Annotated[str, Field(strict=True, min_length=1, max_length=256)]


class LoadAdapterRequest(BaseModel):
    """A ``/v1/load_lora_adapter`` body."""

    model_config = ConfigDict(extra="ignore")

    lora_name: _AdapterName
    lora_path: Annotated[
        str, Field(strict=True, min_length=1, max_length=4096, pattern=r"^[^\x00]*$")
    ]
    load_inplace: bool = False


class UnloadAdapterRequest(BaseModel):
    """A ``/v1/unload_lora_adapter`` body."""

    model_config = ConfigDict(extra="ignore")

    lora_name: _AdapterName


def validate(model: type[BaseModel], body: dict[str, Any], what: str) -> Any:
    """``model.model_validate(body)``; a :class:`ServerError` 400 naming
    the bad fields otherwise."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise ServerError(validation_message(exc, what), 400) from None
