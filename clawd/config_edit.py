"""Change a few keys of one table in config.toml, keeping everything else byte for byte.

Boundary: the only code that writes to an existing config.toml (`write_default_config`
only creates it). It edits lines, not a parsed document, so the user's comments, order
and spacing survive: a live `key = ...` line in the table is rewritten in place (its
trailing comment kept), a missing key goes right under its commented default (`# key =
...`, as `render_default_config` writes it) or at the end of the table, and a removed
key's line is dropped. The result is parsed again and must equal the old document with
exactly the requested change, else nothing is written; the write is atomic (temp file +
rename), so the daemon's config watcher never sees half a file.
"""

from __future__ import annotations

import os
import re
import tempfile
import tomllib
from collections.abc import Mapping
from pathlib import Path

from clawd.config import _toml_value
from clawd.errors import ConfigError

_HEADER = re.compile(r"^\s*\[\s*([^\[\]]+?)\s*\]\s*(#.*)?$")
_ARRAY_HEADER = re.compile(r"^\s*\[\[")


def _key_line(key: str) -> re.Pattern[str]:
    return re.compile(rf"^(\s*)(?:{re.escape(key)}|\"{re.escape(key)}\")\s*=\s*(.*?)\s*$")


def _commented_key(key: str) -> re.Pattern[str]:
    return re.compile(rf"^\s*#\s*{re.escape(key)}\s*=")


def _value_end(rest: str) -> int | None:
    """Where a one-line TOML string/bool/number value ends in `rest` (text after '='), so a
    trailing comment can be kept. None: a value this editor does not rewrite (multi-line
    strings, arrays, inline tables)."""
    if rest.startswith(('"""', "'''", "[", "{")):
        return None
    if rest.startswith('"'):
        i = 1
        while i < len(rest):
            if rest[i] == "\\":
                i += 2
                continue
            if rest[i] == '"':
                return i + 1
            i += 1
        return None
    if rest.startswith("'"):
        j = rest.find("'", 1)
        return None if j < 0 else j + 1
    j = rest.find("#")
    return len(rest.rstrip()) if j < 0 else len(rest[:j].rstrip())


def _section_of(lines: list[str]) -> list[str | None]:
    """The table each line belongs to ("" = top level, None = an array-of-tables)."""
    out: list[str | None] = []
    current: str | None = ""
    for line in lines:
        if _ARRAY_HEADER.match(line):
            current = None
        else:
            m = _HEADER.match(line)
            if m:
                current = m.group(1).strip().strip('"')
        out.append(current)
    return out


def edit_lines(text: str, table: str, changes: Mapping[str, str | None]) -> str:
    """`text` with `changes` applied to [table]: a str value sets the key, None removes it."""
    lines = text.splitlines()
    for key, value in changes.items():
        sections = _section_of(lines)
        live = [i for i, ln in enumerate(lines) if sections[i] == table and _key_line(key).match(ln)]
        if value is None:
            lines = [ln for i, ln in enumerate(lines) if i not in live]
            continue
        new = f"{key} = {_toml_value(value)}"
        if live:
            i = live[0]
            m = _key_line(key).match(lines[i])
            indent, rest = m.group(1), m.group(2)
            end = _value_end(rest)
            if end is None:
                raise ConfigError(
                    f"config.toml: {table}.{key} is written in a form clawd cannot edit safely; set it by hand: {new}"
                )
            tail = rest[end:]
            lines[i] = indent + new + (("  " + tail.strip()) if tail.strip() else "")
            continue
        in_table = [i for i, s in enumerate(sections) if s == table]
        if not in_table:
            while lines and not lines[-1].strip():
                lines.pop()
            lines += ["", f"[{table}]", new]
            continue
        commented = [i for i in in_table if _commented_key(key).match(lines[i])]
        if commented:
            at = commented[0] + 1  # right under its commented default and help text
        else:
            at = max(i for i in in_table if lines[i].strip()) + 1  # the table's last non-blank line
        lines.insert(at, new)
    return "\n".join(lines) + "\n"


def set_table_keys(config_file: Path, table: str, changes: Mapping[str, str | None]) -> bool:
    """Apply `changes` to [table] of config_file (created if absent). Returns False when the
    file already says exactly that (nothing written).

    Raises:
        ConfigError: the file is unreadable or not valid TOML, the keys are written in a form
            the line editor cannot change safely, or it cannot be written; the file is unchanged.
    """
    try:
        old_text = config_file.read_text(encoding="utf-8") if config_file.exists() else ""
        old = tomllib.loads(old_text)
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read {config_file}: {e}") from e
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{config_file}: invalid TOML ({e}); fix it first, nothing was changed") from e

    want = {k: v for k, v in old.items()}
    section = dict(want.get(table, {})) if isinstance(want.get(table, {}), dict) else None
    if section is None:
        raise ConfigError(f"{config_file}: {table} is not a table; fix it by hand")
    for k, v in changes.items():
        if v is None:
            section.pop(k, None)
        else:
            section[k] = v
    want[table] = section
    if want == old or (not section and table not in old and want == {**old, table: {}}):
        return False

    new_text = edit_lines(old_text, table, changes)
    try:
        got = tomllib.loads(new_text)
    except tomllib.TOMLDecodeError:
        got = None
    if got != want:
        # E.g. the keys were set as dotted keys (model.path = ...) or in an inline table.
        pairs = ", ".join(f"{k} = {_toml_value(v)}" if v is not None else f"remove {k}" for k, v in changes.items())
        raise ConfigError(f"{config_file}: cannot edit [{table}] safely; change it by hand: {pairs}")
    try:
        write_text_atomic(config_file, new_text)
    except OSError as e:
        raise ConfigError(f"cannot write {config_file}: {e.strerror or e}; nothing was changed") from e
    return True


def write_text_atomic(path: Path, text: str) -> None:
    """Write `text` to `path` through a temp file in the same dir and a rename, keeping the
    file's mode: a crash mid-write leaves the old file or the new one, never half. OSError out."""
    mode = path.stat().st_mode & 0o777 if path.exists() else 0o644
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}-", suffix=path.suffix, dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
