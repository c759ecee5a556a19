"""`clawd service`: run the daemon as a per-user service (systemd --user on Linux,
a launchd LaunchAgent on macOS), following CONVENTIONS.md §9-10.

Besides the daemon's unit it installs, and removes, the overnight training trigger (§9-10): a
systemd timer + oneshot service, or a background LaunchAgent, that runs `clawd train --now
--scheduled` at 03:00.

Boundary: this module renders the unit files from their templates, writes or removes them,
and drives systemctl / launchctl / loginctl / journalctl through ONE runner function
(tests inject a fake and a temporary HOME). Everything it needs from the environment
(HOME, XDG_*, CLAWD_HOME, PATH, USER) arrives as a mapping; it never uses sudo and never
installs a system-wide unit.

Where the templates live: the canonical templates are package data in `clawd/units/`,
read with importlib.resources, so `clawd service install` finds them in an editable
install and in a wheel alike (setuptools cannot ship the repository's top-level folders
inside the package). The top-level `systemd/` and `launchd/` folders hold example
renderings of them, produced by `write_examples()` (`python -m clawd.service`), and a
test fails when they fall out of date.
"""

from __future__ import annotations

import os
import plistlib
import pwd
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from clawd.config import SPECS, env_var
from clawd.errors import ClawdError
from clawd.paths import resolve_paths

UNIT_NAME = "clawd.service"
TRAIN_UNIT = "clawd-train.service"
TIMER_UNIT = "clawd-train.timer"
LABEL = "ai.clawd.daemon"
TRAIN_LABEL = "ai.clawd.train"
# The files `clawd service install` writes, the daemon's first; each is a template in clawd/units/.
UNIT_FILES = {"systemd": (UNIT_NAME, TRAIN_UNIT, TIMER_UNIT), "launchd": (f"{LABEL}.plist", f"{TRAIN_LABEL}.plist")}
_XDG_DIRS = ("XDG_CONFIG_HOME", "XDG_DATA_HOME", "XDG_STATE_HOME", "XDG_CACHE_HOME")
_DEFAULT_PATH = "/usr/local/bin:/usr/bin:/bin"
# Folders relative to the repository root; see the module docstring.
EXAMPLES = {"linux": Path("systemd"), "darwin": Path("launchd")}


# ---- running system commands -----------------------------------------------------------


@dataclass(frozen=True)
class CommandResult:
    returncode: int
    stdout: str = ""
    stderr: str = ""

    @property
    def message(self) -> str:
        """The first non-empty output line, for a one-line report."""
        for line in (self.stderr + "\n" + self.stdout).splitlines():
            if line.strip():
                return line.strip()
        return f"exit code {self.returncode}"


Runner = Callable[..., CommandResult]  # runner(argv, *, capture=True) -> CommandResult


def run_command(argv: Sequence[str], *, capture: bool = True, timeout: float = 30.0) -> CommandResult:
    """Run one system command. capture=False hands it the terminal (log following)
    and waits until it exits. A missing program is rc 127, as in a shell."""
    try:
        if not capture:
            return CommandResult(subprocess.call(list(argv)))
        p = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError:
        return CommandResult(127, "", f"{argv[0]}: command not found")
    except subprocess.TimeoutExpired:
        return CommandResult(124, "", f"{shlex.join(argv)} did not answer within {timeout:.0f} s")
    return CommandResult(p.returncode, p.stdout, p.stderr)


def _dry_runner(echo: Callable[[str], None]) -> Runner:
    def run(argv: Sequence[str], *, capture: bool = True, **_) -> CommandResult:
        echo(f"would run: {shlex.join(argv)}")
        return CommandResult(0)

    return run


# ---- where things go ---------------------------------------------------------------------


