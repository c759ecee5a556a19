"""Who may talk to the daemon: one ASGI middleware in front of every route.

A daemon on 127.0.0.1 is reachable by every local user and, through the browser, by every
web page the user opens (a cross-site form POST, or DNS rebinding: a page whose name
resolves to 127.0.0.1). The guard refuses them before any route runs, in this order:

1. Host: a loopback name or the configured server.host, else 400 (DNS rebinding sends
   the attacker's name; with a wildcard listen address an IP literal or this machine's
   name is accepted too: a rebinding page cannot send those).
2. Origin, on state-changing methods: absent (not a browser) or the daemon's own or one of
   server.allowed_origins, else 403 (a browser always sends Origin cross-site).
3. The bearer token on every route but the open ones (health and the API's schema), from
   loopback too: other local users share loopback. server.trust_loopback = true is the
   explicit opt-out.
4. A body must be JSON (application/json), else 415: the one content type a page cannot
   send cross-site without a CORS preflight, which this daemon never answers.

It is pure ASGI, not BaseHTTPMiddleware, so streamed replies pass through unbuffered.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import socket

from clawd.errors import AuthError, ClawdError, Forbidden, InvalidRequest, UnsupportedMediaType
from clawd.protocol import ErrorResponse

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
WILDCARD = frozenset({"0.0.0.0", "::", ""})
# Open without the token: nothing here reads or changes the user's data.
OPEN_PATHS = frozenset({"/clawd/health", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"})
STATE_CHANGING = frozenset({"POST", "PUT", "PATCH", "DELETE"})
TOKEN_MESSAGE = "Incorrect API key provided: send 'Authorization: Bearer <token>' with the token from `clawd token`."

# What the guard can answer on any operation, for the OpenAPI schema (api.py adds it to each).
RESPONSES: dict[int | str, dict] = {
    400: {"description": "Bad request: invalid input, or a Host that is not this daemon's", "model": ErrorResponse},
    401: {"description": "Missing or wrong bearer token (`clawd token`)", "model": ErrorResponse},
    403: {"description": "A state-changing request from a foreign Origin", "model": ErrorResponse},
    415: {"description": "A request body that is not application/json", "model": ErrorResponse},
}


def host_name(host_header: str) -> str:
    """The name part of a Host header: "localhost:8757" → "localhost", "[::1]:80" → "::1"."""
    h = host_header.strip().lower()
    if h.startswith("["):
        return h[1 : h.find("]")] if "]" in h else h
    if h.count(":") == 1:
        h = h.split(":", 1)[0]
    return h.rstrip(".")


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def _loopback(client_host: str) -> bool:
    try:
        return ipaddress.ip_address(client_host).is_loopback
    except ValueError:
        return client_host == "localhost"


class Policy:
    """The guard's settings, fixed at start-up (server.* is not reloaded live)."""

    def __init__(
        self,
        *,
        token: str,
        host: str,
        port: int,
        allowed_origins: str | list[str] = "",
        trust_loopback: bool = False,
    ):
        self.token = token
        self.host = host.strip().lower()
        self.port = port
        self.trust_loopback = trust_loopback
        names = set(LOOPBACK_NAMES)
        if self.host not in WILDCARD:
            names.add(self.host)
        self.host_names = frozenset(names)
        if isinstance(allowed_origins, str):
            allowed_origins = allowed_origins.split(",")
        own = {f"http://{'[' + n + ']' if ':' in n else n}:{port}" for n in self.host_names}
        self.origins = frozenset(own | {_origin(o) for o in allowed_origins if o.strip()})
        # With a wildcard listen address LAN clients name this machine: its own names count
        # (not getfqdn(): a DNS lookup that can stall start-up for seconds).
        machine = socket.gethostname().lower() if self.host in WILDCARD else ""
        self.machine_names = frozenset({machine, f"{machine}.local"} - {"", ".local"})

    def host_allowed(self, header: str) -> bool:
        name = host_name(header)
        if name in self.host_names:
            return True
        return self.host in WILDCARD and (_is_ip(name) or name in self.machine_names)

    def origin_allowed(self, origin: str) -> bool:
        return _origin(origin) in self.origins

    def token_ok(self, authorization: str) -> bool:
        scheme, _, given = authorization.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), self.token.encode())


def _origin(origin: str) -> str:
    return origin.strip().lower().rstrip("/")


def check(policy: Policy, method: str, path: str, headers: dict[str, str], client_host: str) -> ClawdError | None:
    """The first rule the request breaks, as the error to answer with; None: let it through."""
    if not policy.host_allowed(headers.get("host", "")):
        return InvalidRequest(
            "This daemon answers only requests addressed to it (Host must be localhost, 127.0.0.1, [::1] "
            "or server.host).",
            param="Host",
        )
    origin = headers.get("origin")
    if method in STATE_CHANGING and origin is not None and not policy.origin_allowed(origin):
        return Forbidden(
            f"Requests from the web page at {origin[:100]!r} are refused: add it to server.allowed_origins "
            "to let it use this daemon."
        )
    open_route = method in ("GET", "HEAD") and path in OPEN_PATHS
    if not open_route and not (policy.trust_loopback and _loopback(client_host)):
        if not policy.token_ok(headers.get("authorization", "")):
            return AuthError(TOKEN_MESSAGE)
    if _has_body(headers) and not _is_json(headers.get("content-type", "")):
        return UnsupportedMediaType("Send the request body as JSON with 'Content-Type: application/json'.")
    return None


def _has_body(headers: dict[str, str]) -> bool:
    if "transfer-encoding" in headers:
        return True
    try:
        return int(headers.get("content-length", "0") or 0) > 0
    except ValueError:
        return True  # a malformed length: treat as a body, so the type is checked


def _is_json(content_type: str) -> bool:
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json"


class Guard:
    """ASGI middleware: answers the request itself when `check` refuses it."""

    def __init__(self, app, policy: Policy):
        self.app = app
        self.policy = policy

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        # Repeated headers: the first wins, as Starlette's Request.headers.get does.
        headers: dict[str, str] = {}
        for k, v in scope.get("headers", ()):
            headers.setdefault(k.decode("latin-1").lower(), v.decode("latin-1"))
        client = scope.get("client")
        error = check(self.policy, scope["method"].upper(), scope["path"], headers, client[0] if client else "")
        if error is None:
            return await self.app(scope, receive, send)
        body = json.dumps(error.to_openai()).encode()
        response_headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        if error.status == 401:
            response_headers.append((b"www-authenticate", b"Bearer"))
        await send({"type": "http.response.start", "status": error.status, "headers": response_headers})
        await send({"type": "http.response.body", "body": body})
