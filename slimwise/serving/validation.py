"""Request-body checks shared by the colocated server's middleware (`plan_select.py`) and the disaggregated
proxy (`proxy/`): strict JSON, a JSON object, valid Unicode, and the per-request cost limit (`--max-n`). Both
answer a body that fails them with the same OpenAI-style 400, never a 500 (Python's json module raises
RecursionError, not ValueError, on deeply nested input). Standard library only: the middleware runs inside
vLLM's API server.
"""

from __future__ import annotations

import json
import math

# completions per request (`n`) a server accepts unless `slimwise serve --max-n` says otherwise
MAX_N_DEFAULT = 16


class BadRequest(Exception):
    """A client error found by the proxy itself: 400 with an OpenAI-style JSON body."""

    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.param, self.status = param, status

    @property
    def kind(self) -> str:
        return "invalid_request_error" if self.status == 400 else "request_too_large"

    def payload(self) -> dict:
        """The OpenAI-style error body."""
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.status}}


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:40]} is out of range")
    return value


def _no_constant(name: str):
    raise ValueError(f"{name} is not valid JSON (numbers must be finite)")


def _check_text(value, path: str = "body") -> None:
    """Every string must be encodable: a lone surrogate ("\\ud800") parses but cannot be forwarded."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise BadRequest(
                f"{path} holds an unpaired surrogate (\\u{ord(value[exc.start]):04x}); send valid Unicode",
                path.removeprefix("body."),
            ) from None
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_text(key, path)
            _check_text(item, f"{path}.{key}")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _check_text(item, f"{path}[{i}]")


def parse_body(raw: bytes) -> dict:
    """The request body as a JSON object, or BadRequest: strict JSON (no NaN/Infinity, no number that
    overflows to infinity such as 1e400), UTF-8, no lone surrogates."""
    if not raw.strip():
        raise BadRequest("the request body is empty; send a JSON object")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadRequest(
            f"the request body is not UTF-8 (byte 0x{raw[exc.start]:02x} at offset {exc.start})"
        ) from None
    try:
        body = json.loads(text, parse_float=_finite, parse_constant=_no_constant)
    except json.JSONDecodeError as exc:
        raise BadRequest(
            f"the request body is not valid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})"
        ) from None
    except (ValueError, RecursionError) as exc:
        # _finite/_no_constant, an over-long integer, nesting too deep
        raise BadRequest(f"the request body is not valid JSON: {str(exc)[:200]}") from None
    if not isinstance(body, dict):
        kind = {list: "array", str: "string", bool: "boolean", int: "number", float: "number"}.get(
            type(body), "null"
        )
        raise BadRequest(f"the request body must be a JSON object, not a JSON {kind}")
    try:
        _check_text(body)
    except RecursionError:
        raise BadRequest("the request body is nested too deeply") from None
    return body


def check_n(body: dict, max_n: int) -> None:
    """Refuse a request for more completions than the server allows (`n`, and `best_of` where a client sends
    it): each costs a whole generation, so one request could otherwise occupy the engine for minutes. Values
    that are not whole numbers are left to the request model's own validation."""
    for field in ("n", "best_of"):
        value = body.get(field)
        if isinstance(value, int) and not isinstance(value, bool) and value > max_n:
            raise BadRequest(
                f"{field}={value} is above this server's limit of {max_n} completions per request "
                "(slimwise serve --max-n)",
                field,
            )
