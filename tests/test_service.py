"""`clawd service`: the rendered systemd unit and launchd plist are valid and absolute,
install / uninstall write and remove the right file and run the right commands (against a
temporary HOME and a fake command runner: the real home and service manager are never
touched), --dry-run changes nothing, and a `clawd serve` stopped by SIGTERM (what
`systemctl stop` sends) ends its stream properly, keeps its turns whole and exits 0."""

from __future__ import annotations

import json
import os
import plistlib
import shutil
import signal
import sqlite3
import subprocess
import sys
import tomllib
from fnmatch import fnmatch
from importlib import resources
from pathlib import Path

import httpx
import pytest

from clawd import service
from clawd.service import CommandResult
from tests.conftest import ROOT, ServeProcess, make_env

CLAWD_EXE = str(Path(sys.executable).parent / "clawd")  # the venv's entry point: exists, absolute


class FakeRunner:
    """Records every command; answers from a table of argv-prefix -> CommandResult."""

    def __init__(self, answers: dict[tuple[str, ...], CommandResult] | None = None):
        self.calls: list[list[str]] = []
        self.answers = answers or {}

    def __call__(self, argv, *, capture: bool = True, **_) -> CommandResult:
        self.calls.append(list(argv))
        for prefix, result in self.answers.items():
            if tuple(argv[: len(prefix)]) == prefix:
                return result
        return CommandResult(0)


@pytest.fixture
def user_env(tmp_path) -> dict[str, str]:
    home = tmp_path / "home"
    home.mkdir()
    return {"HOME": str(home), "USER": "tester", "PATH": "/usr/local/bin:/usr/bin:relative/bin:/bin"}


def unit_entries(text: str) -> dict[str, list[str]]:
    """`Section.Key` -> values (systemd keys may repeat, so not configparser)."""
    out: dict[str, list[str]] = {}
    section = ""
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        key, _, value = line.partition("=")
        out.setdefault(f"{section}.{key}", []).append(value)
    return out


# ---- rendering -------------------------------------------------------------------------------

def test_systemd_unit_is_absolute_and_complete(user_env):
    env = {**user_env, "CLAWD_HOME": "~/clawd home", "XDG_DATA_HOME": "/data/xdg", "XDG_CACHE_HOME": "rel"}
    path, text = service.render("linux", CLAWD_EXE, env)
    assert path == Path(user_env["HOME"]) / ".config" / "systemd" / "user" / "clawd.service"
    e = unit_entries(text)
    assert e["Service.ExecStart"] == [f"{CLAWD_EXE} serve"]
    assert e["Service.Restart"] == ["on-failure"]
    assert e["Install.WantedBy"] == ["default.target"]
    envs = dict(v.strip('"').split("=", 1) for v in e["Service.Environment"])
    # The executable's directory first, then the caller's PATH minus relative entries.
    assert envs["PATH"].split(":") == [str(Path(CLAWD_EXE).parent), "/usr/local/bin", "/usr/bin", "/bin"]
    assert envs["CLAWD_HOME"] == f"{user_env['HOME']}/clawd home"  # ~ expanded here, not by systemd
    assert envs["XDG_DATA_HOME"] == "/data/xdg" and "XDG_CACHE_HOME" not in envs  # relative XDG ignored
    assert "~" not in text.split("[Unit]", 1)[1]
    for bad in ("sh -c", "bash", "$(", "sudo", "User="):  # no inline shell, never a system unit
        assert bad not in text.split("[Unit]", 1)[1]


def test_systemd_unit_without_clawd_home_and_xdg_config_home(user_env):
    env = {**user_env, "XDG_CONFIG_HOME": "/cfg"}
    path, text = service.render("linux", CLAWD_EXE, env)
    assert path == Path("/cfg/systemd/user/clawd.service")
    assert "CLAWD_HOME" not in text


def test_systemd_unit_quotes_odd_paths(user_env, tmp_path):
    odd = tmp_path / "dir with space & 100%"
    exe = odd / "clawd"
    env = {**user_env, "CLAWD_HOME": str(odd / "state")}
    _, text = service.render("linux", str(exe), env)
    e = unit_entries(text)
    assert e["Service.ExecStart"] == [f'"{str(exe).replace("%", "%%")}" serve']
    assert f'"CLAWD_HOME={str(odd).replace("%", "%%")}/state"' in e["Service.Environment"]


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_systemd_analyze_verifies_the_unit(user_env, tmp_path):
    _, text = service.render("linux", CLAWD_EXE, {**user_env, "CLAWD_HOME": str(tmp_path / "c")})
    unit = tmp_path / "verify" / "clawd.service"
    unit.parent.mkdir()
    unit.write_text(text)
    runtime = tmp_path / "runtime"
    runtime.mkdir(mode=0o700)
    env = {**os.environ, "XDG_RUNTIME_DIR": str(runtime), "HOME": user_env["HOME"]}
    p = subprocess.run(["systemd-analyze", "--user", "verify", str(unit)], capture_output=True, text=True,
                       env=env, timeout=60)
    assert p.returncode == 0 and not (p.stdout + p.stderr).strip(), p.stdout + p.stderr


