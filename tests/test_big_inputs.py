"""Big inputs never block the daemon (issue 18, item 3): a body over server.max_request_mb
gets 413 at once, announced (Content-Length) or not (chunked), and while a big-but-allowed
prompt is rendered and tokenized, /clawd/health keeps answering within 100 ms.

Real HTTP (uvicorn on a socket, raw sockets on the client side so nothing buffers the
body for us); the fake engine, made to tokenize as slowly as llama.cpp does a long prompt.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from urllib.parse import urlparse

import httpx
import pytest

from clawd.engines import fake
from tests.conftest import AUTH, ROOT, give_token, make_env, start_daemon

MB = 1024 * 1024


@pytest.fixture
def big_daemon(clawd_home):
    """A daemon in its own process whose tokenizer is as slow as llama.cpp's on a long prompt."""
    give_token(clawd_home)  # the daemon keeps the token file it finds: tests send TEST_TOKEN
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.slow_tokenizer_daemon"],
        cwd=ROOT,
        env=make_env(clawd_home, CLAWD_SERVER_PORT=0, CLAWD_MINING_ENABLED=0),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        line = proc.stdout.readline()  # blocks until the daemon listens, or ends with it
        assert line.startswith("ready "), f"the daemon did not start (exit {proc.poll()})"
        yield line.split()[1]
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def raw_post(url: str, path: str, *, length: int | None, body_size: int, timeout: float = 10.0):
    """POST `body_size` bytes of JSON-ish filler on a raw socket, announced with
    Content-Length `length` (None: chunked), sending from a thread while the response is
    read here. Returns (status, parsed JSON body, seconds until the response arrived)."""
    u = urlparse(url)
    sock = socket.create_connection((u.hostname, u.port), timeout=timeout)
    head = f"POST {path} HTTP/1.1\r\nHost: {u.hostname}:{u.port}\r\nContent-Type: application/json\r\n"
    head += "".join(f"{k}: {v}\r\n" for k, v in AUTH.items())
    head += f"Content-Length: {length}\r\n" if length is not None else "Transfer-Encoding: chunked\r\n"
    t0 = time.perf_counter()
    sock.sendall((head + "\r\n").encode())

    def send_body():
        piece = b"x" * (256 * 1024)
        sent = 0
        try:
            while sent < body_size:
                n = min(len(piece), body_size - sent)
                data = piece[:n]
                sock.sendall(data if length is not None else f"{n:x}\r\n".encode() + data + b"\r\n")
                sent += n
            if length is None:
                sock.sendall(b"0\r\n\r\n")
        except OSError:
            pass  # the server answered and closed: the rest of the body is not wanted

    sender = threading.Thread(target=send_body, daemon=True)
    sender.start()
    data = b""
    try:
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
        elapsed = time.perf_counter() - t0
        head_part, _, rest = data.partition(b"\r\n\r\n")
        status = int(head_part.split(b" ", 2)[1])
        size = next(
            int(line.split(b":", 1)[1])
            for line in head_part.split(b"\r\n")
            if line.lower().startswith(b"content-length")
        )
        while len(rest) < size:
            chunk = sock.recv(65536)
            if not chunk:
                break
            rest += chunk
    finally:
        sock.close()
        sender.join(timeout)
    return status, json.loads(rest[:size]), elapsed


