"""Open WebUI as a source of ratings (clawd/openwebui/), against a real daemon (fake engine).

The request bodies and the rating record are the ones a real Open WebUI 0.12.4 sent and
returned (tests/openwebui_captured.json); tests/test_openwebui_live.py runs Open WebUI itself.
"""

from __future__ import annotations

import copy
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from clawd import cli
from clawd.config import OpenWebUISettings
from clawd.openwebui import origin
from clawd.protocol import Message
from clawd.store import signals
from tests.test_miner import (
    CHAT,
    MODEL,
    api_signal,
    assert_openai_error,
    mine,
    mining_daemon,
    stored_turn,
)

CAPTURED = json.loads((Path(__file__).parent / "openwebui_captured.json").read_text(encoding="utf-8"))
QUESTION = "What color is the sky?"


@pytest.fixture
def md(clawd_home):
    d = mining_daemon(clawd_home)
    yield d
    d.stop()


@pytest.fixture
def http():
    from tests.conftest import AUTH

    with httpx.Client(headers=AUTH, timeout=30) as c:
        yield c


def owui_headers(chat_id: str | None = None, message_id: str | None = None, task: str = "") -> dict:
    """What an Open WebUI connection with README's Headers setting sends."""
    h = {"X-OpenWebUI-Task": task}
    if chat_id:
        h["X-OpenWebUI-Chat-Id"] = chat_id
    if message_id:
        h["X-OpenWebUI-Message-Id"] = message_id
    return h


def record(
    message_id: str,
    rating: int,
    *,
    fid: str | None = None,
    updated_at: int = 1796400000,
    chat_id: str = "chat-a",
    text: str | None = None,
    reason: str = "",
    comment: str = "",
) -> dict:
    """A rating as Open WebUI's API returns it (the captured record, its fields replaced)."""
    r = copy.deepcopy(CAPTURED["feedback_record"])
    r["data"].update(rating=rating, reason=reason, comment=comment)
    r["meta"].update(chat_id=chat_id, message_id=message_id)
    r["updated_at"] = updated_at
    if fid is not None:
        r["id"] = fid
    else:
        r.pop("id")
    msgs = {}
    if text is not None:  # the snapshot the UI sends: the whole chat, nested one level deeper
        msgs = {message_id: {"id": message_id, "role": "assistant", "content": text, "parentId": "u1"}}
    r["snapshot"] = {"chat": {"id": chat_id, "chat": {"history": {"messages": msgs, "currentId": message_id}}}}
    return r


def feedback_rows(d, turn_id: str) -> list[tuple]:
    async def q():
        rows = await d.state.db.conn.execute_fetchall(
            "SELECT kind, text, external_id FROM feedback WHERE turn_id = ? ORDER BY id", (turn_id,)
        )
        return [tuple(r) for r in rows]

    return d.run(q())


def say(d, http, text: str, **headers) -> tuple[str, str]:
    body = {"model": MODEL, "temperature": 0, "messages": [{"role": "user", "content": text}]}
    r = http.post(d.url + CHAT, json=body, headers=headers)
    assert r.status_code == 200, r.text
    return r.headers["x-clawd-turn-id"], r.json()["choices"][0]["message"]["content"]


# --- background tasks are side turns ------------------------------------------------------------


@pytest.mark.parametrize("task", sorted(CAPTURED["task_requests"]))
def test_open_webui_task_requests_are_side_turns_never_mined(md, http, task):
    body = {"model": MODEL, **CAPTURED["task_requests"][task]}
    r = http.post(md.url + CHAT, json=body)  # no headers at all: recognised by its template
    assert r.status_code == 200, r.text
    tid = r.headers["x-clawd-turn-id"]
    assert stored_turn(md, tid).turn_type == "side"
    mine(md)
    assert md.run(signals.get(md.state.db, tid)) is None  # never paired, never mined
    # the chat request of the same capture is a main turn
    r = http.post(md.url + CHAT, json={"model": MODEL, **CAPTURED["chat_request"]}, headers=owui_headers("c", "m"))
    assert stored_turn(md, r.headers["x-clawd-turn-id"]).turn_type == "main"


def test_the_task_header_marks_a_custom_template_a_side_turn(md, http):
    """An admin's own title template matches no default: Open WebUI's {{TASK}} header still says."""
    text = "Name this chat in three words: <history>USER: What color is the sky?</history>"
    plain, _ = say(md, http, text, **owui_headers("c1", "m1"))
    task, _ = say(md, http, text, **owui_headers("c1", "m1", task="title_generation"))
    assert stored_turn(md, plain).turn_type == "main"
    assert stored_turn(md, task).turn_type == "side"