def test_launchd_plist_is_absolute_and_complete(user_env):
    env = {**user_env, "HOME": user_env["HOME"] + "/odd & <chars>", "CLAWD_HOME": "/srv/clawd"}
    path, text = service.render("darwin", CLAWD_EXE, env)
    home = env["HOME"]
    assert path == Path(home) / "Library" / "LaunchAgents" / "ai.clawd.daemon.plist"
    plist = plistlib.loads(text.encode())
    assert plist["Label"] == "ai.clawd.daemon" == path.stem
    assert plist["ProgramArguments"] == [CLAWD_EXE, "serve"]
    assert plist["RunAtLoad"] is True
    assert plist["KeepAlive"] == {"SuccessfulExit": False}
    # With CLAWD_HOME every file of clawd, logs included, lives under it (paths.py).
    assert plist["StandardOutPath"] == "/srv/clawd/state/logs/clawd.out.log"
    assert plist["StandardErrorPath"] == "/srv/clawd/state/logs/clawd.err.log"
    assert plist["WorkingDirectory"] == home
    assert plist["EnvironmentVariables"]["CLAWD_HOME"] == "/srv/clawd"
    assert plist["EnvironmentVariables"]["PATH"].startswith(str(Path(CLAWD_EXE).parent) + ":")

    def strings(v):
        if isinstance(v, str):
            yield v
        elif isinstance(v, dict):
            for x in v.values():
                yield from strings(x)
        elif isinstance(v, list):
            for x in v:
                yield from strings(x)

    for s in strings(plist):
        assert "~" not in s and "$" not in s and "@" not in s, s  # launchd expands neither ~ nor $HOME
    for key in ("StandardOutPath", "StandardErrorPath", "WorkingDirectory"):
        assert os.path.isabs(plist[key])


def test_launchd_logs_default_to_library_logs(user_env):
    _, text = service.render("darwin", CLAWD_EXE, user_env)
    plist = plistlib.loads(text.encode())
    assert plist["StandardOutPath"] == f"{user_env['HOME']}/Library/Logs/clawd/clawd.out.log"
    assert "CLAWD_HOME" not in plist["EnvironmentVariables"]


def test_render_refuses_relative_executable_and_other_platforms(user_env):
    from clawd.errors import ClawdError

    with pytest.raises(ClawdError, match="absolute"):
        service.render("linux", "clawd", user_env)
    with pytest.raises(ClawdError, match="Linux .systemd. and macOS"):
        service.render("win32", CLAWD_EXE, user_env)


def test_repository_examples_are_current_renderings():
    for platform, rel in service.EXAMPLES.items():
        assert (ROOT / rel).read_text() == service.render_example(platform), \
            f"{rel} is stale: run `python -m clawd.service`"


def test_templates_ship_as_package_data():
    # Read through importlib.resources (works in a wheel), and covered by pyproject's package-data.
    units = resources.files("clawd").joinpath("units")
    names = sorted(p.name for p in units.iterdir() if p.is_file())
    assert names == ["ai.clawd.daemon.plist", "clawd.service"]
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["clawd"]
    assert all(any(fnmatch(f"units/{n}", p) for p in patterns) for n in names)


# ---- install / uninstall / status / logs -----------------------------------------------------------