class HealthPoller:
    """Polls /clawd/health back to back on its own thread and keeps every latency."""

    def __init__(self, url: str):
        self.url = url
        self.latencies: list[float] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        with httpx.Client(base_url=self.url, timeout=5) as c:
            while not self._stop.is_set():
                t0 = time.perf_counter()
                r = c.get("/clawd/health")
                self.latencies.append(time.perf_counter() - t0)
                if r.status_code != 200:
                    self.errors.append(r.text)

    def wait_for_polls(self, n: int, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while len(self.latencies) < n and time.monotonic() < deadline:
            time.sleep(0.01)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(10)


def test_a_50mb_body_gets_413_at_once(fake_daemon):
    status, body, elapsed = raw_post(fake_daemon.url, "/v1/chat/completions", length=50 * MB, body_size=50 * MB)
    assert status == 413
    assert body["error"]["code"] == "request_too_large" and "max_request_mb" in body["error"]["message"]
    assert elapsed < 1.0, f"413 took {elapsed:.2f} s"
    assert fake_daemon.client().get("/clawd/health").json() == {"status": "ok"}


def test_a_chunked_body_over_the_limit_gets_413(fake_daemon):
    status, body, elapsed = raw_post(fake_daemon.url, "/v1/chat/completions", length=None, body_size=3 * MB)
    assert status == 413, body
    assert body["error"]["type"] == "invalid_request_error"
    assert elapsed < 1.0


def test_a_chunked_body_under_the_limit_is_served(fake_daemon):
    """The limit buffers a chunked body and hands it on whole: the request works as usual."""
    payload = json.dumps({"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})

    def chunks():
        for i in range(0, len(payload), 7):
            yield payload[i : i + 7].encode()

    r = fake_daemon.client().post(
        "/v1/chat/completions", content=chunks(), headers={"content-type": "application/json"}
    )
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"]


def test_the_limit_is_configurable(clawd_home):
    d = start_daemon(clawd_home, fake.Engine(n_ctx=512), {"CLAWD_SERVER_MAX_REQUEST_MB": 0.01})
    try:
        msg = {"model": "fake-model", "messages": [{"role": "user", "content": "x" * 20_000}], "max_tokens": 1}
        r = d.client().post("/v1/chat/completions", json=msg)
        assert r.status_code == 413
        small = {**msg, "messages": [{"role": "user", "content": "hi"}]}
        assert d.client().post("/v1/chat/completions", json=small).status_code == 200
    finally:
        d.stop()


def test_a_prompt_far_too_long_for_the_context_is_refused_before_tokenizing(clawd_home):
    class CountingTokenizer(fake.Engine):
        calls = 0

        def tokenize(self, text, *, add_bos, special=True):
            CountingTokenizer.calls += 1
            return super().tokenize(text, add_bos=add_bos, special=special)

    d = start_daemon(clawd_home, CountingTokenizer(n_ctx=512))
    try:
        before = CountingTokenizer.calls
        msg = {"model": "fake-model", "messages": [{"role": "user", "content": "x" * (64 * 512 + 1)}]}
        r = d.client().post("/v1/chat/completions", json=msg)
        assert r.status_code == 400
        assert r.json()["error"]["code"] == "context_length_exceeded"
        assert CountingTokenizer.calls == before  # refused on its length alone
    finally:
        d.stop()


def test_health_answers_within_100ms_while_a_big_prompt_is_tokenized_and_50mb_arrive(big_daemon):
    url = big_daemon
    content = "y" * int(0.9 * MB)  # just under the 1 MB limit, with the JSON around it
    results: dict = {}

    def big_prompt():
        with httpx.Client(base_url=url, timeout=60, headers=AUTH) as c:
            r = c.post(
                "/v1/chat/completions",
                json={"model": "fake-model", "messages": [{"role": "user", "content": content}], "max_tokens": 4},
            )
            results["big"] = r.status_code

    # The same polling with nothing else going on: what this machine's load alone costs
    # (a couple of ms when quiet; on a CI box shared with other jobs, far more).
    with HealthPoller(url) as idle:
        idle.wait_for_polls(200)
    with HealthPoller(url) as poller:
        worker = threading.Thread(target=big_prompt)
        worker.start()
        results["huge"] = raw_post(url, "/v1/chat/completions", length=50 * MB, body_size=50 * MB)
        worker.join(60)
    assert results["big"] == 200
    assert results["huge"][0] == 413
    assert not poller.errors
    assert len(poller.latencies) >= 10, "health was hardly polled: the test proves nothing"
    worst, idle_worst = max(poller.latencies), max(idle.latencies)
    assert worst < 0.1 + idle_worst, (
        f"/clawd/health took {worst * 1000:.0f} ms at worst ({len(poller.latencies)} polls); "
        f"{idle_worst * 1000:.0f} ms with no big input"
    )


def test_max_request_mb_is_validated_like_every_setting(tmp_path):
    from clawd.config import load_settings
    from clawd.errors import ConfigError

    assert load_settings(tmp_path / "none.toml", {}).server.max_request_mb == 1.0
    with pytest.raises(ConfigError, match="server.max_request_mb"):
        load_settings(tmp_path / "none.toml", {"CLAWD_SERVER_MAX_REQUEST_MB": "0"})


async def test_the_daemons_connections_have_tcp_nodelay():
    """uvicorn serves on the socket daemon.bind_socket makes; asyncio sets TCP_NODELAY on its
    connections only when that socket says IPPROTO_TCP. Without it each keep-alive response
    waited ~40 ms (Nagle's algorithm against the client's delayed ACK)."""
    import asyncio

    from clawd.daemon import bind_socket

    seen: asyncio.Future = asyncio.get_running_loop().create_future()

    class Probe(asyncio.Protocol):
        def connection_made(self, transport):
            sock = transport.get_extra_info("socket")
            seen.set_result(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            transport.close()

    sock = bind_socket("127.0.0.1", 0)
    server = await asyncio.get_running_loop().create_server(Probe, sock=sock)
    try:
        _, writer = await asyncio.open_connection("127.0.0.1", sock.getsockname()[1])
        assert await asyncio.wait_for(seen, 10) != 0
        writer.close()
    finally:
        server.close()
        await server.wait_closed()
