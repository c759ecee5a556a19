"""Where should a separate teacher model (training.teacher = "model:NAME") score a signal?

Issue 16 item 2: the OPD teacher is another local model (say Qwen2.5-Coder-1.5B-Instruct over a
0.5B student). Scoring is prefill only: the hinted context plus the student's sampled tokens,
log-probs at the student's top-k. Two places can do it:

- the miner: llama.cpp, the teacher's quantized GGUF loaded on demand (clawd's own engine,
  `engines/llamacpp.Engine.score`), freed after;
- the trainer: MLX, the teacher's weights dequantized to float32 as the trainer loads every
  model (`training/weights.load_model`), then `loss.response_logprobs` at the support.

1. Scoring alone. Each placement runs in its own child process so its peak RSS is its own.
   For each it prints the load time (MLX: warm, from its cache of dequantized weights, and the
   first run's cold load), the seconds per signal (median of --signals contexts) and the peak
   resident memory. The anchor is the same scoring by the student model in the same place.
2. Whole trainer runs (`python -m clawd.training.run`, as the daemon starts it) on a job of
   --samples hinted samples: teacher = base (the anchor) and teacher = the model. Each phase's
   seconds (from the trainer's own events) and the trainer's peak RSS.

    python benchmarks/teacher_placement.py --student S.gguf --teacher T.gguf [--samples 8] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TOP_K = 4
# A hinted context the size of an ordinary chat turn: system, request, hint, answer.
REQUEST = (
    "You are a helpful assistant. Answer the user's questions clearly.\n\nUser: I am planning a "
    "weekend trip to Lisbon with two friends in late spring. We like walking, old churches, "
    "tiled facades and cheap seafood places where locals eat. Could you suggest a two-day plan "
    "that does not need a car, with one viewpoint at sunset each day and a rough budget per "
    "person for food? We arrive Friday night and leave Sunday evening.\n\n"
    "[The user's feedback on an earlier answer: Keep it under 120 words and end with 'Cheers'.]"
    "\n\nAssistant:"
)
ANSWER = (
    " Day 1: start in Alfama, walk up to the Sé cathedral and São Vicente de Fora, lunch on "
    "grilled sardines in a tasca near Largo do Chafariz de Dentro, then the tiled walls of the "
    "National Azulejo Museum. Sunset at Miradouro da Senhora do Monte. Day 2: Belém by tram 15: "
    "Jerónimos Monastery, a pastel de nata, the riverside walk, back to Bairro Alto for dinner "
    "and sunset at São Pedro de Alcântara. Food: about 35 euros per person per day. Cheers"
)


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def child_llamacpp(model: Path, prompt: list[int], target: list[int], at: list[list[int]], signals: int) -> dict:
    import numpy as np

    from clawd.engines.llamacpp import Engine

    t0 = time.perf_counter()
    engine = Engine(model, n_ctx=2048)
    load = time.perf_counter() - t0
    times = []
    for i in range(signals):
        # A different first token per signal, so no signal reuses the last one's cached prefix.
        p = [prompt[0]] * (i + 1) + prompt
        t0 = time.perf_counter()
        engine.score(p, target, top_k=TOP_K, at_ids=np.array(at, np.int32), reuse_cache=False)
        times.append(time.perf_counter() - t0)
    engine.close()
    return {"load_s": load, "per_signal_s": statistics.median(times), "peak_rss_mb": _peak_mb()}


def child_mlx(model: Path, prompt: list[int], target: list[int], at: list[list[int]], signals: int, cache: str) -> dict:
    """signals = 0: the cold load only (the GGUF dequantized into `cache`, the first run's
    cost). Otherwise a warm load from `cache`, as every later run loads, then the scoring:
    its peak RSS is what a run holds, without the one-off dequantization's."""
    from clawd.training import blas

    choice = blas.enable(Path(cache))  # as the trainer does: without it MLX's reference BLAS runs
    import mlx.core as mx

    from clawd.training.loss import response_logprobs
    from clawd.training.weights import load_model

    t0 = time.perf_counter()
    lm = load_model(model, cache_dir=Path(cache))
    load = time.perf_counter() - t0
    times = []
    for i in range(signals):
        ids = mx.array([prompt[0]] * (i + 1) + prompt + target, dtype=mx.int32)
        t0 = time.perf_counter()
        lp = response_logprobs(lm, ids, len(prompt) + i + 1, mx.array(at, dtype=mx.int32))
        mx.eval(lp)
        times.append(time.perf_counter() - t0)
    out = {"load_s": load, "peak_rss_mb": _peak_mb(), "blas": choice.name}
    if times:
        out["per_signal_s"] = statistics.median(times)
    return out


def trainer_job(job_dir: Path, student: Path, teacher: Path | None, prompt, target, n: int) -> None:
    """A job of `n` hinted samples (reward -1, the hint in REQUEST already), nothing held out,
    one epoch in batches of 4, no QA canary or turn-end check: the prepare and train phases
    the teacher setting changes, and a gate of direction + KL only."""
    import dataclasses

    from clawd.config import TrainingSettings
    from clawd.training.data import Job, Sample, write_job

    settings = TrainingSettings(teacher=f"model:{teacher}" if teacher else "base", epochs=1, batch_size=4)
    samples = [Sample(f"t{i}", [prompt[0]] * (i + 1) + prompt, target, -1, prompt + [prompt[0]] * i) for i in range(n)]
    job = Job(job_dir.name, str(student), student.stem, dataclasses.asdict(settings), train=samples)
    job.canary, job.top_k = samples[:1], TOP_K
    job.teacher_model_path = str(teacher) if teacher else None
    job_dir.mkdir(parents=True)
    write_job(job, job_dir / "job.json")