def test_install_and_uninstall_systemd(user_env):
    runner = FakeRunner({("loginctl",): CommandResult(0, "Linger=no\n")})
    out: list[str] = []
    rc = service.install("linux", user_env, clawd_executable=CLAWD_EXE, runner=runner, echo=out.append, uid=1000)
    assert rc == 0
    path, text = service.render("linux", CLAWD_EXE, user_env)
    assert path.read_text() == text
    assert runner.calls == [
        ["systemctl", "--user", "daemon-reload"],
        ["systemctl", "--user", "enable", "--now", "clawd.service"],
        ["loginctl", "show-user", "tester", "-p", "Linger"],
    ]
    joined = "\n".join(out)
    assert "lingering is off" in joined and "    loginctl enable-linger tester" in out
    assert not any("sudo" in " ".join(c) for c in runner.calls)

    # Installing again unchanged: no restart; changed (clawd moved): the running unit restarts.
    runner.calls.clear()
    service.install("linux", user_env, clawd_executable=CLAWD_EXE, runner=runner, echo=out.append, uid=1000)
    assert ["systemctl", "--user", "restart", "clawd.service"] not in runner.calls
    runner.calls.clear()
    moved = str(Path(CLAWD_EXE).parent.parent / "elsewhere" / "clawd")
    service.install("linux", user_env, clawd_executable=moved, runner=runner, echo=out.append, uid=1000)
    assert ["systemctl", "--user", "restart", "clawd.service"] in runner.calls

    runner.calls.clear()
    assert service.uninstall("linux", user_env, runner=runner, echo=out.append, uid=1000) == 0
    assert not path.exists()
    assert runner.calls == [["systemctl", "--user", "disable", "--now", "clawd.service"],
                            ["systemctl", "--user", "daemon-reload"]]
    runner.calls.clear()
    out.clear()
    assert service.uninstall("linux", user_env, runner=runner, echo=out.append, uid=1000) == 0
    assert runner.calls == [] and "not installed" in out[0]


def test_install_reports_linger_on(user_env):
    runner = FakeRunner({("loginctl",): CommandResult(0, "Linger=yes\n")})
    out: list[str] = []
    service.install("linux", user_env, clawd_executable=CLAWD_EXE, runner=runner, echo=out.append, uid=1000)
    assert any("lingering is on" in line for line in out)
    assert not any("enable-linger" in line for line in out)


def test_install_failures_are_reported(user_env):
    out: list[str] = []
    bus = FakeRunner({("systemctl", "--user", "enable"): CommandResult(1, "", "Failed to connect to bus\n")})
    assert service.install("linux", user_env, clawd_executable=CLAWD_EXE, runner=bus, echo=out.append) == 1
    assert any("Failed to connect to bus" in line for line in out)
    assert service.unit_path("linux", user_env).is_file()  # written; a rerun is idempotent

    out.clear()
    missing = FakeRunner({("systemctl",): CommandResult(127, "", "systemctl: command not found")})
    assert service.install("linux", user_env, clawd_executable=CLAWD_EXE, runner=missing, echo=out.append) == 1
    assert any("not available" in line for line in out)


def test_install_and_uninstall_launchd(user_env):
    runner = FakeRunner()
    out: list[str] = []
    assert service.install("darwin", user_env, clawd_executable=CLAWD_EXE, runner=runner, echo=out.append,
                           uid=501) == 0
    path = Path(user_env["HOME"]) / "Library" / "LaunchAgents" / "ai.clawd.daemon.plist"
    assert plistlib.loads(path.read_bytes())["ProgramArguments"] == [CLAWD_EXE, "serve"]
    assert (Path(user_env["HOME"]) / "Library" / "Logs" / "clawd").is_dir()  # launchd will not create it
    assert runner.calls == [["launchctl", "bootout", "gui/501/ai.clawd.daemon"],
                            ["launchctl", "bootstrap", "gui/501", str(path)]]
    runner.calls.clear()
    assert service.uninstall("darwin", user_env, runner=runner, echo=out.append, uid=501) == 0
    assert runner.calls == [["launchctl", "bootout", "gui/501/ai.clawd.daemon"]] and not path.exists()


def test_dry_run_writes_and_runs_nothing(user_env):
    out: list[str] = []
    runner = FakeRunner()
    assert service.install("linux", user_env, clawd_executable=CLAWD_EXE, runner=runner, echo=out.append,
                           dry_run=True) == 0
    assert runner.calls == []
    assert list(Path(user_env["HOME"]).iterdir()) == []
    path, text = service.render("linux", CLAWD_EXE, user_env)
    joined = "\n".join(out)
    assert f"would write {path}:" in joined and f"    ExecStart={CLAWD_EXE} serve" in joined
    assert "would run: systemctl --user daemon-reload" in joined
    assert "would run: systemctl --user enable --now clawd.service" in joined
    assert "would run: loginctl show-user tester -p Linger" in joined

    out.clear()
    assert service.logs("linux", user_env, runner=runner, echo=out.append, dry_run=True) == 0
    assert out == ["would run: journalctl --user -u clawd -f"] and runner.calls == []