def test_a_conversation_that_quotes_a_template_is_no_task():
    title = CAPTURED["task_requests"]["title_generation"]["messages"][0]["content"]
    as_messages = [Message(role="user", content=title)]
    assert origin.looks_like_task(as_messages)
    assert origin.looks_like_task([Message(role="system", content="Be brief."), *as_messages])
    # a user who pastes a template into an ongoing chat is talking, not running a task
    chat = [Message(role="user", content="hi"), Message(role="assistant", content="Hello!"), *as_messages]
    assert not origin.looks_like_task(chat)
    assert not origin.looks_like_task([Message(role="user", content="### Task: fix my essay, please")])
    # the templates the capture did not exercise, by their openings in Open WebUI's config.py
    autocomplete = (
        "### Task:\nYou are an autocompletion system. ...\n<chat_history>\n</chat_history>\n<text>The sky</text>"
    )
    query = (
        "### Task:\nAnalyze the chat history to determine the necessity of generating search queries ...<chat_history>"
    )
    emoji = "Your task is to reflect the speaker's likely facial expression through a fitting emoji. ..."
    for text in (autocomplete, query, emoji):
        assert origin.looks_like_task([Message(role="user", content=text)]), text[:40]


# --- matching a rating to its turn --------------------------------------------------------------


def test_a_rating_lands_on_the_message_it_names_not_on_a_newer_same_answer(md, http):
    """The issue: a 👎 on an older chat landed on a newer chat with the same answer."""
    older, answer = say(md, http, QUESTION, **owui_headers("chat-a", "msg-a"))
    newer, same = say(md, http, QUESTION, **owui_headers("chat-b", "msg-b"))
    assert answer == same  # the fake engine answers alike: text alone cannot tell them apart
    r = http.post(md.url + "/clawd/feedback", json=record("msg-a", -1, text=answer, reason="Not factually correct"))
    assert r.status_code == 200, r.text
    assert (r.json()["turn_id"], r.json()["matched_by"]) == (older, "message_id")
    assert feedback_rows(md, older) == [("down", None, None), ("correction", "Not factually correct", None)]
    assert feedback_rows(md, newer) == []


def test_an_ambiguous_text_match_is_refused_not_guessed(md, http):
    """Two chats got the same answer, and the requests carried no message ids (headers not set)."""
    first, answer = say(md, http, QUESTION)
    second, _ = say(md, http, QUESTION)
    r = http.post(md.url + "/clawd/feedback", json=record("msg-x", -1, text=answer, comment="say blue"))
    err = assert_openai_error(r, 409)
    assert err["code"] == "ambiguous_match" and "2 clawd turns" in err["message"]
    # the same through an export file: reported, and nothing attached
    r = http.post(md.url + "/clawd/feedback", json=[record("msg-x", -1, fid="f1", text=answer)])
    assert r.status_code == 200, r.text
    assert [x["outcome"] for x in r.json()["results"]] == ["ambiguous"]
    assert feedback_rows(md, first) == feedback_rows(md, second) == []
    # One answer that only one turn gave is unambiguous by text
    only, unique = say(md, http, "What color is grass?")
    r = http.post(md.url + "/clawd/feedback", json=record("msg-y", 1, text=unique))
    assert (r.json()["turn_id"], r.json()["matched_by"]) == (only, "text")


def test_the_chat_id_narrows_a_text_match(md, http):
    """ENABLE_FORWARD_USER_INFO_HEADERS alone sends the chat id but no message id."""
    in_a, answer = say(md, http, QUESTION, **{"X-OpenWebUI-Chat-Id": "chat-a"})
    in_b, _ = say(md, http, QUESTION, **{"X-OpenWebUI-Chat-Id": "chat-b"})
    r = http.post(md.url + "/clawd/feedback", json=record("unknown", 1, chat_id="chat-b", text=answer))
    assert r.status_code == 200, r.text
    assert r.json()["turn_id"] == in_b
    assert feedback_rows(md, in_a) == []


