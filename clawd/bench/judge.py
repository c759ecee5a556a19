"""How well do clawd's judges read a next state? Every configured judge on the labelled corpus.

    clawd bench judge [--judge rules|self|gguf:PATH|openai:URL[#MODEL] ...] [--split dev|select|heldout|all]
                      [--limit N | --sample N] [--cascade-only] [--no-hints] [--model PATH]
                      [--json OUT] [--hints]
    (or: make bench-judge ARGS="...")

The corpus (clawd/bench/judge_corpus/*.jsonl, format in README "Judge benchmark") holds
hand-labelled turns: a request, the assistant's response, the next state (the user's next
message or a tool result), a label (-1 correction / 0 neutral / +1 approval) and, for
corrections, the instruction the next state carries. The dev split is for tuning judges;
the select split, written after the rules were widened on dev, only chooses how judges are
combined (order, margin), never a rule, prompt or example; the held-out split is written
separately and only ever reported.

Judges are built and called exactly as the miner builds and calls them: the rules judge is
clawd.judge_rules.RulesJudge (`evaluate`, and `correction` for the hint), an LLM judge comes
from clawd.daemon.build_judge (the daemon's own builder, with config.toml's votes and
temperature) and answers through LLMJudge.evaluate / LLMJudge.hints. The judge has no HTTP
surface, so this benchmark runs in-process: "self" loads the served model (config.toml's
model, or --model PATH, default the embedded one) with llama-cpp-python; no daemon is needed.
For each LLM judge, a "rules>JUDGE" row also shows the miner's cascade: rules first, the LLM
only where the rules are undecided (no extra calls: it combines the two rows).

Per judge and split it reports accuracy, correction recall, approval precision, inverted
verdicts, undecided rate, LLM votes parsed and judge time per item; for corrections, the hint
each judge makes and whether it states the carried instruction (clawd/bench/judge_scoring.py
says how that is checked).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from clawd.bench import judge_scoring as scoring
from clawd.errors import ClawdError, ConfigError, ContextLengthExceeded
from clawd.judge import JudgeInput, JudgeUnavailable
from clawd.judge_rules import RulesJudge

CORPUS_DIR = Path(__file__).parent / "judge_corpus"
SPLITS = ("dev", "select", "heldout")


# ---------------------------------------------------------------------------------------
# The corpus


@dataclass(frozen=True)
class Item:
    id: str
    split: str
    kind: str
    voice: str
    label: int
    instruction: str | None
    inp: JudgeInput


def read_split(split: str, corpus_dir: Path = CORPUS_DIR) -> list[dict] | None:
    """The rows of one split's file, or None when the file is absent."""
    path = corpus_dir / f"{split}.jsonl"
    if not path.is_file():
        return None
    rows = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except ValueError as e:
                raise ConfigError(f"{path}:{n} is not JSON ({e})") from None
    return rows


def response_text(response) -> str:
    """The response as a judge reads it. A tool-call message becomes the calls as JSON, the
    form clawd's transcript template gives an assistant tool call (clawd/templates.py)."""
    if isinstance(response, str):
        return response
    calls = [
        {"name": (c.get("function") or {}).get("name"), "arguments": (c.get("function") or {}).get("arguments")}
        for c in response.get("tool_calls") or []
    ]
    text = (response.get("content") or "").strip()
    return "\n".join(t for t in (text, json.dumps(calls, ensure_ascii=False) if calls else "") if t)


def to_item(row: dict, split: str) -> Item:
    nxt = row["next"]
    inp = JudgeInput(
        request=row["messages"],
        response=response_text(row["response"]),
        next_state=nxt["content"],
        next_role=nxt["role"],
    )
    return Item(row["id"], split, row["kind"], row["voice"], row["label"], row["instruction"], inp)