def child_trainer(job_dir: str, cache: str, out: str) -> dict:
    """The trainer child on the job, as the daemon runs it; the phases' seconds from its events,
    and its peak RSS (the child's: ru_maxrss of this process's children)."""
    proc = subprocess.run(
        [sys.executable, "-m", "clawd.training.run", job_dir, "--cache", cache, "--out", out],
        capture_output=True,
        text=True,
        check=False,
        cwd=ROOT,
    )
    if proc.returncode != 0:
        raise SystemExit(f"trainer failed:\n{proc.stderr[-2000:]}")
    phases, end = [], None
    for line in proc.stdout.splitlines():
        e = json.loads(line)
        if e["event"] == "phase":
            phases.append((e["phase"], e["time"]))
        end = e["time"]
    seconds = {name: round(nxt - t, 2) for (name, t), (_, nxt) in zip(phases, phases[1:] + [("end", end)])}
    return {"phases_s": seconds, "peak_rss_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024}


def measure(place: str, model: Path, prompt, target, at, signals: int, cache: str = "") -> dict:
    args = json.dumps(
        {
            "place": place,
            "model": str(model),
            "prompt": prompt,
            "target": target,
            "at": at,
            "n": signals,
            "cache": cache,
        }
    )
    out = subprocess.run([sys.executable, __file__, "--child", args], capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"{place} on {model.name} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--student", type=Path)
    ap.add_argument("--teacher", type=Path)
    ap.add_argument("--signals", type=int, default=3)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--samples", type=int, default=8, help="hinted samples in each whole trainer run")
    ap.add_argument("--only", choices=("scoring", "trainer"), help="run one part only")
    ap.add_argument("--trainer-child", nargs=3, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.trainer_child:
        print(json.dumps(child_trainer(*a.trainer_child)))
        return
    if a.child:
        c = json.loads(a.child)
        args = (Path(c["model"]), c["prompt"], c["target"], c["at"], c["n"])
        print(json.dumps(child_llamacpp(*args) if c["place"] == "llamacpp" else child_mlx(*args, c["cache"])))
        return
    if not (a.student and a.teacher):
        ap.error("--student and --teacher are required")
    from llama_cpp import Llama

    tok = Llama(str(a.teacher), vocab_only=True, verbose=False)
    prompt = tok.tokenize(REQUEST.encode(), add_bos=True, special=False)
    target = tok.tokenize(ANSWER.encode(), add_bos=False, special=False)
    at = [[(7 * i + j) % 1000 + 100 for j in range(TOP_K)] for i in range(len(target))]
    print(f"context: {len(prompt)} prompt + {len(target)} response tokens, top-k {TOP_K}, {a.signals} signals")
    rows = {}
    with tempfile.TemporaryDirectory() as cache:
        for place in () if a.only == "trainer" else ("llamacpp", "mlx"):
            for role, model in (("student", a.student), ("teacher", a.teacher)):
                if place == "mlx":
                    cold = measure(place, model, prompt, target, at, 0, cache)
                r = measure(place, model, prompt, target, at, a.signals, cache)
                extra = ""
                if place == "mlx":
                    r.update(cold_load_s=cold["load_s"], cold_peak_rss_mb=cold["peak_rss_mb"])
                    extra = f"  (first run: load {cold['load_s']:.1f} s, peak {cold['peak_rss_mb']:.0f} MB)"
                rows[f"{place}/{role}"] = r
                print(
                    f"{place:9} {role:8} {model.name:42} load {r['load_s']:5.1f} s  per signal "
                    f"{r['per_signal_s']:5.2f} s  peak RSS {r['peak_rss_mb']:6.0f} MB{extra}"
                )
        # 2. Whole trainer runs of the student (weights already in the cache): teacher = base,
        #    the anchor, then the teacher model.
        if a.only != "scoring":
            print(f"whole trainer runs: {a.samples} hinted samples, 1 epoch, batch 4")
        for name, teacher in () if a.only == "scoring" else (("base", None), ("model", a.teacher)):
            job_dir = Path(cache) / "jobs" / f"job-{name}"
            trainer_job(job_dir, a.student, teacher, prompt, target, a.samples)
            out = subprocess.run(
                [sys.executable, __file__, "--trainer-child", str(job_dir), cache, str(Path(cache) / "adapters")],
                capture_output=True,
                text=True,
                check=False,
            )
            if out.returncode != 0:
                raise SystemExit(f"trainer run with teacher {name} failed:\n{out.stderr[-2000:]}")
            r = json.loads(out.stdout.strip().splitlines()[-1])
            rows[f"trainer/{name}"] = r
            print(f"  teacher {name:5}  peak RSS {r['peak_rss_mb']:6.0f} MB  phases (s): {r['phases_s']}")
    for role in () if a.only == "trainer" else ("student", "teacher"):
        ratio = rows[f"mlx/{role}"]["per_signal_s"] / rows[f"llamacpp/{role}"]["per_signal_s"]
        print(f"{role}: MLX / llama.cpp seconds per signal = {ratio:.2f}x")
    if a.json:
        a.json.write_text(json.dumps({"context": [len(prompt), len(target)], "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
