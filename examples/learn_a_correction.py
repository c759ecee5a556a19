"""Demo: teach the embedded Gemma 3 270M one correction, watch it learn it, then undo it.

    .venv/bin/python examples/learn_a_correction.py [--home DIR] [--json]

What happens, all on this machine, through clawd's HTTP API:
1. `clawd serve` starts on a private CLAWD_HOME (a temp dir unless --home), with the rules
   judge (fast and deterministic: the user's own correction sentence becomes the hint).
2. For eight countries we ask "What is the capital of X?", and answer the model's reply with
   a correction: "No, just the name please: <city>." (a reply that is already just the name
   gets "Perfect, thanks."). A few corrected replies also get a thumbs-down.
3. The miner turns each (reply, correction) pair into a signal: reward −1 and the hint.
4. Before training we measure, on held-out countries never used in training, the log-prob
   margin  log p(" <city>.") − log p(" The capital of <country> is <city>.")  — how much the
   served model prefers the short answer the user asked for.
5. `POST /clawd/training` runs the trainer (progress shown); its adapter must pass the eval
   gate and the live check to become active. The margin is measured again, and the greedy
   answer to a held-out question is shown before and after (every held-out answer must still
   end where it ended before, with no template text: the gate's turn-end check). The gate's QA
   canary is shown too: it measures the factual accuracy this lesson costs the 270M base, but
   does not refuse the adapter in the demo (see DEMO_SETTINGS).
6. Rollback: the margin returns to exactly its value before training.
The last line with --json is every number, for tests (tests/test_learning_demo.py).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from clawd.client import daemon_token
from clawd.paths import resolve_paths

ROOT = Path(__file__).resolve().parent.parent
TRAIN = [
    ("France", "Paris"),
    ("Germany", "Berlin"),
    ("Italy", "Rome"),
    ("Egypt", "Cairo"),
    ("Canada", "Ottawa"),
    ("Russia", "Moscow"),
    ("Greece", "Athens"),
    ("Kenya", "Nairobi"),
]
HELD_OUT = [("Spain", "Madrid"), ("Japan", "Tokyo"), ("Peru", "Lima")]
# A demo should show an effect within one short run: a few small steps, training right after
# the corrections, judged by the rules judge (the default "self" judge is slower). The learning
# rate is clawd's default (1e-4), written out so the demo shows what it ran with.
# The QA canary measures, but does not refuse here: on the 270M base, answering with the bare
# name costs factual accuracy (the sentence "The capital of Hungary is ..." carries the fact).
# Measured on 2 cores: every adapter of this lesson lost 8 or more of the 50 QA questions
# (2 steps or 4, lr 5e-5 or 1e-4, RL only or mostly OPD), and the default gate
# (training.qa_max_drop = 2 points) refuses it. The demo shows the loss and lets it through,
# to show the rest of the loop; your daemon keeps the default.
DEMO_SETTINGS = {
    "CLAWD_TRAINING_AUTO": "0",
    "CLAWD_TRAINING_LEARNING_RATE": "1e-4",
    "CLAWD_TRAINING_BATCH_SIZE": "4",
    "CLAWD_TRAINING_QA_MAX_DROP": "100",
    # One pass per batch (2 steps, not 4): KL to base 0.08 instead of 0.32, QA 84% instead of
    # 70%, and the held-out answer "It is Madrid." instead of "I don't know." (measured).
    "CLAWD_TRAINING_EPOCHS": "1",
    "CLAWD_MINING_JUDGE": "rules",
    "CLAWD_MINING_HINT_JUDGE": "rules",
    "CLAWD_MINING_QUIET_S": "0",
}


def say(quiet: bool, *parts) -> None:
    if not quiet:
        print(*parts, flush=True)


def start_daemon(home: Path) -> tuple[subprocess.Popen, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CLAWD_")}
    env.update(CLAWD_HOME=str(home), **DEMO_SETTINGS)
    proc = subprocess.Popen(
        [sys.executable, "-m", "clawd.cli", "serve", "--port", "0"],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    for line in proc.stdout:
        if "clawd: serving" in line:
            url = line.split(" at ")[1].split("/v1")[0]
            return proc, url
    raise SystemExit("clawd serve did not start:\n" + (proc.stdout.read() if proc.stdout else ""))


def ask(c: httpx.Client, messages: list[dict], **kw) -> dict:
    r = c.post("/v1/chat/completions", json={"model": model_id(c), "messages": messages, "max_tokens": 24, **kw})
    r.raise_for_status()
    return r.json()


_MODEL: dict = {}


def model_id(c: httpx.Client) -> str:
    if "id" not in _MODEL:
        _MODEL["id"] = c.get("/v1/models").json()["data"][0]["id"]
    return _MODEL["id"]


def question(country: str) -> list[dict]:
    return [{"role": "user", "content": f"What is the capital of {country}?"}]


def margin(c: httpx.Client, adapter: str = "active") -> float:
    """Mean over held-out countries of log p(short answer) − log p(long answer)."""
    out = []
    for country, city in HELD_OUT:

        def total(text: str) -> float:
            r = c.post("/clawd/score", json={"messages": question(country), "completion": text, "adapter": adapter})
            r.raise_for_status()
            return r.json()["total"]

        out.append(total(f" {city}.") - total(f" The capital of {country} is {city}."))
    return sum(out) / len(out)


def just_the_name(reply: str, city: str) -> bool:
    return re.findall(r"[\w'-]+", reply.lower()) == city.lower().split()


def teach(c: httpx.Client, quiet: bool) -> None:
    """The user wants the bare name: a reply that is just the name gets thanks (+1), any other
    reply a correction (−1 and the hint): a reply that already did what the user asked must not
    be punished, as a real user would not correct it."""
    for i, (country, city) in enumerate(TRAIN):
        first = ask(c, question(country), temperature=0.7, seed=i)
        reply = first["choices"][0]["message"]["content"]
        right = just_the_name(reply, city)
        answer = "Perfect, thanks." if right else f"No, just the name please: {city}."
        say(quiet, f"  Q: capital of {country}?  A: {reply.strip()[:60]!r}  user: {answer!r}")
        ask(
            c,
            question(country) + [{"role": "assistant", "content": reply}, {"role": "user", "content": answer}],
            temperature=0.7,
            seed=100 + i,
        )
        if i % 3 == 0 and not right:
            c.post("/clawd/feedback", json={"turn_id": first["id"], "rating": -1}).raise_for_status()


def wait_signals(c: httpx.Client, n: int, timeout: float = 600) -> dict:
    deadline = time.time() + timeout
    while time.time() < deadline:
        counts = c.get("/clawd/status").json()["signals"]
        if counts.get("ready", 0) >= n and counts.get("pending", 0) == 0:
            return counts
        time.sleep(1)
    raise SystemExit(f"signals not ready in time: {counts}")


def train(c: httpx.Client, quiet: bool, timeout: float = 1800) -> dict:
    job = c.post("/clawd/training").raise_for_status().json()["job_id"]
    say(quiet, f"  training job {job} ...")
    last = None
    deadline = time.time() + timeout
    while time.time() < deadline:
        st = c.get("/clawd/training").json()
        line = f"    {st['phase']}: step {st['step']}/{st['total']}, prepared {st['prepared']}/{st['samples']}"
        if st["metrics"]:
            line += f", loss {st['metrics'].get('loss', 0):+.4f}"
        if line != last:
            say(quiet, line)
            last = line
        if st["state"] in ("idle", "error"):
            return st
        time.sleep(1)
    raise SystemExit("training did not finish in time")


def greedy(c: httpx.Client, country: str) -> str:
    return ask(c, question(country), temperature=0)["choices"][0]["message"]["content"].strip()


def held_out_answers(c: httpx.Client) -> list[dict]:
    """Greedy answers to every held-out question and how each turn ended ("stop": the model
    ended its turn; "length": it ran on to max_tokens). Learning a correction must not change
    where answers end (the eval gate's turn-end check)."""
    out = []
    for country, _ in HELD_OUT:
        choice = ask(c, question(country), temperature=0)["choices"][0]
        out.append({"country": country, "answer": choice["message"]["content"], "finish": choice["finish_reason"]})
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--home", type=Path, help="CLAWD_HOME to use (default: a fresh temp dir)")
    p.add_argument("--json", action="store_true", help="print every number as one JSON line at the end")
    a = p.parse_args()
    home = a.home or Path(tempfile.mkdtemp(prefix="clawd-demo-"))
    quiet = a.json
    say(quiet, f"clawd home: {home}")
    proc, url = start_daemon(home)
    result: dict = {"home": str(home)}
    try:
        # The API wants the daemon's token from loopback too; it wrote it in its home on start-up.
        token = daemon_token(resolve_paths({"CLAWD_HOME": str(home)}))
        with httpx.Client(base_url=url, timeout=600, headers={"Authorization": f"Bearer {token}"}) as c:
            say(quiet, f"1. teaching {len(TRAIN)} corrections")
            teach(c, quiet)
            result["signals"] = wait_signals(c, len(TRAIN))
            say(quiet, f"2. mined: {result['signals']}")
            held = HELD_OUT[0][0]
            result["margin_before"] = margin(c)
            # One greedy request per held-out country: a second identical one from this client
            # would be a regenerate, a −1 signal on a held-out answer.
            result["held_out_before"] = held_out_answers(c)
            result["answer_before"] = result["held_out_before"][0]["answer"].strip()
            say(quiet, f"3. before: margin {result['margin_before']:+.3f} nats; {held}? -> {result['answer_before']!r}")
            st = train(c, quiet)
            result["training"] = st["result"]
            if not (st["result"] or {}).get("promoted"):
                say(quiet, f"   not promoted: {st['result']}")
                if a.json:  # the caller (a test) sees why
                    print(json.dumps(result))
                return 1
            gate = st["result"]["gate"]
            say(
                quiet,
                f"4. adapter {st['result']['adapter_id']} passed the gate (gain {gate['gain']:+.4f} on "
                f"{gate['n']} {gate['judged_on']} signals, KL to base {gate['kl_to_base']:.4f}) and is live",
            )
            qa = gate.get("qa")
            if qa:
                lost = ", ".join(repr(q["answer"].strip()) for q in qa["lost"][:4])
                say(
                    quiet,
                    f"   QA canary: {qa['accuracy']:.0%} right (parent {qa['accuracy_parent']:.0%}); "
                    f"the default gate refuses a loss over 2 points{': lost ' + lost if lost else ''}",
                )
            result["margin_after"] = margin(c)
            result["held_out_after"] = held_out_answers(c)
            result["answer_after"] = result["held_out_after"][0]["answer"].strip()
            say(quiet, f"   after:  margin {result['margin_after']:+.3f} nats; {held}? -> {result['answer_after']!r}")
            c.post("/clawd/adapters/rollback").raise_for_status()
            result["margin_rollback"] = margin(c)
            result["answer_rollback"] = greedy(c, held)
            result["adapter"] = c.get(f"/clawd/adapters/{st['result']['adapter_id']}").json()  # kept, retired
            say(
                quiet,
                f"5. rolled back: margin {result['margin_rollback']:+.3f} nats "
                f"({'identical to before' if result['margin_rollback'] == result['margin_before'] else 'DIFFERENT'})",
            )
    finally:
        proc.terminate()
        proc.wait(60)
    if a.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
