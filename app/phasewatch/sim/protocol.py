"""vLLM's OpenAI-compatible wire shapes: request validation, chunks, responses, errors.

Shapes and key order follow vLLM v0.10's `protocol.py` and serving code, except where noted
as vLLM 0.32's (docs/simulator.md says which is which):
- completion chunks are dumped with `exclude_unset=True`, as 0.32 does: every choice carries
  `index`, `text`, `logprobs`, `finish_reason`, `stop_reason`, and the chunk has a `usage` key
  only with continuous usage stats (0.10 dumped every field, so `"usage":null`);
- chat chunks are dumped with `exclude_unset=True`: the first is role-only
  (`{"role":"assistant","content":""}`), the rest carry `{"content": ...}`, the last adds
  `stop_reason`; `usage` appears only with continuous usage stats;
- the include_usage chunk has `choices: []` and usage without nulls, before `data: [DONE]`;
- `system_fingerprint` goes where 0.32 stamps it: on the terminal chunk (finish_reason set)
  without include_usage, else on the include_usage chunk (and on non-streamed responses);
- `UsageInfo` orders its keys prompt_tokens, total_tokens, completion_tokens, as vLLM does;
- errors are `{"error": {"message", "type", "param", "code"}}` with the HTTP status as `code`.
Everything is built with orjson, compact. Nothing here does I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import orjson

from phasewatch.sim.tokenizer import Tokenizer

ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    408: "RequestTimeoutError",
    413: "RequestEntityTooLargeError",
    422: "UnprocessableEntityError",
    429: "RateLimitError",
    500: "InternalServerError",
    501: "NotImplementedError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}


class ApiError(Exception):
    """A request vLLM would refuse, with the status and message vLLM would send."""

    def __init__(self, message: str, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param

    def body(self) -> bytes:
        return error_body(self.message, self.status, self.param)


def error_body(message: str, status: int, param: str | None = None) -> bytes:
    error_type = ERROR_TYPES.get(
        status, "InternalServerError" if status >= 500 else "BadRequestError"
    )
    return orjson.dumps(
        {"error": {"message": message, "type": error_type, "param": param, "code": status}}
    )


Kind = Literal["completion", "chat"]


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    kind: Kind
    prompt_len: int
    max_tokens: int
    stream: bool
    include_usage: bool
    continuous_usage: bool
    ignore_eos: bool
    seed: int | None


@dataclass(frozen=True, slots=True)
class ServedModel:
    name: str
    max_model_len: int
    tokenizer: Tokenizer


def parse_json(raw: bytes) -> dict[str, Any]:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise ApiError(f"Request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ApiError("Request body must be a JSON object")
    return body


def parse_generation(body: dict[str, Any], kind: Kind, served: ServedModel) -> GenerationRequest:
    """Validate a completions or chat completions body the way vLLM would, or raise ApiError."""
    model = body.get("model")
    if model is not None and model != served.name:
        raise ApiError(f"The model `{model}` does not exist.", status=404, param="model")

    if kind == "completion":
        prompt_len = _completion_prompt_len(body.get("prompt"), served.tokenizer)
        max_tokens_raw = body.get("max_tokens", 16)
        default_max: int | None = 16
    else:
        prompt_len = _chat_prompt_len(body, served.tokenizer)
        max_tokens_raw = body.get("max_completion_tokens", body.get("max_tokens"))
        default_max = None
    if max_tokens_raw is None:
        max_tokens_raw = default_max

    n = body.get("n", 1)
    if n is not None and n != 1:
        raise ApiError("The simulator generates one choice per request (n must be 1)", param="n")
    if body.get("echo"):
        raise ApiError("echo is not supported by the simulator", param="echo")
    if kind == "completion" and body.get("logprobs") is not None:
        raise ApiError("logprobs are not supported by the simulator", param="logprobs")
    if kind == "chat" and body.get("logprobs"):
        raise ApiError("logprobs are not supported by the simulator", param="logprobs")

    stream = _bool(body, "stream")
    options = body.get("stream_options")
    if options and not stream:
        raise ApiError("Stream options can only be defined when `stream=True`.")
    if options is not None and not isinstance(options, dict):
        raise ApiError("stream_options must be an object", param="stream_options")
    # vLLM: include_usage defaults to true once stream_options is given; continuous usage
    # only takes effect together with include_usage.
    include_usage = bool(options) and bool(options.get("include_usage", True))  # type: ignore[union-attr]
    continuous = include_usage and bool(options.get("continuous_usage_stats", False))  # type: ignore[union-attr]

    seed = body.get("seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise ApiError("seed must be an integer", param="seed")
    temperature = body.get("temperature")
    if temperature is not None and (not isinstance(temperature, int | float) or temperature < 0):
        raise ApiError("temperature must be a non-negative number", param="temperature")

    limit = served.max_model_len
    if max_tokens_raw is None:
        if prompt_len >= limit:
            raise ApiError(
                f"This model's maximum context length is {limit} tokens. However, your request "
                f"has {prompt_len} input tokens. Please reduce the length of the input messages."
            )
        max_tokens = limit - prompt_len
    else:
        if not isinstance(max_tokens_raw, int) or isinstance(max_tokens_raw, bool):
            raise ApiError("max_tokens must be an integer", param="max_tokens")
        if max_tokens_raw < 1:
            raise ApiError(
                f"max_tokens must be at least 1, got {max_tokens_raw}.", param="max_tokens"
            )
        max_tokens = max_tokens_raw
        if prompt_len + max_tokens > limit:
            raise ApiError(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{prompt_len + max_tokens} tokens ({prompt_len} in the messages, {max_tokens} "
                "in the completion). Please reduce the length of the messages or completion."
            )

    return GenerationRequest(
        kind=kind,
        prompt_len=prompt_len,
        max_tokens=max_tokens,
        stream=stream,
        include_usage=include_usage,
        continuous_usage=continuous,
        ignore_eos=_bool(body, "ignore_eos"),
        seed=seed,
    )


def _bool(body: dict[str, Any], key: str) -> bool:
    value = body.get(key, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ApiError(f"{key} must be a boolean", param=key)
    return value


def _completion_prompt_len(prompt: Any, tokenizer: Tokenizer) -> int:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one prompt
    if isinstance(prompt, str):
        count = tokenizer.count(prompt)
    elif isinstance(prompt, list) and all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt
    ):
        count = len(prompt)  # token ids
    elif isinstance(prompt, list) and prompt:
        raise ApiError("The simulator serves one prompt per request", param="prompt")
    else:
        raise ApiError(
            "Either prompt or prompt_embeds must be provided and non-empty.", param="prompt"
        )
    if count == 0:
        raise ApiError(
            "The prompt has no tokens (the simulator counts whitespace-separated words)",
            param="prompt",
        )
    return count


def _chat_prompt_len(body: dict[str, Any], tokenizer: Tokenizer) -> int:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError("messages must be a non-empty list", param="messages")
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ApiError("each message must be an object with a role", param="messages")
        content = message.get("content")
        if content is not None and not isinstance(content, str | list):
            raise ApiError("message content must be a string or a list of parts", param="messages")
    add_generation_prompt = body.get("add_generation_prompt", True) is not False
    return tokenizer.count_chat(messages, add_generation_prompt)


# -- streaming chunks -----------------------------------------------------------------------------


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


DONE = b"data: [DONE]\n\n"


def usage(prompt: int, completion: int, details_null: bool) -> dict[str, Any]:
    out: dict[str, Any] = {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
    }
    if details_null:
        out["prompt_tokens_details"] = None  # exclude_unset=False dumps the unset field
    return out


@dataclass(frozen=True, slots=True)
class ChunkBuilder:
    """Builds one request's SSE events; it knows the request's id, kind and usage options."""

    kind: Kind
    request_id: str
    created: int
    model: str
    prompt_tokens: int
    include_usage: bool
    continuous_usage: bool
    fingerprint: str

    def _head(self, chunk_object: str) -> dict[str, Any]:
        return {
            "id": self.request_id,
            "object": chunk_object,
            "created": self.created,
            "model": self.model,
        }

    def role(self) -> bytes:
        """The chat stream's first event: role only, empty content (it is not a token)."""
        payload = self._head("chat.completion.chunk")
        payload["choices"] = [
            {
                "index": 0,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
        ]
        if self.continuous_usage:
            payload["usage"] = usage(self.prompt_tokens, 0, details_null=False)
        return sse(payload)

    def tokens(self, text: str, completion_tokens: int, finish_reason: str | None) -> bytes:
        """One event carrying one or more tokens' text; `completion_tokens` is the running total."""
        if self.kind == "completion":
            payload = self._head("text_completion")
            payload["choices"] = [
                {
                    "index": 0,
                    "text": text,
                    "logprobs": None,
                    "finish_reason": finish_reason,
                    "stop_reason": None,
                }
            ]
            if self.continuous_usage:
                payload["usage"] = usage(self.prompt_tokens, completion_tokens, details_null=False)
            return self._terminal(payload, finish_reason)
        payload = self._head("chat.completion.chunk")
        choice: dict[str, Any] = {
            "index": 0,
            "delta": {"content": text},
            "logprobs": None,
            "finish_reason": finish_reason,
        }
        if finish_reason is not None:
            choice["stop_reason"] = None
        payload["choices"] = [choice]
        if self.continuous_usage:
            payload["usage"] = usage(self.prompt_tokens, completion_tokens, details_null=False)
        return self._terminal(payload, finish_reason)

    def _terminal(self, payload: dict[str, Any], finish_reason: str | None) -> bytes:
        """vLLM 0.32 stamps its fingerprint on the terminal chunk when no usage chunk follows."""
        if finish_reason is not None and not self.include_usage:
            payload["system_fingerprint"] = self.fingerprint
        return sse(payload)

    def final_usage(self, completion_tokens: int) -> bytes:
        payload = self._head(
            "text_completion" if self.kind == "completion" else "chat.completion.chunk"
        )
        payload["choices"] = []
        payload["usage"] = usage(self.prompt_tokens, completion_tokens, details_null=False)
        payload["system_fingerprint"] = self.fingerprint
        return sse(payload)

    def response(self, text: str, completion_tokens: int, finish_reason: str) -> bytes:
        """The whole non-streaming response, every field dumped as vLLM's model_dump does."""
        if self.kind == "completion":
            payload = self._head("text_completion")
            payload["choices"] = [
                {
                    "index": 0,
                    "text": text,
                    "logprobs": None,
                    "finish_reason": finish_reason,
                    "stop_reason": None,
                    "prompt_logprobs": None,
                }
            ]
        else:
            payload = self._head("chat.completion")
            payload["choices"] = [
                {
                    "index": 0,
                    "message": {
                        "role": "assistant",
                        "content": text,
                        "refusal": None,
                        "annotations": None,
                        "audio": None,
                        "function_call": None,
                        "tool_calls": [],
                        "reasoning_content": None,
                    },
                    "logprobs": None,
                    "finish_reason": finish_reason,
                    "stop_reason": None,
                }
            ]
        payload["service_tier"] = None
        payload["system_fingerprint"] = self.fingerprint
        payload["usage"] = usage(self.prompt_tokens, completion_tokens, details_null=True)
        if self.kind == "chat":
            payload["prompt_logprobs"] = None
        payload["kv_transfer_params"] = None
        return orjson.dumps(payload)


def streaming_error(message: str, status: int) -> bytes:
    return b"data: " + error_body(message, status) + b"\n\n"
