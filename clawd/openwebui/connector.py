"""The daemon's pull from Open WebUI: new, changed and removed ratings, on a schedule.

Open WebUI keeps feedback in its own database and never tells the model server, so clawd
asks (openwebui.url, openwebui.api_key; nothing is contacted while url is empty). Each pull:

- with an admin's key, GET /api/v1/evaluations/feedbacks/all/ids (id + updated_at of every
  rating), then GET /api/v1/evaluations/feedback/{id} for those new or changed since the last
  pull (updated_at counts whole seconds, so a rating changed within a second of the last pull
  is fetched again);
- with a user's key (that route is admin-only: 401), the user's own ratings, page by page, from
  /api/v1/evaluations/feedbacks/user (no snapshot: they attach by message id only);

then applies each (ingest.py) and deletes what clawd holds of ratings no longer listed. A pull
that fails changes nothing and is retried at the next one; `clawd status` shows the error.
The settings are read afresh at every pull: a config reload applies them live.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from clawd.config import OpenWebUISettings
from clawd.openwebui import ingest
from clawd.store import feedback as feedback_rows
from clawd.store.db import Database

log = logging.getLogger(__name__)
IDS_PATH = "/api/v1/evaluations/feedbacks/all/ids"
ONE_PATH = "/api/v1/evaluations/feedback/{id}"
USER_PATH = "/api/v1/evaluations/feedbacks/user"
RECENT_S = 2.0  # a rating updated this close to the last pull may have changed again in its second
MAX_PAGES = 1000
TIMEOUT_S = 15.0


class PullError(Exception):
    """Open WebUI could not be asked (unreachable, refused the key, answered nonsense)."""


@dataclass
class SyncStatus:
    """The connector's state, for /clawd/status."""

    url: str = ""
    last_pull_at: float | None = None
    last_error: str | None = None
    last: dict[str, int] = field(default_factory=dict)  # outcome -> count, of the last pull
    outcomes: dict[str, int] = field(default_factory=dict)  # every rating held, by outcome

    def public(self) -> dict:
        return asdict(self)


class OpenWebUIClient:
    """Open WebUI's evaluation API, with one bearer key."""

    def __init__(self, url: str, api_key: str, transport: httpx.AsyncBaseTransport | None = None):
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        try:
            self.http = httpx.AsyncClient(
                base_url=url.rstrip("/"), headers=headers, timeout=TIMEOUT_S, transport=transport, trust_env=False
            )
        except httpx.InvalidURL as e:
            raise PullError(f"openwebui.url {url!r} is not a URL ({e}): fix it in config.toml") from e
        self._url, self._key_digest = url.rstrip("/"), hashlib.sha256(api_key.encode()).hexdigest()[:16]
        # Whose ratings the last listing showed: all (an admin's key) or one user's (set by listing()).
        self.scope = f"{self._url} all"

    async def aclose(self) -> None:
        await self.http.aclose()

    async def _get(self, path: str, **params) -> Any:
        try:
            r = await self.http.get(path, params=params or None)
        except httpx.HTTPError as e:
            raise PullError(f"cannot reach Open WebUI at {self.http.base_url}: {e}") from e
        if r.status_code in (401, 403):
            raise PermissionError(r.status_code)
        if r.status_code != 200:
            raise PullError(f"Open WebUI answered {r.status_code} to GET {path}: {r.text[:200]}")
        try:
            return r.json()
        except ValueError as e:
            raise PullError(f"Open WebUI answered GET {path} with something that is not JSON") from e

    async def listing(self) -> tuple[dict[str, float | None], list[dict] | None]:
        """Every rating's id -> updated_at, and (with a user's key) the records themselves."""
        try:
            rows = await self._get(IDS_PATH)
            self.scope = f"{self._url} all"
            return {r["id"]: r.get("updated_at") for r in _records(rows)}, None
        except PermissionError:
            pass  # not an admin: the user's own ratings
        self.scope = f"{self._url} user {self._key_digest}"
        records: list[dict] = []
        try:
            for page in range(1, MAX_PAGES + 1):
                body = await self._get(USER_PATH, page=page)
                items = _records(body.get("items") if isinstance(body, dict) else None)
                records += items
                if not items or len(records) >= _count(body.get("total")):
                    break
        except PermissionError as e:
            raise PullError(
                f"Open WebUI refused the API key ({e.args[0]}): set openwebui.api_key to a key or token "
                "of an Open WebUI account (Settings > Account)"
            ) from e
        return {r["id"]: r.get("updated_at") for r in records}, records

    async def record(self, feedback_id: str) -> dict | None:
        try:
            body = await self._get(ONE_PATH.format(id=feedback_id))
        except PermissionError as e:
            raise PullError(f"Open WebUI refused to show rating {feedback_id} ({e.args[0]})") from e
        except PullError as e:
            if " 404 " in str(e):
                return None  # deleted since it was listed: the next pull removes it
            raise
        return body if isinstance(body, dict) else None


