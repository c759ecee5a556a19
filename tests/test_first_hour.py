"""What a new user trips over in the first hour (issue: the first hour): a quiet CLI, `clawd
status` that survives a broken config.toml, and config limits that are the API's limits.
Each runs the real CLI (a subprocess) against a real daemon on the fake engine."""

from __future__ import annotations

import json

import pytest

from clawd.config import TEMPERATURE_MAX, load_settings
from clawd.errors import ConfigError
from clawd.protocol import ChatCompletionRequest
from tests.test_serve_process import clawd


def _port(d) -> str:
    return d.url.rsplit(":", 1)[1]


def test_commands_print_no_http_log_lines_unless_verbose(fake_daemon, clawd_home):
    quiet = clawd(clawd_home, "status", CLAWD_SERVER_PORT=_port(fake_daemon), CLAWD_LOG_LEVEL="info")
    assert quiet.returncode == 0, quiet.stderr
    assert "HTTP Request" not in quiet.stderr and "httpx" not in quiet.stderr
    loud = clawd(clawd_home, "-v", "status", CLAWD_SERVER_PORT=_port(fake_daemon), CLAWD_LOG_LEVEL="info")
    assert loud.returncode == 0 and "HTTP Request: GET" in loud.stderr  # -v brings them back


@pytest.mark.parametrize(
    "bad, named",
    [
        ("[generation]\ntemperature = 5.0\n", "generation.temperature"),  # accepted before; the API refuses it
        ("[generation]\ntop_p = 0.0\n", "generation.top_p"),
        ("[generation\ntemperature = 0.5\n", "invalid TOML"),
        ("[generation]\ntemprature = 0.5\n", "unknown key"),
    ],
)
def test_status_reports_a_broken_config_and_still_finds_the_daemon(fake_daemon, clawd_home, bad, named):
    (clawd_home / "config.toml").write_text(f"[server]\nport = {_port(fake_daemon)}\n{bad}")
    # A file that is not TOML at all says nothing, its port included: that user's daemon is found
    # where the environment (or the default) says.
    env = {"CLAWD_SERVER_PORT": _port(fake_daemon)} if "TOML" in named else {}
    text = clawd(clawd_home, "status", **env)
    assert text.returncode == 0, text.stderr
    assert "config.toml has an error" in text.stdout and named in text.stdout
    assert "fake" in text.stdout  # the running daemon's status is still shown
    data = json.loads(clawd(clawd_home, "status", "--json", **env).stdout)
    assert data["running"] and named in data["config_error"]
    # Every other command still refuses the file with its one-line error.
    other = clawd(clawd_home, "config")
    assert other.returncode == 1 and named in other.stderr


def test_a_good_config_has_no_config_error(fake_daemon, clawd_home):
    (clawd_home / "config.toml").write_text(f"[server]\nport = {_port(fake_daemon)}\n")
    data = json.loads(clawd(clawd_home, "status", "--json").stdout)
    assert data["running"] and data["config_error"] is None


def test_config_limits_are_the_api_limits(tmp_path):
    cfg = tmp_path / "config.toml"
    for value, ok in ((TEMPERATURE_MAX, True), (TEMPERATURE_MAX + 0.5, False)):
        cfg.write_text(f"[generation]\ntemperature = {value}\n")
        api_ok = True
        try:
            ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], temperature=value)
        except ValueError:
            api_ok = False
        try:
            load_settings(cfg, {})
            config_ok = True
        except ConfigError as e:
            config_ok = False
            assert "generation.temperature" in e.message and f"<= {TEMPERATURE_MAX}" in e.message
        assert config_ok == api_ok == ok
