"""config.py: layering, validation errors, the written default config."""

from __future__ import annotations

import dataclasses
import json
import re
import tomllib

import pytest

from clawd.config import (
    GenerationSettings,
    ModelSettings,
    ServerSettings,
    Settings,
    describe_settings,
    env_var,
    load_settings,
    settings_to_dict,
    write_default_config,
)
from clawd.errors import ConfigError


@pytest.fixture
def cfg(tmp_path):
    return tmp_path / "config.toml"


def test_missing_file_gives_defaults(cfg):
    s = load_settings(cfg, {})
    assert s == Settings()
    assert s.server.host == "127.0.0.1" and s.server.port == 8757 and s.server.require_token is False
    assert s.server.trust_loopback is False and s.server.allowed_origins == ""
    assert s.model.engine == "llamacpp" and s.model.path == "" and s.model.chat_format == "auto"
    assert s.generation.max_tokens == 512 and s.log_level == "info"


def test_every_field_has_help_text():
    for cls in (ServerSettings, ModelSettings, GenerationSettings):
        for f in dataclasses.fields(cls):
            assert f.metadata.get("help"), f"{cls.__name__}.{f.name} has no help"
    keys = [k for k, _, _ in describe_settings()]
    assert keys[0] == "log_level"
    assert {"server.port", "model.path", "model.n_threads", "generation.top_p"} <= set(keys)


def test_layering_file_env_override(cfg):
    cfg.write_text('log_level = "debug"\n[server]\nport = 9001\nhost = "0.0.0.0"\n[generation]\ntemperature = 1\n')

    s = load_settings(cfg, {})
    assert s.server.port == 9001  # file beats default
    assert s.server.host == "0.0.0.0"
    assert s.generation.temperature == 1.0 and isinstance(s.generation.temperature, float)
    assert s.log_level == "debug"

    env = {"CLAWD_SERVER_PORT": "9002", "CLAWD_LOG_LEVEL": "WARNING", "CLAWD_MODEL_PATH": "/m/x.gguf"}
    s = load_settings(cfg, env)
    assert s.server.port == 9002  # env beats file
    assert s.log_level == "warning"
    assert s.model.path == "/m/x.gguf"
    assert s.server.host == "0.0.0.0"  # untouched by env: file still holds

    s = load_settings(cfg, env, {"server.port": 9003, "log_level": None, "model.engine": "fake"})
    assert s.server.port == 9003  # override beats env
    assert s.log_level == "warning"  # None = flag not given
    assert s.model.engine == "fake"


@pytest.mark.parametrize(
    "raw, expected",
    [("1", True), ("true", True), ("YES", True), ("on", True), ("0", False), ("false", False), ("off", False)],
)
def test_bool_from_env(cfg, raw, expected):
    assert load_settings(cfg, {"CLAWD_SERVER_REQUIRE_TOKEN": raw}).server.require_token is expected


def test_env_var_names():
    assert env_var("server.port") == "CLAWD_SERVER_PORT"
    assert env_var("model.n_ctx") == "CLAWD_MODEL_N_CTX"
    assert env_var("log_level") == "CLAWD_LOG_LEVEL"


def test_bad_int_from_env_names_variable_and_key(cfg):
    with pytest.raises(ConfigError) as ei:
        load_settings(cfg, {"CLAWD_SERVER_PORT": "abc"})
    msg = ei.value.message
    assert "CLAWD_SERVER_PORT" in msg and "server.port must be an integer, got 'abc'" in msg
    assert "\n" not in msg
    assert ei.value.param == "server.port"


def test_bad_type_in_file_names_file_and_key(cfg):
    cfg.write_text('[server]\nport = "abc"\n')
    with pytest.raises(ConfigError) as ei:
        load_settings(cfg, {})
    assert str(cfg) in ei.value.message and "server.port must be an integer, got 'abc'" in ei.value.message

    cfg.write_text("[server]\nport = true\n")  # a bool is not a port
    with pytest.raises(ConfigError, match="server.port must be an integer"):
        load_settings(cfg, {})

    cfg.write_text('[server]\nrequire_token = "maybe"\n')
    with pytest.raises(ConfigError, match="server.require_token must be a boolean"):
        load_settings(cfg, {})


