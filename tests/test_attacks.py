"""Attacks on a real daemon over HTTP, as a web page in the user's browser or another local user
would make them (issue 18): cross-site text/plain and foreign-Origin POSTs, DNS rebinding (a
foreign Host), writes from loopback without the token, export path traversal. Each is refused
with its 4xx, and nothing is written: not in the clawd home, not outside it, not in the
database. Plus the file modes that keep other local users out, and the two opt-ins
(server.trust_loopback, server.allowed_origins)."""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

import httpx
import pytest

from clawd import cli
from clawd.paths import ensure_dirs, resolve_paths
from tests.conftest import AUTH, TEST_TOKEN, make_env, start_daemon
from tests.test_tui_adapters import ENV, chat, make_adapter

EVIL = "http://evil.example"


async def _db_dump(db) -> dict[str, list]:
    """Every row of every table: equal dumps mean the request changed nothing in the store."""
    async with db.conn.execute("SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name") as cur:
        names = [r[0] for r in await cur.fetchall()]
    out = {}
    for name in names:
        async with db.conn.execute(f'SELECT * FROM "{name}"') as cur:
            out[name] = [tuple(r) for r in await cur.fetchall()]
    return out


def _files(root: Path) -> dict[str, tuple[int, int]]:
    """Every file under root (but the database, which SQLite touches on reads) with size and mtime."""
    return {
        str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in root.rglob("*")
        if not p.name.startswith("clawd.db") and p.name != "tui.log" and (p.is_file() or p.is_symlink())
    }


class World:
    """What an attack could change: the home's files, a folder outside it, the store, and
    what the daemon serves and runs."""

    def __init__(self, d, outside: Path):
        self.d, self.outside = d, outside

    def snapshot(self) -> tuple:
        d = self.d
        return (
            _files(d.home),
            _files(self.outside),
            d.run(_db_dump(d.state.db)),
            d.state.model.active_adapter,
            d.state.scheduler.status.state,
        )


@pytest.fixture(scope="module")
def target(tmp_path_factory, tiny_gguf):
    """A tiny llama.cpp daemon with a real adapter (ad-one, active), a turn and a session:
    every state-changing route has something it could change."""
    from clawd.engines.llamacpp import Engine

    home = tmp_path_factory.mktemp("attacked") / "home"
    home.mkdir()
    d = start_daemon(home, Engine(tiny_gguf, n_ctx=256, n_threads=1, model_id="tiny"), ENV)
    turn = chat(d, "question?")
    make_adapter(d, tmp_path_factory.mktemp("lora"), "ad-one", seed=1, parent_id=None, signals=[turn])
    d.run(d.state.registry.activate("ad-one"))
    outside = tmp_path_factory.mktemp("outside")
    (outside / "precious.txt").write_text("keep me")
    yield d, World(d, outside), turn
    d.stop()


