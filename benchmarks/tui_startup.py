"""TUI start-up: process start -> the first screen (Chat) mounted and drawn, against a running
daemon (fake engine), next to its anchor measured in the same run: a bare Textual app (one
Static) started the same way. Also the bare interpreter, for scale. Goal: the TUI < 1 s.

    .venv/bin/python benchmarks/tui_startup.py [--runs 7]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def child(kind: str, url: str) -> None:
    """Run an app headless; print the wall time when its first screen is up, then quit."""
    from textual.app import App

    if kind == "tui":
        from tui.app import ClawdApp
        from tui.client import DaemonClient

        token = (Path(os.environ["CLAWD_HOME"]) / "token").read_text().strip()  # the TUI may not import clawd
        base, app_args = ClawdApp, (DaemonClient(url, token=token),)
    else:
        from textual.widgets import Static

        class Bare(App):
            def compose(self):
                yield Static("hello")

        base, app_args = Bare, ()

    class Timed(base):
        def on_mount(self) -> None:
            super_mount = getattr(super(), "on_mount", None)
            if super_mount:
                super_mount()
            self.call_after_refresh(self.first_screen_drawn)

        def first_screen_drawn(self) -> None:
            print(f"MOUNTED {time.time():.6f} {type(self.screen).__name__}", flush=True)
            self.exit()

    Timed(*app_args).run(headless=True)


def measure(cmd: list[str], env: dict) -> float:
    """Seconds from just before the process starts to its MOUNTED line (or its exit)."""
    t0 = time.time()
    out = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, check=True).stdout
    m = re.search(r"MOUNTED ([\d.]+)", out)
    return (float(m.group(1)) if m else time.time()) - t0


def start_daemon(home: str) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "CLAWD_HOME": home, "CLAWD_MINING_ENABLED": "0"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "clawd.cli", "serve", "--engine", "fake", "--port", "0"],
        env=env,
        cwd=ROOT,
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
    )
    for line in proc.stderr:
        m = re.search(r"at (http://[\d.]+:\d+)/v1", line)
        if m:
            return proc, m.group(1)
    raise SystemExit("the fake daemon did not start")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=7)
    p.add_argument("--child", nargs=2, metavar=("KIND", "URL"), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        return child(*a.child)
    with tempfile.TemporaryDirectory() as home:
        daemon, url = start_daemon(home)
        try:
            env = {**os.environ, "CLAWD_HOME": home}
            me = [sys.executable, str(Path(__file__).resolve()), "--child"]
            measure(me + ["tui", url], env)  # warm the OS file cache once, for both
            runs = {"python -c pass": [], "bare Textual app": [], "clawd TUI (Chat screen)": []}
            for _ in range(a.runs):  # interleaved, so background load hits all alike
                runs["python -c pass"].append(measure([sys.executable, "-c", "pass"], env))
                runs["bare Textual app"].append(measure(me + ["bare", url], env))
                runs["clawd TUI (Chat screen)"].append(measure(me + ["tui", url], env))
        finally:
            daemon.terminate()
            daemon.wait(10)
    med = {k: statistics.median(v) for k, v in runs.items()}
    anchor = med["bare Textual app"]
    print(f"TUI start-up, median of {a.runs} runs (process start -> first screen drawn):")
    for name, s in med.items():
        print(f"  {name:<26} {s * 1000:7.0f} ms   {s / anchor:5.2f}x the bare Textual app")
    tui = med["clawd TUI (Chat screen)"]
    print(
        f"goal < 1000 ms: {'met' if tui < 1.0 else 'NOT met'} ({tui * 1000:.0f} ms; "
        f"{(tui - anchor) * 1000:+.0f} ms over the bare app)"
    )


if __name__ == "__main__":
    main()