def test_task_turns_are_never_rated(md, http):
    """Open WebUI's task requests carry the chat's message id too: the rating is the reply's."""
    reply, _ = say(md, http, QUESTION, **owui_headers("chat-a", "msg-a"))
    title_body = {"model": MODEL, **CAPTURED["task_requests"]["title_generation"]}
    r = http.post(md.url + CHAT, json=title_body, headers=owui_headers("chat-a", "msg-a", task="title_generation"))
    title = r.headers["x-clawd-turn-id"]
    r = http.post(md.url + "/clawd/feedback", json=record("msg-a", 1))
    assert r.json()["turn_id"] == reply
    assert feedback_rows(md, title) == []


# --- changes and removals -------------------------------------------------------------------------


def test_a_changed_rating_replaces_thumb_and_hint(md, http):
    tid, _ = say(md, http, QUESTION, **owui_headers("chat-a", "msg-a"))
    down = record("msg-a", -1, fid="fb-1", updated_at=100, reason="Not factually correct", comment="say blue")
    assert http.post(md.url + "/clawd/feedback", json=down).status_code == 200
    mine(md)
    s = api_signal(http, md, tid)
    assert (s["reward"], s["reward_source"]) == (-1, "feedback")
    assert s["hint"] == "Not factually correct say blue"

    again = http.post(md.url + "/clawd/feedback", json=down)  # the same rating once more: nothing changes
    assert again.json()["outcome"] == "unchanged"
    assert len(feedback_rows(md, tid)) == 2

    up = record("msg-a", 1, fid="fb-1", updated_at=100)  # 👎 -> 👍 within the same second
    r = http.post(md.url + "/clawd/feedback", json=up)
    assert r.json()["outcome"] == "attached"
    assert feedback_rows(md, tid) == [("up", None, "fb-1")]
    mine(md)
    s = api_signal(http, md, tid)
    assert (s["reward"], s["reward_source"]) == (1, "feedback")
    assert s["hint"] is None and s["hints"] == []


# --- the export file --------------------------------------------------------------------------------


def test_clawd_import_openwebui_applies_an_export_file(md, http, tmp_path, monkeypatch, capsys):
    a, answer_a = say(md, http, QUESTION, **owui_headers("chat-a", "msg-a"))
    b, answer_b = say(md, http, "What color is grass?", **owui_headers("chat-b", "msg-b"))
    export = [
        record("msg-a", -1, fid="fb-a", text=answer_a, comment="say blue, plainly"),
        record("msg-b", 1, fid="fb-b", chat_id="chat-b", text=answer_b),
        {"id": "fb-arena", "type": "arena", "data": {}},
        {"id": "fb-bad", "type": "rating", "data": {"rating": "sideways"}},
        record("msg-gone", 1, fid="fb-gone", chat_id="chat-z", text="An answer from another server."),
    ]
    # a long chat in the snapshot (1.2 MB, over the body limit): the import sends the rated message only
    export[0]["snapshot"]["chat"]["chat"]["history"]["messages"].update(
        {f"old-{i}": {"id": f"old-{i}", "role": "user", "content": "x" * 2000} for i in range(600)}
    )
    path = tmp_path / "feedback-export.json"
    path.write_text(json.dumps(export), encoding="utf-8")
    monkeypatch.setenv("CLAWD_HOME", str(md.home))
    monkeypatch.setenv("CLAWD_SERVER_PORT", str(md.state.port))

    assert cli.main(["import", "openwebui", str(path)]) == 0
    out = capsys.readouterr().out
    assert "5 ratings: 2 attached, 2 invalid, 1 not_found" in out
    assert "fb-bad: invalid" in out and "fb-gone: not_found" in out
    assert feedback_rows(md, a) == [("down", None, "fb-a"), ("correction", "say blue, plainly", "fb-a")]
    assert feedback_rows(md, b) == [("up", None, "fb-b")]

    assert cli.main(["import", "openwebui", str(path)]) == 0  # importing it again changes nothing
    assert "2 unchanged" in capsys.readouterr().out
    assert len(feedback_rows(md, a)) == 2

    path.write_text("{not json", encoding="utf-8")
    assert cli.main(["import", "openwebui", str(path)]) == 1
    assert "is not JSON" in capsys.readouterr().err


def test_an_export_array_of_non_objects_is_a_400(md, http):
    assert_openai_error(http.post(md.url + "/clawd/feedback", json=["fb", 1]), 400)


# --- the connector: a pull from Open WebUI's API -------------------------------------------------------