def load_items(
    split: str, limit: int | None = None, corpus_dir: Path = CORPUS_DIR, *, sample: int | None = None
) -> list[Item]:
    """The items of `split` (one of SPLITS or "all"), validated; `limit` per split (the
    first N), or `sample` per split (N spread over the whole split, the same N every run)."""
    wanted = SPLITS if split == "all" else (split,)
    found = {s: read_split(s, corpus_dir) for s in wanted}
    if split != "all" and found[split] is None:
        raise ConfigError(f"the {split} split ({corpus_dir / (split + '.jsonl')}) is not there")
    found = {s: rows for s, rows in found.items() if rows is not None}
    problems = scoring.corpus_problems(found)
    if problems:
        raise ConfigError("the judge corpus does not follow its format:\n  " + "\n  ".join(problems[:20]))
    return [to_item(r, s) for s, rows in found.items() for r in (spread(rows, sample) if sample else rows[:limit])]


def spread(rows: list, n: int) -> list:
    """n rows taken evenly across `rows`, in order. The corpus files are grouped by kind, so the
    first N would measure a few kinds only; every k-th row covers them all, and the same n
    always picks the same rows (a slow judge measured on a sample is comparable run to run)."""
    if n >= len(rows):
        return list(rows)
    return [rows[i * len(rows) // n] for i in range(n)]


# ---------------------------------------------------------------------------------------
# Running judges


@dataclass
class Outcome:
    judge: str
    id: str
    split: str
    label: int
    score: int | None  # None: undecided (rules) or no verdict (backend failure, too long)
    votes: list[int | None]
    seconds: float
    hint: str | None = None
    hint_ok: bool | None = None  # None: not a correction carrying an instruction
    error: str | None = None
    logprobs: dict[int, float] | None = None  # the likelihood judge's score per verdict


def _hint_fields(item: Item, hints: list[str]) -> tuple[str | None, bool | None]:
    """The hint to show and whether any candidate states the instruction (the miner keeps
    every candidate and the teacher picks one, so one good candidate is enough)."""
    hints = [h for h in hints if h]
    if not item.instruction:  # a correction that names no fix: nothing to check the hint against
        return (hints[0] if hints else None), None
    checks = [scoring.hint_states_instruction(h, item.instruction) for h in hints]
    return next((h for h, ok in zip(hints, checks) if ok), hints[0] if hints else None), any(checks)


def run_rules(items: list[Item]) -> list[Outcome]:
    rules = RulesJudge()
    out = []
    for item in items:
        t0 = time.perf_counter()
        verdict = rules.evaluate(item.inp)
        # The miner asks the rules for the user's own correction sentence on every turn.
        hint = rules.correction(item.inp) if item.label == -1 else None
        seconds = time.perf_counter() - t0
        o = Outcome("rules", item.id, item.split, item.label, None if verdict is None else verdict.score, [], seconds)
        if item.label == -1:
            o.hint, o.hint_ok = _hint_fields(item, [hint] if hint else [])
        out.append(o)
    return out


async def run_llm(spec: str, judge, items: list[Item], progress=None, *, hints: bool = True) -> list[Outcome]:
    """`judge` is an LLMJudge from clawd.daemon.build_judge. Like the miner: the hint judge
    runs only where the verdict is not +1 (and not at all with hints=False)."""
    out = []
    for n, item in enumerate(items, 1):
        t0 = time.perf_counter()
        o = Outcome(spec, item.id, item.split, item.label, None, [], 0.0)
        try:
            verdict = await judge.evaluate(item.inp)
            o.score, o.votes, o.logprobs = verdict.score, list(verdict.votes), verdict.logprobs
            if item.label == -1 and hints:
                made = await judge.hints(item.inp) if verdict.score != 1 else []
                o.hint, o.hint_ok = _hint_fields(item, made)
        except (JudgeUnavailable, ContextLengthExceeded) as e:
            o.error = getattr(e, "message", str(e))
        o.seconds = time.perf_counter() - t0
        out.append(o)
        if progress:
            progress(n, len(items))
    return out


def cascade(items: list[Item], rules: list[Outcome], llm: list[Outcome]) -> list[Outcome]:
    """The miner's order: the rules' verdict where they decide, else the LLM's. Hint
    candidates as the miner gathers them: the user's own correction sentence wherever the
    verdict is -1 (the rules need not have recognised it), the LLM hint judge's only where the
    verdict is not +1."""
    own_words = RulesJudge()
    out = []
    for item, r, m in zip(items, rules, llm, strict=True):
        use_llm = r.score is None
        o = Outcome(
            f"rules>{m.judge}",
            r.id,
            r.split,
            r.label,
            m.score if use_llm else r.score,
            m.votes if use_llm else [],
            r.seconds + (m.seconds if use_llm else 0.0),
            error=m.error if use_llm else None,
            logprobs=m.logprobs if use_llm else None,
        )
        if item.label == -1:
            hints = [own_words.correction(item.inp, corrected=o.score == -1)] + ([m.hint] if o.score != 1 else [])
            o.hint, o.hint_ok = _hint_fields(item, hints)
        out.append(o)
    return out


def fill_unasked(spec: str, items: list[Item], llm: list[Outcome]) -> list[Outcome]:
    """The LLM's outcomes lined up with `items`, where it was asked only on some (the rules'
    undecided ones, --cascade-only): a placeholder, never read by `cascade`, for the rest."""
    by_id = {o.id: o for o in llm}
    return [by_id.get(i.id) or Outcome(spec, i.id, i.split, i.label, None, [], 0.0) for i in items]


# ---------------------------------------------------------------------------------------
# Reporting


def summarize(outcomes: list[Outcome]) -> list[dict]:
    """One row of figures per (judge, split), in first-seen order."""
    groups: dict[tuple[str, str], list[Outcome]] = {}
    for o in outcomes:
        groups.setdefault((o.judge, o.split), []).append(o)
    rows = []
    for (judge, split), os_ in groups.items():
        f = scoring.figures(
            [o.label for o in os_],
            [None if o.error else o.score for o in os_],
            [o.votes for o in os_],
            [o.seconds for o in os_],
        )
        checked = [o.hint_ok for o in os_ if o.hint_ok is not None]
        rows.append(
            {
                "judge": judge,
                "split": split,
                **asdict(f),
                "hints_checked": len(checked),
                "hints_ok": sum(checked),
                "errors": sum(o.error is not None for o in os_),
            }
        )
    return rows


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{100 * x:.1f}%"


def table(rows: list[dict]) -> str:
    head = (
        "| judge | split | n | accuracy | correction recall | approval precision | inverted | neutral read as -1 "
        "| undecided | votes parsed | ms/item | hint states instruction |"
    )
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for r in rows:
        hints = f"{r['hints_ok']}/{r['hints_checked']}" if r["hints_checked"] else "—"
        lines.append(
            f"| {r['judge']} | {r['split']} | {r['n']} | {_pct(r['accuracy'])} | {_pct(r['correction_recall'])} "
            f"| {_pct(r['approval_precision'])} | {_pct(r['inverted'])} | {_pct(r['false_corrections'])} "
            f"| {_pct(r['undecided'])} "
            f"| {_pct(r['votes_parsed'])} | {r['ms_per_item']:.1f} | {hints} |"
        )
    return "\n".join(lines)


def hint_lines(outcomes: list[Outcome], items: list[Item]) -> str:
    by_id = {i.id: i for i in items}
    lines = []
    for o in outcomes:
        item = by_id[o.id]
        if item.label != -1:
            continue
        mark = {True: "ok  ", False: "MISS", None: "    "}[o.hint_ok]
        lines.append(f"{mark} {o.id} [{o.judge}] want: {item.instruction!r}  hint: {o.hint!r}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------
# The command


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="clawd bench judge", description=__doc__.splitlines()[0])
    p.add_argument(
        "--judge",
        action="append",
        metavar="SPEC",
        help="a judge to run (repeatable): rules, self, gguf:PATH, openai:URL[#MODEL], likelihood:self or "
        "likelihood:gguf:PATH; "
        "default: rules and config.toml's mining.judge",
    )
    p.add_argument("--split", choices=[*SPLITS, "all"], default="dev", help="corpus split (default dev)")
    p.add_argument("--limit", type=int, help="at most N items per split (the first N)")
    p.add_argument("--sample", type=int, metavar="N", help="N items per split, spread evenly over it (for slow judges)")
    p.add_argument("--model", help="GGUF for the 'self' judge (default: config.toml's model, else the embedded one)")
    p.add_argument("--json", type=Path, metavar="OUT", help="also write figures and every verdict and hint here")
    p.add_argument("--hints", action="store_true", help="print each judge's hint for every correction")
    p.add_argument("--no-hints", action="store_true", help="skip the LLM hint judge (verdicts only; much faster)")
    p.add_argument(
        "--cascade-only",
        action="store_true",
        help="ask each LLM judge only where the rules are undecided, as the miner does; reports the rules>JUDGE "
        "row only (much faster for a slow judge)",
    )
    return p


def _settings(model: str | None):
    from clawd.config import load_settings
    from clawd.paths import resolve_paths

    paths = resolve_paths(os.environ)
    return load_settings(paths.config_file, os.environ, {"model.path": model}), paths


def load_served_model(settings, paths):
    """The served model as `clawd serve` loads it (clawd/models.py, clawd/daemon.py)."""
    from clawd import models
    from clawd.engines.runner import EngineRunner
    from clawd.paths import ensure_dirs
    from clawd.served import ServedModel
    from clawd.templates import choose_format

    ensure_dirs(paths)
    choice = models.resolve_model(settings.model, paths)
    print(f"clawd bench judge: loading {choice.id} from {choice.path}", file=sys.stderr)
    engine = models.load_engine(settings.model, choice, top_k=settings.generation.top_k, cache_dir=paths.cache_dir)
    info = engine.info
    fmt = choose_format(settings.model.chat_format, info.chat_template, info.bos_token, info.eos_token, info.add_bos)
    return ServedModel(EngineRunner(engine), fmt)


async def _run(args, items: list[Item]) -> list[Outcome]:
    settings, paths = _settings(args.model)
    specs = list(dict.fromkeys(args.judge or ["rules", settings.mining.judge]))
    rules = run_rules(items)
    outcomes = list(rules) if "rules" in specs else []
    llm_specs = [s for s in specs if s != "rules"]
    if not llm_specs:
        return outcomes
    from clawd.daemon import build_judge  # the miner's judge builder; deferred: it loads the server stack

    needs_served = any(s.removeprefix("likelihood:") == "self" for s in llm_specs)
    served = load_served_model(settings, paths) if needs_served else None
    try:
        for spec in llm_specs:
            judge = build_judge(spec, settings, served, paths)
            if judge is None:
                continue

            def progress(n, total, spec=spec):
                if n % 10 == 0 or n == total:
                    print(f"clawd bench judge: {spec}: {n}/{total}", file=sys.stderr, flush=True)

            asked = [i for i, r in zip(items, rules) if r.score is None] if args.cascade_only else items
            try:
                llm = await run_llm(spec, judge, asked, progress, hints=not args.no_hints)
            finally:
                close = getattr(judge.completer, "aclose", None)
                if close:
                    await close()
            if args.cascade_only:
                outcomes += cascade(items, rules, fill_unasked(spec, items, llm))
            else:
                outcomes += llm + cascade(items, rules, llm)
    finally:
        if served is not None:
            served.runner.close()
    return outcomes


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        for flag, value in (("--limit", args.limit), ("--sample", args.sample)):
            if value is not None and value < 1:
                raise ConfigError(f"{flag} must be at least 1")
        if args.limit and args.sample:
            raise ConfigError("give --limit or --sample, not both")
        items = load_items(args.split, args.limit, sample=args.sample)
        outcomes = asyncio.run(_run(args, items))
    except ClawdError as e:
        print(f"clawd bench judge: error: {e.message}", file=sys.stderr)
        return 1
    rows = summarize(outcomes)
    splits = sorted({i.split for i in items})
    print(f"judge corpus: {len(items)} items ({', '.join(splits)})")
    print(table(rows))
    if args.hints:
        print("\nHints for corrections (ok: states the carried instruction; MISS: does not):")
        print(hint_lines(outcomes, items))
    if args.json:
        args.json.write_text(
            json.dumps({"figures": rows, "outcomes": [asdict(o) for o in outcomes]}, indent=1, ensure_ascii=False)
        )
        print(f"clawd bench judge: wrote {args.json}", file=sys.stderr)
    return 0
