"""OpenAI's request bodies checked field by field, and the response objects built.

`parse_request(kind, body, limits)` turns a JSON body of `/v1/chat/completions` (kind
"chat") or `/v1/completions` (kind "completion") into a `ParsedRequest`, or raises `ApiError`
naming the field: an unknown field, a wrong type, a value out of range or a field this
server does not implement (each a 400 with OpenAI's error object, as OpenAI answers such a
request; a body that is not JSON is a 400 too). Nothing is silently ignored: `user` and
`metadata`-like fields that change no token are accepted by name, penalties only at their
neutral values.

Example:
    >>> request = parse_request("chat", {"model": "m", "messages": [
    ...     {"role": "user", "content": "Hi"}], "n": 2, "stop": "\\n", "temperature": 0})
    >>> request.n, request.stop, request.temperature
    (2, ['\\n'], 0.0)
    >>> try:
    ...     parse_request("chat", {"model": "m", "messages": [], "tools": []})
    ... except ApiError as error:
    ...     error.status, error.body()["error"]["param"]
    (400, 'tools')
"""
from __future__ import annotations

import dataclasses
import json
import math
import time
import uuid

MAX_STOP_STRINGS = 4  # OpenAI's bound
MAX_N = 128
# Chat roles the chat template is given; "developer" (OpenAI's newer name for the system
# message) is given as "system", which chat templates know. Tool and function messages need
# tool calls, which this server does not implement.
CHAT_ROLES = ("system", "user", "assistant", "developer")
ROLE_ALIASES = {"developer": "system"}
TOOL_ROLES = ("tool", "function")
LOGPROB_FLOOR = -9999.0  # OpenAI's stand-in for -inf (a token the sampler could not pick)

# Fields each endpoint reads (and checks); any other field is refused by name.
COMMON_FIELDS = frozenset({"model", "n", "temperature", "top_p", "max_tokens", "stop", "seed",
                           "stream", "stream_options", "user", "response_format",
                           "frequency_penalty", "presence_penalty", "logit_bias"})
CHAT_FIELDS = COMMON_FIELDS | {"messages", "max_completion_tokens", "logprobs",
                               "top_logprobs"}
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "logprobs", "echo", "suffix", "best_of"}
# OpenAI fields this server knows and does not implement: the reason the 400 gives.
UNSUPPORTED = {
    "tools": "tool calling is not implemented",
    "tool_choice": "tool calling is not implemented",
    "functions": "function calling is not implemented",
    "function_call": "function calling is not implemented",
    "parallel_tool_calls": "tool calling is not implemented",
    "audio": "audio output is not implemented",
    "modalities": "only text output is implemented",
    "prediction": "predicted outputs are not implemented",
    "reasoning_effort": "the model has no reasoning setting",
    "service_tier": "there is one service tier",
    "store": "completions are not stored",
    "metadata": "completions are not stored",
    "web_search_options": "web search is not implemented",
}


class ApiError(Exception):
    """An HTTP error with OpenAI's error object: {"error": {message, type, param, code}}."""

    TYPES = {400: "invalid_request_error", 401: "invalid_request_error",
             404: "invalid_request_error", 413: "invalid_request_error",
             429: "rate_limit_error", 500: "server_error", 503: "server_error"}

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message,
                          "type": self.TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}


def _bad(param: str, message: str, code: str = "invalid_value") -> ApiError:
    return ApiError(400, f"`{param}`: {message}", param=param, code=code)


@dataclasses.dataclass(frozen=True)
class ParsedRequest:
    """A checked request. prompts: per prompt, either text (completion), token ids
    (completion) or messages (chat). The numbers are None where the body leaves them."""

    kind: str  # "chat" | "completion"
    model: str | None
    prompts: list  # [str | list[int] | list[dict]]: one per prompt (chat: one)
    n: int
    temperature: float | None
    top_p: float | None
    max_tokens: int | None
    stop: list  # [str]
    seed: int | None
    stream: bool
    include_usage: bool
    logprobs: bool
    top_logprobs: int
    schema: dict | None  # response_format as a JSON schema (json_object: {"type": "object"})


def _number(body: dict, name: str, low: float, high: float) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise _bad(name, f"must be a number, got {value!r}", "invalid_type")
    if not low <= value <= high:
        raise _bad(name, f"must be between {low} and {high}, got {value!r}")
    return float(value)


