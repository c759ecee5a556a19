"""The one synchronous HTTP client to a running clawd daemon: the CLI, clawd/bench and the benchmarks.

Boundary: where the daemon is (base URL from the config), the bearer token (from the token
file), timeouts, and what a failed request becomes. What to ask and what to do with the
answer is the caller's business. The TUI keeps its own async client (tui/client.py), which
must not import clawd. Import this module lazily from the CLI: httpx is loaded with it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import httpx
from httpx import HTTPError  # what get / post / request raise: no answer, or an error status

from clawd.errors import ClawdError

if TYPE_CHECKING:
    from clawd.config import Settings
    from clawd.paths import Paths

__all__ = ["DaemonClient", "DaemonUnreachable", "HTTPError", "daemon_token", "daemon_url"]


class DaemonUnreachable(ClawdError):
    """No answer from the daemon at all (not running, wrong port, connection dropped)."""


def daemon_url(settings: Settings) -> str:
    """The daemon's base URL from `server.host` / `server.port`; a wildcard listen address
    is reached on loopback."""
    host = settings.server.host
    if host in ("0.0.0.0", "::"):
        host = "127.0.0.1"
    return f"http://{'[' + host + ']' if ':' in host else host}:{settings.server.port}"


def daemon_token(paths: Paths) -> str | None:
    """The bearer token the daemon made, or None before it ever ran."""
    from clawd.token import read_token

    return read_token(paths.token_file) if paths.token_file.exists() else None


class DaemonClient:
    """Requests to one daemon. `call` is the CLI's: JSON, or a one-line ClawdError.
    `get` / `post` are the benchmarks': JSON of a 2xx answer, else httpx's error.
    `request` / `stream` hand back the raw response for callers that time or stream it."""

    def __init__(self, base_url: str, *, token: str | None = None, timeout: float = 5.0, where: str | None = None):
        self.base_url = base_url.rstrip("/")
        self.token = token
        self.where = where or self.base_url  # how messages name the daemon
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.http = httpx.Client(base_url=self.base_url, headers=headers, timeout=timeout)

    @classmethod
    def configured(cls, settings: Settings, paths: Paths, *, timeout: float = 5.0) -> DaemonClient:
        """The daemon this home's config names, with its token."""
        return cls(
            daemon_url(settings),
            token=daemon_token(paths),
            timeout=timeout,
            where=f"{settings.server.host}:{settings.server.port}",
        )

    def call(self, method: str, path: str, **kw) -> Any:
        """One request; its JSON, or a one-line ClawdError (DaemonUnreachable when nothing answered)."""
        try:
            r = self.http.request(method, path, **kw)
        except httpx.HTTPError as e:
            raise DaemonUnreachable(
                f"clawd is not running at {self.where} ({e or type(e).__name__}): start it with `clawd serve`"
            ) from e
        body = r.json()
        if r.status_code >= 400:
            raise ClawdError(body.get("error", {}).get("message", f"HTTP {r.status_code}"))
        return body

    def get(self, path: str, **params) -> Any:
        r = self.http.get(path, params=params)
        r.raise_for_status()
        return r.json()

    def post(self, path: str, body: dict | None = None, **params) -> Any:
        r = self.http.post(path, json=body, params=params)
        r.raise_for_status()
        return r.json()

    def request(self, method: str, path: str, **kw) -> httpx.Response:
        return self.http.request(method, path, **kw)

    def stream(self, method: str, path: str, **kw):
        """A context manager over the streamed response (httpx.Client.stream)."""
        return self.http.stream(method, path, **kw)

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> DaemonClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