def manager(platform: str) -> str:
    """The service manager for a sys.platform value: "systemd" or "launchd"."""
    if platform.startswith("linux"):
        return "systemd"
    if platform == "darwin":
        return "launchd"
    raise ClawdError(
        f"user services are supported on Linux (systemd) and macOS (launchd), not {platform}; "
        "run `clawd serve` from your own start-up script instead"
    )


def _home(env: Mapping[str, str]) -> Path:
    home = env.get("HOME", "")
    if not home or not os.path.isabs(home):
        raise ClawdError("HOME is not set to an absolute path: set it so the service file can be written")
    return Path(home)


def unit_dir(platform: str, env: Mapping[str, str]) -> Path:
    """Where the unit files go: ~/.config/systemd/user/ or ~/Library/LaunchAgents/."""
    home = _home(env)
    if manager(platform) == "launchd":
        return home / "Library" / "LaunchAgents"
    xdg = env.get("XDG_CONFIG_HOME", "")
    base = Path(xdg) if xdg and os.path.isabs(xdg) else home / ".config"
    return base / "systemd" / "user"


def unit_paths(platform: str, env: Mapping[str, str]) -> list[Path]:
    """Every file `clawd service install` writes, the daemon's unit first."""
    return [unit_dir(platform, env) / name for name in UNIT_FILES[manager(platform)]]


def unit_path(platform: str, env: Mapping[str, str]) -> Path:
    """The daemon's unit file."""
    return unit_paths(platform, env)[0]


def _launchd_log_dir(env: Mapping[str, str]) -> Path:
    # ~/Library/Logs/clawd, or CLAWD_HOME's log dir when set: one place per home.
    return resolve_paths(env, platform="darwin", home=_home(env)).log_dir


def find_clawd(env: Mapping[str, str]) -> str:
    """The absolute path of the `clawd` command the service should run: the one beside
    this Python (a venv or pipx install), else the first on PATH."""
    beside = Path(sys.executable).parent / "clawd"  # not resolved: a venv's python is a symlink
    if beside.is_file() and os.access(beside, os.X_OK):
        return os.path.abspath(beside)
    found = shutil.which("clawd", path=env.get("PATH") or None)
    if found:
        return os.path.abspath(found)
    raise ClawdError(
        f"no `clawd` command next to {sys.executable} or on PATH: install clawd with pip or pipx, "
        "then run `clawd service install` again"
    )


def service_env(platform: str, clawd_executable: str, env: Mapping[str, str]) -> dict[str, str]:
    """The environment the service runs with. Services do not inherit the login shell's,
    so PATH and the variables that decide where clawd's files are (CLAWD_HOME, XDG_*)
    are written in; settings stay in config.toml, which the daemon reloads live."""
    home = _home(env)
    parts = [str(Path(clawd_executable).parent)]
    for p in (env.get("PATH") or _DEFAULT_PATH).split(os.pathsep):
        if p and os.path.isabs(p) and p not in parts:
            parts.append(p)
    out = {"PATH": os.pathsep.join(parts)}
    clawd_home = env.get("CLAWD_HOME", "")
    if clawd_home:
        if clawd_home == "~" or clawd_home.startswith("~/"):
            clawd_home = str(home / clawd_home[2:])
        out["CLAWD_HOME"] = os.path.abspath(clawd_home)
    if manager(platform) == "systemd":  # macOS paths ignore XDG_* (paths.py)
        out.update({k: env[k] for k in _XDG_DIRS if os.path.isabs(env.get(k, "") or "")})
    return out


def shadowed_settings(env: Mapping[str, str]) -> list[str]:
    """CLAWD_<SETTING> variables set in this shell that the service will not see."""
    return [env_var(k) for k in SPECS if env_var(k) in env]


# ---- rendering ------------------------------------------------------------------------------


def _template(name: str) -> str:
    return resources.files("clawd").joinpath("units", name).read_text(encoding="utf-8")


