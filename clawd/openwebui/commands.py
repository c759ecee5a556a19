"""`clawd connect openwebui` and `clawd import openwebui FILE` (cli.py hands over here).

connect checks that Open WebUI answers with the key, then writes [openwebui] into config.toml:
a running daemon reloads it and starts pulling at once (connector.py). import sends an export
file (Open WebUI: Admin Panel > Evaluations > Export, a JSON array) to the running daemon in
batches under its body-size limit, each record's snapshot cut down to the rated message (the
whole chat is not needed to match it, and would make a big file's batches huge).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from clawd.config_edit import set_table_keys
from clawd.errors import ClawdError
from clawd.openwebui.connector import OpenWebUIClient, PullError
from clawd.openwebui.origin import CONNECTION_HEADERS

BATCH_BYTES = 256 * 1024  # well under server.max_request_mb's 1 MB default


def connect(config_file: Path, url: str, api_key: str, *, check: bool, daemon_url: str) -> list[str]:
    """Check (unless told not to), write the config; the lines to print."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ClawdError(f"--url must be Open WebUI's http(s) address, e.g. http://localhost:3000 (got {url!r})")
    url = url.rstrip("/")
    out = []
    if check:
        listed, records = asyncio.run(_listing(url, api_key))
        who = "an admin's: everyone's ratings" if records is None else "a user's: that user's ratings only"
        out.append(f"Open WebUI at {url} answers; the key is {who} ({len(listed)} now).")
    changed = set_table_keys(config_file, "openwebui", {"url": url, "api_key": api_key})
    out.append(f"{'wrote' if changed else 'already in'} [openwebui] of {config_file}: a running daemon pulls now,")
    out.append("then every openwebui.poll_s seconds (`clawd status` shows the last pull).")
    out.append("")
    out.append("In Open WebUI (Admin Panel > Settings > Connections > OpenAI API, add a connection):")
    out.append(f"  URL      {daemon_url}/v1")
    out.append("  Key      the output of `clawd token`")
    out.append(f"  Headers  {json.dumps(CONNECTION_HEADERS)}")
    out.append("The headers let clawd put each rating on the exact reply it rates, and keep Open WebUI's")
    out.append("title and tag requests out of training (README: Use clawd with Open WebUI).")
    return out


async def _listing(url: str, api_key: str):
    client = OpenWebUIClient(url, api_key)
    try:
        return await client.listing()
    except PullError as e:
        raise ClawdError(str(e)) from e
    finally:
        await client.aclose()


def read_export(path: Path) -> list[Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise ClawdError(f"cannot read {path}: {e.strerror or e}") from e
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ClawdError(f"{path} is not JSON ({e}): export it from Open WebUI's Admin Panel > Evaluations") from e
    if isinstance(data, dict):
        data = [data]  # one record
    if not isinstance(data, list):
        raise ClawdError(f"{path} is not an Open WebUI feedback export (a JSON array of ratings)")
    return [_trimmed(r) for r in data]


def _trimmed(record: Any) -> Any:
    """The record with its snapshot cut to the rated message (unchanged if it has another shape)."""
    if not isinstance(record, dict) or not isinstance(record.get("snapshot"), dict):
        return record
    meta = record.get("meta") if isinstance(record.get("meta"), dict) else {}
    wanted = meta.get("message_id")
    outer = record["snapshot"].get("chat")
    if not isinstance(outer, dict) or not isinstance(wanted, str):
        return record
    inner = outer.get("chat") if isinstance(outer.get("chat"), dict) else outer
    history = inner.get("history") if isinstance(inner.get("history"), dict) else {}
    pool = history.get("messages") if isinstance(history.get("messages"), dict) else {}
    candidates = list(pool.values()) + (inner.get("messages") if isinstance(inner.get("messages"), list) else [])
    for m in candidates:
        if isinstance(m, dict) and m.get("id") == wanted:
            keep = {k: m[k] for k in ("id", "role", "content") if k in m}
            chat = {"history": {"messages": {wanted: keep}}}
            if isinstance(outer.get("id"), str):
                chat["id"] = outer["id"]
            return {**record, "snapshot": {"chat": chat}}
    return record


def batches(records: list[Any], budget: int = BATCH_BYTES) -> list[list[Any]]:
    out: list[list[Any]] = []
    size = 0
    for r in records:
        n = len(json.dumps(r, ensure_ascii=False).encode())
        if not out or size + n > budget:
            out.append([])
            size = 0
        out[-1].append(r)
        size += n
    return out


def import_summary(results: list[dict]) -> list[str]:
    counts: dict[str, int] = {}
    for r in results:
        counts[r["outcome"]] = counts.get(r["outcome"], 0) + 1
    lines = [f"{len(results)} ratings: " + (", ".join(f"{n} {k}" for k, n in sorted(counts.items())) or "none")]
    for i, r in enumerate(results):
        if r["outcome"] not in ("attached", "unchanged"):
            lines.append(f"  #{i} {r.get('id') or '(no id)'}: {r['outcome']}: {r.get('detail') or ''}".rstrip(": "))
    return lines
