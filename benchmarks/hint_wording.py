"""Does the hinted teacher do what the user asked? Compliance of the base model + hint, per wording.

On-policy distillation can only pass on what its teacher does: the frozen base model with the
user's correction in its context (METHOD.md §3). This script asks the held-out first messages
of each simulated user (clawd/bench/users/) with one of that user's corrections, turned into a
hint by the rules judge exactly as the miner does, in several wordings, through a real daemon,
and prints the teacher's compliance (greedy / sampled at T = 0.7): the ceiling of what the OPD
term can teach. `method` is METHOD.md §3's wording, the one clawd uses; the others are
alternatives measured against it.

    python benchmarks/hint_wording.py [--users terse,detailed] [--prompts 8] [--model PATH]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from clawd.bench.daemon import Daemon  # noqa: E402
from clawd.bench.learning import Budget, daemon_settings, embedded_model, measure, teacher_context  # noqa: E402
from clawd.bench.users import resolve_user, shipped_users  # noqa: E402
from clawd.errors import ClawdError  # noqa: E402

WORDINGS = {
    "method": teacher_context,
    "hint first": lambda prompt, hint: [{"role": "user", "content": f"{hint}\n\n{prompt}"}],
    "important": lambda prompt, hint: [{"role": "user", "content": f"{prompt}\n\n(Important: {hint})"}],
    "system": lambda prompt, hint: [{"role": "system", "content": hint}, {"role": "user", "content": prompt}],
}


def measure_all(users, n_prompts: int, max_tokens: int, model: Path, work: Path) -> list[dict]:
    """One row per (user, wording): the hinted base's compliance, greedy and sampled."""
    budget, rows = Budget(eval_prompts=n_prompts, max_tokens=max_tokens), []
    with Daemon(work / "home", daemon_settings("hybrid", budget), model=model) as d:
        for user in users:
            for wording, build in WORDINGS.items():
                point = measure(d, user, budget, f"{user.name}-{wording}", hinted=build)
                if not point["answers"]:  # the miner would make no hint of any of its corrections
                    continue
                rows.append(
                    {"user": user.name, "wording": wording, "greedy": point["greedy"], "sampled": point["sampled"]}
                )
                print(
                    f"{user.name:10} {wording:11} greedy {point['greedy']:4.0%}  sampled {point['sampled']:4.0%}",
                    flush=True,
                )
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--users", default=",".join(shipped_users()))
    p.add_argument("--prompts", type=int, default=8, help="held-out first messages per user")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--model", type=Path, help="GGUF to serve (default: the embedded Gemma 3 270M)")
    p.add_argument("--out", type=Path, help="write the numbers as JSON here")
    a = p.parse_args()
    try:
        users = [resolve_user(name) for name in a.users.split(",")]
    except ClawdError as e:
        sys.exit(f"hint_wording: {e.message}")
    work = Path(tempfile.mkdtemp(prefix="clawd-hint-wording-"))
    try:
        rows = measure_all(users, a.prompts, a.max_tokens, a.model or embedded_model(work), work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print("\n| user | " + " | ".join(WORDINGS) + " |\n|---|" + "---|" * len(WORDINGS))
    for name in dict.fromkeys(r["user"] for r in rows):
        cells = [f"{r['greedy']:.0%} / {r['sampled']:.0%}" for r in rows if r["user"] == name]
        print(f"| {name} | " + " | ".join(cells) + " |")
    if a.out:
        a.out.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
