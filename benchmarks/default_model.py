"""Which model should clawd embed? The candidates side by side, every number measured in this run.

Issue 16 item 4: Gemma 3 270M base (the embedded default), SmolLM2-135M-Instruct and
Qwen2.5-Coder-0.5B-Instruct (both pulled with `clawd models pull NAME`). Per model:

- install: the GGUF's bytes, and the float32 copy the trainer dequantizes into the cache.
- QA, greedy, through a real daemon with the model's own prompt format, scored by the gate's
  exact match (clawd/training/qa.py):
  - `canary`: the gate's 50 questions. They were chosen so that the Gemma base answers all of
    them (docs/learning.md), so this column favours Gemma by construction.
  - `fresh`: FRESH_QA below, 30 questions no model was chosen on (counts, sums, science,
    authors, capitals not in the canary).
- instruction following: the first 8 held-out messages of each shipped simulated user
  (clawd/bench/users/), asked bare and with one of the user's corrections as the miner's hint
  (METHOD §3's wording: what the hinted teacher sees), greedy and sampled at T 0.7, scored by
  the user's own compliance check (clawd.bench.learning.measure). A hinted prompt whose
  correction the rules judge makes no hint of is skipped, as the miner would. The checks test
  form only, so a refusal ("I don't know.") or the hint copied back can pass them: the
  `answered` figures count such an answer as a failure (`is_real_answer`).
- speed: raw llama-cpp-python with every core, outside the daemon: prefill tok/s over a
  256-token prompt and decode tok/s over 128 greedy tokens (`Llama.generate`, which does not
  stop at the end of text, so every model decodes the same count); median of 3.
- serving memory: the daemon's peak RSS (VmHWM) after the QA and instruction-following calls.
- training: one clawd hybrid step at 256 tokens (benchmarks/train.py's Bench: the trainer's
  own prepare, loss, clip and AdamW) after a warm-up step of the same length, median of 3
  steps. Twice per model, each in its own child: first cold (it dequantizes the GGUF into the
  cache and prepares), then warm (the trainer's steady state); the table shows the warm run,
  both peak RSS figures are kept. Sizes and memory are in MB (10^6 bytes).

Prints a Markdown table and writes every number (and every answer) as JSON with --json. About
15 min for the three on 2 cores, more on the first run (dequantizing). Usage:
    python benchmarks/default_model.py [--models embedded,smollm2-135m-instruct,...]
                                       [--home DIR] [--json OUT]
    python benchmarks/default_model.py --report docs/default-model.json   # the tables again
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from clawd.bench.daemon import Daemon  # noqa: E402
from clawd.bench.learning import Budget, daemon_settings, measure, teacher_context  # noqa: E402
from clawd.bench.users import resolve_user, shipped_users  # noqa: E402
from clawd.served import HINT_MARKER  # noqa: E402
from clawd.training import qa as qa_score  # noqa: E402

DEFAULT_MODELS = "embedded,smollm2-135m-instruct,qwen2.5-coder-0.5b-instruct"
PREFILL_TOKENS, DECODE_TOKENS, SPEED_ROUNDS = 256, 128, 3
TRAIN_TOKENS, TRAIN_ROUNDS = 256, 3
EVAL_PROMPTS, EVAL_MAX_TOKENS = 8, 48

# Questions no candidate was chosen on: the canary's exact-match rules hold (no accepted answer
# is a word of its question; no Italy, which the transcript format's example answers).
FRESH_QA: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("How many days are in a week?", ("7", "seven")),
    ("What is 6 times 7?", ("42", "forty two")),
    ("How many legs does a spider have?", ("8", "eight")),
    ("What is 12 plus 15?", ("27", "twenty seven")),
    ("How many minutes are in an hour?", ("60", "sixty")),
    ("Which planet is closest to the Sun?", ("mercury",)),
    ("What gas do plants take in from the air to make their food?", ("carbon dioxide", "co2")),
    ("At what temperature in degrees Celsius does water boil at sea level?", ("100", "one hundred")),
    ("Who wrote Pride and Prejudice?", ("austen",)),
    ("What is the chemical symbol for gold?", ("au",)),
    ("How many continents are there on Earth?", ("7", "seven")),
    ("What is the capital of Australia?", ("canberra",)),
    ("What is the capital of Sweden?", ("stockholm",)),
    ("What is the longest river in South America?", ("amazon",)),
    ("Which planet is known as the Red Planet?", ("mars",)),
    ("What is the square root of 81?", ("9", "nine")),
    ("How many sides does a hexagon have?", ("6", "six")),
    ("At what temperature in degrees Fahrenheit does water freeze?", ("32", "thirty two")),
    ("What language is mainly spoken in Mexico?", ("spanish",)),
    ("Who developed the theory of relativity?", ("einstein",)),
    ("What is the hardest natural substance?", ("diamond", "diamonds")),
    ("In which country are the pyramids of Giza?", ("egypt",)),
    ("What is 100 divided by 4?", ("25", "twenty five")),
    ("What is the currency of the United Kingdom?", ("pound", "pounds", "sterling")),
    ("How many hours are in a day?", ("24", "twenty four")),
    ("What is the smallest prime number?", ("2", "two")),
    ("Which animal is known as the king of the jungle?", ("lion",)),
    ("What is the capital of Turkey?", ("ankara",)),
    ("How many months are in a year?", ("12", "twelve")),
    ("Who discovered penicillin?", ("fleming",)),
)


# ---- children: training (mlx) and raw llama.cpp speed, each in its own process ------------------


def child_train(model: Path, cache: Path) -> dict:
    """One clawd hybrid step at TRAIN_TOKENS after a warm-up step: median of TRAIN_ROUNDS."""
    from clawd.training import blas

    blas.enable(cache)  # before mlx is imported, as the trainer does
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from train import Bench

    cold = not any(cache.rglob("*.safetensors"))
    bench = Bench(model, cache, [TRAIN_TOKENS])
    opt = bench.optimizer()
    warmup_s = bench.clawd_step(TRAIN_TOKENS, opt)
    steps = [bench.clawd_step(TRAIN_TOKENS, opt) for _ in range(TRAIN_ROUNDS)]
    return {
        "cache": "cold" if cold else "warm",
        "tokens": TRAIN_TOKENS,
        "step_s": statistics.median(steps),
        "steps_s": steps,
        "warmup_s": warmup_s,
        "load_s": bench.load_s,
        "prepare_s": bench.prepare_s,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e6,  # KiB on Linux
    }


def child_speed(model: Path) -> dict:
    """Prefill and decode tok/s of raw llama-cpp-python (no daemon), median of SPEED_ROUNDS."""
    from llama_cpp import Llama

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from train import TEXT

    threads = os.cpu_count() or 2
    llm = Llama(str(model), n_ctx=1024, n_threads=threads, n_threads_batch=threads, verbose=False)
    prompt = llm.tokenize((TEXT * 8).encode(), add_bos=True)[:PREFILL_TOKENS]
    prefill, decode = [], []
    for _ in range(SPEED_ROUNDS):
        llm.reset()  # else generate() reuses the cached prompt and skips the prefill
        t0, stamps = time.perf_counter(), []
        # generate() samples on and on (create_completion would stop at the end of text), so
        # every model decodes DECODE_TOKENS; the first token's time is the prefill's.
        for _tok in llm.generate(prompt, temp=0.0, reset=True):
            stamps.append(time.perf_counter())
            if len(stamps) > DECODE_TOKENS:
                break
        prefill.append(len(prompt) / (stamps[0] - t0))
        decode.append(DECODE_TOKENS / (stamps[-1] - stamps[0]))
    import llama_cpp

    return {
        "llama_cpp_python": llama_cpp.__version__,
        "prompt_tokens": len(prompt),
        "threads": threads,
        "prefill_tok_s": statistics.median(prefill),
        "decode_tok_s": statistics.median(decode),
        "prefill_rounds": prefill,
        "decode_rounds": decode,
    }


def run_child(*args: str, timeout: float = 1800) -> dict:
    proc = subprocess.run(
        [sys.executable, __file__, "--child", *args], capture_output=True, text=True, cwd=ROOT, timeout=timeout
    )
    if proc.returncode != 0:
        raise SystemExit(f"child {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---- parent: the daemon-side measurements ------------------------------------------------------


def ask_qa(d: Daemon, questions, tag: str) -> dict:
    """Each question greedily, as its own side turn, scored by the canary's exact match."""
    answers = []
    for i, (question, accepted) in enumerate(questions):
        text = d.chat(
            [{"role": "user", "content": question}],
            max_tokens=qa_score.QA_MAX_TOKENS,
            temperature=0.0,
            seed=0,
            session_id=f"qa-{tag}-{i}",
            side=True,
        )["text"]
        answers.append({"question": question, "answer": text, "right": qa_score.is_correct(text, accepted)})
    return {"accuracy": qa_score.accuracy([a["right"] for a in answers]), "answers": answers}


