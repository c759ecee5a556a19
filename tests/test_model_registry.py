"""`clawd models list|add|use|pull|remove` (clawd/model_registry.py) and the config.toml line
editor under `use` (clawd/config_edit.py).

`pull` runs against tests/fake_hub.py, a local HTTP server speaking the hub routes
huggingface_hub calls, reached through HF_ENDPOINT by a `clawd` subprocess: nothing here
contacts huggingface.co.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from clawd import cli, config_edit, model_registry, reload
from clawd.config import SPECS, load_settings, write_default_config
from clawd.errors import ConfigError
from clawd.paths import resolve_paths
from tests.conftest import ROOT, make_env
from tests.fake_hub import FakeHub

# ---- helpers ---------------------------------------------------------------------------------


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    """A CLAWD_HOME for in-process `clawd models ...` calls, with no CLAWD_* leaking in."""
    for k in list(os.environ):
        if k.startswith("CLAWD_"):
            monkeypatch.delenv(k)
    h = tmp_path / "clawd-home"
    h.mkdir()
    monkeypatch.setenv("CLAWD_HOME", str(h))
    return h


def models(capsys, *argv) -> tuple[int, str, str]:
    code = cli.main(["models", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def one_line_error(code: int, err: str) -> str:
    assert code == 1, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("clawd: error: "), err
    return lines[0]


def state(h: Path) -> tuple[bytes | None, bytes | None]:
    """config.toml and models.json bytes: what bad input must leave alone."""
    cfg, reg = h / "config.toml", h / "data" / "models.json"
    return (cfg.read_bytes() if cfg.exists() else None, reg.read_bytes() if reg.exists() else None)


def registry(h: Path) -> dict[str, dict]:
    f = h / "data" / "models.json"
    return {m["name"]: m for m in json.loads(f.read_text())["models"]} if f.exists() else {}


def mlx_dir(path: Path, model_type: str = "qwen2") -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"model_type": model_type}))
    (path / "model.safetensors").write_bytes(b"\0" * 64)
    (path / "tokenizer.json").write_text("{}")
    return path


# ---- config.toml line editor -----------------------------------------------------------------


def test_set_then_unset_restores_the_users_file_byte_for_byte(tmp_path):
    cfg = tmp_path / "config.toml"
    write_default_config(cfg)
    # A user's own edits: a live setting with a trailing comment and a note of their own.
    text = cfg.read_text().replace("# port = 8757", "port = 9000  # not 8080: llama-server has it")
    text = text.replace("[model]\n", "[model]\n# my note: try qwen next week\n")
    cfg.write_text(text)

    assert config_edit.set_table_keys(cfg, "model", {"path": "/m/a b.gguf", "name": "a"})
    new = cfg.read_text()
    old_lines, new_lines = text.splitlines(), new.splitlines()
    # Only two lines were added, each right under its commented default; nothing else moved.
    added = [ln for ln in new_lines if ln not in old_lines]
    assert added == ['path = "/m/a b.gguf"', 'name = "a"']
    assert [ln for ln in new_lines if ln not in added] == old_lines
    assert new_lines[new_lines.index(added[0]) - 1] == '# path = ""'
    assert new_lines[new_lines.index(added[1]) - 1] == '# name = ""'
    doc = tomllib.loads(new)
    assert doc["model"] == {"path": "/m/a b.gguf", "name": "a"} and doc["server"] == {"port": 9000}

    # A live line is rewritten in place and keeps its comment; quotes and backslashes survive.
    cfg.write_text(new.replace('path = "/m/a b.gguf"', 'path = "/m/a b.gguf"   # mine'))
    tricky = 'C:\\models\\"q" #1.gguf'
    assert config_edit.set_table_keys(cfg, "model", {"path": tricky})
    assert 'path = "C:\\\\models\\\\\\"q\\" #1.gguf"  # mine' in cfg.read_text().splitlines()
    assert load_settings(cfg, {}).model.path == tricky
    assert not config_edit.set_table_keys(cfg, "model", {"path": tricky})  # unchanged: not rewritten

    assert config_edit.set_table_keys(cfg, "model", {"path": None, "name": None})
    assert cfg.read_text() == text


def test_edit_adds_a_missing_table_and_refuses_what_it_cannot_edit(tmp_path):
    cfg = tmp_path / "config.toml"
    cfg.write_text('log_level = "debug"\n\n[server]\nport = 9000\n')
    assert config_edit.set_table_keys(cfg, "model", {"path": "/m/x.gguf"})
    assert tomllib.loads(cfg.read_text()) == {
        "log_level": "debug",
        "server": {"port": 9000},
        "model": {"path": "/m/x.gguf"},
    }
    assert cfg.read_text().startswith('log_level = "debug"\n\n[server]\nport = 9000\n')

    for text in (
        'model.path = "/old.gguf"\n',
        'model = { path = "/old.gguf" }\n',
        '[model]\npath = """/old.gguf"""\n',
        "[model\npath = 1\n",
    ):
        cfg.write_text(text)
        with pytest.raises(ConfigError):
            config_edit.set_table_keys(cfg, "model", {"path": "/new.gguf"})
        assert cfg.read_text() == text  # refused: the file is exactly as it was


# ---- add / list / use ------------------------------------------------------------------------


def test_add_list_use_and_back_to_the_default(home, capsys, tiny_gguf):
    code, out, _ = models(capsys, "add", str(tiny_gguf))
    assert code == 0 and "added tiny-llama (gguf, llama" in out and "clawd models use tiny-llama" in out
    entry = registry(home)["tiny-llama"]
    assert entry["path"] == str(tiny_gguf) and entry["kind"] == "gguf" and entry["architecture"] == "llama"
    assert entry["size_bytes"] == tiny_gguf.stat().st_size and not entry["owned"]
    assert tiny_gguf.exists() and not any((home / "data" / "models").iterdir())  # recorded, not copied

    default_text = (home / "config.toml").read_text()
    code, out, _ = models(capsys, "list", "--json")
    rows = {r["name"]: r for r in json.loads(out)}
    assert list(rows) == ["gemma3-270m", "tiny-llama"]
    assert rows["gemma3-270m"]["in_use"] and rows["gemma3-270m"]["default"] and not rows["tiny-llama"]["in_use"]
    code, out, _ = models(capsys, "list")
    assert code == 0 and out.splitlines()[1].startswith("*  gemma3-270m (default)")

    paths = resolve_paths({"CLAWD_HOME": str(home)})
    before = load_settings(paths.config_file, {})
    code, out, _ = models(capsys, "use", "tiny-llama")
    assert code == 0 and "model set to tiny-llama" in out and "restart clawd to serve it" in out
    after = load_settings(paths.config_file, {})
    assert after.model.path == str(tiny_gguf) and after.model.name == "tiny-llama"
    assert after.model.engine == "llamacpp"
    # The running daemon's config watcher sees exactly these keys, none of them live: a restart.
    changed = reload.changed_keys(before, after)
    assert changed == ["model.path", "model.name"] and not any(reload.is_live(k) for k in changed)

    code, out, _ = models(capsys, "list", "--json")
    assert [r["name"] for r in json.loads(out) if r["in_use"]] == ["tiny-llama"]
    code, out, _ = models(capsys, "--json")  # the old `clawd models` view still works
    info = json.loads(out)
    assert info["id"] == "tiny-llama" and info["path"] == str(tiny_gguf) and info["architecture"] == "llama"
    code, out, _ = models(capsys, "use", "tiny-llama")
    assert code == 0 and "already the configured model" in out

    code, out, _ = models(capsys, "use", "gemma3-270m")
    assert code == 0 and (home / "config.toml").read_text() == default_text  # byte for byte


def test_use_names_the_service_restart_command_and_env_overrides(home, tiny_gguf, monkeypatch):
    paths = resolve_paths({"CLAWD_HOME": str(home)})
    fake_home = home / "user"
    unit = fake_home / ".config" / "systemd" / "user" / "clawd.service"
    unit.parent.mkdir(parents=True)
    unit.write_text("[Service]\n")
    env = {"HOME": str(fake_home), "CLAWD_MODEL_PATH": "/elsewhere.gguf"}
    model_registry.add_model(paths, tiny_gguf, echo=lambda _: None)
    settings = load_settings(paths.config_file, {})
    lines = model_registry.use_model(paths, settings, "tiny-llama", env, platform="linux")
    assert lines[-1] == "clawd: restart clawd to serve it: systemctl --user restart clawd.service"
    assert any("CLAWD_MODEL_PATH is set" in ln for ln in lines)
    plist = fake_home / "Library" / "LaunchAgents" / "ai.clawd.daemon.plist"
    assert model_registry.restart_hint({"HOME": str(fake_home)}, "darwin") == (
        "restart clawd to serve it (stop `clawd serve` and start it again)"
    )  # no service installed
    plist.parent.mkdir(parents=True)
    plist.write_text("<plist/>")
    assert model_registry.restart_hint({"HOME": str(fake_home)}, "darwin") == (
        f"restart clawd to serve it: launchctl kickstart -k gui/{os.getuid()}/ai.clawd.daemon"
    )


def test_mlx_directory_add_and_use(home, capsys, tmp_path):
    d = mlx_dir(tmp_path / "Qwen2.5-0.5B-Instruct-4bit")
    code, out, _ = models(capsys, "add", str(d))
    assert code == 0 and "added qwen2.5-0.5b-instruct-4bit (mlx, qwen2" in out
    assert registry(home)["qwen2.5-0.5b-instruct-4bit"]["kind"] == "mlx"
    before = state(home)
    code, out, err = models(capsys, "use", "qwen2.5-0.5b-instruct-4bit")
    if "mlx" in SPECS["model.engine"].meta["choices"]:
        settings = load_settings(home / "config.toml", {})
        assert code == 0 and settings.model.engine == "mlx" and settings.model.path == str(d)
        code, out, _ = models(capsys)  # what is served now: the directory, present, not MISSING
        assert code == 0 and f"directory: {d}" in out and "MISSING" not in out and "architecture: qwen2" in out, out
        code, out, _ = models(capsys, "--json")
        info = json.loads(out)
        assert info["present"] and info["size_bytes"] == 64 + 2 + len(json.dumps({"model_type": "qwen2"}))
    else:  # no mlx engine in this build: refused, config untouched
        assert "no mlx engine" in one_line_error(code, err) and state(home) == before


def test_copy_and_remove(home, capsys, tiny_gguf, tmp_path):
    code, out, err = models(capsys, "add", str(tiny_gguf), "--name", "tiny-copy", "--copy")
    assert code == 0, err
    copy = Path(registry(home)["tiny-copy"]["path"])
    assert copy.parent == home / "data" / "models" / "tiny-copy" and copy.read_bytes() == tiny_gguf.read_bytes()
    assert registry(home)["tiny-copy"]["owned"]
    own = tmp_path / "mine.gguf"
    own.write_bytes(tiny_gguf.read_bytes())
    assert models(capsys, "add", str(own))[0] == 0

    assert models(capsys, "use", "tiny-copy")[0] == 0
    before = state(home)
    assert "configured model" in one_line_error(*models(capsys, "remove", "tiny-copy")[::2])
    assert state(home) == before and copy.exists()

    assert models(capsys, "use", "gemma3-270m")[0] == 0
    code, out, _ = models(capsys, "remove", "tiny-copy")
    assert code == 0 and not copy.exists() and "tiny-copy" not in registry(home)
    code, out, _ = models(capsys, "remove", "mine")
    assert code == 0 and own.exists() and "left where it is" in out and registry(home) == {}


def test_bad_input_is_one_line_and_changes_nothing(home, capsys, tiny_gguf, tiny_lora, tmp_path):
    assert models(capsys, "add", str(tiny_gguf))[0] == 0
    assert models(capsys, "use", "tiny-llama")[0] == 0
    not_gguf = tmp_path / "notes.gguf"
    not_gguf.write_bytes(b"this is not a model" * 50)
    other = tmp_path / "other"
    other.mkdir()
    (other / "tiny-llama.gguf").write_bytes(tiny_gguf.read_bytes())
    cases = [
        (["add", str(tmp_path / "nope.gguf")], "does not exist"),
        (["add", str(not_gguf)], "is not a GGUF model"),
        (["add", str(tiny_lora)], "LoRA adapter, not a model"),
        (["add", str(tmp_path)], "config.json"),
        (["add", str(other / "tiny-llama.gguf")], "already registered"),
        (["add", str(tiny_gguf), "--name", "x"], "already registered as tiny-llama"),
        (["add", str(not_gguf), "--name", "Bad Name"], "is not a GGUF model"),
        (["add", str(other / "tiny-llama.gguf"), "--name", "Bad Name"], "not allowed"),
        (["add", str(other / "tiny-llama.gguf"), "--name", "gemma3-270m"], "embedded default"),
        (["use", "qwen"], "no model named 'qwen'"),
        (["remove", "qwen"], "no model named 'qwen'"),
        (["pull", "not a repo!"], "not a Hugging Face repo id"),
    ]
    before = state(home)
    for argv, expected in cases:
        line = one_line_error(*models(capsys, *argv)[::2])
        assert expected in line, (argv, line)
        assert state(home) == before, argv

    (other / "tiny-llama.gguf").unlink()
    reg = home / "data" / "models.json"
    data = json.loads(reg.read_text())
    data["models"].append({**data["models"][0], "name": "gone", "path": str(other / "tiny-llama.gguf")})
    reg.write_text(json.dumps(data))
    before = state(home)
    assert "files are gone" in one_line_error(*models(capsys, "use", "gone")[::2])
    assert state(home) == before


# ---- pull, against the fake hub --------------------------------------------------------------


def clawd(home: Path, *args, **env) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "clawd.cli", "models", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env=make_env(home, HF_HOME=home / "hf-home", HF_HUB_DISABLE_TELEMETRY=1, **env),
    )


def sub_error(proc: subprocess.CompletedProcess) -> str:
    assert "Traceback" not in proc.stderr, proc.stderr
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("clawd: error:")]
    assert proc.returncode == 1 and len(errors) == 1, proc.stderr
    return errors[0]


@pytest.fixture
def hub(tiny_gguf):
    g = tiny_gguf.read_bytes()
    repos = {
        "acme/tiny-GGUF": {"README.md": b"# tiny", "tiny-Q8_0.gguf": g, "tiny-Q4_K_M.gguf": g},
        "acme/many-GGUF": {"a-Q8_0.gguf": g, "a-F16.gguf": g},
        "acme/split-GGUF": {"q4/big-Q4_K_M-00001-of-00002.gguf": g, "q4/big-Q4_K_M-00002-of-00002.gguf": b"x" * 99},
        "acme/tiny-mlx": {
            "config.json": b'{"model_type": "llama"}',
            "model.safetensors": b"\0" * 64,
            "tokenizer.json": b"{}",
            "modeling_evil.py": b"import os",
        },
        "acme/nothing": {"README.md": b"# empty"},
    }
    with FakeHub(repos, gated={"acme/gated"}) as h:
        yield h


def test_pull_gguf_picks_q4_k_m_downloads_and_adds(clawd_home, hub, tiny_gguf):
    p = clawd(clawd_home, "pull", "acme/tiny-GGUF", HF_ENDPOINT=hub.url)
    assert p.returncode == 0, p.stderr
    assert "downloading acme/tiny-GGUF/tiny-Q4_K_M.gguf" in p.stderr
    assert "added tiny-q4_k_m (gguf, llama" in p.stdout
    entry = registry(clawd_home)["tiny-q4_k_m"]
    want = clawd_home / "data" / "models" / "hf" / "acme--tiny-GGUF" / "tiny-Q4_K_M.gguf"
    assert entry["path"] == str(want) and entry["source"] == "hf:acme/tiny-GGUF" and entry["owned"]
    assert want.read_bytes() == tiny_gguf.read_bytes()
    fetched = {path for method, path in hub.requests if method == "GET" and "/resolve/" in path}
    assert fetched == {"/acme/tiny-GGUF/resolve/main/tiny-Q4_K_M.gguf"}  # not the Q8_0, not the README

    p = clawd(
        clawd_home,
        "pull",
        "https://huggingface.co/acme/tiny-GGUF",
        "--file",
        "tiny-Q8_0.gguf",
        "--name",
        "tiny-q8",
        HF_ENDPOINT=hub.url,
    )
    assert p.returncode == 0, p.stderr
    assert registry(clawd_home)["tiny-q8"]["path"].endswith("acme--tiny-GGUF/tiny-Q8_0.gguf")

    p = clawd(clawd_home, "pull", "acme/split-GGUF", HF_ENDPOINT=hub.url)
    assert p.returncode == 0, p.stderr
    split = registry(clawd_home)["big-q4_k_m"]
    assert split["path"].endswith("q4/big-Q4_K_M-00001-of-00002.gguf")
    assert split["size_bytes"] == len(tiny_gguf.read_bytes()) + 99

    p = clawd(clawd_home, "use", "tiny-q4_k_m")
    assert p.returncode == 0, p.stderr
    assert load_settings(clawd_home / "config.toml", {}).model.path == str(want)


def test_pull_mlx_repo_fetches_the_directory_without_code(clawd_home, hub):
    p = clawd(clawd_home, "pull", "acme/tiny-mlx", HF_ENDPOINT=hub.url)
    assert p.returncode == 0, p.stderr
    entry = registry(clawd_home)["tiny-mlx"]
    d = Path(entry["path"])
    assert entry["kind"] == "mlx" and entry["architecture"] == "llama"
    assert sorted(f.name for f in d.iterdir() if f.is_file()) == ["config.json", "model.safetensors", "tokenizer.json"]


def test_pull_errors_are_one_line_and_change_nothing(clawd_home, hub):
    write_default_config(clawd_home / "config.toml")
    before = state(clawd_home)
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    cases = [
        (["acme/many-GGUF"], {}, "has 2 GGUF files; pick one with --file: a-F16.gguf, a-Q8_0.gguf"),
        (["acme/tiny-GGUF", "--file", "tiny-Q2_K.gguf"], {}, "has no GGUF file tiny-Q2_K.gguf"),
        (["acme/nothing"], {}, "neither GGUF files nor an MLX/HF model"),
        (["acme/missing"], {}, "no model repo acme/missing"),
        (["acme/gated"], {}, "is gated"),
        (["acme/tiny-GGUF"], {"HF_ENDPOINT": closed}, f"cannot reach the Hugging Face hub at {closed}"),
        (["acme/tiny-GGUF"], {"HF_HUB_OFFLINE": "1"}, "offline mode"),
    ]
    for argv, env, expected in cases:
        line = sub_error(clawd(clawd_home, "pull", *argv, **{"HF_ENDPOINT": hub.url, **env}))
        assert expected in line, (argv, line)
        assert state(clawd_home) == before, argv
    assert not any(path.startswith("/acme/") and "/resolve/" in path for _, path in hub.requests)
    assert not (clawd_home / "data" / "models" / "hf").exists()


def test_a_directory_model_is_named_by_its_whole_name(tmp_path):
    """Adapters are keyed by the model id: two MLX directories differing after a dot must not share one."""
    from clawd.config import ModelSettings
    from clawd.models import resolve_model
    from clawd.paths import resolve_paths

    paths = resolve_paths({"CLAWD_HOME": str(tmp_path / "home")})
    ids = []
    for name in ("Qwen2.5-0.5B-Instruct-4bit", "Qwen2.5-1.5B-Instruct-4bit"):
        (tmp_path / name).mkdir()
        ids.append(resolve_model(ModelSettings(engine="mlx", path=str(tmp_path / name)), paths).id)
    assert ids == ["Qwen2.5-0.5B-Instruct-4bit", "Qwen2.5-1.5B-Instruct-4bit"]
    gguf = tmp_path / "gemma-3-270m.Q4_K_M.gguf"
    gguf.write_bytes(b"")
    assert resolve_model(ModelSettings(path=str(gguf)), paths).id == "gemma-3-270m.Q4_K_M"