def writes(d, turn: str) -> list[tuple[str, str, dict]]:
    """Every state-changing route, with a body that would change something if let through."""
    session = d.run(d.state.db.conn.execute_fetchall("SELECT session_id FROM turns LIMIT 1"))[0][0]
    return [
        ("POST", "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}),
        ("POST", "/clawd/feedback", {"turn_id": turn, "rating": "down", "correction": "say it better"}),
        ("POST", f"/clawd/signals/{turn}/veto", {}),
        ("DELETE", f"/clawd/sessions/{session}", {}),
        ("POST", "/clawd/adapters/base/activate", {}),
        ("POST", "/clawd/adapters/rollback", {}),
        ("POST", "/clawd/adapters/ad-one/export", {"name": "pwned.gguf"}),
        ("POST", "/clawd/training", {}),
        ("POST", "/clawd/training/stop", {}),
    ]


def assert_refused(r: httpx.Response, status: int, code: str | None = None) -> None:
    assert r.status_code == status, f"{r.request.method} {r.request.url.path}: {r.status_code} {r.text}"
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    if code:
        assert err["code"] == code, err


def test_loopback_writes_need_the_token(target):
    """Other local users reach loopback too: no token (or a wrong one), no write."""
    d, world, turn = target
    before = world.snapshot()
    with httpx.Client(base_url=d.url, timeout=30) as bare:
        for method, path, body in writes(d, turn):
            for headers in ({}, {"Authorization": "Bearer clawd-wrong"}, {"Authorization": TEST_TOKEN}):
                r = bare.request(method, path, json=body, headers=headers)
                assert_refused(r, 401, "invalid_api_key")
                assert r.headers["www-authenticate"] == "Bearer"
        # reading needs it too: every conversation is behind it
        for path in ("/clawd/sessions", f"/clawd/turns/{turn}", "/clawd/status", "/v1/models"):
            assert_refused(bare.get(path), 401, "invalid_api_key")
        assert bare.get("/clawd/health").status_code == 200  # open: says nothing about the user
    assert world.snapshot() == before


def test_cross_site_text_plain_post_is_refused(target):
    """A page can POST text/plain cross-site without a preflight: refused whatever else it has,
    415 even with the token (a body that is not declared JSON is never parsed)."""
    d, world, turn = target
    before = world.snapshot()
    with httpx.Client(base_url=d.url, timeout=30) as bare:
        for method, path, body in writes(d, turn):
            content = httpx.Request("POST", "/", json=body or {"x": 1}).content  # JSON text, declared otherwise
            for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", ""):
                headers = {"Content-Type": ctype} if ctype else {}
                r = bare.request(method, path, content=content, headers={**AUTH, **headers})
                assert_refused(r, 415, "unsupported_media_type")
                # as the browser sends it: with its Origin, without the token
                r = bare.request(method, path, content=content, headers={**headers, "Origin": EVIL})
                assert_refused(r, 403, "forbidden_origin")
    assert world.snapshot() == before


def test_foreign_origin_is_refused(target):
    """A state-changing request from another site's page is refused even with the token;
    reading is left to the browser's same-origin rule (no CORS header is ever sent)."""
    d, world, turn = target
    before = world.snapshot()
    with d.client() as c:
        for method, path, body in writes(d, turn):
            for origin in (EVIL, "null", f"http://127.0.0.1:{d.state.port + 1}", f"https://127.0.0.1:{d.state.port}"):
                assert_refused(c.request(method, path, json=body, headers={"Origin": origin}), 403, "forbidden_origin")
        r = c.get("/clawd/sessions", headers={"Origin": EVIL})
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
    assert world.snapshot() == before


def test_foreign_host_is_refused(target):
    """DNS rebinding: a page at evil.example whose name now resolves to 127.0.0.1 sends Host:
    evil.example. Refused before anything else, even with the token."""
    d, world, turn = target
    before = world.snapshot()
    port = d.state.port
    with d.client() as c:
        for host in ("evil.example", f"evil.example:{port}", "127.0.0.1.evil.example", "localhost.evil.example", ""):
            assert_refused(c.get("/clawd/sessions", headers={"Host": host}), 400)
            assert_refused(c.get("/clawd/health", headers={"Host": host}), 400)
            for method, path, body in writes(d, turn):
                assert_refused(c.request(method, path, json=body, headers={"Host": host}), 400)
        for host in (f"127.0.0.1:{port}", f"localhost:{port}", "localhost", f"[::1]:{port}", f"LOCALHOST:{port}"):
            assert c.get("/clawd/sessions", headers={"Host": host}).status_code == 200, host
    assert world.snapshot() == before


BAD_NAMES = [
    "../pwned.gguf",
    "../../outside.gguf",
    "/tmp/pwned.gguf",
    "~/pwned.gguf",
    "~",
    "a\x00b.gguf",
    "a/b.gguf",
    "a\\b.gguf",
    "..",
    ".",
    ".hidden",
    "",
    "x" * 129,
    "name with spaces",
    "ünïcode",
]


def test_export_names_cannot_leave_the_exports_folder(target):
    d, world, _ = target
    outside = world.outside
    before = world.snapshot()
    with d.client() as c:
        for name in BAD_NAMES + [str(outside / "precious.txt"), str(outside / "new.gguf")]:
            r = c.post("/clawd/adapters/ad-one/export", json={"format": "gguf", "name": name, "force": True})
            assert_refused(r, 400)
            assert r.json()["error"]["param"] == "name", r.text
        # the old body named any path: its key is refused outright, not ignored
        for body in ({"path": str(outside / "precious.txt")}, {"name": "ok.gguf", "path": "/tmp/x"}, {}):
            assert_refused(c.post("/clawd/adapters/ad-one/export", json=body), 400)
    assert world.snapshot() == before
    assert (outside / "precious.txt").read_text() == "keep me"
    assert list(Path(d.state.exports_dir).iterdir()) == []


def test_export_writes_under_exports_and_never_overwrites_without_force(target):
    d, world, _ = target
    exports = Path(d.state.exports_dir)
    adapter = Path(d.state.registry.dir) / "ad-one" / "adapter.gguf"
    with d.client() as c:
        r = c.post("/clawd/adapters/ad-one/export", json={"name": "mine.gguf"})
        assert r.status_code == 200, r.text
        assert r.json() == {"adapter_id": "ad-one", "format": "gguf", "path": str(exports / "mine.gguf")}
        assert (exports / "mine.gguf").read_bytes() == adapter.read_bytes()
        (exports / "mine.gguf").write_bytes(b"the user's own edit")
        r = c.post("/clawd/adapters/ad-one/export", json={"name": "mine.gguf"})
        assert_refused(r, 409, "already_exists")
        assert (exports / "mine.gguf").read_bytes() == b"the user's own edit"
        r = c.post("/clawd/adapters/ad-one/export", json={"name": "mine.gguf", "force": True})
        assert r.status_code == 200 and (exports / "mine.gguf").read_bytes() == adapter.read_bytes()
    assert sorted(p.name for p in exports.iterdir()) == ["mine.gguf"]  # no partial files left
    (exports / "mine.gguf").unlink()


def test_cli_export_writes_any_path_the_user_names(target, tmp_path, monkeypatch, capsys):
    """The CLI, not the HTTP body, names the destination: anywhere the user may write."""
    d, _, _ = target
    adapter = Path(d.state.registry.dir) / "ad-one" / "adapter.gguf"
    monkeypatch.setenv("CLAWD_HOME", str(d.home))
    monkeypatch.setenv("CLAWD_SERVER_PORT", str(d.state.port))
    dest = tmp_path / "deep" / "er" / "ad-one.gguf"
    assert cli.main(["adapters", "export", "ad-one", "--out", str(dest)]) == 0
    assert capsys.readouterr().out.strip() == f"exported ad-one as gguf to {dest}"
    assert dest.read_bytes() == adapter.read_bytes()
    dest.write_bytes(b"keep")
    assert cli.main(["adapters", "export", "ad-one", "--out", str(dest)]) == 1
    assert "--force" in capsys.readouterr().err and dest.read_bytes() == b"keep"
    assert cli.main(["adapters", "export", "ad-one", "--out", str(dest), "--force"]) == 0
    assert dest.read_bytes() == adapter.read_bytes()
    assert list(Path(d.state.exports_dir).iterdir()) == []  # the daemon's copy was moved, not left


def test_openapi_documents_the_refusals(target):
    d, _, _ = target
    spec = httpx.get(d.url + "/openapi.json", timeout=30).json()  # open: no token
    for path, ops in spec["paths"].items():
        for method, op in ops.items():
            for status in ("400", "401", "403", "415"):
                assert status in op["responses"], (method, path, status)
    export = spec["paths"]["/clawd/adapters/{adapter_id}/export"]["post"]
    assert "409" in export["responses"]
    assert export["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/ExportRequest")


# --- file modes ---------------------------------------------------------------------------------


def _mode(p: Path) -> int:
    return stat.S_IMODE(p.lstat().st_mode)


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX modes")
def test_files_are_private_to_the_user(clawd_home):
    """Other local users can read nothing: the dirs are 0700, the database and token 0600,
    whatever the umask, and an install made before (0755 / 0644) is fixed at start-up."""
    from clawd.engines.fake import Engine

    env = make_env(clawd_home)
    paths = resolve_paths(env)
    old = os.umask(0o022)
    try:
        # an install from before: world-readable everything
        for p in (paths.config_dir, paths.data_dir, paths.state_dir):
            p.mkdir(mode=0o755, parents=True, exist_ok=True)
            os.chmod(p, 0o755)
        paths.db_file.write_bytes(b"")  # SQLite takes an empty file as a new database
        paths.token_file.write_text(TEST_TOKEN + "\n")
        for f in (paths.db_file, paths.token_file):
            os.chmod(f, 0o644)
        ensure_dirs(paths)
        d = start_daemon(clawd_home, Engine(n_ctx=512))
    finally:
        os.umask(old)
    try:
        with d.client() as c:
            assert (
                c.post(
                    "/v1/chat/completions", json={"model": "fake-model", "messages": [{"role": "user", "content": "x"}]}
                ).status_code
                == 200
            )
        for p in (
            paths.config_dir,
            paths.data_dir,
            paths.state_dir,
            paths.cache_dir,
            paths.exports_dir,
            paths.adapters_dir,
            paths.log_dir,
        ):
            assert _mode(p) == 0o700, p
        wal = paths.db_file.with_name("clawd.db-wal")
        shm = paths.db_file.with_name("clawd.db-shm")
        assert wal.exists() and shm.exists()  # WAL mode: SQLite made them, with the db's mode
        for f in (paths.db_file, wal, shm, paths.token_file):
            assert _mode(f) == 0o600, f
    finally:
        d.stop()


def test_a_new_home_is_private_from_the_start(tmp_path):
    from clawd.engines.fake import Engine

    home = tmp_path / "fresh"
    old = os.umask(0o022)
    try:
        d = start_daemon(home, Engine(n_ctx=512))
    finally:
        os.umask(old)
    try:
        paths = resolve_paths(make_env(home))
        assert _mode(paths.data_dir) == 0o700 and _mode(paths.db_file) == 0o600
        assert _mode(paths.token_file) == 0o600
    finally:
        d.stop()


# --- the opt-ins --------------------------------------------------------------------------------


def test_trust_loopback_lets_loopback_in_without_the_token(clawd_home):
    from clawd.engines.fake import Engine

    d = start_daemon(clawd_home, Engine(n_ctx=512), {"CLAWD_SERVER_TRUST_LOOPBACK": 1})
    body = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "temperature": 0}
    try:
        with httpx.Client(base_url=d.url, timeout=30) as bare:
            r = bare.post("/v1/chat/completions", json=body)
            assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "You said: hi"
            assert bare.get("/clawd/sessions").status_code == 200
            # the browser checks stay: a page still cannot drive it
            assert_refused(bare.post("/v1/chat/completions", json=body, headers={"Origin": EVIL}), 403)
            assert_refused(bare.get("/clawd/sessions", headers={"Host": "evil.example"}), 400)
            r = bare.post("/v1/chat/completions", content=b"{}", headers={"Content-Type": "text/plain"})
            assert_refused(r, 415)
    finally:
        d.stop()