def instruction_following(d: Daemon) -> dict:
    """Per shipped user: held-out compliance bare and hinted, greedy and sampled."""
    budget, out = Budget(eval_prompts=EVAL_PROMPTS, max_tokens=EVAL_MAX_TOKENS), {}
    for name in shipped_users():
        user = resolve_user(name)
        out[name] = {
            "bare": measure(d, user, budget, f"{name}-bare"),
            "hinted": measure(d, user, budget, f"{name}-hinted", hinted=teacher_context),
        }
        b, h = out[name]["bare"], out[name]["hinted"]
        print(
            f"  {name:10} bare {b['greedy']:.0%}/{b['sampled']:.0%}  "
            + (f"hinted {h['greedy']:.0%}/{h['sampled']:.0%} (n={len(h['answers'])})" if h["answers"] else "no hint"),
            flush=True,
        )
    return out


# A refusal or a shrug: the user's form check may pass it, but it answers nothing.
_REFUSAL = re.compile(
    r"\b(don['’]?t know|do not know|not sure|can(?:['’]|no)?t (?:help|answer|provide)|i['’]?m sorry)\b", re.I
)


def is_real_answer(answer: str, prompt: str) -> bool:
    """Not a refusal, and not the hint copied back (most of its words are the hint's)."""
    if _REFUSAL.search(answer):
        return False
    if HINT_MARKER not in prompt:
        return True
    hint = {w.lower() for w in re.findall(r"[\w']+", prompt.split(HINT_MARKER)[-1])}
    words = [w.lower() for w in re.findall(r"[\w']+", answer)]
    return not words or sum(w in hint for w in words) / len(words) < 0.6


