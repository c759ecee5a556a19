"""Serving speed through the clawd daemon vs raw llama-cpp-python, same GGUF, same prompts.

Anchor: llama-cpp-python's own `Llama.create_completion(stream=True)` in this process.
Subject: a real `clawd serve` subprocess, streamed over HTTP (SSE) with httpx.
Both decode greedily from the identical rendered prompt with the same stop string, one
request at a time, alternating anchor / daemon per prompt so drift hits both alike.

Prints per-prompt rows and the ratios: daemon tok/s / anchor tok/s (goal >= 0.97) and
the TTFT the daemon adds (goal <= 15 ms). Usage:
    python benchmarks/serve.py [--model PATH] [--max-tokens 128] [--rounds 2] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from clawd.client import DaemonClient  # noqa: E402
from clawd.paths import ensure_dirs, resolve_paths  # noqa: E402
from clawd.protocol import Message  # noqa: E402
from clawd.templates import TranscriptFormat  # noqa: E402
from clawd.token import read_token  # noqa: E402

# Throughput needs long answers; the base model stops early on most questions, so half
# the set asks for long lists (TTFT is measured on every request alike).
PROMPTS = [
    "What is the capital of France?",
    "Count from 1 to 100, separated by commas.",
    "Write the numbers from 100 down to 1.",
    "List the first 60 even numbers.",
    "Explain what a CPU does in simple terms.",
    "Write the multiplication table of 7 from 1 to 30.",
    "Why is the sky blue?",
    "List the letters of the alphabet, one per line, twice.",
]


def start_daemon(home: Path, model: Path | None, threads: int) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "CLAWD_HOME": str(home), "CLAWD_MODEL_N_THREADS": str(threads), "CLAWD_LOG_LEVEL": "warning"}
    args = [sys.executable, "-m", "clawd.cli", "serve", "--port", "0"]
    if model:
        args += ["--model", str(model)]
    proc = subprocess.Popen(args, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:
        m = re.search(r"at (http://[\d.]+:\d+)/v1", line)
        if m:
            return proc, m.group(1)
    raise SystemExit("clawd serve did not start")


def timed_anchor(llm, prompt: str, max_tokens: int, stop: list[str], temperature: float = 0.0) -> dict:
    t0 = time.perf_counter()
    stamps = []
    # The same sampler chain as clawd's: top-k 40, top-p 0.95, temperature, seeded draw.
    for _ in llm.create_completion(
        prompt,
        max_tokens=max_tokens,
        temperature=temperature,
        top_k=40,
        top_p=0.95,
        min_p=0.0,
        seed=1,
        stop=stop,
        stream=True,
    ):
        stamps.append(time.perf_counter())
    return _rates(t0, stamps, len(stamps))


def timed_daemon(client: DaemonClient, model_id: str, user: str, max_tokens: int, temperature: float = 0.0) -> dict:
    body = {
        "model": model_id,
        "messages": [{"role": "user", "content": user}],
        "stream": True,
        "temperature": temperature,
        "top_p": 0.95,
        "seed": 1,
        "max_tokens": max_tokens,
        "stream_options": {"include_usage": True},
        "session_id": f"bench-{time.time_ns()}",
    }
    t0 = time.perf_counter()
    stamps, usage = [], None
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk["choices"]:
                if choice["delta"].get("content"):
                    stamps.append(time.perf_counter())
    return _rates(t0, stamps, usage["completion_tokens"] if usage else len(stamps))


def _rates(t0: float, stamps: list[float], n_tokens: int) -> dict:
    ttft = (stamps[0] - t0) * 1000 if stamps else float("nan")
    span = stamps[-1] - stamps[0] if len(stamps) > 1 else float("nan")
    return {
        "ttft_ms": ttft,
        "tokens": n_tokens,
        "chunks": len(stamps),
        "span_s": span,
        "tok_s": (len(stamps) - 1) / span if span else float("nan"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, help="GGUF file (default: the embedded Gemma 3 270M)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3, help="passes over the prompt set")
    ap.add_argument(
        "--temperature", type=float, default=0.0, help="0 = greedy; > 0 samples (top-k 40, top-p 0.95) on both sides"
    )
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--json", type=Path, help="write the raw results here")
    args = ap.parse_args()

    from llama_cpp import Llama

    from clawd.models import ensure_embedded_model

    home = Path(tempfile.mkdtemp(prefix="clawd-bench-"))
    paths = resolve_paths({"CLAWD_HOME": str(home)})
    ensure_dirs(paths)
    model = args.model or ensure_embedded_model(paths)
    fmt = TranscriptFormat()
    proc, url = start_daemon(home, args.model and model, args.threads)
    try:
        client = DaemonClient(url, token=read_token(paths.token_file), timeout=300)
        model_id = client.request("GET", "/v1/models").json()["data"][0]["id"]
        llm = Llama(
            model_path=str(model), n_ctx=4096, n_threads=args.threads, n_threads_batch=args.threads, verbose=False
        )
        # Warm both (page in weights, first-call allocations).
        timed_anchor(llm, fmt.render([Message(role="user", content="Hi")]).prompt, 8, ["\nUser:"])
        timed_daemon(client, model_id, "Hi", 8)
        rows = []
        for rnd in range(args.rounds):
            for i, user in enumerate(PROMPTS):
                # A unique suffix per round defeats both sides' prompt caches equally.
                text = user if rnd == 0 else f"{user} (take {rnd + 1})"
                prompt = fmt.render([Message(role="user", content=text)]).prompt
                a = timed_anchor(llm, prompt, args.max_tokens, ["\nUser:"], args.temperature)
                d = timed_daemon(client, model_id, text, args.max_tokens, args.temperature)
                rows.append({"prompt": i, "round": rnd, "anchor": a, "daemon": d})
                print(
                    f"{i:2d}/{rnd} anchor {a['tok_s']:6.1f} tok/s ttft {a['ttft_ms']:6.1f} ms | "
                    f"daemon {d['tok_s']:6.1f} tok/s ttft {d['ttft_ms']:6.1f} ms | tokens {a['tokens']}/{d['tokens']}"
                )
    finally:
        proc.terminate()
        proc.wait(30)

    def pooled(side: str) -> float:
        """Tokens per second over all requests' decode spans (long answers weigh more)."""
        timed = [r[side] for r in rows if r[side]["chunks"] > 1]
        return sum(t["chunks"] - 1 for t in timed) / sum(t["span_s"] for t in timed)

    med = lambda side, key: statistics.median(r[side][key] for r in rows)  # noqa: E731
    summary = {
        "anchor_tok_s": pooled("anchor"),
        "daemon_tok_s": pooled("daemon"),
        "anchor_ttft_ms": med("anchor", "ttft_ms"),
        "daemon_ttft_ms": med("daemon", "ttft_ms"),
        "throughput_ratio": pooled("daemon") / pooled("anchor"),
        "added_ttft_ms": statistics.median(r["daemon"]["ttft_ms"] - r["anchor"]["ttft_ms"] for r in rows),
        "threads": args.threads,
        "temperature": args.temperature,
        "max_tokens": args.max_tokens,
        "requests": len(rows),
        "model": str(model),
    }
    print()
    print(f"temperature {args.temperature}, {len(rows)} requests, {args.threads} threads")
    print("| | raw llama-cpp-python | clawd daemon (HTTP, SSE) | ratio / delta | goal |")
    print("|---|---|---|---|---|")
    print(
        f"| stream tok/s (pooled) | {summary['anchor_tok_s']:.1f} | {summary['daemon_tok_s']:.1f} | "
        f"{summary['throughput_ratio']:.3f}x | >= 0.97x |"
    )
    print(
        f"| TTFT ms (median) | {summary['anchor_ttft_ms']:.1f} | {summary['daemon_ttft_ms']:.1f} | "
        f"+{summary['added_ttft_ms']:.1f} ms | <= 15 ms |"
    )
    if args.json:
        args.json.write_text(json.dumps({"summary": summary, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