def test_an_allowed_origin_may_write(clawd_home):
    from clawd.engines.fake import Engine

    d = start_daemon(
        clawd_home, Engine(n_ctx=512), {"CLAWD_SERVER_ALLOWED_ORIGINS": "http://localhost:3000, https://chat.example/"}
    )
    body = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}
    try:
        with d.client() as c:
            for origin in ("http://localhost:3000", "https://chat.example", f"http://127.0.0.1:{d.state.port}"):
                assert c.post("/v1/chat/completions", json=body, headers={"Origin": origin}).status_code == 200, origin
            for origin in ("http://localhost:3001", "https://chat.example.evil", "http://chat.example"):
                assert_refused(c.post("/v1/chat/completions", json=body, headers={"Origin": origin}), 403)
            # an allowed page still needs the token
            r = httpx.post(d.url + "/v1/chat/completions", json=body, headers={"Origin": "http://localhost:3000"})
            assert_refused(r, 401)
    finally:
        d.stop()


def test_host_rules_for_a_wildcard_and_a_named_listen_address():
    """Listening on every interface, LAN clients name this machine by address or name; a
    rebinding page can only send its own name, which stays refused."""
    import socket

    from clawd.guard import Policy, host_name

    assert [host_name(h) for h in ("localhost:8757", "[::1]:80", "::1", "127.0.0.1", "Example.COM.")] == [
        "localhost",
        "::1",
        "::1",
        "127.0.0.1",
        "example.com",
    ]
    wild = Policy(token="t", host="0.0.0.0", port=8757)
    for ok in ("192.168.1.5:8757", "[fe80::1]:8757", "localhost", f"{socket.gethostname()}:8757"):
        assert wild.host_allowed(ok), ok
    for bad in ("evil.example", "192.168.1.5.evil.example", ""):
        assert not wild.host_allowed(bad), bad
    named = Policy(token="t", host="192.168.1.5", port=8757, allowed_origins=" http://a.example/ ,")
    assert named.host_allowed("192.168.1.5:8757") and not named.host_allowed("192.168.1.6:8757")
    assert named.origin_allowed("http://192.168.1.5:8757") and named.origin_allowed("HTTP://A.example")
    assert not named.origin_allowed("http://192.168.1.5:8758") and not named.origin_allowed("")


def test_status_warns_that_require_token_is_deprecated(clawd_home, monkeypatch, capsys):
    from clawd.engines.fake import Engine

    d = start_daemon(clawd_home, Engine(n_ctx=512))
    try:
        monkeypatch.setenv("CLAWD_HOME", str(clawd_home))
        monkeypatch.setenv("CLAWD_SERVER_PORT", str(d.state.port))
        assert cli.main(["status"]) == 0
        assert "deprecated" not in capsys.readouterr().out  # the CLI sent the token: status answered
        monkeypatch.setenv("CLAWD_SERVER_REQUIRE_TOKEN", "true")
        assert cli.main(["status"]) == 0
        assert "warning: server.require_token is deprecated" in capsys.readouterr().out
    finally:
        d.stop()