def _integer(body: dict, name: str, low: int, high: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(name, f"must be an integer, got {value!r}", "invalid_type")
    if value < low or (high is not None and value > high):
        raise _bad(name, f"must be an integer in {low}..{high if high is not None else ''}, "
                         f"got {value}")
    return value


def _boolean(body: dict, name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise _bad(name, f"must be true or false, got {value!r}", "invalid_type")
    return value


def _stop(body: dict) -> list:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise _bad("stop", f"must be a non-empty string or a list of them, got {stop!r}",
                   "invalid_type")
    if len(stops) > MAX_STOP_STRINGS:
        raise _bad("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}")
    return list(stops)


def _schema(body: dict) -> dict | None:
    fmt = body.get("response_format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise _bad("response_format", "type json_schema needs "
                       "`json_schema: {\"name\": ..., \"schema\": {...}}`", "invalid_type")
        return spec["schema"]
    raise _bad("response_format", f"type must be one of 'text', 'json_object', 'json_schema', "
                                  f"got {fmt!r}")


def _neutral(body: dict) -> None:
    for name in ("frequency_penalty", "presence_penalty"):
        value = _number(body, name, -2.0, 2.0)
        if value not in (None, 0.0):
            raise _bad(name, f"only 0 is supported (got {value}); the server runs no "
                             f"frequency or presence penalty", "unsupported_parameter")
    if body.get("logit_bias"):
        raise _bad("logit_bias", "is not supported (the engine's processors are "
                                 "program-wide)", "unsupported_parameter")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise _bad("user", f"must be a string, got {user!r}", "invalid_type")


def _messages(body: dict) -> list:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", "must be a non-empty list of {role, content} objects",
                   "invalid_type")
    checked = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise _bad(where, "must be an object with a string `role`", "invalid_type")
        role = message["role"]
        if role in TOOL_ROLES:
            raise _bad(f"{where}.role", f"{role!r} messages need tool calling, which is not "
                                        f"implemented (allowed roles: {list(CHAT_ROLES)})",
                       "unsupported_parameter")
        if role not in CHAT_ROLES:
            raise _bad(f"{where}.role", f"must be one of {list(CHAT_ROLES)}, got {role!r}")
        content = message.get("content")
        if isinstance(content, list):  # content parts: text only
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" \
                        or not isinstance(part.get("text"), str):
                    raise _bad(f"{where}.content", "only text parts "
                               "({\"type\": \"text\", \"text\": ...}) are supported",
                               "unsupported_parameter")
                texts.append(part["text"])
            content = "".join(texts)
        if not isinstance(content, str):
            raise _bad(f"{where}.content", f"must be a string, got {content!r}",
                       "invalid_type")
        checked.append({"role": ROLE_ALIASES.get(role, role), "content": content})
    return checked


def _prompts(body: dict) -> list:
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return list(prompt)
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return [list(prompt)]
        if all(isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool)
                                                   for t in p) for p in prompt):
            return [list(p) for p in prompt]
    raise _bad("prompt", "must be a string, a list of strings, a list of token ids or a "
                         "list of token-id lists (non-empty)", "invalid_type")


def parse_request(kind: str, body, max_top_logprobs: int = 20) -> ParsedRequest:
    """The checked request of endpoint `kind` ("chat" | "completion"); ApiError naming the
    field otherwise. max_top_logprobs: the most alternatives the engine records."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
    allowed = CHAT_FIELDS if kind == "chat" else COMPLETION_FIELDS
    for name in body:
        if name in UNSUPPORTED:
            raise _bad(name, f"is not supported: {UNSUPPORTED[name]}", "unsupported_parameter")
        if name not in allowed:
            raise _bad(name, f"unknown field for this endpoint (known: {sorted(allowed)})",
                       "unknown_parameter")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _bad("model", f"must be a string, got {model!r}", "invalid_type")
    _neutral(body)
    n = _integer(body, "n", 1, MAX_N) or 1
    max_tokens = _integer(body, "max_tokens", 1)
    if kind == "chat":
        prompts = [_messages(body)]
        completion_max = _integer(body, "max_completion_tokens", 1)
        if completion_max is not None:
            max_tokens = completion_max if max_tokens is None else min(max_tokens,
                                                                       completion_max)
        logprobs = _boolean(body, "logprobs")
        top = _integer(body, "top_logprobs", 0, max_top_logprobs) or 0
        if top and not logprobs:
            raise _bad("top_logprobs", "needs `logprobs: true`")
    else:
        prompts = _prompts(body)
        if _boolean(body, "echo"):
            raise _bad("echo", "is not supported (the prompt is not echoed)",
                       "unsupported_parameter")
        if body.get("suffix") is not None:
            raise _bad("suffix", "is not supported (no fill-in-the-middle)",
                       "unsupported_parameter")
        best_of = _integer(body, "best_of", 1, MAX_N)
        if best_of not in (None, n):
            raise _bad("best_of", f"only best_of = n ({n}) is supported (no ranking)",
                       "unsupported_parameter")
        top = _integer(body, "logprobs", 0, max_top_logprobs)
        logprobs = top is not None
        top = top or 0
    options = body.get("stream_options")
    stream = _boolean(body, "stream")
    if options is not None and (not isinstance(options, dict) or not stream
                                or set(options) - {"include_usage"}):
        raise _bad("stream_options", "must be {\"include_usage\": bool}, with `stream: true`",
                   "invalid_type")
    seed = _integer(body, "seed", -2**63, 2**63 - 1)
    return ParsedRequest(
        kind=kind, model=model, prompts=prompts, n=n,
        temperature=_number(body, "temperature", 0.0, 2.0),
        top_p=_number(body, "top_p", 0.0, 1.0), max_tokens=max_tokens, stop=_stop(body),
        seed=seed, stream=stream,
        include_usage=bool((options or {}).get("include_usage", False)),
        logprobs=logprobs, top_logprobs=top, schema=_schema(body))


def read_json(raw: bytes):
    """The parsed body; ApiError 400 when it is not JSON."""
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as error:
        raise ApiError(400, f"the request body is not valid JSON: {error}",
                       code="invalid_json") from None


# ------------------------------------------------------------------ response objects
def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex


def floor_logprob(value: float) -> float:
    """A JSON-safe log-prob: -inf (a token the sampler could not pick) as LOGPROB_FLOOR."""
    return value if math.isfinite(value) else LOGPROB_FLOOR


def envelope(kind: str, request_id: str, model: str, created: int, choices: list,
             chunk: bool = False, usage: dict | None = None) -> dict:
    """A completion (chunk) object around `choices`."""
    if kind == "chat":
        name = "chat.completion.chunk" if chunk else "chat.completion"
    else:
        name = "text_completion"
    body = {"id": request_id, "object": name, "created": created, "model": model,
            "choices": choices}
    if usage is not None or not chunk:
        body["usage"] = usage
    return body


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def now() -> int:
    return int(time.time())


__all__ = ["ApiError", "CHAT_ROLES", "LOGPROB_FLOOR", "ParsedRequest", "envelope",
           "floor_logprob", "new_id", "now", "parse_request", "read_json", "usage"]