def _sd_word(s: str, *, exec_line: bool = False) -> str:
    """One systemd unit-file word: specifiers (%) doubled, $ doubled on Exec lines
    (variable expansion), quoted with C escapes when it holds anything unusual."""
    s = s.replace("%", "%%")
    if exec_line:
        s = s.replace("$", "$$")
    if re.fullmatch(r"[A-Za-z0-9_@%$+=:,./-]+", s):
        return s
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _render_systemd(name: str, clawd_executable: str, env: dict[str, str]) -> str:
    environment = "\n".join(f"Environment={_sd_word(f'{k}={v}')}" for k, v in env.items())
    text = (
        _template(name)
        .replace("@CLAWD@", _sd_word(clawd_executable, exec_line=True))
        .replace("@ENVIRONMENT@", environment)
    )
    assert not re.search(r"@[A-Z_]+@", text), f"unfilled placeholder in the systemd template {name}"
    return text


def _render_launchd(name: str, clawd_executable: str, env: dict[str, str], home: Path, log_dir: Path) -> str:
    # Parsed and re-serialised with plistlib, so any path is escaped correctly for XML.
    values = {"@CLAWD@": clawd_executable, "@LOG_DIR@": str(log_dir), "@HOME@": str(home)}

    def fill(v):
        if isinstance(v, str):
            for k, val in values.items():
                v = v.replace(k, val)
            assert not re.search(r"@[A-Z_]+@", v), f"unfilled placeholder in the launchd template: {v}"
            return v
        if isinstance(v, dict):
            return {k: fill(x) for k, x in v.items()}
        if isinstance(v, list):
            return [fill(x) for x in v]
        return v

    plist = fill(plistlib.loads(_template(name).encode("utf-8")))
    plist["EnvironmentVariables"] = dict(env)
    text = plistlib.dumps(plist, sort_keys=False).decode("utf-8")
    note = (
        f"<!-- clawd user agent, written by `clawd service install` from clawd/units/{name}.\n"
        "     Re-run it after moving or upgrading clawd; settings belong in config.toml. -->\n"
    )
    return text.replace("<plist ", note + "<plist ", 1)


def render_all(platform: str, clawd_executable: str, env: Mapping[str, str]) -> list[tuple[Path, str]]:
    """The unit files for this user, the daemon's first: [(where it goes, its text), ...].

    Args:
        platform: a sys.platform value ("linux", "darwin").
        clawd_executable: absolute path of the `clawd` command to run.
        env: the environment (HOME, PATH, CLAWD_HOME, XDG_* are read).
    Raises:
        ClawdError: unsupported platform, HOME unset, or a relative executable path.
    """
    if not os.path.isabs(clawd_executable):
        raise ClawdError(f"the clawd command must be an absolute path, got {clawd_executable!r}")
    senv = service_env(platform, clawd_executable, env)
    if manager(platform) == "systemd":
        return [(p, _render_systemd(p.name, clawd_executable, senv)) for p in unit_paths(platform, env)]
    home, log_dir = _home(env), _launchd_log_dir(env)
    return [(p, _render_launchd(p.name, clawd_executable, senv, home, log_dir)) for p in unit_paths(platform, env)]


def render(platform: str, clawd_executable: str, env: Mapping[str, str]) -> tuple[Path, str]:
    """The daemon's unit file: (where it goes, its text). See render_all."""
    return render_all(platform, clawd_executable, env)[0]


def render_examples(platform: str) -> dict[str, str]:
    """The renderings kept in the repository's systemd/ or launchd/ folder: {file name: text}."""
    home = "/Users/you" if platform == "darwin" else "/home/you"
    env = {"HOME": home, "PATH": "/usr/local/bin:/usr/bin:/bin"}
    out = {}
    for path, text in render_all(platform, f"{home}/.local/bin/clawd", env):
        if platform == "darwin":
            text = text.replace(
                "<!-- clawd user agent",
                "<!-- EXAMPLE for a user `you` (python -m clawd.service regenerates it).\n     clawd user agent",
                1,
            )
        else:
            text = "# EXAMPLE for a user `you` (python -m clawd.service regenerates it).\n" + text
        out[path.name] = text
    return out


