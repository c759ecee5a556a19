"""Does the hinted teacher do what the user asked? Compliance of the base model + hint, per wording.

On-policy distillation can only pass on what its teacher does: the frozen base model with the
user's correction in its context (METHOD.md §3). This script asks the held-out first messages
of each simulated user (clawd/bench/users/) with one of that user's corrections, turned into a
hint by the rules judge exactly as the miner does, in several wordings, through a real daemon,
and prints the teacher's compliance (greedy / sampled at T = 0.7): the ceiling of what the OPD
term can teach. `method` is METHOD.md §3's wording, the one clawd uses; the others are
alternatives measured against it.

The hint itself comes from `--hint-source`: "judge" is the hint the rules judge writes (the
user's request restated as an instruction, "End the answer with 'Cheers'."), what the miner
keeps; "raw" is the user's correction as they typed it ("You forgot to sign off with Cheers").
Both skip the corrections the judge makes no hint of, so they are measured on the same prompts.

    python benchmarks/hint_wording.py [--users terse,detailed] [--prompts 8] [--model PATH]
                                      [--hint-source raw,judge] [--wordings method,system]
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
from clawd.bench.learning import (  # noqa: E402
    HINT_SOURCES,
    Budget,
    daemon_settings,
    embedded_model,
    measure,
    teacher_context,
)
from clawd.bench.users import resolve_user, shipped_users  # noqa: E402
from clawd.errors import ClawdError  # noqa: E402

WORDINGS = {
    "method": teacher_context,
    "hint first": lambda prompt, hint: [{"role": "user", "content": f"{hint}\n\n{prompt}"}],
    "important": lambda prompt, hint: [{"role": "user", "content": f"{prompt}\n\n(Important: {hint})"}],
    "system": lambda prompt, hint: [{"role": "system", "content": hint}, {"role": "user", "content": prompt}],
}


def measure_all(
    users, n_prompts: int, max_tokens: int, model: Path, work: Path, sources=("judge",), wordings=tuple(WORDINGS)
) -> list[dict]:
    """One row per (user, hint source, wording): the hinted base's compliance, greedy and sampled."""
    budget, rows = Budget(eval_prompts=n_prompts, max_tokens=max_tokens), []
    with Daemon(work / "home", daemon_settings("hybrid", budget), model=model) as d:
        for user in users:
            for source in sources:
                for wording in wordings:
                    step = f"{user.name}-{source}-{wording}"
                    point = measure(d, user, budget, step, hinted=WORDINGS[wording], hint_source=source)
                    if not point["answers"]:  # the miner would make no hint of any of its corrections
                        continue
                    rows.append(
                        {
                            "user": user.name,
                            "source": source,
                            "wording": wording,
                            "n": len(point["answers"]),
                            "greedy": point["greedy"],
                            "sampled": point["sampled"],
                            "answers": point["answers"],
                        }
                    )
                    print(
                        f"{user.name:10} {source:5} {wording:11} greedy {point['greedy']:4.0%}  "
                        f"sampled {point['sampled']:4.0%}  (n={len(point['answers'])})",
                        flush=True,
                    )
    return rows


def table(rows: list[dict]) -> str:
    """Per user, a column per (hint source, wording): greedy / sampled compliance; a last row
    with the mean over users (each user weighs the same)."""
    cols = list(dict.fromkeys((r["source"], r["wording"]) for r in rows))
    lines = [
        "| user | " + " | ".join(f"{s}: {w}" for s, w in cols) + " |",
        "|---|" + "---|" * len(cols),
    ]
    cell = lambda r: f"{r['greedy']:.0%} / {r['sampled']:.0%}" if r else "–"  # noqa: E731
    for name in dict.fromkeys(r["user"] for r in rows):
        mine = {(r["source"], r["wording"]): r for r in rows if r["user"] == name}
        lines.append(f"| {name} | " + " | ".join(cell(mine.get(c)) for c in cols) + " |")
    means = []
    for c in cols:
        got = [r for r in rows if (r["source"], r["wording"]) == c]
        means.append(
            f"**{sum(r['greedy'] for r in got) / len(got):.0%} / {sum(r['sampled'] for r in got) / len(got):.0%}**"
        )
    lines.append("| mean | " + " | ".join(means) + " |")
    return "\n".join(lines)


def _choices(text: str, allowed, what: str) -> list[str]:
    got = [t.strip() for t in text.split(",") if t.strip()]
    bad = [t for t in got if t not in allowed]
    if bad or not got:
        sys.exit(f"hint_wording: {what} must be a comma list of {', '.join(allowed)} (got {text!r})")
    return got


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--users", default=",".join(shipped_users()))
    p.add_argument("--prompts", type=int, default=8, help="held-out first messages per user")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--model", type=Path, help="GGUF to serve (default: the embedded Gemma 3 270M)")
    p.add_argument("--hint-source", default="judge", help=f"comma list of {', '.join(HINT_SOURCES)} (default judge)")
    p.add_argument("--wordings", default=",".join(WORDINGS), help="comma list of wordings (default all)")
    p.add_argument("--out", type=Path, help="write the numbers (and every answer) as JSON here")
    a = p.parse_args()
    sources = _choices(a.hint_source, HINT_SOURCES, "--hint-source")
    wordings = _choices(a.wordings, tuple(WORDINGS), "--wordings")
    try:
        users = [resolve_user(name) for name in a.users.split(",")]
    except ClawdError as e:
        sys.exit(f"hint_wording: {e.message}")
    work = Path(tempfile.mkdtemp(prefix="clawd-hint-wording-"))
    try:
        model = a.model or embedded_model(work)
        rows = measure_all(users, a.prompts, a.max_tokens, model, work, sources, wordings)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if not rows:
        sys.exit("hint_wording: no user had a correction the judge makes a hint of")
    print(f"\nmodel {model.name}, {a.prompts} prompts per user, greedy / sampled compliance\n")
    print(table(rows))
    if a.out:
        a.out.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
