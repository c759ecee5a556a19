"""Every path clawd uses, computed from one root.

Boundary: this module turns an environment mapping (CLAWD_HOME, XDG_*, HOME) into a
`Paths` value, and `ensure_dirs` creates those directories. It never reads
`os.environ` itself: `cli.py` passes the environment in once, so tests pass dicts.
Nothing else in clawd builds a path from scratch; everything derives from `Paths`.
Layout rules: CONVENTIONS.md §8.
"""

from __future__ import annotations

import os
import stat
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from clawd.errors import ConfigError

APP = "clawd"


@dataclass(frozen=True)
class Paths:
    """The directories clawd reads and writes; files are derived properties."""

    config_dir: Path
    data_dir: Path
    state_dir: Path
    cache_dir: Path
    runtime_dir: Path
    # Set where the platform has its own log place (macOS ~/Library/Logs/clawd);
    # None means state_dir/logs.
    platform_log_dir: Path | None = None
    # Things the user should hear about once at start-up (e.g. runtime fallback).
    warnings: tuple[str, ...] = field(default=())

    @property
    def config_file(self) -> Path:
        return self.config_dir / "config.toml"

    @property
    def db_file(self) -> Path:
        return self.data_dir / "clawd.db"

    @property
    def token_file(self) -> Path:
        return self.config_dir / "token"

    @property
    def adapters_dir(self) -> Path:
        return self.data_dir / "adapters"

    @property
    def exports_dir(self) -> Path:
        """Where the daemon writes exported adapters (the HTTP API names nothing outside it)."""
        return self.data_dir / "exports"

    @property
    def models_dir(self) -> Path:
        return self.data_dir / "models"

    @property
    def log_dir(self) -> Path:
        return self.platform_log_dir if self.platform_log_dir is not None else self.state_dir / "logs"

    @property
    def pid_file(self) -> Path:
        return self.runtime_dir / "clawd.pid"


def _home(env: Mapping[str, str], home: Path | None) -> Path:
    if home is not None:
        return Path(home)
    h = env.get("HOME", "")
    if h and os.path.isabs(h):
        return Path(h)
    # Last resort only: the passwd entry / platform default.
    return Path.home()


def _xdg(env: Mapping[str, str], var: str, default: Path) -> Path:
    # The XDG spec says relative values are invalid and must be ignored.
    value = env.get(var, "")
    if value and os.path.isabs(value):
        return Path(value)
    return default


def resolve_paths(env: Mapping[str, str], *, platform: str = sys.platform, home: Path | None = None) -> Paths:
    """Compute clawd's directories from `env`; creates nothing (see `ensure_dirs`).

    Args:
        env: the process environment (or a test dict); only CLAWD_HOME, XDG_* and HOME are read.
        platform: `sys.platform` value; "darwin" selects the macOS layout.
        home: the user's home; default $HOME from `env`, else `Path.home()`.
    """
    user_home = _home(env, home)

    clawd_home = env.get("CLAWD_HOME", "")
    if clawd_home:
        # Expand "~" against the home we were given, not the process's, so tests stay hermetic.
        if clawd_home == "~" or clawd_home.startswith("~/"):
            root = user_home / clawd_home[2:]
        else:
            root = Path(clawd_home)
        # Made absolute once so a later chdir (daemonising, tests) cannot move the state.
        root = Path(os.path.abspath(root))
        return Paths(
            config_dir=root,
            data_dir=root / "data",
            state_dir=root / "state",
            cache_dir=root / "cache",
            runtime_dir=root / "run",
        )

    if platform == "darwin":
        # platformdirs' macOS defaults (CONVENTIONS §8). XDG_* are deliberately not
        # honoured here: the table fixes one place per role on macOS.
        support = user_home / "Library" / "Application Support" / APP
        return Paths(
            config_dir=support,
            data_dir=support,
            state_dir=support,
            cache_dir=user_home / "Library" / "Caches" / APP,
            runtime_dir=user_home / "Library" / "Caches" / "TemporaryItems" / APP,
            platform_log_dir=user_home / "Library" / "Logs" / APP,
        )

    config_dir = _xdg(env, "XDG_CONFIG_HOME", user_home / ".config") / APP
    data_dir = _xdg(env, "XDG_DATA_HOME", user_home / ".local" / "share") / APP
    state_dir = _xdg(env, "XDG_STATE_HOME", user_home / ".local" / "state") / APP
    cache_dir = _xdg(env, "XDG_CACHE_HOME", user_home / ".cache") / APP
    warnings: list[str] = []
    runtime_base = env.get("XDG_RUNTIME_DIR", "")
    if runtime_base and os.path.isabs(runtime_base):
        runtime_dir = Path(runtime_base) / APP
    else:
        # XDG_RUNTIME_DIR has no default; a private dir under our own cache is the
        # closest safe place (not /tmp, where another user could pre-create it).
        runtime_dir = cache_dir / "run"
        warnings.append(
            "XDG_RUNTIME_DIR is not set (or not absolute); using the private directory "
            f"{runtime_dir} (mode 0700) for the pid file and control socket"
        )
    return Paths(
        config_dir=config_dir,
        data_dir=data_dir,
        state_dir=state_dir,
        cache_dir=cache_dir,
        runtime_dir=runtime_dir,
        warnings=tuple(warnings),
    )


