"""A thumbs down given in a real Open WebUI, in a real (headless) browser, reaches `clawd signals`.

    pip install 'clawd[browser]'        # playwright (the client library); the browser is the system's
    apt-get install chromium            # Debian's Chromium (no browser download)
    python examples/openwebui_browser.py --open-webui ~/.cache/clawd-tests/openwebui-venv/bin/open-webui

Starts `clawd serve` (fake engine, rules judges: seconds, no model) and Open WebUI pointed at
it as README's "Use clawd with Open WebUI" says, creates the admin account through Open
WebUI's API, runs `clawd connect openwebui`, then in Chromium: logs in, asks a question,
clicks 👎, types a comment and saves. It waits until `clawd signals` shows the turn with the
comment as its hint, and saves a screenshot of the rated reply (--screenshot). Everything it
starts, it stops. Prints what happened, step by step.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx

QUESTION = "What color is the sky on a clear day?"
COMMENT = "Answer in one word: blue."
HEADERS = {
    "X-OpenWebUI-Chat-Id": "{{CHAT_ID}}",
    "X-OpenWebUI-Message-Id": "{{MESSAGE_ID}}",
    "X-OpenWebUI-Task": "{{TASK}}",
}  # clawd.openwebui.origin.CONNECTION_HEADERS, spelled out: this script imports nothing of clawd


def say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(what: str, check, timeout: float):
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.5)


def up(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def clawd(env: dict, *args: str, check: bool = True) -> str:
    r = subprocess.run([sys.executable, "-m", "clawd.cli", *args], env=env, capture_output=True, text=True, timeout=120)
    if check and r.returncode != 0:
        raise SystemExit(f"clawd {' '.join(args)} failed: {r.stderr}")
    return r.stdout


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--open-webui", required=True, help="the open-webui executable (in its own venv)")
    ap.add_argument("--chromium", default="/usr/bin/chromium", help="the browser to drive")
    ap.add_argument("--screenshot", default="docs/openwebui-thumbs-down.png")
    args = ap.parse_args()
    from playwright.sync_api import TimeoutError as PlaywrightTimeout  # the `browser` extra
    from playwright.sync_api import sync_playwright

    work = Path(tempfile.mkdtemp(prefix="clawd-owui-"))
    clawd_port, owui_port = free_port(), free_port()
    env = {
        **os.environ,
        "CLAWD_HOME": str(work / "clawd"),
        "CLAWD_SERVER_PORT": str(clawd_port),
        "CLAWD_MINING_JUDGE": "rules",
        "CLAWD_MINING_HINT_JUDGE": "rules",
        "CLAWD_MINING_QUIET_S": "0",
        "CLAWD_OPENWEBUI_POLL_S": "2",
    }
    procs: list[subprocess.Popen] = []
    try:
        token = clawd(env, "token").strip()
        say(f"clawd serve --engine fake on :{clawd_port}")
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "clawd.cli", "serve", "--engine", "fake"],
                env=env,
                stdout=(work / "clawd.log").open("w"),
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        )
        wait_for("clawd", lambda: up(f"http://127.0.0.1:{clawd_port}/clawd/health"), 60)
        owui_env = {
            "PATH": os.environ["PATH"],
            "HOME": str(work),
            "DATA_DIR": str(work / "open-webui"),
            "WEBUI_SECRET_KEY": uuid.uuid4().hex,
            "OFFLINE_MODE": "true",
            "HF_HUB_OFFLINE": "1",
            "ANONYMIZED_TELEMETRY": "false",
            "DO_NOT_TRACK": "true",
            "SCARF_NO_ANALYTICS": "true",
            "ENABLE_OLLAMA_API": "false",
            "RAG_EMBEDDING_ENGINE": "openai",
            "BYPASS_EMBEDDING_AND_RETRIEVAL": "true",
            "OPENAI_API_BASE_URLS": f"http://127.0.0.1:{clawd_port}/v1",
            "OPENAI_API_KEYS": token,
            "OPENAI_API_CONFIGS": json.dumps({"0": {"enable": True, "headers": HEADERS}}),
            "DEFAULT_MODELS": "fake-model",
        }
        (work / "open-webui").mkdir()
        say(f"open-webui serve on :{owui_port}, its connection: http://127.0.0.1:{clawd_port}/v1 + {HEADERS}")
        procs.append(
            subprocess.Popen(
                [args.open_webui, "serve", "--host", "127.0.0.1", "--port", str(owui_port)],
                env=owui_env,
                cwd=work,
                stdout=(work / "open-webui.log").open("w"),
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        )
        owui = f"http://127.0.0.1:{owui_port}"
        wait_for("Open WebUI", lambda: up(owui + "/health"), 300)
        email, password = "ada@example.com", "pw-" + uuid.uuid4().hex[:12]
        r = httpx.post(owui + "/api/v1/auths/signup", json={"name": "Ada", "email": email, "password": password})
        r.raise_for_status()
        say(f"Open WebUI account {email} created through its API (role {r.json()['role']})")
        out = clawd(env, "connect", "openwebui", "--url", owui, "--api-key", r.json()["token"])
        say("clawd connect openwebui:\n    " + out.strip().replace("\n", "\n    "))

        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=args.chromium, headless=True, args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.goto(owui + "/auth")
            page.fill("input[type=email]", email)
            page.fill("input[type=password]", password)
            page.get_by_role("button", name="Sign in").click()
            say("browser: logged in")
            page.wait_for_selector("#chat-input", timeout=60_000)
            try:  # the first login's "what's new" dialog, when it shows
                page.get_by_role("button", name="Okay, Let's Go!").click(timeout=3000)
            except PlaywrightTimeout:
                page.keyboard.press("Escape")
            page.click("#chat-input")
            page.keyboard.type(QUESTION)
            page.keyboard.press("Enter")
            say(f"browser: asked {QUESTION!r}")
            thumbs = page.get_by_role("button", name="Bad Response")
            thumbs.first.wait_for(state="attached", timeout=120_000)
            page.locator(".chat-assistant").last.hover()
            reply = page.locator(".chat-assistant").last.inner_text()
            say(f"browser: the reply reads {reply.strip()[:80]!r}")
            thumbs.last.click()
            say("browser: clicked 👎")
            box = page.get_by_label("Additional feedback comments")
            box.wait_for(timeout=30_000)
            box.fill(COMMENT)
            say(f"browser: typed the comment {COMMENT!r}")
            Path(args.screenshot).parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=args.screenshot, full_page=False)  # the 👎, its panel and the comment
            say(f"screenshot: {args.screenshot}")

            def saved(r) -> bool:  # the page's update of the rating it created on the 👎 click
                return "/api/v1/evaluations/feedback/" in r.url and r.request.method == "POST"

            with page.expect_response(saved, timeout=30_000) as response:
                page.get_by_role("button", name="Save").last.click()
            data = response.value.json()["data"]
            say(f"browser: saved; Open WebUI stored rating {data['rating']}, comment {data['comment']!r}")
            browser.close()

        def hinted() -> str | None:
            rows = json.loads(clawd(env, "signals", "list", "--json"))
            return next((json.dumps(s) for s in rows if s.get("hint") and COMMENT in s["hint"]), None)

        signal_json = json.loads(wait_for("the signal with the comment as its hint", hinted, 120))
        say(
            f"clawd signals: turn {signal_json['turn_id']} reward {signal_json['reward']} "
            f"({signal_json['reward_source']}), hint {signal_json['hint']!r}"
        )
        print(clawd(env, "signals", "list"), end="")
        return 0
    finally:
        for proc in reversed(procs):
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)


if __name__ == "__main__":
    sys.exit(main())