def test_status_and_logs(user_env):
    runner = FakeRunner()
    st = service.status("linux", user_env, runner=runner)
    assert not st.installed and not st.active and runner.calls == []  # nothing to ask systemd about

    service.install("linux", user_env, clawd_executable=CLAWD_EXE, runner=runner, echo=lambda _: None)
    runner = FakeRunner({("systemctl", "--user", "is-enabled"): CommandResult(0, "enabled\n"),
                         ("systemctl", "--user", "is-active"): CommandResult(0, "active\n"),
                         ("loginctl",): CommandResult(0, "Linger=yes\n")})
    st = service.status("linux", user_env, runner=runner)
    assert (st.installed, st.enabled, st.state, st.active, st.linger) == (True, "enabled", "active", True, True)
    failed = FakeRunner({("systemctl", "--user", "is-active"): CommandResult(3, "failed\n")})
    st = service.status("linux", user_env, runner=failed)
    assert st.state == "failed" and not st.active and any("clawd service logs" in n for n in st.notes)

    service.logs("linux", user_env, runner=runner, follow=False)
    assert runner.calls[-1] == ["journalctl", "--user", "-u", "clawd", "-n", "200", "--no-pager"]
    service.logs("darwin", user_env, runner=runner)
    logs = Path(user_env["HOME"]) / "Library" / "Logs" / "clawd"
    assert runner.calls[-1] == ["tail", "-n", "100", "-F", str(logs / "clawd.out.log"), str(logs / "clawd.err.log")]

    mac = FakeRunner({("launchctl", "print"): CommandResult(0, "gui/501/ai.clawd.daemon = {\n\tstate = running\n"
                                                              "\tpid = 4242\n}\n")})
    service.install("darwin", user_env, clawd_executable=CLAWD_EXE, runner=mac, echo=lambda _: None, uid=501)
    st = service.status("darwin", user_env, runner=mac, uid=501)
    assert (st.state, st.pid, st.active) == ("running", 4242, True)


def test_cli_dry_run(tmp_path, clawd_home):
    home = tmp_path / "fake-home"
    home.mkdir()
    env = make_env(clawd_home, HOME=str(home))
    env.pop("XDG_CONFIG_HOME", None)
    p = subprocess.run([sys.executable, "-m", "clawd.cli", "service", "install", "--dry-run"], env=env, cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert list(home.iterdir()) == []  # nothing written, nothing run
    target = service.unit_path(sys.platform, env)
    assert f"would write {target}:" in p.stdout and "would run: " in p.stdout
    assert f"CLAWD_HOME={clawd_home}" in p.stdout
    p = subprocess.run([sys.executable, "-m", "clawd.cli", "service", "status", "--json"], env=env, cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 3 and json.loads(p.stdout)["installed"] is False


# ---- stopping the service ----------------------------------------------------------------------

def test_sigterm_during_stream_ends_it_cleanly(clawd_home, tiny_gguf):
    """`systemctl stop` / `launchctl bootout` send SIGTERM: the stream in flight gets a
    finish chunk and [DONE] (generation is cut within a token, not at the grace timeout),
    the turn is logged whole, and the process exits 0."""
    serve = ServeProcess(clawd_home, "--model", str(tiny_gguf), env_extra={"CLAWD_MINING_ENABLED": 0})
    lines: list[str] = []
    sent = False
    try:
        url = serve.wait_ready()
        body = {"model": "tiny-llama", "stream": True, "max_tokens": 400, "temperature": 1.0, "seed": 1,
                "messages": [{"role": "user", "content": "tell me everything"}]}
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=30) as r:
            turn_id = r.headers["x-clawd-turn-id"]
            for line in r.iter_lines():  # a hang here fails on the 30 s read timeout
                if not line:
                    continue
                lines.append(line)
                if not sent and '"content":"' in line and '"content":""' not in line:
                    serve.proc.send_signal(signal.SIGTERM)
                    sent = True
        code, out = serve.finish(timeout=30)
    finally:
        serve.kill()
    assert sent and code == 0, out
    events = [ln.removeprefix("data: ") for ln in lines if ln.startswith("data: ")]
    assert events[-1] == "[DONE]", lines[-5:]
    finish = json.loads(events[-2])["choices"][0]
    assert finish["delta"] == {} and finish["finish_reason"] in ("stop", "length")
    con = sqlite3.connect(clawd_home / "data" / "clawd.db")
    try:
        row = con.execute("SELECT length(response_ids), length(response_logprobs), finish_reason FROM turns "
                          "WHERE id = ?", (turn_id,)).fetchone()
    finally:
        con.close()
    if row is not None:  # logged whole or not at all
        n_ids, n_lps, reason = row
        assert n_ids == n_lps > 0 and reason in ("stop", "length", "cancelled")
