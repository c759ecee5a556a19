"""Do the rules judge and a likelihood judge do better together than the cascade? (issue 15, item 3)

`clawd bench judge --json` keeps, per item, the rules' verdict and a likelihood judge's log-prob
of each of \\boxed{-1}, \\boxed{0}, \\boxed{1}. This replays those stored verdicts (no model is
run) under three ways of combining the two:

- llm alone m: the likelihood judge's choice where it leads the runner-up by at least m nats;
- cascade m: the rules' verdict; where they are undecided, the LLM's choice if it leads the
  runner-up by at least m nats (what `mining.judge = "rules>…"` with `mining.likelihood_margin`
  does);
- llm first m: the other order: the LLM's choice where it leads by at least m nats, else the
  rules' verdict (replayed only: on the select split it ties the cascade at its best margin
  and trails it in recall and precision, so the miner keeps the rules first);
- agree: a verdict only where the rules and the LLM's choice agree (fewer, surer signals);
- veto m: the rules' verdict unless the LLM picks the opposite sign by at least m nats (then
  undecided).

Pick the combination and m on the select split and read the held-out run only as the report:
held-out items are never tuned on. (Dev cannot pick between orders: the rules were widened on
it, so every order that lets the LLM overrule them loses there.)

    python benchmarks/judge_ensemble.py [--results docs/judge-llm-results.json | OUT.json] [--margins 0,0.5,1,2]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from clawd.bench.judge_scoring import figures  # noqa: E402
from clawd.judge import likelihood_choice  # noqa: E402

Verdict = int | None


def llm_choice(logprobs: dict[str, float], margin: float) -> Verdict:
    """The likelihood judge's verdict from its stored log-probs (JSON keys the verdicts as text)."""
    return likelihood_choice({int(v): lp for v, lp in logprobs.items()}, margin)


def cascade(rules: Verdict, logprobs: dict[str, float], margin: float) -> Verdict:
    return rules if rules is not None else llm_choice(logprobs, margin)


def llm_first(rules: Verdict, logprobs: dict[str, float], margin: float) -> Verdict:
    sure = llm_choice(logprobs, margin)
    return sure if sure is not None else rules


def agree(rules: Verdict, logprobs: dict[str, float]) -> Verdict:
    return rules if rules is not None and rules == llm_choice(logprobs, 0.0) else None


def veto(rules: Verdict, logprobs: dict[str, float], margin: float) -> Verdict:
    against = llm_choice(logprobs, margin)
    return None if rules and against is not None and against == -rules else rules


def combinations(margins: list[float]) -> list[tuple[str, object]]:
    out: list[tuple[str, object]] = [("agree", agree)]
    for m in margins:
        out.append((f"cascade {m:g}", lambda r, lp, m=m: cascade(r, lp, m)))
        out.append((f"llm first {m:g}", lambda r, lp, m=m: llm_first(r, lp, m)))
        out.append((f"veto {m:g}", lambda r, lp, m=m: veto(r, lp, m)))
    return out


def runs_with_logprobs(results: dict) -> dict[str, tuple[str, list[dict]]]:
    """run name -> (the likelihood judge, per item {id, label, rules, logprobs}) for every run
    that holds both the rules' verdicts and a likelihood judge's log-probs on the same items."""
    out = {}
    for name, run in results["runs"].items():
        by_item: dict[str, dict] = defaultdict(dict)
        for o in run["outcomes"]:
            by_item[o["id"]][o["judge"]] = o
        # The LLM judge alone: a cascade's row holds log-probs only where the rules were undecided.
        llm = next((j for o in by_item.values() for j, v in o.items() if ">" not in j and v.get("logprobs")), None)
        items = [
            {"id": i, "label": o["rules"]["label"], "rules": o["rules"]["score"], "logprobs": o[llm]["logprobs"]}
            for i, o in by_item.items()
            if llm and "rules" in o and llm in o and o[llm].get("logprobs")
        ]
        if items:
            out[name] = (llm, items)
    return out


def row(name: str, labels: list[int], scores: list[Verdict]) -> str:
    f = figures(labels, scores, [[] for _ in scores], [0.0] * len(scores))

    def pct(x: float | None) -> str:
        return "  -  " if x is None else f"{100 * x:5.1f}"

    return (
        f"  {name:14s} {pct(f.accuracy)} {pct(f.correction_recall)} {pct(f.approval_precision)} "
        f"{pct(f.inverted)} {pct(f.false_corrections)} {pct(f.undecided)}"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--results", type=Path, default=ROOT / "docs" / "judge-llm-results.json")
    p.add_argument("--margins", default="0,0.5,1,2", help="comma list of margins in nats")
    args = p.parse_args(argv)
    margins = [float(m) for m in args.margins.split(",")]
    results = json.loads(args.results.read_text())
    if "runs" not in results:  # one `clawd bench judge --json` file rather than a collection of runs
        results = {"runs": {args.results.stem: results}}
    for name, (llm, items) in runs_with_logprobs(results).items():
        labels = [it["label"] for it in items]
        print(f"{name}: {llm}, {len(items)} items")
        print(f"  {'':14s}   acc   rec  prec   inv  neu-1 undec")
        print(row("rules", labels, [it["rules"] for it in items]))
        for m in margins:
            print(row(f"llm alone {m:g}", labels, [llm_choice(it["logprobs"], m) for it in items]))
        for label, combine in combinations(margins):
            print(row(label, labels, [combine(it["rules"], it["logprobs"]) for it in items]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
