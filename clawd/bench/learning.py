"""Does clawd learn a user's preference from conversation? Hybrid vs binary RL vs OPD.

    clawd bench learning [--users terse,detailed] [--methods hybrid,rl,opd] [--seeds 0]
                         [--steps 8] [--batch 4] [--eval-prompts 8] [--max-tokens 48] [--out DIR]
    (or: python benchmarks/learning.py ...)

Per (user, seed, method) an *arm*: a fresh `clawd serve` on its own CLAWD_HOME (the same
path a person uses: HTTP only), with the rules judge and hint judge (fast, deterministic:
the user's correction sentence becomes the hint) and automatic training off. Then:

1. Compliance before: the simulated user's held-out first messages, answered greedily and
   sampled (fixed seeds), as side turns (never mined), scored by the user's detector.
2. Sessions: the user sends a first message from its task pool, reads the (sampled) answer
   and replies — a correction in one of several wordings when the detector fails, an
   approval when it passes, sometimes a thumb. The miner turns each session into a signal.
3. Once `--batch` new signals are ready since the last run (and, by
   `POST /clawd/training?if_ready=1` with min_signals = B, at least B untrained ones),
   one run trains: one batch (batch_size is set above any run's sample count) for `--epochs`
   passes, i.e. `--epochs` optimizer steps, continuing from the active adapter. The eval
   gate may refuse the adapter (gain ≤ 0 on held-out signals, or canary KL > kl_bound):
   that is recorded as data, the active adapter stays, and its signals train again in the
   next run. `--holdout` is clawd's training.holdout (0.2): the share of signals kept from
   training for the gate; 0 makes the gate judge on the training signals (KL still binds).
4. After each run compliance is measured again, until `--steps` optimizer steps are done.

Methods differ only in the loss weights (training.w_rl, training.w_opd), as METHOD.md §5
defines the ablations; the `-self` variants also make the active adapter (each run's π_old)
the hinted teacher (training.teacher = policy) instead of the frozen base; `union` (hybrid)
and `opd-union` score OPD on the student's top-k ∪ the teacher's (training.opd_support = union);
`union-fwd` and `opd-union-fwd` also weight those tokens by the teacher's probabilities instead of
the student's (training.opd_weighting = teacher); the `-ta` variants of those two also train on
the hinted teacher's own answer to each hinted signal (training.teacher_answers), and the
`-both-ta` ones weight by the mean of the two (training.opd_weighting = both). Before training,
each arm also asks the held-out messages with the user's correction as a hint (the teacher's
context): how often the hinted teacher complies bounds what distillation can teach. The teacher is
the served base, or, with training.teacher = "model:PATH" (`--set`), that model, served on its own
for this measurement (once per user: it is the same for every method and seed).

Results: JSON (everything, incl. every answer), a Markdown table and a PNG plot in --out;
`--merge` pools the results.json of earlier runs (more seeds or methods) into one. Seeds fix
task order, reactions and sampling; the trainer's own seed is fixed too.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shlex
import shutil
import signal
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from clawd import teacher_model
from clawd.bench import report
from clawd.bench.daemon import Daemon
from clawd.bench.users import SimulatedUser, resolve_user, shipped_users, unseen_users
from clawd.errors import ClawdError, ConfigError
from clawd.judge import JudgeInput
from clawd.judge_rules import RulesJudge
from clawd.model_registry import second_model_path
from clawd.served import teacher_messages

# The union support weighted by the teacher's probabilities (the `-fwd` arms).
FWD = {"w_opd": 1.0, "opd_support": "union", "opd_weighting": "teacher"}
# METHOD.md §5: an ablation is a loss weight, nothing else.
METHODS = {
    "hybrid": {"w_rl": 1.0, "w_opd": 1.0},
    "rl": {"w_rl": 1.0, "w_opd": 0.0},
    "opd": {"w_rl": 0.0, "w_opd": 1.0},
    # The same with the active adapter (each run's π_old) as the hinted teacher (training.teacher = policy).
    "hybrid-self": {"w_rl": 1.0, "w_opd": 1.0, "teacher": "policy"},
    "opd-self": {"w_rl": 0.0, "w_opd": 1.0, "teacher": "policy"},
    # The OPD support widened to the student's top-k ∪ the teacher's (training.opd_support = union).
    "union": {"w_rl": 1.0, "w_opd": 1.0, "opd_support": "union"},
    "opd-union": {"w_rl": 0.0, "w_opd": 1.0, "opd_support": "union"},
    # Union with the teacher's weights on its columns (training.opd_weighting = teacher): a
    # forward-KL step, which can raise a token the student gives ~0.
    "union-fwd": {**FWD, "w_rl": 1.0},
    "opd-union-fwd": {**FWD, "w_rl": 0.0},
    # The same, also distilled along the hinted teacher's own greedy answer to each hinted signal
    # (training.teacher_answers = its room in tokens): the positions after a first token the
    # student never samples ("In" → "short") get a signal too.
    "union-fwd-ta": {**FWD, "w_rl": 1.0, "teacher_answers": 96},
    "opd-union-fwd-ta": {**FWD, "w_rl": 0.0, "teacher_answers": 96},
    # The same with both weightings averaged (training.opd_weighting = both): the student's own
    # tokens the teacher does not write are pushed down too (aimed at the "I" that rose with "In").
    "union-both-ta": {**FWD, "opd_weighting": "both", "w_rl": 1.0, "teacher_answers": 96},
    "opd-union-both-ta": {**FWD, "opd_weighting": "both", "w_rl": 0.0, "teacher_answers": 96},
}
# Far above any run's sample count: one run = one batch = `epochs` optimizer steps.
ONE_BATCH = 100_000


@dataclass
class Budget:
    steps: int = 8  # optimizer steps per arm
    batch: int = 4  # new ready signals per training run (training.min_signals)
    epochs: int = 2  # passes over each batch = optimizer steps per run (METHOD §6: 2)
    eval_prompts: int = 8  # held-out first messages per measurement (each greedy + sampled)
    max_tokens: int = 48  # per answer, in sessions and measurements
    learning_rate: float = 1e-4
    kl_bound: float = 0.5  # the eval gate's bound (training.kl_bound), kept at clawd's default
    holdout: float = 0.2  # training.holdout: signals kept for the gate's gain (0 = judged on train)
    temperature: float = 0.7  # training sessions and the sampled measurement
    arm_minutes: float = 0.0  # wall-clock cap per arm (0 = none): no new run starts after it
    extra: dict[str, str] = field(default_factory=dict)  # more CLAWD_* settings (--set)

    @property
    def runs(self) -> int:
        return math.ceil(self.steps / self.epochs)

    @property
    def max_sessions(self) -> int:
        # Signals can be empty or held out for the gate (training.holdout); this only stops a
        # user whose replies never become signals from looping forever.
        return self.runs * self.batch * 4 + 8


def daemon_settings(method: str, budget: Budget) -> dict[str, str]:
    w = METHODS[method]
    return {
        "CLAWD_TRAINING_AUTO": "0",
        "CLAWD_TRAINING_MIN_SIGNALS": str(budget.batch),
        "CLAWD_TRAINING_BATCH_SIZE": str(ONE_BATCH),
        "CLAWD_TRAINING_EPOCHS": str(budget.epochs),
        "CLAWD_TRAINING_LEARNING_RATE": str(budget.learning_rate),
        "CLAWD_TRAINING_KL_BOUND": str(budget.kl_bound),
        "CLAWD_TRAINING_HOLDOUT": str(budget.holdout),
        "CLAWD_TRAINING_W_RL": str(w["w_rl"]),
        "CLAWD_TRAINING_W_OPD": str(w["w_opd"]),
        "CLAWD_TRAINING_TEACHER": w.get("teacher", "base"),
        "CLAWD_TRAINING_OPD_SUPPORT": w.get("opd_support", "student"),
        "CLAWD_TRAINING_OPD_WEIGHTING": w.get("opd_weighting", "student"),
        "CLAWD_TRAINING_TEACHER_ANSWERS": str(w.get("teacher_answers", 0)),
        "CLAWD_MINING_JUDGE": "rules",
        "CLAWD_MINING_HINT_JUDGE": "rules",
        "CLAWD_MINING_QUIET_S": "0",
        "CLAWD_LOG_LEVEL": "warning",
        **budget.extra,
    }


def _say(*parts) -> None:
    print(*parts, flush=True)


def teacher_gguf(settings: dict[str, str]) -> Path | None:
    """The GGUF that teaches when the daemon's settings name one (training.teacher =
    "model:PATH"); None when the teacher is the served model (base or policy)."""
    teacher = settings.get("CLAWD_TRAINING_TEACHER", "base")
    if not teacher.startswith(teacher_model.PREFIX):
        return None
    return second_model_path(teacher.removeprefix(teacher_model.PREFIX).strip(), None, role="teacher")


def measure_teacher_model(gguf: Path, user: SimulatedUser, budget: Budget, home: Path) -> dict:
    """The hinted compliance of a teacher model that is not the served one: a daemon of its own
    serves it (the bench's daemon serves the student), with the run's other settings, asked
    exactly as the student is."""
    t0 = time.perf_counter()
    served_as = {k: v for k, v in budget.extra.items() if k != "CLAWD_TRAINING_TEACHER"}
    with Daemon(home, {**served_as, "CLAWD_TRAINING_AUTO": "0", "CLAWD_LOG_LEVEL": "warning"}, model=gguf) as t:
        point = measure(t, user, budget, "teacher", hinted=teacher_context)
        return {**point, "model": t.model_id, "seconds": time.perf_counter() - t0}


def teacher_context(prompt: str, hint: str) -> list[dict]:
    """The prompt as the teacher sees it: the hint appended the miner's way (METHOD §3)."""
    return [m.model_dump(exclude_none=True) for m in teacher_messages([{"role": "user", "content": prompt}], hint)]


def measure(
    d: Daemon,
    user: SimulatedUser,
    budget: Budget,
    step: int | str,
    hinted: Callable[[str, str], list[dict]] | None = None,
    hint_source: str = "judge",
) -> dict:
    """Held-out compliance of the live adapter, greedy and sampled (fixed seeds, side turns).
    `hinted(prompt, hint)`: ask each prompt with one of the user's corrections as the miner
    turns it into a hint, in that wording (`teacher_context` = the teacher's own): what the
    hinted model itself would answer (a correction the rules judge makes no hint of is
    skipped: the miner would have none). `hint_source` (HINT_SOURCES): the hint the rules
    judge writes, or the user's correction as they typed it."""
    prompts = user.held_out[: budget.eval_prompts]
    answers = []
    for i, prompt in enumerate(prompts):
        msgs = [{"role": "user", "content": prompt}]
        if hinted:
            hint = teacher_hint(user, prompt, i, hint_source)
            if hint is None:
                continue
            msgs = hinted(prompt, hint)
        g = d.chat(
            msgs, max_tokens=budget.max_tokens, temperature=0.0, seed=0, session_id=f"eval-{step}-g{i}", side=True
        )["text"]
        s = d.chat(
            msgs,
            max_tokens=budget.max_tokens,
            temperature=budget.temperature,
            seed=7919 + i,
            session_id=f"eval-{step}-s{i}",
            side=True,
        )["text"]
        answers.append(
            {
                "prompt": msgs[-1]["content"],
                "greedy": g,
                "greedy_ok": user.complies(g),
                "sampled": s,
                "sampled_ok": user.complies(s),
            }
        )
    n = len(answers)
    return {
        "step": step,
        "greedy": sum(a["greedy_ok"] for a in answers) / n if n else None,
        "sampled": sum(a["sampled_ok"] for a in answers) / n if n else None,
        "answers": answers,
    }


# Where the teacher's hint comes from: "judge", the rules judge's hint (the user's request
# restated as an instruction, what the miner keeps); "raw", the user's correction verbatim.
HINT_SOURCES = ("judge", "raw")


def teacher_hint(user: SimulatedUser, prompt: str, i: int, source: str = "judge") -> str | None:
    """The user's i-th correction (cycled) as a hint from `source`, or None where the rules
    judge makes no hint of it: the miner would have none, so "raw" skips the same
    corrections and both sources are measured on the same prompts."""
    if source not in HINT_SOURCES:
        raise ValueError(f"hint source must be one of {HINT_SOURCES}, not {source!r}")
    reply = user.corrections[i % len(user.corrections)]
    hint = RulesJudge().correction(JudgeInput([{"role": "user", "content": prompt}], "", reply, "user"))
    if hint is None or source == "judge":
        return hint
    return reply.strip()


def converse(d: Daemon, user: SimulatedUser, task: str, index: int, seed: int, budget: Budget) -> dict:
    """One session: first message, the answer, the user's reply (and maybe a thumb); returns
    the session with the signal the miner made of it."""
    sid = f"{user.name}-seed{seed}-session{index}"
    msgs = [{"role": "user", "content": task}]
    first = d.chat(
        msgs, max_tokens=budget.max_tokens, temperature=budget.temperature, seed=seed * 100_003 + index, session_id=sid
    )
    reaction = user.react(first["text"], random.Random(f"{user.name}:{seed}:{index}"))
    # The reply is the first turn's next state; its own answer is never judged, so 1 token.
    d.chat(
        [*msgs, {"role": "assistant", "content": first["text"]}, {"role": "user", "content": reaction.text}],
        max_tokens=1,
        temperature=0.0,
        seed=0,
        session_id=sid,
    )
    if reaction.thumbs:
        d.post("/clawd/feedback", {"turn_id": first["id"], "rating": reaction.thumbs})
    sig = d.wait_mined(first["id"])
    return {
        "index": index,
        "task": task,
        "turn_id": first["id"],
        "response": first["text"],
        "passed": user.complies(first["text"]),
        "reply": reaction.text,
        "thumbs": reaction.thumbs,
        "reward": sig.get("reward"),
        "reward_source": sig.get("reward_source"),
        "hint": sig.get("hint"),
        "signal": sig["status"],
    }


def run_arm(
    arm: dict,
    user: SimulatedUser,
    budget: Budget,
    home: Path,
    model: Path | None,
    shared_cache: Path,
    save: Callable[[], object],
    teachers: dict,
) -> dict:
    """Fill `arm` (user, method, seed set) in place; `save()` after each measurement, so a
    run cut short (time cap, SIGTERM) still has every point it measured on disk. `teachers`
    keeps a teacher model's measurement per user across arms: the same model, prompts and seeds
    for every method and seed, so asking again would only repeat it."""
    method, seed = arm["method"], arm["seed"]
    tag = f"[{user.name} {method} seed {seed}]"
    home.mkdir(parents=True)
    (home / "cache").symlink_to(shared_cache)  # dequantized weights and the BLAS shim, built once
    arm.update(curve=[], rounds=[], sessions=[], stopped=None, home=str(home))
    tasks = user.session_tasks(budget.max_sessions, seed)
    settings = daemon_settings(method, budget)
    gguf = teacher_gguf(settings)
    if gguf is not None:  # before the student's daemon starts: one model in memory at a time
        key = (user.name, str(gguf))
        if key not in teachers:
            teachers[key] = measure_teacher_model(gguf, user, budget, home / "teacher")
        arm["teacher"] = teachers[key]
    # The arm's clock starts here: the teacher model's measurement (once per user, in its
    # "seconds") would otherwise make one arm per user look slower and leave it less time.
    t0 = time.perf_counter()
    with Daemon(home, settings, model=model) as d:
        arm["curve"].append(measure(d, user, budget, 0))
        if gguf is None:
            arm["teacher"] = measure(d, user, budget, "teacher", hinted=teacher_context)
        _say(
            f"{tag} before: greedy {arm['curve'][0]['greedy']:.0%}, sampled {arm['curve'][0]['sampled']:.0%}; "
            f"the {'teacher ' + arm['teacher']['model'] if gguf else 'base'} with the user's hint: "
            f"{report.fmt(arm['teacher']['greedy'])}, {report.fmt(arm['teacher']['sampled'])}"
        )
        save()
        steps = 0
        while steps < budget.steps:
            if budget.arm_minutes and time.perf_counter() - t0 > budget.arm_minutes * 60:
                arm["stopped"] = f"arm time cap ({budget.arm_minutes:g} min) after {steps} steps"
                break
            result, new_ready = None, 0
            while result is None:
                if len(arm["sessions"]) >= budget.max_sessions:
                    arm["stopped"] = f"{budget.max_sessions} sessions without enough signals to train"
                    break
                s = converse(d, user, tasks[len(arm["sessions"])], len(arm["sessions"]), seed, budget)
                arm["sessions"].append(s)
                _say(
                    f"{tag} session {s['index'] + 1}: {'pass' if s['passed'] else 'FAIL'} "
                    f"{s['response'].strip()[:60]!r} -> {s['reply'][:40]!r}{' +' + s['thumbs'] if s['thumbs'] else ''}"
                    f" | reward {s['reward']} ({s['reward_source']}), hint {'yes' if s['hint'] else 'no'}"
                )
                new_ready += s["signal"] == "ready"
                if new_ready >= budget.batch:  # refused runs leave untrained signals: count new ones
                    t_run = time.perf_counter()
                    result = d.train()
            if result is None:
                break
            detail = d.get(f"/clawd/adapters/{result['adapter_id']}") if result.get("adapter_id") else {}
            metrics = detail.get("metrics") or {}
            run = {
                **result,
                "seconds": time.perf_counter() - t_run,
                "steps": metrics.get("steps", 0),
                "samples": metrics.get("samples"),
                "final": metrics.get("final"),
                "after_sessions": len(arm["sessions"]),
            }
            arm["rounds"].append(run)
            if "error" in result and not result.get("gate"):
                arm["stopped"] = f"training failed: {result['error']}"
                _say(f"{tag} {arm['stopped']}")
                break
            steps += run["steps"] or budget.epochs
            gate = result.get("gate") or {}
            verdict = "promoted" if result.get("promoted") else f"REFUSED: {result.get('note') or result.get('error')}"
            _say(
                f"{tag} run {len(arm['rounds'])}: {run['samples']} samples, {run['steps']} steps "
                f"({run['seconds']:.0f} s); gate gain {gate.get('gain')}, KL to base {gate.get('kl_to_base')} -> "
                f"{verdict}"
            )
            if result.get("promoted"):
                point = measure(d, user, budget, steps)
            else:  # the active adapter did not change: neither did its answers
                point = {**arm["curve"][-1], "step": steps}
            point["adapter"] = result.get("adapter_id") if result.get("promoted") else arm["curve"][-1].get("adapter")
            arm["curve"].append(point)
            save()
            _say(f"{tag} after {steps} steps: greedy {point['greedy']:.0%}, sampled {point['sampled']:.0%}")
    arm["wall_s"] = time.perf_counter() - t0
    return arm


def embedded_model(work: Path) -> Path:
    """The embedded Gemma 3 270M (from its PyPI package, no network) in a scratch home under `work`."""
    from clawd.models import ensure_embedded_model
    from clawd.paths import ensure_dirs, resolve_paths

    paths = resolve_paths({"CLAWD_HOME": str(work / "model-home")})
    ensure_dirs(paths)
    return ensure_embedded_model(paths)


def _names(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def _settings(pairs: list[str]) -> dict[str, str]:
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.startswith("CLAWD_"):
            raise ConfigError(f"--set wants CLAWD_SECTION_FIELD=VALUE, got {pair!r}")
        out[key] = value
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="clawd bench learning",
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--users",
        default="terse,detailed,plain,signoff",
        help=f"comma list: shipped users ({', '.join(shipped_users())}), unseen users "
        f"({', '.join(unseen_users())}) or paths to user .toml files",
    )
    p.add_argument("--methods", default="hybrid,rl,opd", help=f"comma list of {', '.join(METHODS)}")
    p.add_argument("--seeds", default="0", help="comma list of integer seeds")
    b = Budget()
    p.add_argument("--steps", type=int, default=b.steps, help="optimizer steps per arm")
    p.add_argument("--batch", type=int, default=b.batch, help="new ready signals per training run")
    p.add_argument("--epochs", type=int, default=b.epochs, help="passes over each batch (= optimizer steps per run)")
    p.add_argument("--eval-prompts", type=int, default=b.eval_prompts, help="held-out first messages per measurement")
    p.add_argument("--max-tokens", type=int, default=b.max_tokens, help="max tokens per answer")
    p.add_argument("--lr", type=float, default=b.learning_rate, help="training.learning_rate")
    p.add_argument("--kl-bound", type=float, default=b.kl_bound, help="training.kl_bound (the eval gate's bound)")
    p.add_argument(
        "--holdout",
        type=float,
        default=b.holdout,
        help="training.holdout: share of signals the gate "
        "judges on, never trained on (0 = the gate judges on the training signals)",
    )
    p.add_argument(
        "--temperature",
        type=float,
        default=b.temperature,
        help="sampling temperature of sessions and the sampled measurement",
    )
    p.add_argument("--arm-minutes", type=float, default=0.0, help="wall-clock cap per arm; 0 = none")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="CLAWD_X_Y=V",
        help="any other daemon setting, e.g. CLAWD_TRAINING_RANK=8 (repeatable)",
    )
    p.add_argument("--model", type=Path, help="GGUF to serve (default: the embedded Gemma 3 270M)")
    p.add_argument("--out", type=Path, help="results directory (default: bench-results/learning-<time>)")
    p.add_argument(
        "--keep",
        action="store_true",
        help="keep the daemons' homes (databases, adapters, logs) and the work dir's shared cache of "
        "dequantized weights (9 GB with the Qwen 0.5B student and 1.5B teacher): delete the work dir when done",
    )
    p.add_argument(
        "--merge",
        type=Path,
        nargs="+",
        metavar="RESULTS_JSON",
        help="run nothing: pool the arms of earlier runs (more seeds or methods) into one table and plot in --out",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # `timeout` and service managers send SIGTERM: unwind, so each daemon is stopped and
    # what was measured so far is written.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        if args.merge:
            return _merge(args.merge, args.out or Path("bench-results") / time.strftime("learning-%Y%m%d-%H%M%S"))
        return _run(args, list(sys.argv[1:] if argv is None else argv))
    except ClawdError as e:
        print(f"clawd bench learning: error: {e.message}", file=sys.stderr)
        return 1


def _run(args, argv: list[str]) -> int:
    users = [resolve_user(u) for u in _names(args.users)]
    methods = _names(args.methods)
    unknown = [m for m in methods if m not in METHODS]
    if unknown or not methods:
        raise ConfigError(f"unknown method(s) {unknown}; choose from {', '.join(METHODS)}")
    try:
        seeds = [int(s) for s in _names(args.seeds)]
    except ValueError:
        raise ConfigError(f"--seeds wants integers, got {args.seeds!r}") from None
    if min(args.steps, args.batch, args.epochs, args.eval_prompts, args.max_tokens) < 1:
        raise ConfigError("--steps, --batch, --epochs, --eval-prompts and --max-tokens must be at least 1")
    extra = _settings(args.set)
    self_taught = [m for m in methods if "teacher" in METHODS[m]]
    if "CLAWD_TRAINING_TEACHER" in extra and self_taught:
        # --set comes last and would quietly turn hybrid-self / opd-self into hybrid / opd.
        raise ConfigError(
            f"--set CLAWD_TRAINING_TEACHER conflicts with {', '.join(self_taught)}, "
            "whose teacher is the active adapter; run those without it"
        )
    budget = Budget(
        steps=args.steps,
        batch=args.batch,
        epochs=args.epochs,
        eval_prompts=args.eval_prompts,
        max_tokens=args.max_tokens,
        learning_rate=args.lr,
        kl_bound=args.kl_bound,
        holdout=args.holdout,
        temperature=args.temperature,
        arm_minutes=args.arm_minutes,
        extra=extra,
    )
    out = args.out or Path("bench-results") / time.strftime("learning-%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="clawd-bench-learning-"))
    command = "clawd bench learning " + shlex.join(argv)
    results = {
        "config": {
            **asdict(budget),
            "users": [u.name for u in users],
            "user_files": [str(u.path) for u in users],
            "methods": methods,
            "seeds": seeds,
            "eval_temperature": budget.temperature,
            "command": command,
        },
        "arms": [],
    }
    t0 = time.perf_counter()
    _say(
        f"clawd bench learning: {len(users)} user(s) x {len(methods)} method(s) x {len(seeds)} seed(s), "
        f"{budget.steps} steps of {budget.batch} signals; work dir {work}"
    )
    try:
        model = args.model or embedded_model(work)
        results["config"]["model"] = model.name
        shared_cache = work / "shared-cache"
        shared_cache.mkdir()
        teachers: dict = {}
        for user in users:
            for seed in seeds:
                for method in methods:
                    home = work / f"{user.name}-{method}-seed{seed}"
                    arm = {"user": user.name, "method": method, "seed": seed}
                    results["arms"].append(arm)
                    run_arm(
                        arm,
                        user,
                        budget,
                        home,
                        model,
                        shared_cache,
                        save=lambda: _write(results, out, elapsed=time.perf_counter() - t0),
                        teachers=teachers,
                    )
    except BaseException as e:  # a failed daemon, Ctrl-C, SIGTERM: keep what was measured, say why it stopped
        results["error"] = getattr(e, "message", None) or f"{type(e).__name__} {e}".strip()
        _write(results, out, elapsed=time.perf_counter() - t0)
        raise
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    note = _write(results, out, elapsed=time.perf_counter() - t0)
    _say("")
    _say(report.markdown(results))
    _say(
        f"wall time {results['wall_s']:.0f} s; results in {out}/ (results.json, results.md"
        f"{', compliance.png' if note is None else ''}){'; ' + note if note else ''}"
    )
    return 0


# What every arm's numbers depend on: runs pooled by --merge must agree on these (steps may
# differ: an arm that did not get to a milestone shows "–" there).
COMPARABLE = (
    "batch",
    "epochs",
    "eval_prompts",
    "max_tokens",
    "learning_rate",
    "kl_bound",
    "holdout",
    "temperature",
    "extra",
)


def _merge(paths: list[Path], out: Path) -> int:
    runs = []
    for path in paths:
        try:
            run = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise ConfigError(f"--merge: cannot read {path} ({e})") from None
        if not (
            isinstance(run, dict)
            and isinstance(run.get("config"), dict)
            and isinstance(run.get("arms"), list)
            and all(isinstance(a, dict) for a in run["arms"])
        ):
            raise ConfigError(f"--merge: {path} is not a results.json of clawd bench learning")
        if (out / "results.json").resolve() == path.resolve():
            raise ConfigError(f"--merge: --out {out} would overwrite {path}; choose another directory")
        runs.append(run)
    first = runs[0]["config"]
    for path, run in zip(paths, runs):
        cfg = run["config"]
        differ = [k for k in COMPARABLE if cfg.get(k) != first.get(k)]
        if cfg.get("model") and first.get("model") and cfg["model"] != first["model"]:  # older runs lack it
            differ.append("model")
        if differ:
            raise ConfigError(f"--merge: {path} was run with other {', '.join(differ)} than {paths[0]}")
    arms = [a for r in runs for a in r["arms"]]
    counts = Counter((a.get("user"), a.get("method"), a.get("seed")) for a in arms)
    twice = sorted((k for k, n in counts.items() if n > 1), key=str)
    if twice:
        raise ConfigError(f"--merge: the same user, method and seed twice: {twice}")
    union = {
        k: list(dict.fromkeys(v for r in runs for v in r["config"].get(k, [])))
        for k in ("users", "user_files", "methods", "seeds")
    }
    results = {
        "config": {
            **first,
            **union,
            "command": "; ".join(r["config"].get("command", str(p)) for p, r in zip(paths, runs)),
        },
        "arms": arms,
    }
    out.mkdir(parents=True, exist_ok=True)
    note = _write(results, out, elapsed=sum(r.get("wall_s", 0) for r in runs))
    _say(report.markdown({**results, "arms": [a for a in arms if a.get("curve")]}))
    _say(
        f"{len(arms)} arms from {len(runs)} runs (wall time {results['wall_s']:.0f} s in all); "
        f"results in {out}/{'; ' + note if note else ''}"
    )
    return 0


def _write(results: dict, out: Path, elapsed: float | None = None) -> str | None:
    if elapsed is not None:
        results["wall_s"] = elapsed
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    arms = [a for a in results["arms"] if a.get("curve")]
    if not arms:
        return None
    results = {**results, "arms": arms}
    cfg = results["config"]
    (out / "results.md").write_text(
        report.markdown(results) + f"\nCommand: `{cfg['command']}`; wall time {results.get('wall_s', 0):.0f} s.\n"
    )
    return report.plot(results, out / "compliance.png")


if __name__ == "__main__":
    sys.exit(main())
