"""The request-size limit: a pure ASGI middleware in front of every route.

Why here and not in a route: FastAPI reads and parses the whole body before a route runs,
so a 50 MB body would be buffered and parsed on the event loop (seconds during which
`/clawd/health` and every stream wait) only to be refused afterwards. This middleware
answers 413 from the headers alone when `Content-Length` is too big, and counts a chunked
body (no length announced) as it arrives, refusing it as soon as it passes the limit.
"""

from __future__ import annotations

import json

from clawd.errors import ClawdError


class PayloadTooLarge(ClawdError):
    status = 413
    type = "invalid_request_error"
    code = "request_too_large"


# For the OpenAPI document: every route can answer this.
RESPONSES = {
    413: {
        "description": "The request body is larger than server.max_request_mb (an OpenAI-style error object).",
    }
}


def _too_large(limit: int) -> PayloadTooLarge:
    return PayloadTooLarge(
        f"The request body is larger than this server's limit of {limit} bytes "
        "(server.max_request_mb in config.toml): send a shorter request."
    )


class BodySizeLimit:
    """413 for a body over `max_bytes`, before the app reads it."""

    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = _content_length(scope)
        if length is not None:
            if length > self.max_bytes:
                return await _refuse(send, self.max_bytes)
            return await self.app(scope, receive, send)
        if not _chunked(scope):
            return await self.app(scope, receive, send)
        # Chunked: buffer the body (at most max_bytes) before the app sees it, so the refusal
        # is one clean 413 rather than an error raised from deep inside the app's body read.
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away mid-body: nobody to answer
            body = message.get("body", b"")
            size += len(body)
            if size > self.max_bytes:
                return await _refuse(send, self.max_bytes)
            chunks.append(body)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()  # after the body: disconnect detection as usual

        return await self.app(scope, replay, send)


def _content_length(scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # the server (h11) has refused a malformed length already
    return None


def _chunked(scope) -> bool:
    return any(name == b"transfer-encoding" and b"chunked" in value.lower() for name, value in scope.get("headers", ()))


async def _refuse(send, limit: int) -> None:
    body = json.dumps(_too_large(limit).to_openai()).encode()
    await send(
        {
            "type": "http.response.start",
            "status": 413,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                # The unread body is still on the wire: this connection cannot carry another request.
                (b"connection", b"close"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
