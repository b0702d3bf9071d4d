"""Errors of `batchspec serve` as OpenAI JSON, and the guard in front of every request (body size, HTTP metrics).

Every failure a client can cause is a 4xx with `{"error": {"message", "type", "param", "code"}}` and a message that
names the field and what was wrong: 400 for a body that is not a JSON object (or not UTF-8), or that holds a number
too long to read, or a content part that is not text; 413 for a body over the limit, 422 for fields of the wrong
type or out of range. FastAPI's own 422 format is replaced. `code` is always a string (clients branch on it).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

from batchspec.serving.protocol import error_body

ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")


class APIError(Exception):
    """A failure a handler reports to the client: HTTP `status` with an OpenAI error body."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code


def install_error_handlers(app) -> None:
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse
    from starlette.exceptions import HTTPException

    @app.exception_handler(APIError)
    async def api_error(request, err: APIError):
        code = err.code or _status_code_name(err.status)
        return JSONResponse(error_body(err.message, err.type, err.param, code), status_code=err.status)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request, err: RequestValidationError):
        status, body = validation_error(err.errors())
        return JSONResponse(body, status_code=status)

    @app.exception_handler(HTTPException)
    async def http_error(request, err: HTTPException):
        message = str(err.detail)
        if err.status_code == 404:
            message = f"no route {request.method} {request.url.path}"
        elif err.status_code == 400 and "parsing the body" in message:
            if _number_too_long(err.__cause__):
                return JSONResponse(error_body(
                    f"the request body holds a number with more than {_MAX_DIGITS} digits; no field takes a number "
                    f"that long", code="number_too_long"), status_code=400)
            message = "the request body could not be read as JSON (it must be a UTF-8 encoded JSON object)"
        kind = "invalid_request_error" if err.status_code < 500 else "server_error"
        return JSONResponse(error_body(message, kind, code=_status_code_name(err.status_code)),
                            status_code=err.status_code, headers=getattr(err, "headers", None))

    @app.exception_handler(Exception)
    async def internal_error(request, err: Exception):
        return JSONResponse(error_body(f"internal server error: {type(err).__name__}: {err}", "server_error",
                                       code="internal_error"), status_code=500)


def validation_error(errors: list[dict]) -> tuple[int, dict]:
    """(status, OpenAI error body) for pydantic/FastAPI validation errors of a request body."""
    for e in errors:
        if e["type"] == "unsupported_content_part":  # valid OpenAI, but not for this model: 400, as OpenAI and vLLM
            param = f"{_param(e['loc'])}[{e['ctx']['index']}]"
            return 400, error_body(f"{param}: {e['msg']}", param=param, code="unsupported_content")
        if e["type"] == "json_invalid":
            position = e["loc"][1] if len(e["loc"]) > 1 else "?"
            reason = (e.get("ctx") or {}).get("error", "malformed JSON")
            return 400, error_body(f"the request body is not valid JSON: {reason} (at character {position})",
                                   code="invalid_json")
        if tuple(e["loc"]) == ("body",) and e["type"] != "value_error":
            message = ("the request body is missing; send a JSON object" if e["type"] == "missing"
                       else f"the request body must be a JSON object, got {_json_type(e.get('input'))}")
            return 400, error_body(message, code="invalid_body")
    by_param: dict[str | None, list[str]] = {}
    for e in _most_specific(errors):
        messages = by_param.setdefault(_param(e["loc"]), [])
        message = _message(e)
        if message not in messages:
            messages.append(message)
    parts = [f"{param}: {' or '.join(msgs)}" if param else " or ".join(msgs) for param, msgs in by_param.items()]
    first = next(iter(by_param))
    return 422, error_body("invalid request: " + "; ".join(parts[:4]), param=first, code="invalid_value")


def _most_specific(errors: list[dict]) -> list[dict]:
    """For a field that failed every member of a union (str | list[int] | ...), keep the errors that say what was
    wrong with the value (value_error) over those that only list the other types it could have had."""
    specific = {_param(e["loc"]) for e in errors if e["type"] == "value_error"}
    return [e for e in errors if e["type"] == "value_error" or _param(e["loc"]) not in specific]


