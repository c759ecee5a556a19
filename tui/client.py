"""The daemon's HTTP API as async methods: the ONLY module of the TUI that knows URLs.

Every failure leaves as a DaemonError whose message is fit for a notification;
DaemonUnreachable says the daemon could not be reached at all (not running, or gone).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx


class DaemonError(Exception):
    """A request failed; `str(e)` says why, in the daemon's words where it gave some."""


class DaemonUnreachable(DaemonError):
    """Nothing answered at the daemon's address (or the connection dropped)."""


@dataclass
class StreamStarted:
    """The daemon accepted the turn: feedback goes to `turn_id`."""

    turn_id: str
    session_id: str


@dataclass
class StreamFinished:
    finish_reason: str


class DaemonClient:
    def __init__(
        self,
        base_url: str,
        *,
        token: str | None = None,
        timeout: float = 10.0,
        transport: httpx.AsyncBaseTransport | None = None,
    ):
        self.base_url = base_url.rstrip("/")
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.AsyncClient(base_url=self.base_url, headers=headers, timeout=timeout, transport=transport)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _request(self, method: str, path: str, *, timeout: float | None = None, **kw):
        try:
            r = await self._http.request(method, path, **kw, **({"timeout": timeout} if timeout else {}))
        except httpx.TransportError as e:
            raise DaemonUnreachable(f"clawd is not reachable at {self.base_url} ({type(e).__name__})") from e
        if r.status_code >= 400:
            raise DaemonError(_error_message(r.status_code, r.text))
        return r.json()

    # --- daemon ------------------------------------------------------------------------

    async def status(self) -> dict:
        return await self._request("GET", "/clawd/status")

    async def is_up(self) -> bool:
        try:
            await self._request("GET", "/clawd/health", timeout=2.0)
            return True
        except DaemonUnreachable:
            return False

    # --- chat ---------------------------------------------------------------------------

    async def sessions(self, limit: int = 100) -> list[dict]:
        return await self._request("GET", "/clawd/sessions", params={"limit": limit})

    async def turns(self, session_id: str, limit: int = 200) -> list[dict]:
        """The session's turns, oldest first."""
        rows = await self._request("GET", f"/clawd/sessions/{session_id}/turns", params={"limit": limit})
        return list(reversed(rows))

    async def turn(self, turn_id: str) -> dict:
        return await self._request("GET", f"/clawd/turns/{turn_id}")

    async def stream_chat(
        self, model: str, messages: list[dict], session_id: str, max_tokens: int | None = None
    ) -> AsyncIterator[StreamStarted | str | StreamFinished]:
        """One streamed turn: StreamStarted, then text pieces, then StreamFinished.
        Closing the iterator early closes the connection, which stops generation."""
        body = {"model": model, "messages": messages, "stream": True}
        if max_tokens:
            body["max_tokens"] = max_tokens
        headers = {"X-Session-Id": session_id, "X-Turn-Type": "main"}
        try:
            async with self._http.stream(
                "POST", "/v1/chat/completions", json=body, headers=headers, timeout=httpx.Timeout(10.0, read=None)
            ) as r:
                if r.status_code >= 400:
                    raise DaemonError(_error_message(r.status_code, (await r.aread()).decode()))
                yield StreamStarted(
                    r.headers.get("x-clawd-turn-id", ""), r.headers.get("x-clawd-session-id", session_id)
                )
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[len("data: ") :]
                    if data == "[DONE]":
                        return
                    event = json.loads(data)
                    if "error" in event:
                        raise DaemonError(event["error"].get("message", "generation failed"))
                    for choice in event.get("choices", []):
                        if choice.get("delta", {}).get("content"):
                            yield choice["delta"]["content"]
                        if choice.get("finish_reason"):
                            yield StreamFinished(choice["finish_reason"])
        except httpx.TransportError as e:
            raise DaemonUnreachable(f"lost the connection to clawd at {self.base_url} ({type(e).__name__})") from e
        raise DaemonUnreachable("the reply stream ended before it was complete")

    async def feedback(self, turn_id: str, *, rating: str | None = None, correction: str | None = None) -> dict:
        body = {"turn_id": turn_id, "source": "tui"}
        if rating:
            body["rating"] = rating
        if correction:
            body["correction"] = correction
        return await self._request("POST", "/clawd/feedback", json=body)

    # --- learning -----------------------------------------------------------------------

    async def signals(self, limit: int = 200) -> list[dict]:
        return await self._request("GET", "/clawd/signals", params={"limit": limit})

    async def set_veto(self, turn_id: str, vetoed: bool) -> dict:
        return await self._request("POST", f"/clawd/signals/{turn_id}/{'veto' if vetoed else 'unveto'}")

    async def forget(self, session_id: str) -> dict:
        return await self._request("DELETE", f"/clawd/sessions/{session_id}")

    # --- training -----------------------------------------------------------------------

    async def training(self) -> dict:
        return await self._request("GET", "/clawd/training")

    async def training_history(self) -> dict:
        return await self._request("GET", "/clawd/training/history")

    async def start_training(self) -> dict:
        return await self._request("POST", "/clawd/training")

    async def stop_training(self) -> dict:
        return await self._request("POST", "/clawd/training/stop", timeout=90.0)

    # --- adapters -----------------------------------------------------------------------

    async def adapters(self) -> dict:
        return await self._request("GET", "/clawd/adapters")

    async def adapter_signals(self, adapter_id: str) -> list[dict]:
        return (await self._request("GET", f"/clawd/adapters/{adapter_id}/signals"))["signals"]

    async def compare(self, adapter_id: str, n: int = 3, max_tokens: int = 96) -> dict:
        # Generated while you wait, behind any chat request: allow minutes, not seconds.
        return await self._request(
            "POST", f"/clawd/adapters/{adapter_id}/compare", params={"n": n, "max_tokens": max_tokens}, timeout=600.0
        )

    async def activate(self, adapter_id: str | None) -> dict:
        return await self._request("POST", f"/clawd/adapters/{adapter_id or 'base'}/activate", timeout=120.0)

    async def rollback(self) -> dict:
        return await self._request("POST", "/clawd/adapters/rollback", timeout=120.0)


def _error_message(status: int, text: str) -> str:
    try:
        msg = json.loads(text)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        msg = text.strip()[:200] or "no details"
    return f"{msg} (HTTP {status})"
