"""A local stand-in for PyPI, so `clawd models pull NAME` (a catalog model) is tested without the network.

It serves a folder of wheels the way pypi.org does for the routes clawd/pypi_fetch.py uses:

  GET /simple/PROJECT/             PEP 691 JSON {"files": [{"filename", "url", "size",
                                    "hashes": {"sha256"}}]} when asked for it (Accept), else the
                                    PEP 503 HTML page (anchors with #sha256=, no sizes)
  HEAD /packages/FILENAME          its Content-Length
  GET /packages/FILENAME           the wheel (honours `Range: bytes=N-` with a 206, unless
                                    `ranges` is False: then always the whole file with a 200)

Knobs a test turns to make it misbehave, each on one wheel file name:
  cut_once   the next GET sends the whole Content-Length header but only the first half of the
             bytes, then closes the connection (a download that breaks off)
  cut_always every GET breaks off like that, also when resuming (the pull must give up)
  serve_instead  bytes served in place of the file, while the listing still has the file's sha256
             (a corrupting proxy or mirror)
And on the whole index: `html_only` answers every project page in HTML (an older mirror).

`requests` records (path, Range header or None) of every request.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

_PROJECT = re.compile(r"^/simple/([^/]+)/?$")
_FILE = re.compile(r"^/packages/([^/]+)$")


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


class FakePyPI:
    def __init__(self, folder: Path):
        self.folder = folder
        self.ranges = True
        self.html_only = False
        self.cut_once: set[str] = set()
        self.cut_always: set[str] = set()
        self.serve_instead: dict[str, bytes] = {}
        self.requests: list[tuple[str, str | None]] = []
        pypi = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # keep pytest output clean
                pass

            def do_GET(self):
                pypi._handle(self)

            def do_HEAD(self):  # a file's size, for a listing that has none
                name = unquote(urlsplit(self.path).path).removeprefix("/packages/")
                ok = (pypi.folder / name).is_file() and "/" not in name
                self.send_response(200 if ok else 404)
                self.send_header("Content-Length", str((pypi.folder / name).stat().st_size if ok else 0))
                self.end_headers()

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FakePyPI:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def downloads(self, filename: str) -> list[str | None]:
        """The Range header of each GET of that file (None: a request from the start)."""
        return [rng for path, rng in self.requests if path == f"/packages/{filename}"]

    def _handle(self, req: BaseHTTPRequestHandler) -> None:
        path = unquote(urlsplit(req.path).path)
        self.requests.append((path, req.headers.get("Range")))
        m = _PROJECT.match(path)
        if m:
            wheels = [w for w in sorted(self.folder.glob("*.whl")) if normalize(w.name.split("-")[0]) == m.group(1)]
            if not wheels or m.group(1) != normalize(m.group(1)):
                return self._send(req, 404, b"not found", "text/plain")
            files = [
                {
                    "filename": w.name,
                    "url": f"/packages/{w.name}",  # relative, as PyPI's mirrors often write it
                    "size": w.stat().st_size,
                    "hashes": {"sha256": hashlib.sha256(w.read_bytes()).hexdigest()},
                }
                for w in wheels
            ]
            if "application/vnd.pypi.simple.v1+json" in (req.headers.get("Accept") or "") and not self.html_only:
                body = json.dumps({"meta": {"api-version": "1.1"}, "name": m.group(1), "files": files}).encode()
                return self._send(req, 200, body, "application/vnd.pypi.simple.v1+json")
            anchors = "".join(
                f'<a href="{f["url"]}#sha256={f["hashes"]["sha256"]}">{f["filename"]}</a><br/>\n' for f in files
            )
            return self._send(req, 200, f"<!DOCTYPE html><html><body>{anchors}</body></html>".encode(), "text/html")
        m = _FILE.match(path)
        if not m or not (self.folder / m.group(1)).is_file():
            return self._send(req, 404, b"not found", "text/plain")
        name = m.group(1)
        data = self.serve_instead.get(name) or (self.folder / name).read_bytes()
        start = 0
        rng = re.match(r"bytes=(\d+)-$", req.headers.get("Range") or "")
        if rng and self.ranges:
            start = int(rng.group(1))
            if start >= len(data):
                return self._send(req, 416, b"", "text/plain", extra={"Content-Range": f"bytes */{len(data)}"})
        cut = name in self.cut_always or name in self.cut_once
        self.cut_once.discard(name)
        req.send_response(206 if start else 200)
        req.send_header("Content-Type", "application/octet-stream")
        req.send_header("Accept-Ranges", "bytes" if self.ranges else "none")
        req.send_header("Content-Length", str(len(data) - start))
        if start:
            req.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        if cut:
            req.send_header("Connection", "close")
        req.end_headers()
        if cut:  # promise everything, send half of what is left, hang up
            req.wfile.write(data[start : start + max(1, (len(data) - start) // 2)])
            req.wfile.flush()
            req.close_connection = True
            return
        req.wfile.write(data[start:])

    @staticmethod
    def _send(req, status: int, body: bytes, ctype: str, extra: dict | None = None) -> None:
        req.send_response(status)
        req.send_header("Content-Type", ctype)
        req.send_header("Content-Length", str(len(body)))
        for k, v in (extra or {}).items():
            req.send_header(k, v)
        req.end_headers()
        req.wfile.write(body)


def build_wheel(folder: Path, package: str, version: str, files: dict[str, bytes]) -> Path:
    """A wheel as the catalog's packages are laid out: `{module}/…` files plus a dist-info."""
    import zipfile

    module = package.replace("-", "_")
    path = folder / f"{module}-{version}-py3-none-any.whl"
    dist = f"{module}-{version}.dist-info"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr(f"{module}/__init__.py", "")
        for member, data in files.items():
            z.writestr(member, data)
        z.writestr(f"{dist}/METADATA", f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n")
        z.writestr(f"{dist}/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{dist}/RECORD", "")
    return path