def write_examples(root: Path) -> list[Path]:
    out = []
    for platform, folder in EXAMPLES.items():
        (root / folder).mkdir(parents=True, exist_ok=True)
        for name, text in render_examples(platform).items():
            (root / folder / name).write_text(text, encoding="utf-8")
            out.append(root / folder / name)
    return out


# ---- install / uninstall / status / logs ------------------------------------------------------


def _user(env: Mapping[str, str], uid: int) -> str:
    return env.get("USER") or env.get("LOGNAME") or pwd.getpwuid(uid).pw_name


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)  # a half-written unit is never loaded


def _systemctl(*args: str) -> list[str]:
    return ["systemctl", "--user", *args]


def check_linger(env: Mapping[str, str], uid: int, runner: Runner) -> bool | None:
    """Whether the user manager outlives logout (and starts at boot); None = unknown."""
    r = runner(["loginctl", "show-user", _user(env, uid), "-p", "Linger"])
    if r.returncode != 0:
        return None
    value = r.stdout.strip().partition("=")[2].strip().lower()
    return {"yes": True, "no": False}.get(value)


def _linger_lines(env: Mapping[str, str], uid: int, linger: bool | None) -> list[str]:
    user = _user(env, uid)
    if linger:
        return [f"lingering is on for {user}: clawd keeps running after logout and starts at boot."]
    what = "is off" if linger is False else "could not be checked"
    return [
        f"lingering {what} for {user}: without it clawd stops at your last logout (SSH included) "
        "and does not start at boot. Enable it with:",
        f"    loginctl enable-linger {user}",
    ]


def install(
    platform: str,
    env: Mapping[str, str],
    *,
    clawd_executable: str | None = None,
    runner: Runner = run_command,
    echo: Callable[[str], None] = print,
    dry_run: bool = False,
    uid: int | None = None,
) -> int:
    """Write the units, start the daemon now and at every login, and arm the overnight
    training trigger. Returns the exit code.

    With dry_run, prints the files it would write and the commands it would run."""
    uid = os.getuid() if uid is None else uid
    kind = manager(platform)
    exe = clawd_executable or find_clawd(env)
    files = render_all(platform, exe, env)
    path, text = files[0]  # the daemon's
    if dry_run:
        runner = _dry_runner(echo)
    old = path.read_text(encoding="utf-8") if path.is_file() else None
    if not dry_run and kind == "launchd":
        _launchd_log_dir(env).mkdir(parents=True, exist_ok=True)  # launchd will not create it
    for p, t in files:
        if dry_run:
            echo(f"would write {p}:")
            echo("\n".join("    " + ln for ln in t.splitlines()))
        else:
            _write(p, t)
            echo(f"wrote {p}")
    for var in shadowed_settings(env):
        echo(f"note: {var} is set in this shell but the service will not see it; put the setting in config.toml")

    if kind == "systemd":
        steps = [_systemctl("daemon-reload"), _systemctl("enable", "--now", UNIT_NAME)]
        if old is not None and old != text:
            steps.append(_systemctl("restart", UNIT_NAME))  # enable --now leaves a running old unit alone
        steps.append(_systemctl("enable", "--now", TIMER_UNIT))
    else:
        domain = f"gui/{uid}"
        # bootstrap refuses a label that is already loaded, so unload first (failure = not loaded).
        for label in (LABEL, TRAIN_LABEL):
            runner(["launchctl", "bootout", f"{domain}/{label}"])
        steps = [["launchctl", "bootstrap", domain, str(p)] for p, _ in files]
    for argv in steps:
        r = runner(argv)
        if not dry_run:
            echo(f"ran: {shlex.join(argv)}")
        if r.returncode != 0:
            echo(f"failed: {shlex.join(argv)}: {r.message}")
            if r.returncode == 127:
                echo(
                    f"{argv[0]} is not available here, so the service cannot be started; "
                    "run `clawd serve` yourself, or remove the file with `clawd service uninstall`"
                )
            else:
                echo(
                    f"the units are written to {path.parent}; fix the problem above and run "
                    "`clawd service install` again"
                )
            return 1
    if not dry_run:
        echo(
            "clawd runs as a user service now and at every login, and trains at 03:00 when enough signals "
            "are ready: `clawd service status`, `clawd service logs`."
        )
    if kind == "systemd":
        linger = check_linger(env, uid, runner)
        if not dry_run:
            for line in _linger_lines(env, uid, linger):
                echo(line)
    return 0