class FakeOpenWebUI:
    """Open WebUI's evaluation routes as the connector uses them (routers/evaluations.py): an
    admin's key lists every rating's id, a user's key gets 401 there and its own pages."""

    ADMIN, USER = "admin-key", "user-key"

    def __init__(self):
        self.records: dict[str, dict] = {}
        self.user_sees: set[str] | None = None  # the ids a user's key lists (None: all of them)
        self.requests: list[str] = []
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_GET(self):
                owner.requests.append(self.path)
                key = self.headers.get("authorization", "").removeprefix("Bearer ")
                path, _, query = self.path.partition("?")
                if key not in (owner.ADMIN, owner.USER):
                    return self._send(401, {"detail": "Not authenticated"})
                if path == "/api/v1/evaluations/feedbacks/all/ids":
                    if key != owner.ADMIN:
                        return self._send(401, {"detail": "Unauthorized"})
                    rows = [
                        {"id": i, "user_id": "u", "created_at": 1, "updated_at": r["updated_at"]}
                        for i, r in owner.records.items()
                    ]
                    return self._send(200, rows)
                if path.startswith("/api/v1/evaluations/feedback/"):
                    r = owner.records.get(path.rsplit("/", 1)[1])
                    return self._send(200, r) if r else self._send(404, {"detail": "Not found"})
                if path == "/api/v1/evaluations/feedbacks/user":
                    page = int(query.partition("=")[2] or 1)
                    items = [
                        {k: v for k, v in r.items() if k != "snapshot"}
                        for i, r in owner.records.items()
                        if owner.user_sees is None or i in owner.user_sees
                    ]
                    return self._send(200, {"items": items[(page - 1) * 30 : page * 30], "total": len(items)})
                return self._send(404, {"detail": "Not found"})

            def _send(self, status, body):
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def owui():
    f = FakeOpenWebUI()
    yield f
    f.close()


def connect(md, url: str, key: str) -> None:
    md.state.openwebui.settings = OpenWebUISettings(url=url, api_key=key)  # what a config reload does


def pull(md, http) -> dict:
    r = http.post(md.url + "/clawd/openwebui/pull")
    assert r.status_code == 200, r.text
    return r.json()["pulled"]


@pytest.mark.parametrize("key", [FakeOpenWebUI.ADMIN, FakeOpenWebUI.USER])
def test_the_connector_pulls_new_changed_and_removed_ratings(md, http, owui, key):
    a, _ = say(md, http, QUESTION, **owui_headers("chat-a", "msg-a"))
    b, _ = say(md, http, "What color is grass?", **owui_headers("chat-b", "msg-b"))
    assert_openai_error(http.post(md.url + "/clawd/openwebui/pull"), 404)  # not connected yet
    connect(md, owui.url, key)
    assert pull(md, http) == {}

    owui.records["fb-a"] = record("msg-a", -1, fid="fb-a", updated_at=100, comment="say blue")
    owui.records["fb-b"] = record("msg-b", 1, fid="fb-b", updated_at=100, chat_id="chat-b")
    assert pull(md, http) == {"attached": 2}
    assert feedback_rows(md, a) == [("down", None, "fb-a"), ("correction", "say blue", "fb-a")]
    assert feedback_rows(md, b) == [("up", None, "fb-b")]
    owui.requests.clear()
    assert pull(md, http) == {}  # nothing changed: nothing fetched again
    assert not [p for p in owui.requests if "/feedback/" in p]

    owui.records["fb-a"] = record("msg-a", 1, fid="fb-a", updated_at=200)  # 👎 -> 👍 in Open WebUI
    del owui.records["fb-b"]  # and the other rating deleted there
    assert pull(md, http) == {"attached": 1, "removed": 1}
    assert feedback_rows(md, a) == [("up", None, "fb-a")]
    assert feedback_rows(md, b) == []
    mine(md)
    assert api_signal(http, md, a)["reward"] == 1 and api_signal(http, md, a)["hint"] is None
    assert api_signal(http, md, b)["reward_source"] != "feedback"

    status = http.get(md.url + "/clawd/status").json()["openwebui"]
    assert status["url"] == owui.url and status["last_error"] is None and status["outcomes"] == {"attached": 1}


