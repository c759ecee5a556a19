"""Background mining vs the user: TTFT with the miner busy, and signals mined per minute per judge.

Everything runs through real `clawd serve` subprocesses (CLAWD_HOME in a temp dir), over HTTP.

1. Time to first token. Anchor: the same daemon config with mining disabled ("idle"). Subject:
   mining on (judge and hint judge "self", the served model) with a backlog of seeded
   conversations whose next messages are corrections, thanks and ambiguous replies, so the
   miner has real judging and scoring to do ("busy"). Both phases send the same N short
   streaming requests (temperature 0) one at a time with the same random 0.5-2 s gaps;
   TTFT is send -> first SSE chunk with content. Goal: p95 busy / idle <= 1.2.
2. Signals mined per minute, per judge (rules, self, gguf:<the same model file>): a fresh
   copy of the seeded store, mining on, timed from "daemon ready" until nothing is pending.
   Anchor: the rules judge (no model calls) in the same run.

The conversation set is seeded once with mining disabled and the database copied into a
fresh home for every phase, so every phase starts from the same backlog. Usage:
    python benchmarks/mining.py [--model PATH] [--requests 40] [--conversations 24]
                                [--judges rules,self,gguf] [--json OUT]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import re
import shlex
import shutil
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
from clawd.token import read_token  # noqa: E402

# (first request, the user's next message). The rules decide corrections (-1, plus the
# user's own sentence as a hint candidate) and thanks (+1, no hint judge); ambiguous
# replies go to the LLM judge (votes) and the hint judge.
CORRECTIONS = [
    ("Write a haiku about the sea.", "That's too long, make it shorter."),
    ("What is 12 times 13?", "That's wrong, it is 156."),
    ("Name three primary colors.", "No, I meant the colors of light, not paint."),
    ("Give me a synonym for happy.", "You forgot to give an example sentence."),
    ("Translate 'good morning' into Spanish.", "Wrong language, I asked for Italian."),
    ("Write a title for a blog post about coffee.", "Make it funnier please."),
    ("How many days are in a leap year?", "You should explain why, too."),
    ("Suggest a name for a black cat.", "Try again, something less common."),
    ("Write one sentence about autumn.", "Too formal. Write it like a text to a friend."),
    ("What is the boiling point of water?", "Give the answer in Fahrenheit instead."),
]
THANKS = [
    ("What is the capital of Japan?", "Thanks, that's perfect!"),
    ("Give me a word that rhymes with cat.", "Great, thank you."),
    ("What color is the sky on a clear day?", "Perfect, thanks!"),
    ("How many legs does a spider have?", "Thank you so much, that helps."),
    ("Name a fruit that is yellow.", "Awesome, exactly what I needed."),
    ("What is 2 plus 2?", "Thanks!"),
    ("Say hello in French.", "Great answer, thank you!"),
    ("What do bees make?", "That's right, thanks."),
    ("Name a large ocean.", "Nice, thanks a lot."),
    ("What is the opposite of hot?", "Cool, thank you!"),
]
AMBIGUOUS = [
    ("Tell me a fun fact about octopuses.", "Hmm."),
    ("What is the tallest mountain in the world?", "And the second tallest?"),
    ("Recommend a book for a long flight.", "I see."),
    ("What is photosynthesis?", "Interesting. What about animals?"),
    ("Describe a sunset in one sentence.", "Ok."),
    ("What is a prime number?", "Is 1 one of them?"),
    ("Name a famous painter.", "Why him?"),
    ("What language is spoken in Brazil?", "Huh, I thought so."),
    ("How far is the moon?", "What about Mars?"),
    ("What is the speed of sound?", "Hmm, ok."),
]
# The user requests whose TTFT is measured: short, distinct from the seeded ones.
PROMPTS = [
    "What is the capital of Peru?",
    "Name a planet.",
    "What is 7 plus 5?",
    "Say hi.",
    "What is the color of grass?",
    "Name a dog breed.",
    "What is ice made of?",
    "Spell the word cat.",
    "What day comes after Monday?",
    "Name a vegetable.",
    "What is the capital of Canada?",
    "How many hours are in a day?",
    "Name a musical instrument.",
    "What do cows drink?",
    "What is the largest planet?",
    "Name a city in Italy.",
    "What is 9 minus 4?",
    "Name a bird.",
    "What is the freezing point of water?",
    "Name a sport played with a ball.",
    "What is the capital of Egypt?",
    "Name a flower.",
    "How many months are in a year?",
    "What is the opposite of up?",
    "Name a metal.",
    "What is the capital of Spain?",
    "Name a shape.",
    "What is 3 times 3?",
    "Name a farm animal.",
    "What is the first letter of the alphabet?",
]


def conversations(n: int) -> list[tuple[str, str, str]]:
    """n (kind, first request, next message), the three kinds interleaved so any n mixes them."""
    kinds = [("correction", CORRECTIONS), ("thanks", THANKS), ("ambiguous", AMBIGUOUS)]
    out = []
    for i in range(n):
        kind, pool = kinds[i % 3]
        q, nxt = pool[(i // 3) % len(pool)]
        rnd = i // (3 * len(pool))
        out.append((kind, q if rnd == 0 else f"{q} (take {rnd + 1})", nxt))
    return out


def prompts(n: int) -> list[str]:
    return [
        p if i < len(PROMPTS) else f"{p} (take {i // len(PROMPTS) + 1})"
        for i, p in ((i, PROMPTS[i % len(PROMPTS)]) for i in range(n))
    ]


# ---- daemon --------------------------------------------------------------------------


class Daemon:
    """One `clawd serve` subprocess on a home; its output goes to a log file (a pipe
    nobody reads would stall it)."""

    def __init__(self, home: Path, model: Path, threads: int, mining: dict[str, str]):
        self.home = home
        self.log = home / "serve.log"
        env = {
            **os.environ,
            "CLAWD_HOME": str(home),
            "CLAWD_MODEL_N_THREADS": str(threads),
            "CLAWD_LOG_LEVEL": "warning",
            **mining,
        }
        args = [sys.executable, "-m", "clawd.cli", "serve", "--port", "0", "--model", str(model)]
        self.cmd = (
            " ".join(f"{k}={shlex.quote(v.replace(str(model), '<model>'))}" for k, v in mining.items())
            + " clawd "
            + shlex.join(args[3:-2])
            + " --model <model>"
        )
        fh = open(self.log, "w")  # noqa: SIM115 - lives as long as the process
        self.proc = subprocess.Popen(args, env=env, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT, text=True)
        fh.close()
        deadline = time.time() + 120
        while time.time() < deadline:
            m = re.search(r"at (http://[\d.]+:\d+)/v1", self.log.read_text())
            if m:
                self.url = m.group(1)
                break
            if self.proc.poll() is not None:
                raise SystemExit(f"clawd serve exited:\n{self.log.read_text()[-2000:]}")
            time.sleep(0.05)
        else:
            raise SystemExit("clawd serve did not start within 120 s")
        self.ready = time.perf_counter()
        token = read_token(resolve_paths({"CLAWD_HOME": str(home)}).token_file)
        self.client = DaemonClient(self.url, token=token, timeout=600)
        self.model_id = self.client.request("GET", "/v1/models").json()["data"][0]["id"]

    def status(self) -> dict:
        return self.client.request("GET", "/clawd/status").json()

    def stop(self) -> None:
        self.client.close()
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def mining_env(enabled: bool, judge: str = "rules", hint_judge: str = "rules", votes: int = 3) -> dict[str, str]:
    return {
        "CLAWD_MINING_ENABLED": "1" if enabled else "0",
        "CLAWD_MINING_JUDGE": judge,
        "CLAWD_MINING_HINT_JUDGE": hint_judge,
        "CLAWD_MINING_VOTES": str(votes),
    }


def fresh_home(base: Path, name: str, seeded: Path | None) -> Path:
    """A new CLAWD_HOME, holding a copy of the seeded database if given."""
    home = base / name
    paths = resolve_paths({"CLAWD_HOME": str(home)})
    ensure_dirs(paths)
    if seeded is not None:
        for f in seeded.parent.glob(seeded.name + "*"):  # clawd.db and any -wal / -shm
            shutil.copy2(f, paths.db_file.parent / f.name)
    return home


# ---- requests ------------------------------------------------------------------------


def chat(d: Daemon, messages: list[dict], max_tokens: int, session_id: str) -> str:
    body = {
        "model": d.model_id,
        "messages": messages,
        "stream": False,
        "temperature": 0,
        "max_tokens": max_tokens,
        "seed": 1,
        "session_id": session_id,
    }
    return d.client.post("/v1/chat/completions", body)["choices"][0]["message"]["content"]


def timed_stream(d: Daemon, user: str, max_tokens: int, session_id: str) -> dict:
    body = {
        "model": d.model_id,
        "messages": [{"role": "user", "content": user}],
        "stream": True,
        "temperature": 0,
        "seed": 1,
        "max_tokens": max_tokens,
        "session_id": session_id,
    }
    t0 = time.perf_counter()
    first = None
    with d.client.stream("POST", "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        turn_id = r.headers.get("x-clawd-turn-id")
        for line in r.iter_lines():
            if first is None and line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if any(c["delta"].get("content") for c in chunk.get("choices", [])):
                    first = time.perf_counter()
    t1 = time.perf_counter()
    return {"ttft_ms": (first - t0) * 1000 if first else float("nan"), "total_ms": (t1 - t0) * 1000, "turn_id": turn_id}


def seed(d: Daemon, convs: list[tuple[str, str, str]], answer_tokens: int) -> None:
    for i, (_, q, nxt) in enumerate(convs):
        sid = f"seed-{i}"
        msgs = [{"role": "user", "content": q}]
        answer = chat(d, msgs, answer_tokens, sid)
        # The next main turn carries the first turn's next state; its own answer stays
        # 'waiting' (no next message), so it costs the miner nothing.
        chat(d, [*msgs, {"role": "assistant", "content": answer}, {"role": "user", "content": nxt}], 8, sid)


def ttft_phase(d: Daemon, users: list[str], gaps: list[float], max_tokens: int, tag: str) -> list[dict]:
    """Warm up, then one request at a time with the given gaps; each row notes what the
    daemon was doing just before the request went out."""
    timed_stream(d, "Hello!", max_tokens, f"{tag}-warm")
    rows = []
    for i, (user, gap) in enumerate(zip(users, gaps)):
        time.sleep(gap)
        st = d.status()
        row = timed_stream(d, user, max_tokens, f"{tag}-{i}")
        row.update(
            engine_busy=st["busy"],
            miner_busy=bool(st["miner"] and st["miner"]["busy"]),
            pending=st["signals"]["pending"],
            gap_s=gap,
        )
        rows.append(row)
    # Server-side TTFT (turn start -> first token, no HTTP), fetched after the phase so
    # the lookups never overlap a measured request.
    for row in rows:
        if row["turn_id"]:
            timings = d.client.request("GET", f"/clawd/turns/{row['turn_id']}").json().get("timings") or {}
            row["server_ttft_ms"] = timings.get("ttft_ms")
    return rows


def mine_until_drained(d: Daemon, expected: int, timeout_s: float) -> dict:
    """Poll until every paired turn is mined (nothing pending, `expected` rows ready or empty)."""
    t0 = d.ready
    busy_polls = polls = 0
    while True:
        st = d.status()
        sig = st["signals"]
        polls += 1
        busy_polls += bool(st["miner"]["busy"])
        done = sig["ready"] + sig["empty"]
        if sig["pending"] == 0 and done >= expected:
            break
        if time.perf_counter() - t0 > timeout_s:
            break
        time.sleep(0.25)
    elapsed = time.perf_counter() - t0
    rows = d.client.request("GET", "/clawd/signals", params={"limit": 10_000}).json()
    mined = [r for r in rows if r["status"] in ("ready", "empty")]
    return {
        "elapsed_s": elapsed,
        "mined": len(mined),
        "pending": sig["pending"],
        "waiting": sig["waiting"],
        "timed_out": sig["pending"] > 0 or done < expected,
        "per_min": len(mined) / elapsed * 60,
        "judge_error": st["miner"]["judge_error"],
        "rewards": dict(collections.Counter(str(r["reward"]) for r in mined)),
        "sources": dict(collections.Counter(r["reward_source"] for r in mined)),
        "with_hint": sum(1 for r in mined if r["hint"]),
        "busy_share": busy_polls / polls,
        # LLM votes that parsed to a score (a small judge often forgets its \\boxed{})
        "votes_valid": sum(v is not None for r in mined for v in r["votes"]),
        "votes_total": sum(len(r["votes"]) for r in mined),
        # chosen hints by where they came from: the user's own words, feedback, or a judge
        "hint_sources": dict(
            collections.Counter(h["source"] for r in mined for h in r["hints"] if h["text"] == r["hint"])
        ),
        "signals": mined,
    }


# ---- report --------------------------------------------------------------------------


def pct(values: list[float], q: float) -> float:
    vals = sorted(v for v in values if v == v)
    if not vals:
        return float("nan")
    if len(vals) == 1:
        return vals[0]
    return statistics.quantiles(vals, n=100, method="inclusive")[int(q) - 1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, help="GGUF file (default: the embedded Gemma 3 270M)")
    ap.add_argument("--requests", type=int, default=40, help="measured user requests per TTFT phase")
    ap.add_argument("--conversations", type=int, default=24, help="seeded conversations (mixed kinds)")
    ap.add_argument(
        "--judges",
        default="rules,self,gguf",
        help="comma list for the mining-rate runs: rules, self, gguf (= gguf:<model file>)",
    )
    ap.add_argument("--votes", type=int, default=3, help="judge votes per turn (mining.votes)")
    ap.add_argument("--max-tokens", type=int, default=16, help="max_tokens of the measured requests")
    ap.add_argument("--answer-tokens", type=int, default=48, help="max_tokens of the seeded answers")
    ap.add_argument("--gap-min", type=float, default=0.5)
    ap.add_argument("--gap-max", type=float, default=2.0)
    ap.add_argument("--mine-timeout", type=float, default=300.0, help="cap per mining-rate run, seconds")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--seed", type=int, default=0, help="seed of the request gaps")
    ap.add_argument("--json", type=Path, help="write the raw results here")
    args = ap.parse_args()
    t_start = time.perf_counter()
    load_start = os.getloadavg()[0]

    from clawd.models import ensure_embedded_model

    base = Path(tempfile.mkdtemp(prefix="clawd-bench-mining-"))
    seed_home = fresh_home(base, "seed", None)
    seed_paths = resolve_paths({"CLAWD_HOME": str(seed_home)})
    model = (args.model or ensure_embedded_model(seed_paths)).resolve()
    convs = conversations(args.conversations)
    users = prompts(args.requests)
    rng = random.Random(args.seed)
    gaps = [rng.uniform(args.gap_min, args.gap_max) for _ in users]
    results: dict = {
        "args": {k: str(v) for k, v in vars(args).items()},
        "model": str(model) if args.model else f"embedded Gemma 3 270M ({model.name})",
    }
    commands = {}
    try:
        # -- seed once, mining off ---------------------------------------------------
        t = time.perf_counter()
        d = Daemon(seed_home, model, args.threads, mining_env(False))
        try:
            seed(d, convs, args.answer_tokens)
        finally:
            d.stop()
        results["seed_s"] = time.perf_counter() - t
        print(
            f"seeded {len(convs)} conversations in {results['seed_s']:.1f} s "
            f"({collections.Counter(k for k, _, _ in convs)})",
            flush=True,
        )
        seeded_db = seed_paths.db_file

        # -- TTFT: idle anchor, then busy ---------------------------------------------
        phases = {
            "idle": mining_env(False, "self", "self", args.votes),
            "busy": mining_env(True, "self", "self", args.votes),
        }
        for name, env in phases.items():
            d = Daemon(fresh_home(base, name, seeded_db), model, args.threads, env)
            commands[f"ttft-{name}"] = d.cmd
            try:
                if name == "busy":  # the miner must be at work before the first request
                    deadline = time.time() + 30
                    while not d.status()["miner"]["busy"] and time.time() < deadline:
                        time.sleep(0.1)
                rows = ttft_phase(d, users, gaps, args.max_tokens, name)
                st = d.status()
                results[f"ttft_{name}"] = {"rows": rows, "end_signals": st["signals"], "miner": st["miner"]}
            finally:
                d.stop()
            r = results[f"ttft_{name}"]
            print(
                f"{name}: TTFT p50 {pct([x['ttft_ms'] for x in rows], 50):.1f} ms, "
                f"p95 {pct([x['ttft_ms'] for x in rows], 95):.1f} ms; engine busy at send "
                f"{sum(x['engine_busy'] for x in rows)}/{len(rows)}, miner busy at send "
                f"{sum(x['miner_busy'] for x in rows)}/{len(rows)}; signals at end {r['end_signals']}",
                flush=True,
            )

        # -- signals per minute, per judge --------------------------------------------
        specs = {"rules": ("rules", "rules"), "self": ("self", "self"), "gguf": (f"gguf:{model}", f"gguf:{model}")}
        results["mining"] = {}
        for name in [j.strip() for j in args.judges.split(",") if j.strip()]:
            judge, hint_judge = specs[name]
            d = Daemon(
                fresh_home(base, f"mine-{name}", seeded_db),
                model,
                args.threads,
                mining_env(True, judge, hint_judge, args.votes),
            )
            commands[f"mine-{name}"] = d.cmd
            try:
                res = mine_until_drained(d, len(convs), args.mine_timeout)
            finally:
                d.stop()
            results["mining"][name] = res
            print(
                f"mining {name}: {res['mined']} signals in {res['elapsed_s']:.1f} s = {res['per_min']:.1f}/min"
                f"{' (TIMED OUT, ' + str(res['pending']) + ' pending)' if res['timed_out'] else ''}; "
                f"rewards {res['rewards']}, sources {res['sources']}, with hint {res['with_hint']}, "
                f"judge_error {res['judge_error']}",
                flush=True,
            )
    finally:
        shutil.rmtree(base, ignore_errors=True)

    wall = time.perf_counter() - t_start
    results["wall_s"] = wall
    # Anything else on the machine shows up as TTFT outliers: say how loaded it was.
    results["loadavg_1min"] = {"start": load_start, "end": os.getloadavg()[0]}
    report(results, args, convs, commands, wall)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2, default=str))


def report(results: dict, args, convs, commands: dict, wall: float) -> None:
    idle, busy = results["ttft_idle"]["rows"], results["ttft_busy"]["rows"]
    q = {
        (name, p): pct([r["ttft_ms"] for r in rows], p)
        for name, rows in (("idle", idle), ("busy", busy))
        for p in (50, 95)
    }
    sq = {
        (name, p): pct([r.get("server_ttft_ms") or float("nan") for r in rows], p)
        for name, rows in (("idle", idle), ("busy", busy))
        for p in (50, 95)
    }
    print()
    print(
        f"model {results['model']}, {args.threads} threads, {len(convs)} seeded conversations, "
        f"{len(idle)} requests per phase (max_tokens {args.max_tokens}, gaps {args.gap_min}-{args.gap_max} s), "
        f"judge votes {args.votes}; 1-min load average {results['loadavg_1min']['start']:.2f} at start, "
        f"{results['loadavg_1min']['end']:.2f} at end"
    )
    print()
    print(
        "| TTFT (send -> first content chunk) | idle: mining off (anchor) | busy: mining on, judge self | "
        "ratio busy/idle | goal |"
    )
    print("|---|---|---|---|---|")
    for p in (50, 95):
        ratio = q[("busy", p)] / q[("idle", p)]
        print(
            f"| p{p} ms | {q[('idle', p)]:.1f} | {q[('busy', p)]:.1f} | {ratio:.2f}x | {'<= 1.2x' if p == 95 else ''} |"
        )
    for p in (50, 95):
        print(
            f"| p{p} ms, server side (turn start -> first token) | {sq[('idle', p)]:.1f} | "
            f"{sq[('busy', p)]:.1f} | {sq[('busy', p)] / sq[('idle', p)]:.2f}x | |"
        )
    held = [r["ttft_ms"] for r in busy if r["engine_busy"]]
    free = [r["ttft_ms"] for r in busy if not r["engine_busy"]]
    eb = results["ttft_busy"]
    print(
        f"| busy: requests sent while the engine was held (by the miner) | | {len(held)}/{len(busy)}: "
        f"p50 {pct(held, 50):.1f}, max {max(held, default=float('nan')):.1f} | | |"
    )
    print(
        f"| busy: requests sent while the engine was free | | {len(free)}/{len(busy)}: "
        f"p50 {pct(free, 50):.1f}, max {max(free, default=float('nan')):.1f} | | |"
    )
    print(
        f"| busy: miner busy at send / signals pending at end / mined during phase | | "
        f"{sum(r['miner_busy'] for r in busy)}/{len(busy)} / {eb['end_signals']['pending']} / "
        f"{eb['miner']['mined']} | | |"
    )
    print()
    mining = results.get("mining", {})
    if mining:
        anchor = mining.get("rules", {}).get("per_min")
        print(
            "| judge (evaluative + hint) | signals mined | time s | signals/min | vs rules | rewards +1/0/-1 "
            "| reward sources | with hint (chosen hint's source) | LLM votes parsed | judge error |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|")
        for name, m in mining.items():
            rw = m["rewards"]
            vs = f"{m['per_min'] / anchor:.3f}x" if anchor else "n/a"
            to = f" (timed out, {m['pending']} pending)" if m["timed_out"] else ""
            print(
                f"| {name} | {m['mined']}{to} | {m['elapsed_s']:.1f} | {m['per_min']:.1f} | {vs} | "
                f"{rw.get('1', 0)}/{rw.get('0', 0)}/{rw.get('-1', 0)} | "
                f"{', '.join(f'{k} {v}' for k, v in sorted(m['sources'].items()))} | {m['with_hint']} ("
                f"{', '.join(f'{k} {v}' for k, v in sorted(m['hint_sources'].items()))}) | "
                f"{m['votes_valid']}/{m['votes_total']} | "
                f"{m['judge_error'] or ''} |"
            )
        print()
    print(f"wall time {wall:.0f} s. Command: python {shlex.join(sys.argv)}")
    print(f"daemons (<model> = {results['model']}):")
    for k, v in commands.items():
        print(f"  {k}: {v}")


if __name__ == "__main__":
    main()