def answered(point: dict, how: str) -> float | None:
    """Compliance that counts a refusal or a copied hint as a failure."""
    got = point["answers"]
    if not got:
        return None
    return sum(a[f"{how}_ok"] and is_real_answer(a[how], a["prompt"]) for a in got) / len(got)


def peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024 / 1e6  # kB (KiB) in /proc
    return float("nan")


def resolve_model(name: str, home: Path) -> Path:
    """`embedded` is the packaged Gemma; anything else a model `clawd models pull` installed."""
    from clawd.model_registry import second_model_path
    from clawd.models import ensure_embedded_model
    from clawd.paths import ensure_dirs, resolve_paths

    if name == "embedded":
        paths = resolve_paths({"CLAWD_HOME": str(home / "model-home")})
        ensure_dirs(paths)
        return ensure_embedded_model(paths)
    return second_model_path(name, resolve_paths(dict(os.environ)), "model")


def measure_model(name: str, home: Path) -> dict:
    model = resolve_model(name, home)
    cache = home / "cache" / name
    cache.mkdir(parents=True, exist_ok=True)
    row: dict = {"name": name, "file": model.name, "gguf_mb": model.stat().st_size / 1e6}
    print(f"\n== {name} ({model})", flush=True)

    t0 = time.perf_counter()
    row["speed"] = run_child("speed", str(model))
    print(f"  speed: prefill {row['speed']['prefill_tok_s']:.0f} tok/s, decode {row['speed']['decode_tok_s']:.1f}")
    row["train_cold"] = run_child("train", str(model), str(cache))
    row["train"] = run_child("train", str(model), str(cache))
    row["dequantized_mb"] = sum(f.stat().st_size for f in cache.rglob("*.safetensors")) / 1e6
    print(f"  train: step {row['train']['step_s']:.2f} s, peak RSS {row['train']['peak_rss_mb']:.0f} MB", flush=True)

    settings = daemon_settings("hybrid", Budget())
    with Daemon(home / f"serve-{name}", settings, model=model) as d:
        row["qa_canary"] = ask_qa(d, qa_score.QA_SET, "canary")
        row["qa_fresh"] = ask_qa(d, FRESH_QA, "fresh")
        print(f"  QA: canary {row['qa_canary']['accuracy']:.0%}, fresh {row['qa_fresh']['accuracy']:.0%}", flush=True)
        row["following"] = instruction_following(d)
        row["serve_peak_rss_mb"] = peak_rss_mb(d.proc.pid)
    row["wall_s"] = time.perf_counter() - t0
    return row