def _param(loc) -> str | None:
    """('body', 'messages', 0, 'content', 'list[TextPart]', 0, 'text') -> 'messages[0].content[0].text'."""
    name = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(part, int):
            name += f"[{part}]"
        elif "[" in part or "(" in part:  # a union member's tag, not a field
            continue
        else:
            name += f".{part}" if name else part
    return name or None


def _message(e: dict) -> str:
    message = e["msg"].removeprefix("Value error, ")
    if e["type"].endswith("_type") or e["type"] in ("literal_error", "finite_number"):
        message += f" (got {_json_type(e.get('input'))})"
    return message


def _json_type(value) -> str:
    names = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array",
             dict: "an object", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def _status_code_name(status: int) -> str:
    """The error code of a failure that gave none."""
    return {400: "bad_request", 404: "not_found", 405: "method_not_allowed", 413: "request_too_large",
            422: "invalid_value", 429: "rate_limit_exceeded", 500: "internal_error", 503: "unavailable"}.get(
        status, f"http_{status}")


_MAX_DIGITS = sys.get_int_max_str_digits()


def _number_too_long(cause: BaseException | None) -> bool:
    """FastAPI could not parse the body because json.loads met an integer over Python's int-string conversion limit
    (4,300 digits): valid JSON, whose number no field could take anyway."""
    return isinstance(cause, ValueError) and "integer string conversion" in str(cause)


class BodyGuard:
    """ASGI middleware: refuses bodies over `max_bytes` with 413, bodies that do not arrive whole within `timeout_s`
    with 408 (a client that stops sending, a body shorter than its Content-Length, a chunked body that never ends),
    and counts every response in the metrics.

    Reads the body up front (it is bounded in size and time) and hands it on whole, so FastAPI never sees an oversize
    or unfinished request.
    """

    def __init__(self, app, max_bytes: int, timeout_s: float = 30.0, metrics=None) -> None:
        self.app, self.max_bytes, self.timeout_s, self.metrics = app, max_bytes, timeout_s, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if scope["method"] == "POST":  # the body is JSON whatever the client declared (curl -d sends form type)
            headers = [(k, v) for k, v in scope["headers"] if k != b"content-type"]
            scope = {**scope, "headers": headers + [(b"content-type", b"application/json")]}
        endpoint = scope["path"] if scope["path"] in ENDPOINTS else "other"

        async def counted_send(message):
            if message["type"] == "http.response.start" and self.metrics is not None:
                self.metrics.http_requests.labels(endpoint, str(message["status"])).inc()
            await send(message)

        body, problem = await self._read_body(scope, receive)
        if problem is not None:
            return await _send_json(counted_send, *problem)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # http.disconnect, once the client goes away

        await self.app(scope, replay, counted_send)

    async def _read_body(self, scope, receive) -> tuple[bytes, tuple[int, dict] | None]:
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None:
            if not declared.isdigit():
                return b"", (400, error_body("invalid Content-Length header", code="bad_request"))
            if int(declared) > self.max_bytes:
                return b"", self._too_large(int(declared))
        chunks, size = [], 0
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                return b"", (408, error_body(f"the request body did not arrive within {self.timeout_s:g} s "
                                             f"({size} bytes received)", code="request_timeout"))
            if message["type"] == "http.disconnect":
                break
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                return b"", self._too_large(size)
            if not message.get("more_body", False):
                break
        return b"".join(chunks), None

    def _too_large(self, size: int) -> tuple[int, dict]:
        return 413, error_body(f"the request body has {size} bytes or more; the limit is {self.max_bytes}",
                               code="request_too_large")


async def _send_json(send, status: int, body: dict) -> None:
    """A whole JSON response to a request whose body was not read whole. After a 413 uvicorn reads and drops the rest
    of the body (the client may still be sending it; the connection's header deadline bounds how long); after a 400
    (no framing to trust) or a 408 (the client stopped sending) the connection closes."""
    payload = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    await send({"type": "http.response.start", "status": status,
                "headers": headers + ([(b"connection", b"close")] if status in (400, 408) else [])})
    await send({"type": "http.response.body", "body": payload})