def test_bad_choice_and_range(cfg):
    with pytest.raises(ConfigError, match="model.engine must be one of llamacpp, mlx, openai, fake"):
        load_settings(cfg, {"CLAWD_MODEL_ENGINE": "vllm"})
    with pytest.raises(ConfigError, match="server.port must be <= 65535"):
        load_settings(cfg, {}, {"server.port": "70000"})
    with pytest.raises(ConfigError, match="generation.temperature must be >= 0"):
        load_settings(cfg, {"CLAWD_GENERATION_TEMPERATURE": "-1"})
    with pytest.raises(ConfigError, match="generation.top_p must be a finite number"):
        load_settings(cfg, {"CLAWD_GENERATION_TOP_P": "nan"})


def test_unknown_keys_in_file_are_named_with_valid_ones(cfg):
    cfg.write_text("[server]\nprot = 9000\n")
    with pytest.raises(ConfigError) as ei:
        load_settings(cfg, {})
    msg = ei.value.message
    assert "server.prot" in msg and "host, port, trust_loopback, allowed_origins, require_token" in msg
    assert ei.value.param == "server.prot"

    cfg.write_text("colour = 1\n")
    with pytest.raises(ConfigError, match=r"unknown key colour; valid top-level keys.*log_level.*\[server\]"):
        load_settings(cfg, {})

    cfg.write_text("server = 5\n")
    with pytest.raises(ConfigError, match=r"server must be a table"):
        load_settings(cfg, {})


def test_unknown_override_key(cfg):
    with pytest.raises(ConfigError, match="unknown setting 'server.prot'"):
        load_settings(cfg, {}, {"server.prot": 1})


def test_bad_toml_syntax(cfg):
    cfg.write_text("[server]\nport = = 9\n")
    with pytest.raises(ConfigError) as ei:
        load_settings(cfg, {})
    assert str(cfg) in ei.value.message and "invalid TOML" in ei.value.message
    assert "line 2" in ei.value.message


def test_unrelated_env_ignored(cfg):
    # CLAWD_HOME and friends belong to paths.py, not to settings.
    assert load_settings(cfg, {"CLAWD_HOME": "/x", "PORT": "1"}) == Settings()


def test_default_config_parses_back_to_defaults_and_has_every_help(cfg):
    assert write_default_config(cfg) is True
    text = cfg.read_text()
    assert load_settings(cfg, {}) == Settings()
    for key, _default, _help in describe_settings():
        name = key.rpartition(".")[2]
        assert f"# {name} = " in text
        assert env_var(key) in text
    # Every help text appears in full once line wrapping is undone.
    unwrapped = " ".join(line.lstrip("# ").strip() for line in text.splitlines())
    for _, _, help_text in describe_settings():
        assert help_text in unwrapped
    # No value is set: every non-blank line is a comment or a (empty) table header.
    for line in text.splitlines():
        assert (
            not line
            or line.startswith("#")
            or line in ("[server]", "[model]", "[generation]", "[mining]", "[training]", "[openwebui]")
        ), line
    # Uncommenting every value line reproduces the defaults exactly.
    live = "\n".join(line[2:] if re.match(r"# [a-z_]+ = ", line) else line for line in text.splitlines())
    doc = tomllib.loads(live)
    assert doc["log_level"] == "info" and doc["server"]["port"] == 8757 and doc["model"]["path"] == ""
    cfg.write_text(live)
    assert load_settings(cfg, {}) == Settings()


def test_default_config_never_overwrites(cfg):
    cfg.write_text("[server]\nport = 9999\n")
    assert write_default_config(cfg) is False
    assert cfg.read_text() == "[server]\nport = 9999\n"


def test_default_config_creates_parent(tmp_path):
    target = tmp_path / "a" / "b" / "config.toml"
    assert write_default_config(target) is True and target.exists()


def test_settings_to_dict_is_json_ready(cfg):
    d = settings_to_dict(load_settings(cfg, {"CLAWD_SERVER_PORT": "9000"}))
    assert d["server"]["port"] == 9000 and d["log_level"] == "info"
    assert json.loads(json.dumps(d)) == d