def test_a_pull_removes_only_what_its_own_listing_used_to_show(md, http, owui):
    """An imported rating, or one pulled with an admin's key, is not "removed" by a listing that
    never showed it (a user's key sees only that user's ratings; an import is in no listing)."""
    a, _ = say(md, http, QUESTION, **owui_headers("chat-a", "msg-a"))
    b, _ = say(md, http, "What color is grass?", **owui_headers("chat-b", "msg-b"))
    r = http.post(md.url + "/clawd/feedback", json=[record("msg-a", -1, fid="fb-imported", comment="say blue")])
    assert r.status_code == 200, r.text
    owui.records["fb-b"] = record("msg-b", 1, fid="fb-b", updated_at=100, chat_id="chat-b")
    connect(md, owui.url, FakeOpenWebUI.ADMIN)
    assert pull(md, http) == {"attached": 1}  # the imported rating is in no listing: kept
    assert feedback_rows(md, a) == [("down", None, "fb-imported"), ("correction", "say blue", "fb-imported")]

    owui.user_sees = set()  # this user rated nothing: their listing is empty
    connect(md, owui.url, FakeOpenWebUI.USER)
    assert pull(md, http) == {}  # the admin's listing showed fb-b; the user's never did
    assert feedback_rows(md, b) == [("up", None, "fb-b")]

    connect(md, owui.url, FakeOpenWebUI.ADMIN)
    del owui.records["fb-b"]
    assert pull(md, http) == {"removed": 1}  # gone from the listing that showed it
    assert feedback_rows(md, b) == [] and len(feedback_rows(md, a)) == 2


def test_a_url_that_is_no_url_is_a_502_saying_so(md, http):
    connect(md, "http://[::1", FakeOpenWebUI.ADMIN)
    err = upstream_error(http.post(md.url + "/clawd/openwebui/pull"))
    assert "is not a URL" in err["message"]


def upstream_error(r: httpx.Response) -> dict:
    assert r.status_code == 502, r.text
    err = r.json()["error"]
    assert err["code"] == "upstream_unavailable"
    return err


def test_the_connector_says_why_it_cannot_pull(md, http, owui, monkeypatch, capsys):
    connect(md, owui.url, "wrong-key")
    err = upstream_error(http.post(md.url + "/clawd/openwebui/pull"))
    assert "refused the API key" in err["message"]
    assert http.get(md.url + "/clawd/status").json()["openwebui"]["last_error"] == err["message"]
    monkeypatch.setenv("CLAWD_HOME", str(md.home))
    monkeypatch.setenv("CLAWD_SERVER_PORT", str(md.state.port))
    assert cli.main(["status"]) == 0
    assert f"open webui  {owui.url}: NOT PULLING: Open WebUI refused the API key" in capsys.readouterr().out
    owui.close()
    connect(md, owui.url, FakeOpenWebUI.ADMIN)
    assert "cannot reach Open WebUI" in upstream_error(http.post(md.url + "/clawd/openwebui/pull"))["message"]


def test_the_daemon_pulls_at_once_when_its_settings_change(md, http, owui):
    tid, _ = say(md, http, QUESTION, **owui_headers("chat-a", "msg-a"))
    owui.records["fb-a"] = record("msg-a", -1, fid="fb-a", updated_at=100)
    md.state.openwebui.settings = OpenWebUISettings(url=owui.url, api_key=FakeOpenWebUI.ADMIN, poll_s=1.0)
    md.state.openwebui.poke()
    deadline = time.monotonic() + 20
    while feedback_rows(md, tid) != [("down", None, "fb-a")]:
        assert time.monotonic() < deadline, "the connector never pulled"
        threading.Event().wait(0.05)


def test_clawd_connect_openwebui_checks_and_writes_the_config(md, owui, monkeypatch, capsys):
    monkeypatch.setenv("CLAWD_HOME", str(md.home))
    assert cli.main(["connect", "openwebui", "--url", owui.url + "/", "--api-key", FakeOpenWebUI.ADMIN]) == 0
    out = capsys.readouterr().out
    assert "an admin's" in out and '"X-OpenWebUI-Message-Id": "{{MESSAGE_ID}}"' in out
    text = (md.home / "config.toml").read_text()
    assert f'url = "{owui.url}"' in text and f'api_key = "{FakeOpenWebUI.ADMIN}"' in text
    assert cli.main(["connect", "openwebui", "--url", owui.url, "--api-key", "nope"]) == 1
    assert "refused the API key" in capsys.readouterr().err
    assert cli.main(["connect", "openwebui", "--url", "localhost:3000"]) == 1
    assert "http(s) address" in capsys.readouterr().err
