"""Learning-benchmark results → summary numbers, a Markdown table and a PNG plot.

Boundary: pure functions over the JSON the harness writes (clawd/bench/learning.py); no
HTTP, no daemon. matplotlib is optional (`pip install 'clawd[bench]'`): without it the plot
is skipped with a note.
"""

from __future__ import annotations

import statistics
from pathlib import Path

MILESTONES = (4, 8, 16)  # optimizer steps the table reports (METHOD.md §7 reports 8 and 16)
CRITERION_RUN = 3  # the preference "holds" once it is met in this many consecutive sessions


def sessions_to_criterion(passed: list[bool], run: int = CRITERION_RUN) -> int | None:
    """Sessions until the preference held in `run` consecutive sessions (the count includes
    those sessions), or None if it never did (METHOD.md §7, v2)."""
    streak = 0
    for i, ok in enumerate(passed):
        streak = streak + 1 if ok else 0
        if streak >= run:
            return i + 1
    return None


def compliance_at(curve: list[dict], step: int, key: str) -> float | None:
    """Compliance of the adapter live after `step` optimizer steps: the last measurement
    taken at or before that step, provided training got that far; None otherwise."""
    if not curve or curve[-1]["step"] < step:
        return None
    return [p for p in curve if p["step"] <= step][-1][key]


def summarize(arm: dict) -> dict:
    curve, rounds = arm["curve"], arm["rounds"]
    kls = [r["gate"]["kl_to_base"] for r in rounds if r.get("gate") and r["gate"].get("kl_to_base") is not None]
    promoted_kls = [r["gate"]["kl_to_base"] for r in rounds if r.get("promoted")]
    return {
        "user": arm["user"],
        "method": arm["method"],
        "seed": arm["seed"],
        "steps": curve[-1]["step"] if curve else 0,
        "sessions": len(arm["sessions"]),
        **{f"{key}_before": curve[0][key] for key in ("greedy", "sampled")},
        # the hinted base (the OPD teacher) on the same prompts: what distillation could pass on
        **{f"{key}_teacher": arm["teacher"][key] if arm.get("teacher") else None for key in ("greedy", "sampled")},
        **{f"{key}_after_{s}": compliance_at(curve, s, key) for key in ("greedy", "sampled") for s in MILESTONES},
        **{f"{key}_final": curve[-1][key] for key in ("greedy", "sampled")},
        "sessions_to_criterion": sessions_to_criterion([s["passed"] for s in arm["sessions"]]),
        "training_compliance": (
            sum(s["passed"] for s in arm["sessions"]) / len(arm["sessions"]) if arm["sessions"] else None
        ),
        # canary KL of the adapter live at the end (the gate's forgetting measure), and the largest seen
        "kl_to_base": promoted_kls[-1] if promoted_kls else 0.0,
        "kl_max": max(kls, default=None),
        "refused": sum(1 for r in rounds if not r.get("promoted")),
        "runs": len(rounds),
    }


def _mean(values: list) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.fmean(vals) if vals else None


def fmt(v, pct: bool = True) -> str:
    if v is None:
        return "–"
    return f"{v:.0%}" if pct else f"{v:.3f}"


def group(summaries: list[dict]) -> list[dict]:
    """Means over seeds per (user, method), in the order first seen."""
    keys = list(dict.fromkeys((s["user"], s["method"]) for s in summaries))
    out = []
    for user, method in keys:
        rows = [s for s in summaries if s["user"] == user and s["method"] == method]
        crit = [s["sessions_to_criterion"] for s in rows]
        g = {
            "user": user,
            "method": method,
            "seeds": len(rows),
            "sessions": _mean([s["sessions"] for s in rows]),
            "criterion_reached": sum(c is not None for c in crit),
            "sessions_to_criterion": _mean(crit),
        }
        for k in rows[0]:
            if k.startswith(("greedy_", "sampled_")) or k in (
                "steps",
                "kl_to_base",
                "kl_max",
                "refused",
                "runs",
                "training_compliance",
            ):
                g[k] = _mean([s[k] for s in rows])
        out.append(g)
    return out


def markdown(results: dict) -> str:
    grouped = group([summarize(a) for a in results["arms"]])
    head = (
        "| user | method | seeds | compliance before | teacher + hint | after 4 steps | after 8 steps "
        "| after 16 steps | at the end (steps) | sessions to criterion | training-session compliance "
        "| canary KL to base (bound) | runs refused |"
    )
    lines = [
        "Compliance on held-out first messages, greedy / sampled (T = "
        f'{results["config"]["eval_temperature"]}); means over seeds. "–": training did not get that far. '
        "Teacher + hint: the teacher asked with the user's correction as a hint, the teacher's context: the "
        "base model, or training.teacher's model where the run set one (for the -self methods, their "
        "teacher before the first run).",
        "",
        head,
        "|" + "---|" * (head.count("|") - 1),
    ]
    bound = results["config"]["kl_bound"]
    for g in grouped:
        cells = [
            f"{fmt(g[f'greedy_{k}'])} / {fmt(g[f'sampled_{k}'])}"
            for k in ("before", "teacher", *(f"after_{s}" for s in MILESTONES), "final")
        ]
        cells[-1] += f" ({g['steps']:.0f})"
        if g["criterion_reached"]:
            crit = f"{g['sessions_to_criterion']:.1f}"
            if g["criterion_reached"] < g["seeds"]:
                crit += f" ({g['criterion_reached']}/{g['seeds']} seeds)"
        else:
            crit = f"not in {g['sessions']:.0f}"
        lines.append(
            f"| {g['user']} | {g['method']} | {g['seeds']} | "
            + " | ".join(cells)
            + f" | {crit} | {fmt(g['training_compliance'])} | {fmt(g['kl_to_base'], False)} ({bound}) "
            f"| {g['refused']:.1f} of {g['runs']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def plot(results: dict, path: Path) -> str | None:
    """Compliance vs optimizer step: a column per user, greedy on top and sampled below (so
    lines that agree do not hide each other), a colour per method. Returns a note instead
    when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no plot: matplotlib is not installed (pip install 'clawd[bench]')"
    users = list(dict.fromkeys(a["user"] for a in results["arms"]))
    methods = list(dict.fromkeys(a["method"] for a in results["arms"]))
    colours = dict(zip(methods, ("tab:red", "tab:blue", "tab:green", "tab:purple", "tab:orange")))
    fig, axes = plt.subplots(2, len(users), figsize=(5 * len(users), 6.5), squeeze=False, sharex="col")
    for col, user in enumerate(users):
        for row, key in enumerate(("greedy", "sampled")):
            ax = axes[row][col]
            for method in methods:
                arms = [a for a in results["arms"] if a["user"] == user and a["method"] == method]
                if not arms:
                    continue
                steps = sorted({p["step"] for a in arms for p in a["curve"]})
                ys = [_mean([compliance_at(a["curve"], s, key) for a in arms]) for s in steps]
                ax.plot(steps, ys, marker="o", color=colours.get(method), label=method, alpha=0.8)
            ax.set_title(f"{user}: {key}")
            ax.set_ylabel("held-out compliance")
            ax.set_ylim(-0.05, 1.05)
            ax.grid(alpha=0.3)
        axes[1][col].set_xlabel("optimizer steps")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return None