# Conversations, the token and trained adapters are the user's alone: every directory clawd
# creates is 0700 and its database and token 0600, whatever the umask (other local users
# share the machine). Existing installs, made 0755 / 0644 before, are fixed on every start.
PRIVATE_DIR = 0o700
PRIVATE_FILE = 0o600


def private_files(paths: Paths) -> list[Path]:
    """The files only their owner may read: the database (with SQLite's -wal / -shm) and the token."""
    db = paths.db_file
    return [db, db.with_name(db.name + "-wal"), db.with_name(db.name + "-shm"), paths.token_file]


def make_private(paths: Paths, *, create_db: bool = False) -> None:
    """Set PRIVATE_FILE on each of `private_files` that exists. With `create_db` (the daemon,
    before it opens the store), first create the database file empty (SQLite takes that as
    a new database) with that mode: SQLite gives -wal / -shm the database's own mode."""
    if create_db:
        try:
            os.close(os.open(paths.db_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, PRIVATE_FILE))
        except FileExistsError:
            pass
    for f in private_files(paths):
        if f.exists() and not f.is_symlink() and stat.S_IMODE(f.stat().st_mode) != PRIVATE_FILE:
            os.chmod(f, PRIVATE_FILE)


def ensure_dirs(paths: Paths) -> None:
    """Create every clawd directory, private (0700), and make the database and token 0600.

    Raises:
        ConfigError: a directory cannot be created, or the runtime dir belongs to
            another user (its pid file and socket must not be shared).
    """
    dirs = [
        paths.config_dir,
        paths.data_dir,
        paths.state_dir,
        paths.cache_dir,
        paths.adapters_dir,
        paths.models_dir,
        paths.exports_dir,
        # launchd will not create log dirs itself, so they must exist beforehand.
        paths.log_dir,
    ]
    try:
        for d in [*dirs, paths.runtime_dir]:
            d.mkdir(mode=PRIVATE_DIR, parents=True, exist_ok=True)
            # mkdir's mode is masked by the umask and ignored for an existing dir: set it explicitly.
            if stat.S_IMODE(d.stat().st_mode) != PRIVATE_DIR:
                os.chmod(d, PRIVATE_DIR)
        make_private(paths)
    except OSError as e:
        raise ConfigError(
            f"cannot create clawd directory {e.filename}: {e.strerror}; set CLAWD_HOME to a writable directory"
        ) from e
    if hasattr(os, "getuid"):
        st = paths.runtime_dir.stat()
        if st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) & 0o077:
            raise ConfigError(
                f"runtime directory {paths.runtime_dir} is not private to this user; "
                "remove it or set XDG_RUNTIME_DIR / CLAWD_HOME elsewhere"
            )
