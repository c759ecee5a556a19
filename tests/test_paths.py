"""paths.py: CLAWD_HOME relocation, XDG on Linux, the macOS mapping, runtime fallback."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from clawd.paths import Paths, ensure_dirs, resolve_paths

HOME = Path("/home/u")


def test_clawd_home_puts_everything_under_it(tmp_path):
    env = {"CLAWD_HOME": str(tmp_path), "XDG_CONFIG_HOME": "/elsewhere", "XDG_RUNTIME_DIR": "/run/user/1"}
    for platform in ("linux", "darwin"):
        p = resolve_paths(env, platform=platform, home=HOME)
        assert p.config_dir == tmp_path
        assert p.data_dir == tmp_path / "data"
        assert p.state_dir == tmp_path / "state"
        assert p.cache_dir == tmp_path / "cache"
        assert p.runtime_dir == tmp_path / "run"
        assert p.config_file == tmp_path / "config.toml"
        assert p.token_file == tmp_path / "token"
        assert p.db_file == tmp_path / "data" / "clawd.db"
        assert p.adapters_dir == tmp_path / "data" / "adapters"
        assert p.models_dir == tmp_path / "data" / "models"
        assert p.log_dir == tmp_path / "state" / "logs"  # even on macOS: all state under CLAWD_HOME
        assert p.pid_file == tmp_path / "run" / "clawd.pid"
        assert p.warnings == ()


def test_clawd_home_relative_is_made_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    p = resolve_paths({"CLAWD_HOME": "rel/state"}, platform="linux", home=HOME)
    assert p.config_dir.is_absolute() and p.config_dir == tmp_path / "rel" / "state"
    p = resolve_paths({"CLAWD_HOME": "~/ch"}, platform="linux", home=HOME)
    assert p.config_dir == HOME / "ch"


def test_linux_defaults_without_xdg():
    p = resolve_paths({"XDG_RUNTIME_DIR": "/run/user/1000"}, platform="linux", home=HOME)
    assert p.config_dir == HOME / ".config" / "clawd"
    assert p.data_dir == HOME / ".local" / "share" / "clawd"
    assert p.state_dir == HOME / ".local" / "state" / "clawd"
    assert p.cache_dir == HOME / ".cache" / "clawd"
    assert p.runtime_dir == Path("/run/user/1000/clawd")
    assert p.log_dir == HOME / ".local" / "state" / "clawd" / "logs"
    assert p.warnings == ()


def test_home_comes_from_env_mapping():
    p = resolve_paths({"HOME": "/home/other", "XDG_RUNTIME_DIR": "/run/u"}, platform="linux")
    assert p.config_dir == Path("/home/other/.config/clawd")


def test_linux_xdg_absolute_used_relative_ignored():
    env = {
        "XDG_CONFIG_HOME": "/x/conf",
        "XDG_DATA_HOME": "relative/data",  # invalid per the XDG spec: ignored
        "XDG_STATE_HOME": "/x/state",
        "XDG_CACHE_HOME": "cache",
        "XDG_RUNTIME_DIR": "/run/user/7",
    }
    p = resolve_paths(env, platform="linux", home=HOME)
    assert p.config_dir == Path("/x/conf/clawd")
    assert p.data_dir == HOME / ".local" / "share" / "clawd"
    assert p.state_dir == Path("/x/state/clawd")
    assert p.cache_dir == HOME / ".cache" / "clawd"
    assert p.runtime_dir == Path("/run/user/7/clawd")


@pytest.mark.parametrize("runtime", [None, "", "run/rel"])
def test_linux_runtime_fallback_is_private_and_warned(tmp_path, runtime):
    env = {"XDG_CACHE_HOME": str(tmp_path / "cache")}
    if runtime is not None:
        env["XDG_RUNTIME_DIR"] = runtime
    p = resolve_paths(env, platform="linux", home=tmp_path)
    assert p.runtime_dir == tmp_path / "cache" / "clawd" / "run"
    assert len(p.warnings) == 1 and "XDG_RUNTIME_DIR" in p.warnings[0] and str(p.runtime_dir) in p.warnings[0]

    old = os.umask(0o022)  # a permissive umask must not leak into the runtime dir
    try:
        ensure_dirs(p)
    finally:
        os.umask(old)
    assert stat.S_IMODE(p.runtime_dir.stat().st_mode) == 0o700


def test_macos_mapping():
    # The XDG variables are set to prove macOS does not consult them (CONVENTIONS §8).
    env = {"XDG_CONFIG_HOME": "/x/conf", "XDG_RUNTIME_DIR": "/run/user/1"}
    p = resolve_paths(env, platform="darwin", home=Path("/Users/u"))
    support = Path("/Users/u/Library/Application Support/clawd")
    assert p.config_dir == p.data_dir == p.state_dir == support
    assert p.cache_dir == Path("/Users/u/Library/Caches/clawd")
    assert p.runtime_dir == Path("/Users/u/Library/Caches/TemporaryItems/clawd")
    assert p.log_dir == Path("/Users/u/Library/Logs/clawd")
    assert p.config_file == support / "config.toml"
    assert p.db_file == support / "clawd.db"
    assert p.warnings == ()


def test_macos_mapping_matches_platformdirs(tmp_path, monkeypatch):
    macos = pytest.importorskip("platformdirs.macos")
    monkeypatch.setenv("HOME", str(tmp_path))
    for var in ("XDG_CONFIG_HOME", "XDG_DATA_HOME", "XDG_STATE_HOME", "XDG_CACHE_HOME", "XDG_RUNTIME_DIR"):
        monkeypatch.delenv(var, raising=False)
    ref = macos.MacOS("clawd", appauthor=False)
    p = resolve_paths({}, platform="darwin", home=tmp_path)
    assert p.config_dir == Path(ref.user_config_dir)
    assert p.data_dir == Path(ref.user_data_dir)
    assert p.state_dir == Path(ref.user_state_dir)
    assert p.cache_dir == Path(ref.user_cache_dir)
    assert p.runtime_dir == Path(ref.user_runtime_dir)
    assert p.log_dir == Path(ref.user_log_dir)


def test_ensure_dirs_creates_everything(tmp_path):
    p = resolve_paths({"CLAWD_HOME": str(tmp_path / "h")}, platform="linux", home=HOME)
    ensure_dirs(p)
    for d in (
        p.config_dir,
        p.data_dir,
        p.state_dir,
        p.cache_dir,
        p.runtime_dir,
        p.adapters_dir,
        p.models_dir,
        p.log_dir,
    ):
        assert d.is_dir(), d
    assert stat.S_IMODE(p.runtime_dir.stat().st_mode) == 0o700
    ensure_dirs(p)  # idempotent


def test_ensure_dirs_tightens_existing_runtime_dir(tmp_path):
    p = resolve_paths({"CLAWD_HOME": str(tmp_path)}, platform="linux", home=HOME)
    p.runtime_dir.mkdir(mode=0o755)
    os.chmod(p.runtime_dir, 0o755)
    ensure_dirs(p)
    assert stat.S_IMODE(p.runtime_dir.stat().st_mode) == 0o700


def test_paths_is_frozen():
    p = resolve_paths({"CLAWD_HOME": "/h"}, platform="linux", home=HOME)
    assert isinstance(p, Paths)
    with pytest.raises(AttributeError):
        p.config_dir = Path("/x")  # type: ignore[misc]