def _mean(rows: list[dict], kind: str, how: str, real: bool = False) -> float | None:
    got = [answered(r[kind], how) if real else r[kind][how] for r in rows if r[kind]["answers"]]
    return sum(got) / len(got) if got else None


def table(results: list[dict]) -> str:
    pct = lambda x: "–" if x is None else f"{x:.0%}"  # noqa: E731
    both = lambda users, kind, real=False: (  # noqa: E731
        f"{pct(_mean(users, kind, 'greedy', real))} / {pct(_mean(users, kind, 'sampled', real))}"
    )
    lines = [
        "| model | GGUF MB | training copy MB | QA canary | QA fresh | bare: greedy / sampled | "
        "hinted: greedy / sampled | answered, bare | answered, hinted | prefill tok/s | decode tok/s | "
        "serve peak RSS MB | train step s (256 tok) | train peak RSS MB (warm / cold) |",
        "|---|" + "---|" * 13,
    ]
    for r in results:
        users = list(r["following"].values())
        cold = r.get("train_cold", {}).get("peak_rss_mb")
        lines.append(
            f"| {r['name']} | {r['gguf_mb']:.0f} | {r['dequantized_mb']:.0f} "
            f"| {pct(r['qa_canary']['accuracy'])} | {pct(r['qa_fresh']['accuracy'])} "
            f"| {both(users, 'bare')} | {both(users, 'hinted')} "
            f"| {both(users, 'bare', True)} | {both(users, 'hinted', True)} "
            f"| {r['speed']['prefill_tok_s']:.0f} | {r['speed']['decode_tok_s']:.1f} "
            f"| {r['serve_peak_rss_mb']:.0f} | {r['train']['step_s']:.2f} "
            f"| {r['train']['peak_rss_mb']:.0f} / {'–' if cold is None else f'{cold:.0f}'} |"
        )
    return "\n".join(lines)


def following_table(results: list[dict]) -> str:
    """Per user and model: bare and hinted compliance, greedy / sampled (answered in brackets)."""
    names = [r["name"] for r in results]
    lines = [
        "| user | " + " | ".join(f"{n} bare | {n} hinted" for n in names) + " |",
        "|---|" + "---|" * 2 * len(names),
    ]

    def cell(m: dict) -> str:
        if not m["answers"]:
            return "–"
        return f"{m['greedy']:.0%} / {m['sampled']:.0%} ({answered(m, 'greedy'):.0%} / {answered(m, 'sampled'):.0%})"

    for user in results[0]["following"]:
        cells = []
        for r in results:
            f = r["following"][user]
            cells += [cell(f["bare"]), cell(f["hinted"])]
        lines.append(f"| {user} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default=DEFAULT_MODELS, help=f"comma list (default {DEFAULT_MODELS})")
    ap.add_argument("--home", type=Path, help="scratch dir to keep (dequantized weights are cached there)")
    ap.add_argument("--json", type=Path, help="write every number and answer here")
    ap.add_argument("--report", type=Path, help="run nothing: print the tables of an earlier --json")
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)  # internal: train MODEL CACHE | speed MODEL
    a = ap.parse_args()
    if a.child:
        mode, model = a.child[0], Path(a.child[1])
        res = child_train(model, Path(a.child[2])) if mode == "train" else child_speed(model)
        print(json.dumps(res))
        return 0

    if a.report:
        print_tables(json.loads(a.report.read_text())["results"])
        return 0

    home = a.home or Path(tempfile.mkdtemp(prefix="clawd-bench-default-model-"))
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    try:
        results = [measure_model(name.strip(), home) for name in a.models.split(",") if name.strip()]
    finally:
        if a.home is None:
            shutil.rmtree(home, ignore_errors=True)
    machine = {
        "machine": platform.machine(),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "load_before": load_before,
        "load_at_end": os.getloadavg(),
        "total_s": time.perf_counter() - t0,
        "command": " ".join(sys.argv),
    }
    print(f"\n{machine}\n")
    print_tables(results)
    if a.json:
        a.json.write_text(json.dumps({**machine, "results": results}, indent=1))
    return 0


def print_tables(results: list[dict]) -> None:
    print(table(results))
    print("\nPer user: greedy / sampled compliance (answered: no refusal, no copied hint)\n")
    print(following_table(results))


if __name__ == "__main__":
    sys.exit(main())