def _count(total: Any) -> int:
    try:
        return int(total or 0)
    except (TypeError, ValueError) as e:
        raise PullError(f"Open WebUI's feedback listing has a total of {total!r}: is openwebui.url Open WebUI?") from e


def _records(rows: Any) -> list[dict]:
    if not isinstance(rows, list):
        raise PullError("Open WebUI's feedback listing is not a list: is openwebui.url Open WebUI?")
    return [r for r in rows if isinstance(r, dict) and isinstance(r.get("id"), str)]


async def pull(db: Database, client: OpenWebUIClient, reopen: ingest.Reopen | None, since: float | None) -> dict:
    """One pull. `since`: when the previous pull began (None: never). Returns outcome -> count."""
    listed, records = await client.listing()
    known = await feedback_rows.external_states(db, ingest.SOURCE)
    counts: dict[str, int] = {}

    def count(outcome: str) -> None:
        counts[outcome] = counts.get(outcome, 0) + 1

    by_id = {r["id"]: r for r in records or []}
    for fid, updated in listed.items():
        seen = known.get(fid)
        recent = since is not None and isinstance(updated, int | float) and updated >= since - RECENT_S
        if seen is not None and seen.updated_at == updated and not recent:
            continue
        record = by_id.get(fid) if records is not None else await client.record(fid)
        if record is None:
            continue
        applied = await ingest.apply_record(db, record, reopen=reopen)
        count(applied.outcome)
    # Removed: what this same listing (url and key's reach) showed before and shows no longer.
    # Ratings imported from a file, posted, or pulled from another instance or a wider key are
    # not this listing's to remove.
    for fid in await feedback_rows.pulled_ids(db, ingest.SOURCE, client.scope) - listed.keys():
        count((await ingest.remove(db, fid, reopen=reopen)).outcome)
    await feedback_rows.mark_pulled(db, ingest.SOURCE, list(listed), client.scope)
    return counts


class FeedbackSync:
    """Pulls every `settings.poll_s` while `settings.url` is set; `settings` may be replaced."""

    def __init__(self, db: Database, settings: OpenWebUISettings, reopen: ingest.Reopen | None = None):
        self.db = db
        self.settings = settings
        self.reopen = reopen
        self.status = SyncStatus(url=settings.url)
        self._since: float | None = None
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self.run(), name="openwebui-sync")

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def poke(self) -> None:
        """Pull now (the settings changed, or someone asked)."""
        self._wake.set()

    async def pull_once(self) -> dict:
        s = self.settings
        self.status.url = s.url
        if not s.url:
            return {}
        started = time.time()
        client = None
        try:
            client = OpenWebUIClient(s.url, s.api_key)
            counts = await pull(self.db, client, self.reopen, self._since)
        except PullError as e:
            self.status.last_error = str(e)
            log.warning("Open WebUI feedback not pulled: %s", e)
            raise
        finally:
            if client is not None:
                await client.aclose()
        self._since = started
        self.status.last_pull_at, self.status.last_error, self.status.last = time.time(), None, counts
        self.status.outcomes = await feedback_rows.external_counts(self.db, ingest.SOURCE)
        if counts:
            log.info("Open WebUI feedback pulled: %s", ", ".join(f"{n} {k}" for k, n in sorted(counts.items())))
        return counts

    async def run(self) -> None:
        while True:
            self._wake.clear()
            try:
                await self.pull_once()
            except asyncio.CancelledError:
                raise
            except PullError:
                pass  # said in the status and the log; tried again at the next poll
            except Exception as e:  # a bug in one pull must not end the connector for good
                log.exception("Open WebUI pull failed")
                self.status.last_error = f"{type(e).__name__}: {e}"
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.settings.poll_s)
