"""`clawd service`: the rendered systemd units and launchd plists (the daemon's and the
overnight training trigger's) are valid and absolute, install / uninstall write and remove
the right files and run the right commands (against a
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

import pytest

from clawd import service
from clawd.service import CommandResult
from tests.conftest import ROOT, ServeProcess, authed, make_env

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


def test_training_units_are_absolute_and_complete(user_env):
    env = {**user_env, "CLAWD_HOME": "/srv/clawd", "XDG_DATA_HOME": "/data/xdg"}
    files = service.render_all("linux", CLAWD_EXE, env)
    units = Path(user_env["HOME"]) / ".config" / "systemd" / "user"
    assert [p for p, _ in files] == [
        units / "clawd.service",
        units / "clawd-train.service",
        units / "clawd-train.timer",
    ]
    daemon, train, timer = (unit_entries(text) for _, text in files)
    assert daemon["Service.TimeoutStopSec"] == ["45"]  # the trainer child stops at a checkpoint (~20 s)
    assert train["Service.Type"] == ["oneshot"]
    assert train["Service.ExecStart"] == [f"{CLAWD_EXE} train --now --scheduled"]
    assert (train["Service.Nice"], train["Service.CPUSchedulingPolicy"], train["Service.IOSchedulingClass"]) == (
        ["19"],
        ["idle"],
        ["idle"],
    )
    assert train["Service.Environment"] == daemon["Service.Environment"]  # finds the same daemon and files
    assert "Install.WantedBy" not in train and "Service.Restart" not in train  # started by the timer only
    assert timer["Timer.OnCalendar"] == ["*-*-* 03:00:00"] and timer["Timer.Persistent"] == ["true"]
    assert timer["Timer.Unit"] == ["clawd-train.service"] and timer["Install.WantedBy"] == ["timers.target"]
    for _, text in files[1:]:
        for bad in ("sh -c", "bash", "$(", "sudo", "User=", "~", "@"):  # no inline shell, no placeholder
            assert bad not in text.split("[Unit]", 1)[1], (bad, text)


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_systemd_analyze_verifies_the_units(user_env, tmp_path):
    verify = tmp_path / "verify"
    verify.mkdir()
    for path, text in service.render_all("linux", CLAWD_EXE, {**user_env, "CLAWD_HOME": str(tmp_path / "c")}):
        (verify / path.name).write_text(text)
    runtime = tmp_path / "runtime"
    runtime.mkdir(mode=0o700)
    env = {**os.environ, "XDG_RUNTIME_DIR": str(runtime), "HOME": user_env["HOME"]}
    units = [str(verify / n) for n in ("clawd.service", "clawd-train.service", "clawd-train.timer")]
    p = subprocess.run(
        ["systemd-analyze", "--user", "verify", *units], capture_output=True, text=True, env=env, timeout=60
    )
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


def test_launchd_training_plist(user_env):
    files = service.render_all("darwin", CLAWD_EXE, user_env)
    agents = Path(user_env["HOME"]) / "Library" / "LaunchAgents"
    assert [p for p, _ in files] == [agents / "ai.clawd.daemon.plist", agents / "ai.clawd.train.plist"]
    daemon, train = (plistlib.loads(text.encode()) for _, text in files)
    assert daemon["ExitTimeOut"] == 45
    assert train["Label"] == "ai.clawd.train"
    assert train["ProgramArguments"] == [CLAWD_EXE, "train", "--now", "--scheduled"]
    assert train["ProcessType"] == "Background" and train["LowPriorityIO"] is True
    assert train["Nice"] == 19 and type(train["Nice"]) is int
    assert train["StartCalendarInterval"] == {"Hour": 3, "Minute": 0}
    log = f"{user_env['HOME']}/Library/Logs/clawd/train.log"
    assert train["StandardOutPath"] == train["StandardErrorPath"] == log
    assert train["EnvironmentVariables"] == daemon["EnvironmentVariables"]
    assert train["WorkingDirectory"] == user_env["HOME"]
    assert "RunAtLoad" not in train and "KeepAlive" not in train  # runs at 03:00 only, once


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
    for platform, folder in service.EXAMPLES.items():
        examples = service.render_examples(platform)
        assert sorted(examples) == sorted(p.name for p in (ROOT / folder).iterdir())
        for name, text in examples.items():
            assert (ROOT / folder / name).read_text() == text, (
                f"{folder / name} is stale: run `python -m clawd.service`"
            )


def test_templates_ship_as_package_data():
    # Read through importlib.resources (works in a wheel), and covered by pyproject's package-data.
    units = resources.files("clawd").joinpath("units")
    names = sorted(p.name for p in units.iterdir() if p.is_file())
    assert names == [
        "ai.clawd.daemon.plist",
        "ai.clawd.train.plist",
        "clawd-train.service",
        "clawd-train.timer",
        "clawd.service",
    ]
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["clawd"]
    assert all(any(fnmatch(f"units/{n}", p) for p in patterns) for n in names)


# ---- install / uninstall / status / logs -----------------------------------------------------------


def test_install_and_uninstall_systemd(user_env):
    runner = FakeRunner({("loginctl",): CommandResult(0, "Linger=no\n")})
    out: list[str] = []
    rc = service.install("linux", user_env, clawd_executable=CLAWD_EXE, runner=runner, echo=out.append, uid=1000)
    assert rc == 0
    files = service.render_all("linux", CLAWD_EXE, user_env)
    for p, text in files:
        assert p.read_text() == text
    path = files[0][0]
    assert runner.calls == [
        ["systemctl", "--user", "daemon-reload"],
        ["systemctl", "--user", "enable", "--now", "clawd.service"],
        ["systemctl", "--user", "enable", "--now", "clawd-train.timer"],
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
    assert not any(p.exists() for p, _ in files)
    assert list(path.parent.iterdir()) == []  # no temporary file left behind either
    assert runner.calls == [
        ["systemctl", "--user", "disable", "--now", "clawd-train.timer"],
        ["systemctl", "--user", "stop", "clawd-train.service"],
        ["systemctl", "--user", "disable", "--now", "clawd.service"],
        ["systemctl", "--user", "daemon-reload"],
    ]
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
    assert service.install("darwin", user_env, clawd_executable=CLAWD_EXE, runner=runner, echo=out.append, uid=501) == 0
    agents = Path(user_env["HOME"]) / "Library" / "LaunchAgents"
    path, train = agents / "ai.clawd.daemon.plist", agents / "ai.clawd.train.plist"
    assert plistlib.loads(path.read_bytes())["ProgramArguments"] == [CLAWD_EXE, "serve"]
    assert plistlib.loads(train.read_bytes())["ProgramArguments"] == [CLAWD_EXE, "train", "--now", "--scheduled"]
    assert (Path(user_env["HOME"]) / "Library" / "Logs" / "clawd").is_dir()  # launchd will not create it
    assert runner.calls == [
        ["launchctl", "bootout", "gui/501/ai.clawd.daemon"],
        ["launchctl", "bootout", "gui/501/ai.clawd.train"],
        ["launchctl", "bootstrap", "gui/501", str(path)],
        ["launchctl", "bootstrap", "gui/501", str(train)],
    ]
    runner.calls.clear()
    assert service.uninstall("darwin", user_env, runner=runner, echo=out.append, uid=501) == 0
    assert runner.calls == [
        ["launchctl", "bootout", "gui/501/ai.clawd.train"],
        ["launchctl", "bootout", "gui/501/ai.clawd.daemon"],
    ]
    assert list(agents.iterdir()) == []


def test_uninstall_an_install_that_predates_the_training_units(user_env):
    # Installed by an older clawd: only clawd.service is there; nothing is asked about the others.
    path, text = service.render("linux", CLAWD_EXE, user_env)
    path.parent.mkdir(parents=True)
    path.write_text(text)
    runner = FakeRunner()
    st = service.status("linux", user_env, runner=runner)
    assert st.training == "not installed" and any("clawd service install" in n for n in st.notes)
    assert not any("clawd-train" in " ".join(c) for c in runner.calls)
    runner.calls.clear()
    assert service.uninstall("linux", user_env, runner=runner, echo=lambda _: None) == 0
    assert runner.calls == [
        ["systemctl", "--user", "disable", "--now", "clawd.service"],
        ["systemctl", "--user", "daemon-reload"],
    ]
    assert not path.exists()


def test_dry_run_writes_and_runs_nothing(user_env):
    out: list[str] = []
    runner = FakeRunner()
    assert (
        service.install("linux", user_env, clawd_executable=CLAWD_EXE, runner=runner, echo=out.append, dry_run=True)
        == 0
    )
    assert runner.calls == []
    assert list(Path(user_env["HOME"]).iterdir()) == []
    path, text = service.render("linux", CLAWD_EXE, user_env)
    joined = "\n".join(out)
    assert f"would write {path}:" in joined and f"    ExecStart={CLAWD_EXE} serve" in joined
    assert "would run: systemctl --user daemon-reload" in joined
    assert "would run: systemctl --user enable --now clawd.service" in joined
    assert "would run: systemctl --user enable --now clawd-train.timer" in joined
    assert f"    ExecStart={CLAWD_EXE} train --now --scheduled" in joined
    assert "would run: loginctl show-user tester -p Linger" in joined

    out.clear()
    assert service.uninstall("linux", user_env, runner=runner, echo=out.append, dry_run=True) == 0
    assert runner.calls == [] and list(Path(user_env["HOME"]).iterdir()) == []
    for p in service.unit_paths("linux", user_env):
        assert f"would remove {p}" in out
    assert "would run: systemctl --user disable --now clawd-train.timer" in out

    out.clear()
    assert service.logs("linux", user_env, runner=runner, echo=out.append, dry_run=True) == 0
    assert out == ["would run: journalctl --user -u clawd -u clawd-train -f"] and runner.calls == []


def test_status_and_logs(user_env):
    runner = FakeRunner()
    st = service.status("linux", user_env, runner=runner)
    assert not st.installed and not st.active and runner.calls == []  # nothing to ask systemd about

    service.install("linux", user_env, clawd_executable=CLAWD_EXE, runner=runner, echo=lambda _: None)
    runner = FakeRunner(
        {
            ("systemctl", "--user", "is-enabled"): CommandResult(0, "enabled\n"),
            ("systemctl", "--user", "is-active"): CommandResult(0, "active\n"),
            ("systemctl", "--user", "show", "clawd-train.timer"): CommandResult(
                0, "NextElapseUSecRealtime=Tue 2025-01-14 03:00:00 CET\nUnitFileState=enabled\nActiveState=active\n"
            ),
            ("loginctl",): CommandResult(0, "Linger=yes\n"),
        }
    )
    st = service.status("linux", user_env, runner=runner)
    assert (st.installed, st.enabled, st.state, st.active, st.linger) == (True, "enabled", "active", True, True)
    assert (st.training, st.next_training) == ("enabled, active", "Tue 2025-01-14 03:00:00 CET")
    assert st.notes == ["overnight training: clawd-train.timer enabled, active; next run Tue 2025-01-14 03:00:00 CET"]
    assert st.to_dict()["next_training"] == st.next_training
    assert [
        "systemctl",
        "--user",
        "show",
        "clawd-train.timer",
        "-p",
        "UnitFileState",
        "-p",
        "ActiveState",
        "-p",
        "NextElapseUSecRealtime",
    ] in runner.calls
    disarmed = FakeRunner(
        {
            ("systemctl", "--user", "show"): CommandResult(
                0, "UnitFileState=disabled\nActiveState=inactive\nNextElapseUSecRealtime=\n"
            )
        }
    )
    st = service.status("linux", user_env, runner=disarmed)
    assert (st.training, st.next_training) == ("disabled, inactive", None)
    assert any("systemctl --user enable --now clawd-train.timer" in n for n in st.notes)
    failed = FakeRunner({("systemctl", "--user", "is-active"): CommandResult(3, "failed\n")})
    st = service.status("linux", user_env, runner=failed)
    assert st.state == "failed" and not st.active and any("clawd service logs" in n for n in st.notes)

    service.logs("linux", user_env, runner=runner, follow=False)
    assert runner.calls[-1] == ["journalctl", "--user", "-u", "clawd", "-u", "clawd-train", "-n", "200", "--no-pager"]
    service.logs("darwin", user_env, runner=runner)
    logs = Path(user_env["HOME"]) / "Library" / "Logs" / "clawd"
    assert runner.calls[-1] == ["tail", "-n", "100", "-F", str(logs / "clawd.out.log"), str(logs / "clawd.err.log")]
    logs.mkdir(parents=True)
    (logs / "train.log").write_text("")  # after the first overnight run
    service.logs("darwin", user_env, runner=runner)
    assert runner.calls[-1][-1] == str(logs / "train.log")

    mac = FakeRunner(
        {("launchctl", "print"): CommandResult(0, "gui/501/ai.clawd.daemon = {\n\tstate = running\n\tpid = 4242\n}\n")}
    )
    service.install("darwin", user_env, clawd_executable=CLAWD_EXE, runner=mac, echo=lambda _: None, uid=501)
    st = service.status("darwin", user_env, runner=mac, uid=501)
    assert (st.state, st.pid, st.active, st.training) == ("running", 4242, True, "loaded")
    assert ["launchctl", "print", "gui/501/ai.clawd.train"] in mac.calls
    unloaded = FakeRunner({("launchctl", "print", "gui/501/ai.clawd.train"): CommandResult(113, "", "not found")})
    assert service.status("darwin", user_env, runner=unloaded, uid=501).training == "not loaded"


def test_cli_dry_run(tmp_path, clawd_home):
    home = tmp_path / "fake-home"
    home.mkdir()
    env = make_env(clawd_home, HOME=str(home))
    env.pop("XDG_CONFIG_HOME", None)
    p = subprocess.run(
        [sys.executable, "-m", "clawd.cli", "service", "install", "--dry-run"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 0, p.stderr
    assert list(home.iterdir()) == []  # nothing written, nothing run
    target = service.unit_path(sys.platform, env)
    assert f"would write {target}:" in p.stdout and "would run: " in p.stdout
    assert f"CLAWD_HOME={clawd_home}" in p.stdout
    p = subprocess.run(
        [sys.executable, "-m", "clawd.cli", "service", "status", "--json"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
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
        body = {
            "model": "tiny-llama",
            "stream": True,
            "max_tokens": 400,
            "temperature": 1.0,
            "seed": 1,
            "messages": [{"role": "user", "content": "tell me everything"}],
        }
        with authed.stream("POST", url + "/v1/chat/completions", json=body, timeout=30) as r:
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
        row = con.execute(
            "SELECT length(response_ids), length(response_logprobs), finish_reason FROM turns WHERE id = ?", (turn_id,)
        ).fetchone()
    finally:
        con.close()
    if row is not None:  # logged whole or not at all
        n_ids, n_lps, reason = row
        assert n_ids == n_lps > 0 and reason in ("stop", "length", "cancelled")
