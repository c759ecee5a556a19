"""clawd/client.py, the CLI's way to the daemon: where the daemon is, the bearer token from the
token file, and the one-line errors the CLI prints when no daemon answers or it refuses a
request. A stand-in daemon on loopback records what the CLI sends."""

from __future__ import annotations

import argparse
import json
import os
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from clawd import cli
from clawd.client import DaemonClient, DaemonUnreachable, daemon_url
from clawd.config import load_settings
from clawd.errors import ClawdError
from clawd.paths import ensure_dirs, resolve_paths
from clawd.token import ensure_token


class StandIn:
    """Answers every request with one fixed status and JSON body, and keeps the requests."""

    def __init__(self, status: int, body: dict):
        self.requests: list[dict] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                outer.requests.append({"path": self.path, "auth": self.headers.get("Authorization")})
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.02,), daemon=True)
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def free_port() -> int:
    with socket.socket() as s:  # bound, never listening: nothing answers there afterwards
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def home_env(clawd_home, monkeypatch):
    for k in [k for k in os.environ if k.startswith("CLAWD_")]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("CLAWD_HOME", str(clawd_home))
    return clawd_home


def test_no_daemon_is_one_line_on_stderr_and_exit_1(home_env, monkeypatch, capsys):
    port = free_port()
    monkeypatch.setenv("CLAWD_SERVER_PORT", str(port))
    assert cli.main(["signals", "list"]) == 1
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1, err
    assert err.startswith(f"clawd: error: clawd is not running at 127.0.0.1:{port} (")
    assert err.rstrip().endswith("): start it with `clawd serve`")
    assert cli.main(["status"]) == 3  # status says so on stdout, with its own exit code
    out = capsys.readouterr().out
    assert out.startswith(f"clawd is not running at http://127.0.0.1:{port} (") and "clawd serve" in out


def test_token_file_is_sent_and_the_daemons_error_is_the_message(home_env, monkeypatch, capsys):
    paths = resolve_paths({"CLAWD_HOME": str(home_env)})
    ensure_dirs(paths)
    token = ensure_token(paths.token_file)
    daemon = StandIn(404, {"error": {"message": "no signal for turn t-1"}})
    try:
        monkeypatch.setenv("CLAWD_SERVER_PORT", str(daemon.port))
        assert cli.main(["signals", "show", "t-1"]) == 1
    finally:
        daemon.close()
    assert capsys.readouterr().err == "clawd: error: no signal for turn t-1\n"
    assert daemon.requests == [{"path": "/clawd/signals/t-1", "auth": f"Bearer {token}"}]


def test_waiting_for_the_daemon_ends_at_any_answer(home_env, monkeypatch):
    # A refusal (a wrong token) is an answer: waiting longer cannot help, so it fails at once.
    daemon = StandIn(401, {"error": {"message": "bad token"}})
    try:
        monkeypatch.setenv("CLAWD_SERVER_PORT", str(daemon.port))
        with pytest.raises(ClawdError, match="bad token") as e:
            cli._wait_for_daemon(argparse.Namespace(), 3600)
    finally:
        daemon.close()
    assert not isinstance(e.value, DaemonUnreachable) and len(daemon.requests) == 1
    monkeypatch.setenv("CLAWD_SERVER_PORT", str(free_port()))
    with pytest.raises(DaemonUnreachable):  # nothing answers and no time is left
        cli._wait_for_daemon(argparse.Namespace(), 0)


@pytest.mark.parametrize(
    ("host", "url"),
    [
        ("127.0.0.1", "http://127.0.0.1:9"),
        ("0.0.0.0", "http://127.0.0.1:9"),  # a wildcard listen address is reached on loopback
        ("::", "http://127.0.0.1:9"),
        ("::1", "http://[::1]:9"),
        ("example.lan", "http://example.lan:9"),
    ],
)
def test_daemon_url(host, url):
    settings = load_settings(Path("/nonexistent/config.toml"), {}, {"server.host": host, "server.port": 9})
    assert daemon_url(settings) == url


def test_no_token_no_authorization_header():
    with DaemonClient("http://127.0.0.1:9/") as c:
        assert "authorization" not in c.http.headers and c.base_url == "http://127.0.0.1:9"
    with DaemonClient("http://127.0.0.1:9", token="t") as c:
        assert c.http.headers["authorization"] == "Bearer t"
