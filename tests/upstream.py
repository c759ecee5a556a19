"""A real OpenAI-compatible upstream for the `openai` engine's tests: llama-cpp-python's own
server (`python -m llama_cpp.server`) on a tiny GGUF, started as a subprocess on a free port."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaCppServer:
    def __init__(self, model: Path, n_ctx: int):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/v1"
        # One thread: llama.cpp's threads spin-wait on each other on a loaded 2-core machine.
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "llama_cpp.server",
                "--model",
                str(model),
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--n_ctx",
                str(n_ctx),
                "--n_threads",
                "1",
                "--n_threads_batch",
                "1",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )

    def wait_ready(self, timeout: float = 90) -> str:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError("llama_cpp.server exited:\n" + self.proc.stdout.read())
            try:
                if httpx.get(self.url + "/models", timeout=2).status_code == 200:
                    return self.url
            except httpx.TransportError:
                time.sleep(0.2)
        raise AssertionError("llama_cpp.server did not start")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.proc.stdout.close()
