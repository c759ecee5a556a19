"""A local stand-in for the Hugging Face hub, so `clawd models pull` is tested without the network.

It serves the routes huggingface_hub (2.x, and 0.2x alike) calls for `HfApi.list_repo_tree`,
`HfApi.repo_info` / `model_info`, `hf_hub_download` and `snapshot_download`:

  GET  /api/models/OWNER/NAME[/revision/REV]            repo info: id, sha, siblings
  GET  /api/models/OWNER/NAME/tree/REV[/PATH]?recursive  [{"type": "file", "path", "size", "oid"}] (one page)
  HEAD /OWNER/NAME/resolve/REV/PATH                      X-Repo-Commit, ETag, Content-Length (no body)
  GET  /OWNER/NAME/resolve/REV/PATH                      the bytes (honours `Range: bytes=N-` for resumes)

An unknown repo answers 404 + `X-Error-Code: RepoNotFound`, an unknown file 404 +
`EntryNotFound`, a gated repo 401 + `GatedRepo`: the headers huggingface_hub maps to its
error classes. Point a `clawd` subprocess at it with HF_ENDPOINT=<url>. `requests` records
(method, path) of every request, so a test can show what was fetched.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

_API = re.compile(r"^/api/models/([^/]+/[^/]+)(?:/(revision|tree)/([^/]+)(/.*)?)?$")
_RESOLVE = re.compile(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$")


class FakeHub:
    def __init__(self, repos: dict[str, dict[str, bytes]], gated: set[str] = frozenset()):
        self.repos = repos
        self.gated = set(gated)
        self.requests: list[tuple[str, str]] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep pytest output clean
                pass

            def do_HEAD(self):
                hub._handle(self, head=True)

            def do_GET(self):
                hub._handle(self, head=False)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FakeHub:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    @staticmethod
    def sha(repo: str) -> str:
        return hashlib.sha1(repo.encode()).hexdigest()  # a stable 40-hex "commit"

    def _handle(self, req: BaseHTTPRequestHandler, *, head: bool) -> None:
        path = unquote(urlsplit(req.path).path)
        self.requests.append((req.command, path))
        m = _API.match(path)
        if m and not head:
            repo, what, _rev, sub = m.groups()
            if not self._repo_ok(req, repo):
                return
            files = self.repos[repo]
            if what == "tree":
                prefix = (sub or "/").strip("/")
                entries = [
                    {"type": "file", "path": p, "size": len(b), "oid": hashlib.sha1(b).hexdigest()}
                    for p, b in sorted(files.items())
                    if not prefix or p.startswith(prefix + "/")
                ]
                return self._json(req, entries)
            return self._json(
                req,
                {
                    "id": repo,
                    "modelId": repo,
                    "sha": self.sha(repo),
                    "private": False,
                    "siblings": [{"rfilename": p} for p in sorted(files)],
                },
            )
        m = _RESOLVE.match(path)
        if m:
            repo, _rev, name = m.groups()
            if not self._repo_ok(req, repo, head=head):
                return
            if name not in self.repos[repo]:
                return self._error(req, 404, "EntryNotFound", f"{name} does not exist", head=head)
            body = self.repos[repo][name]
            start = 0
            rng = re.match(r"bytes=(\d+)-$", req.headers.get("Range", ""))
            if rng and not head:
                start = int(rng.group(1))
            req.send_response(206 if start else 200)
            req.send_header("X-Repo-Commit", self.sha(repo))
            req.send_header("ETag", f'"{hashlib.sha1(body).hexdigest()}"')
            req.send_header("Accept-Ranges", "bytes")
            req.send_header("Content-Type", "application/octet-stream")
            req.send_header("Content-Length", str(len(body) - start))
            if start:
                req.send_header("Content-Range", f"bytes {start}-{len(body) - 1}/{len(body)}")
            req.end_headers()
            if not head:
                req.wfile.write(body[start:])
            return
        self._error(req, 404, None, "not a route of the fake hub", head=head)

    def _repo_ok(self, req, repo: str, *, head: bool = False) -> bool:
        if repo in self.gated:
            self._error(req, 401, "GatedRepo", "Access to this model is restricted", head=head)
            return False
        if repo not in self.repos:
            self._error(req, 404, "RepoNotFound", "Repository not found", head=head)
            return False
        return True

    @staticmethod
    def _json(req, obj) -> None:
        data = json.dumps(obj).encode()
        req.send_response(200)
        req.send_header("Content-Type", "application/json")
        req.send_header("Content-Length", str(len(data)))
        req.end_headers()
        req.wfile.write(data)

    @staticmethod
    def _error(req, status: int, code: str | None, message: str, *, head: bool) -> None:
        data = b"" if head else json.dumps({"error": message}).encode()
        req.send_response(status)
        if code:
            req.send_header("X-Error-Code", code)
        req.send_header("X-Error-Message", message)
        req.send_header("Content-Type", "application/json")
        req.send_header("Content-Length", str(len(data)))
        req.end_headers()
        req.wfile.write(data)
