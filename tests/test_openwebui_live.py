"""A real Open WebUI (from PyPI, in its own venv) in front of a real clawd daemon (fake engine).

Slow: the first run installs open-webui (~2 GB with torch) under
~/.cache/clawd-tests/openwebui-venv, reused afterwards (CLAWD_OPENWEBUI_VENV moves it); it
starts in about a minute. Skipped, with the reason, when python3.11 or the install is missing.
Open WebUI is set up as README's "Use clawd with Open WebUI" says: the connection's Headers
carry {{CHAT_ID}}, {{MESSAGE_ID}} and {{TASK}}. Its title template is replaced by one that
clawd's template recognition does not know, so the title turn is a side turn by the header.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import time
import uuid
from pathlib import Path

import httpx
import pytest

from clawd import cli
from clawd.config import OpenWebUISettings
from clawd.openwebui.origin import CONNECTION_HEADERS
from clawd.store import signals
from tests.conftest import AUTH
from tests.test_miner import api_signal, mine, mining_daemon

pytestmark = pytest.mark.slow

VENV = Path(os.environ.get("CLAWD_OPENWEBUI_VENV", Path.home() / ".cache/clawd-tests/openwebui-venv"))
OPEN_WEBUI = VENV / "bin" / "open-webui"
CUSTOM_TITLE = "Name this conversation in at most four words.\n<conversation>\n{{MESSAGES:END:2}}\n</conversation>"
START_S = 300


def open_webui_installed() -> Path:
    """The open-webui executable, installing it into its own venv on first use (or skip)."""
    if OPEN_WEBUI.exists():
        return OPEN_WEBUI
    python = shutil.which("python3.11")
    if python is None:
        pytest.skip("open-webui needs python3.11 (for its own venv), which is not on PATH")
    try:
        subprocess.run([python, "-m", "venv", str(VENV)], check=True, capture_output=True, timeout=300)
        subprocess.run(
            [str(VENV / "bin" / "pip"), "install", "-q", "open-webui"], check=True, capture_output=True, timeout=3600
        )
    except (subprocess.SubprocessError, OSError) as e:
        shutil.rmtree(VENV, ignore_errors=True)
        detail = getattr(e, "stderr", b"") or b""
        pytest.skip(f"cannot install open-webui from PyPI here: {e} {detail.decode(errors='replace')[-300:]}")
    return OPEN_WEBUI


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def clawd(clawd_home):
    d = mining_daemon(clawd_home)
    yield d
    d.stop()


@pytest.fixture
def open_webui(clawd, tmp_path):
    exe = open_webui_installed()
    port = free_port()
    data = tmp_path / "open-webui"
    data.mkdir()
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(tmp_path),
        "DATA_DIR": str(data),
        "WEBUI_SECRET_KEY": uuid.uuid4().hex,
        # Nothing from the network: no model downloads, no telemetry, no Ollama.
        "OFFLINE_MODE": "true",
        "HF_HUB_OFFLINE": "1",
        "ANONYMIZED_TELEMETRY": "false",
        "DO_NOT_TRACK": "true",
        "SCARF_NO_ANALYTICS": "true",
        "ENABLE_OLLAMA_API": "false",
        "RAG_EMBEDDING_ENGINE": "openai",
        "BYPASS_EMBEDDING_AND_RETRIEVAL": "true",
        # clawd as its one OpenAI connection, set up as README says.
        "OPENAI_API_BASE_URLS": f"{clawd.url}/v1",
        "OPENAI_API_KEYS": AUTH["Authorization"].removeprefix("Bearer "),
        "OPENAI_API_CONFIGS": json.dumps({"0": {"enable": True, "headers": CONNECTION_HEADERS}}),
        "TITLE_GENERATION_PROMPT_TEMPLATE": CUSTOM_TITLE,
        "ENABLE_FOLLOW_UP_GENERATION": "false",
    }
    log = (tmp_path / "open-webui.log").open("w")
    proc = subprocess.Popen(
        [str(exe), "serve", "--host", "127.0.0.1", "--port", str(port)],
        env=env,
        cwd=tmp_path,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_S
    try:
        while True:
            assert proc.poll() is None, (tmp_path / "open-webui.log").read_text()[-3000:]
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "Open WebUI did not start in time"
            time.sleep(0.5)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
        log.close()


def wait_for(what: str, check, timeout: float = 120.0):
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def rows(d, sql: str, *args) -> list[tuple]:
    async def q():
        return [tuple(r) for r in await d.state.db.conn.execute_fetchall(sql, args)]

    return d.run(q())


def changes(pulled: dict) -> dict:
    """A pull's outcomes but `unchanged` (a rating changed within a second of the last pull is
    fetched again, and found unchanged)."""
    return {k: n for k, n in pulled.items() if k != "unchanged"}


class OpenWebUIUser:
    """Open WebUI's own HTTP API, as its web page calls it."""

    def __init__(self, url: str):
        self.http = httpx.Client(base_url=url, timeout=120)
        r = self.http.post(
            "/api/v1/auths/signup",
            json={"name": "Ada", "email": "ada@example.com", "password": "pw-" + uuid.uuid4().hex},
        )
        assert r.status_code == 200, r.text
        self.token = r.json()["token"]
        assert r.json()["role"] == "admin"  # the first account is the admin: its key reads every rating
        self.http.headers["Authorization"] = f"Bearer {self.token}"

    def chat(self, question: str) -> tuple[str, str, str]:
        """A new chat with one question, as the page sends it. (chat id, reply message id, reply)"""
        model = self.http.get("/api/models").json()["data"][0]["id"]
        r = self.http.post("/api/v1/chats/new", json={"chat": {"title": "New Chat", "models": [model], "messages": []}})
        assert r.status_code == 200, r.text
        chat_id, user_id, reply_id = r.json()["id"], str(uuid.uuid4()), str(uuid.uuid4())
        r = self.http.post(
            "/api/chat/completions",
            json={
                "model": model,
                "stream": False,
                "chat_id": chat_id,
                "id": reply_id,
                "parent_id": user_id,
                "user_message": {"id": user_id, "role": "user", "content": question, "parentId": None},
                "messages": [{"role": "user", "content": question}],
                "background_tasks": {"title_generation": True, "tags_generation": True},
            },
        )
        assert r.status_code == 200, r.text
        return chat_id, reply_id, r.json()["choices"][0]["message"]["content"]

    def rate(self, chat_id: str, message_id: str, rating: int, *, reason: str = "", comment: str = "", fid=None):
        body = {
            "type": "rating",
            "data": {"rating": rating, "model_id": "fake-model", "reason": reason, "comment": comment},
            "meta": {"chat_id": chat_id, "message_id": message_id, "model_id": "fake-model", "arena": False},
            "snapshot": {"chat": self.http.get(f"/api/v1/chats/{chat_id}").json()},
        }
        r = self.http.post(f"/api/v1/evaluations/feedback{'/' + fid if fid else ''}", json=body)
        assert r.status_code == 200, r.text
        return r.json()["id"]