def uninstall(
    platform: str,
    env: Mapping[str, str],
    *,
    runner: Runner = run_command,
    echo: Callable[[str], None] = print,
    dry_run: bool = False,
    uid: int | None = None,
) -> int:
    """Stop the service and the training trigger and remove their unit files. Returns the exit code."""
    uid = os.getuid() if uid is None else uid
    kind = manager(platform)
    paths = [p for p in unit_paths(platform, env) if dry_run or p.exists()]
    if not paths:
        echo(f"clawd is not installed as a service (no {unit_path(platform, env)}).")
        return 0
    if dry_run:
        runner = _dry_runner(echo)
    # The trigger first, so it cannot start a run meanwhile; only units whose file is there.
    if kind == "systemd":
        stops = {
            TIMER_UNIT: _systemctl("disable", "--now", TIMER_UNIT),
            TRAIN_UNIT: _systemctl("stop", TRAIN_UNIT),
            UNIT_NAME: _systemctl("disable", "--now", UNIT_NAME),
        }
    else:
        stops = {f"{label}.plist": ["launchctl", "bootout", f"gui/{uid}/{label}"] for label in (TRAIN_LABEL, LABEL)}
    for name, argv in stops.items():
        if any(p.name == name for p in paths):
            r = runner(argv)
            if not dry_run:
                echo(f"ran: {shlex.join(argv)}" + ("" if r.returncode == 0 else f" ({r.message})"))
    for path in paths:
        if dry_run:
            echo(f"would remove {path}")
        else:
            path.unlink(missing_ok=True)
            echo(f"removed {path}")
    if kind == "systemd":
        runner(_systemctl("daemon-reload"))
    return 0


@dataclass
class ServiceStatus:
    manager: str
    unit_path: Path
    installed: bool
    enabled: str | None = None  # systemd: is-enabled's answer; launchd: "loaded" / "not loaded"
    active: bool = False
    state: str = "not installed"
    pid: int | None = None
    linger: bool | None = None
    training: str | None = None  # the overnight trigger: "enabled, active" (systemd), "loaded" (launchd), ...
    next_training: str | None = None  # systemd's next elapse of clawd-train.timer, when it has one
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {
            "manager": self.manager,
            "unit_path": str(self.unit_path),
            "installed": self.installed,
            "enabled": self.enabled,
            "active": self.active,
            "state": self.state,
            "pid": self.pid,
            "linger": self.linger,
            "training": self.training,
            "next_training": self.next_training,
            "notes": self.notes,
        }


