"""A request body's JSON and the fields the gateway itself reads, checked before anything uses
them: a malformed value is a 400 with the OpenAI error object naming it, never a 500. Fields the
gateway only passes on are the engine's to judge (its own 400 goes back unchanged)."""
from __future__ import annotations

import json
import math
from typing import Annotated, Any

from .errors import ApiError

MAX_TOKEN_ID = 0xFFFFFFFF  # the store keys token ids as u32

try:  # msgspec (the gateway extra) parses a 100k-token prompt 2-3x faster than the json module
    import msgspec

    _fast_decode = msgspec.json.decode
    _FastError: tuple = (msgspec.DecodeError,)
    _convert = msgspec.convert
    _ConvertError: type[Exception] = msgspec.ValidationError
    # strict: a boolean is not an integer here, as in the check without msgspec
    _TOKEN_IDS = list[Annotated[int, msgspec.Meta(ge=0, le=MAX_TOKEN_ID)]]
except ImportError:  # pragma: no cover - without the extra: the json module alone
    _fast_decode = _convert = None
    _FastError = ()


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def parse(raw: bytes, max_depth: int) -> dict:
    """The body as a JSON object: 400 when empty, not JSON (NaN and Infinity included), not an
    object, or nested deeper than `max_depth`."""
    if not raw.strip():
        raise ApiError(400, "the request has no body: send a JSON object", code="missing_body")
    # A value cannot nest deeper than it has brackets: most bodies are checked by this count alone.
    deep = raw.count(b"[") + raw.count(b"{") > max_depth
    try:
        # NaN/Infinity are not JSON to either parser; a lone surrogate escape, which only json
        # accepts, is left to it.
        try:
            body = _fast_decode(raw) if _fast_decode is not None else json.loads(raw, parse_constant=_no_constants)
        except _FastError:
            body = json.loads(raw, parse_constant=_no_constants)
    except RecursionError:  # both parsers give up near 1000 levels
        raise ApiError(400, f"request JSON nested deeper than {max_depth} levels", code="too_deep") from None
    except ValueError as exc:
        raise ApiError(400, f"request body is not valid JSON: {exc}", code="invalid_json") from None
    if deep and _depth_over(body, max_depth):
        raise ApiError(400, f"request JSON nested deeper than {max_depth} levels", code="too_deep")
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object")
    return body


def _depth_over(value: Any, limit: int) -> bool:
    if not isinstance(value, (dict, list)):
        return False
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item
        for child in children:
            if isinstance(child, (dict, list)):
                if depth + 1 > limit:
                    return True
                stack.append((child, depth + 1))
    return False


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    return "an array" if isinstance(value, list) else "an object"


def _bad(name: str, message: str) -> ApiError:
    return ApiError(400, f"'{name}' {message}", param=name, code="invalid_value")


def _integer(body: dict, name: str, least: int, most: int | None = None) -> None:
    value = body.get(name)
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(name, f"must be an integer, not {_kind(value)}")
    if value < least:
        raise _bad(name, f"must be at least {least}, not {value}")
    if most is not None and value > most:
        raise _bad(name, f"must be at most {most} (the gateway's max_n), not {value}")


def _number(body: dict, name: str, least: float, most: float = math.inf) -> None:
    value = body.get(name)
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _bad(name, f"must be a number, not {_kind(value)}")
    if not least <= value <= most:
        span = f"at least {least:g}" if most == math.inf else f"between {least:g} and {most:g}"
        raise _bad(name, f"must be {span}, not {value}")


def _token_ids(value: list) -> bool:
    """Integers (not booleans) from 0 to MAX_TOKEN_ID, checked at C speed: a prompt of 100k ids
    checked element by element in Python cost the event loop ~10 ms. msgspec checks type and range
    in one pass (12k ids: ~0.1 ms, against ~0.8 ms for a set of types, min and max)."""
    if not value:
        return False
    if _convert is not None:
        try:
            _convert(value, _TOKEN_IDS, strict=True)
        except _ConvertError:
            return False
        return True
    return set(map(type, value)) == {int} and min(value) >= 0 and max(value) <= MAX_TOKEN_ID


def check_prompt(prompt: Any) -> None:
    """A string, a list of token ids, or a batch: a list of strings or of token-id lists."""
    if isinstance(prompt, str):
        return
    if not isinstance(prompt, list) or not prompt:
        raise _bad("prompt", f"must be a string, a list of token ids, or a non-empty list of those, "
                             f"not {'an empty array' if prompt == [] else _kind(prompt)}")
    if all(isinstance(p, str) for p in prompt):
        return
    if _token_ids(prompt):
        return
    if all(isinstance(p, list) and p and _token_ids(p) for p in prompt):
        return
    raise _bad("prompt", f"must be a string, token ids (integers 0 to {MAX_TOKEN_ID}), or a list of either "
                         "(one kind throughout)")


def check_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", "must be a non-empty list")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise _bad("messages", f"[{i}] must be an object, not {_kind(message)}")
        if not isinstance(message.get("role"), str):
            raise _bad("messages", f"[{i}].role must be a string")
        content = message.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise _bad("messages", f"[{i}].content must be a string, a list of parts or null, not {_kind(content)}")


def choices(body: dict) -> int:
    """The sequences a request makes an engine run at once (after check_fields)."""
    return max(int(body.get("n") or 1), int(body.get("best_of") or 1))


def check_fields(kind: str, body: dict, max_n: int = 16) -> None:
    """The sampling and streaming fields, typed and in range (after prompt/messages and model)."""
    if kind == "completions":
        check_prompt(body["prompt"])
    else:
        check_messages(body["messages"])
    if body.get("stream") is not None and not isinstance(body["stream"], bool):
        raise _bad("stream", f"must be a boolean, not {_kind(body['stream'])}")
    _integer(body, "max_tokens", 0)
    _integer(body, "max_completion_tokens", 0)
    _integer(body, "n", 1, max_n)
    _integer(body, "best_of", 1, max_n)
    _number(body, "temperature", 0.0)
    _number(body, "top_p", 0.0, 1.0)
    for name in ("user", "cache_salt"):
        if body.get(name) is not None and not isinstance(body[name], str):
            raise _bad(name, f"must be a string, not {_kind(body[name])}")
    if body.get("stream_options") is not None and not isinstance(body["stream_options"], dict):
        raise _bad("stream_options", f"must be an object, not {_kind(body['stream_options'])}")