def test_ratings_made_in_open_webui_reach_the_right_turns(clawd, open_webui, monkeypatch, capsys):
    owui = OpenWebUIUser(open_webui)
    sky_chat, sky_msg, _ = owui.chat("What color is the sky?")
    grass_chat, grass_msg, _ = owui.chat("What color is grass?")

    def main_turn(message_id):
        found = rows(clawd, "SELECT id FROM turns WHERE client_message_id = ? AND turn_type = 'main'", message_id)
        return found[0][0] if len(found) == 1 else None

    sky, grass = main_turn(sky_msg), main_turn(grass_msg)
    assert sky and grass

    # Title and tags: Open WebUI asks them in the background, as side turns of the same chat
    def side_tasks():
        got = rows(clawd, "SELECT request_json FROM turns WHERE client_chat_id = ? AND turn_type = 'side'", sky_chat)
        return got if len(got) >= 2 else None

    texts = [t[0] for t in wait_for("the title and tags requests", side_tasks)]
    assert any("Name this conversation" in t for t in texts)  # custom template: side by the task header
    assert any("Generate 1-3 broad tags" in t for t in texts)
    assert rows(clawd, "SELECT COUNT(*) FROM turns WHERE client_chat_id = ? AND turn_type = 'main'", sky_chat) == [(1,)]

    # Rate two replies in Open WebUI, one with a reason and a comment
    sky_fid = owui.rate(sky_chat, sky_msg, -1, reason="Not factually correct", comment="Just say blue.")
    grass_fid = owui.rate(grass_chat, grass_msg, 1)

    # The connector: `clawd connect` checks the key and writes the config; the daemon pulls
    monkeypatch.setenv("CLAWD_HOME", str(clawd.home))
    assert cli.main(["connect", "openwebui", "--url", open_webui, "--api-key", owui.token]) == 0
    assert "an admin's" in capsys.readouterr().out
    clawd.state.openwebui.settings = OpenWebUISettings(url=open_webui, api_key=owui.token)  # as the reload does
    with httpx.Client(headers=AUTH, timeout=60) as http:
        r = http.post(clawd.url + "/clawd/openwebui/pull")
        assert r.status_code == 200, r.text
        assert r.json()["pulled"] == {"attached": 2}
        fb = "SELECT kind, text, external_id FROM feedback WHERE turn_id = ? ORDER BY id"
        assert rows(clawd, fb, sky) == [
            ("down", None, sky_fid),
            ("correction", "Not factually correct Just say blue.", sky_fid),
        ]
        assert rows(clawd, fb, grass) == [("up", None, grass_fid)]
        mine(clawd)
        s = api_signal(http, clawd, sky)
        assert (s["reward"], s["reward_source"], s["hint"]) == (-1, "feedback", "Not factually correct Just say blue.")

        # Open WebUI's export file (Admin Panel > Evaluations > Export) holds the same ratings
        export = owui.http.get("/api/v1/evaluations/feedbacks/all/export")
        assert export.status_code == 200 and len(export.json()) == 2
        path = clawd.home / "feedback-export.json"
        path.write_bytes(export.content)
        monkeypatch.setenv("CLAWD_SERVER_PORT", str(clawd.state.port))
        assert cli.main(["import", "openwebui", str(path)]) == 0
        assert "2 ratings: 2 unchanged" in capsys.readouterr().out

        # Changed in Open WebUI (👎 -> 👍): changed in clawd, the hint gone with it
        owui.rate(sky_chat, sky_msg, 1, fid=sky_fid)
        assert changes(http.post(clawd.url + "/clawd/openwebui/pull").json()["pulled"]) == {"attached": 1}
        assert rows(clawd, fb, sky) == [("up", None, sky_fid)]
        mine(clawd)
        s = api_signal(http, clawd, sky)
        assert (s["reward"], s["reward_source"], s["hint"]) == (1, "feedback", None)

        # Removed in Open WebUI: removed in clawd
        assert owui.http.delete(f"/api/v1/evaluations/feedback/{grass_fid}").status_code == 200
        assert changes(http.post(clawd.url + "/clawd/openwebui/pull").json()["pulled"]) == {"removed": 1}
        assert rows(clawd, fb, grass) == []

    # no side turn ever became a signal
    side = rows(clawd, "SELECT id FROM turns WHERE turn_type = 'side'")
    assert side and all(clawd.run(signals.get(clawd.state.db, t)) is None for (t,) in side)
