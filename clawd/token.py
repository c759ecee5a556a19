"""The bearer token: made once, kept in a 0600 file, read by the daemon and its clients."""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from clawd.errors import ConfigError


def ensure_token(path: Path) -> str:
    """Return the token, creating it (owner-only) on first use."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return read_token(path)
    token = "clawd-" + secrets.token_urlsafe(32)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token


def read_token(path: Path) -> str:
    try:
        token = path.read_text().strip()
    except OSError as e:
        raise ConfigError(
            f"cannot read the token file {path} ({e.strerror}); delete it and restart the daemon to make a new one"
        ) from e
    if not token:
        raise ConfigError(f"the token file {path} is empty; delete it and restart the daemon")
    return token