def _training_status(st: ServiceStatus, uid: int, runner: Runner) -> None:
    """Fill in the overnight training trigger's state, with one note saying it."""
    if not (st.unit_path.parent / UNIT_FILES[st.manager][1]).is_file():
        st.training = "not installed"
        st.notes.append("overnight training is not set up: run `clawd service install` again to add it")
        return
    if st.manager == "systemd":
        r = runner(
            _systemctl("show", TIMER_UNIT, "-p", "UnitFileState", "-p", "ActiveState", "-p", "NextElapseUSecRealtime")
        )
        props = dict(ln.partition("=")[::2] for ln in r.stdout.splitlines() if "=" in ln)
        st.training = f"{props.get('UnitFileState') or '?'}, {props.get('ActiveState') or '?'}"
        st.next_training = props.get("NextElapseUSecRealtime") or None
        when = f"; next run {st.next_training}" if st.next_training else ""
        st.notes.append(f"overnight training: {TIMER_UNIT} {st.training}{when}")
        if props.get("ActiveState") != "active":
            st.notes.append(f"arm it with `systemctl --user enable --now {TIMER_UNIT}`")
        return
    r = runner(["launchctl", "print", f"gui/{uid}/{TRAIN_LABEL}"])
    st.training = "loaded" if r.returncode == 0 else "not loaded"
    st.notes.append(f"overnight training: {TRAIN_LABEL} {st.training} (runs at 03:00, or on wake after sleep)")


def status(
    platform: str, env: Mapping[str, str], *, runner: Runner = run_command, uid: int | None = None
) -> ServiceStatus:
    """Is the unit installed, loaded, running? Runs no command when it is not installed."""
    uid = os.getuid() if uid is None else uid
    kind = manager(platform)
    st = ServiceStatus(kind, unit_path(platform, env), installed=unit_path(platform, env).is_file())
    if not st.installed:
        st.notes.append("install it with `clawd service install` to start clawd at login")
        return st
    if kind == "systemd":
        enabled = runner(_systemctl("is-enabled", UNIT_NAME))
        active = runner(_systemctl("is-active", UNIT_NAME))
        if active.returncode == 127:
            st.state = "unknown (systemctl not found)"
            return st
        st.enabled = enabled.stdout.strip() or enabled.message
        st.state = active.stdout.strip() or active.message
        st.active = st.state == "active"
        _training_status(st, uid, runner)
        st.linger = check_linger(env, uid, runner)
        if st.linger is not True:
            st.notes += _linger_lines(env, uid, st.linger)
        if not st.active:
            st.notes.append("see why with `clawd service logs`; start it with `systemctl --user start clawd`")
        return st
    _training_status(st, uid, runner)
    r = runner(["launchctl", "print", f"gui/{uid}/{LABEL}"])
    if r.returncode != 0:
        st.enabled, st.state = "not loaded", "not running"
        st.notes.append(f"load it with `launchctl bootstrap gui/{uid} {st.unit_path}` or `clawd service install`")
        return st
    st.enabled = "loaded"
    m = re.search(r"^\s*state = (\S+)", r.stdout, re.M)
    st.state = m.group(1) if m else "loaded"
    st.active = st.state == "running"
    pid = re.search(r"^\s*pid = (\d+)", r.stdout, re.M)
    st.pid = int(pid.group(1)) if pid else None
    if not st.active:
        st.notes.append("see why with `clawd service logs`")
    return st


def logs(
    platform: str,
    env: Mapping[str, str],
    *,
    follow: bool = True,
    runner: Runner = run_command,
    echo: Callable[[str], None] = print,
    dry_run: bool = False,
) -> int:
    """Show the service's log and the overnight training's (journal, or the LaunchAgents'
    log files), following it."""
    if manager(platform) == "systemd":
        argv = ["journalctl", "--user", "-u", "clawd", "-u", "clawd-train"] + (
            ["-f"] if follow else ["-n", "200", "--no-pager"]
        )
    else:
        d = _launchd_log_dir(env)
        files = [d / "clawd.out.log", d / "clawd.err.log"]
        files += [d / "train.log"] if (d / "train.log").is_file() else []  # written at the first 03:00 run
        argv = ["tail", "-n", "100"] + (["-F"] if follow else []) + [str(f) for f in files]
    if dry_run:
        return _dry_runner(echo)(argv).returncode
    r = runner(argv, capture=False)
    if r.returncode == 127:
        echo(f"{argv[0]} is not available: {r.message}")
    return r.returncode


if __name__ == "__main__":
    for p in write_examples(Path(__file__).resolve().parent.parent):
        print(f"wrote {p}")
