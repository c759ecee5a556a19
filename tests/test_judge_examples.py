"""The evaluative judge's worked examples (`mining.judge_examples`): judged turns shown to an LLM
judge as earlier exchanges, before the turn it judges."""

from __future__ import annotations

import asyncio
import dataclasses
import difflib
import re

import pytest

from clawd.config import Settings
from clawd.daemon import build_judge
from clawd.judge import VERDICT_TEXTS, JudgeInput, LikelihoodJudge, LLMJudge, evaluative_messages
from clawd.judge_examples import EXAMPLES
from clawd.judge_rules import RulesJudge

INP = JudgeInput([{"role": "user", "content": "Name a color."}], "Blue.", "no, a warm one", "user")


def test_examples_come_first_as_exchanges_answered_with_the_verdict_alone():
    plain = evaluative_messages(INP)
    shown = evaluative_messages(INP, EXAMPLES)
    assert shown[0] == plain[0] and shown[-1] == plain[-1]  # same system prompt, same question last
    pairs = shown[1:-1]
    assert len(pairs) == 2 * len(EXAMPLES)
    for (example, verdict), question, answer in zip(EXAMPLES, pairs[::2], pairs[1::2]):
        assert question == evaluative_messages(example)[-1]
        assert answer == {"role": "assistant", "content": VERDICT_TEXTS[verdict]}


def test_examples_cover_every_verdict_and_tool_results_both_ways():
    verdicts = [v for _, v in EXAMPLES]
    assert set(verdicts) == {-1, 0, 1}
    assert verdicts.count(-1) > verdicts.count(1) > 0  # corrections are the common case
    tool = {v for e, v in EXAMPLES if e.next_role == "tool"}
    assert tool == {-1, 1}
    # mixed order: no three neighbours share a verdict, so no run of them pulls the next answer its way
    assert all(len(set(verdicts[i : i + 3])) > 1 for i in range(len(verdicts) - 2))


def test_the_rules_judge_never_contradicts_an_example():
    """A mislabelled example teaches the LLM judge the wrong verdict. Where the rules decide,
    they must agree: a second, independent reading of each label."""
    rules = RulesJudge()
    decided = []
    for example, verdict in EXAMPLES:
        got = rules.evaluate(example)
        if got is not None and got.score != 0:
            assert got.score == verdict, (example.next_state, got.score, verdict)
            decided.append(verdict)
    assert len(decided) >= 4  # the check reads most of them, not none


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9']+", text.lower())


def _shingles(text: str, n: int = 5) -> set[tuple[str, ...]]:
    w = _words(text)
    return {tuple(w[i : i + n]) for i in range(len(w) - n + 1)}


def test_examples_are_not_taken_from_the_judge_corpus():
    """The corpus's splits measure the judge; an example close to an item (its request, its
    response or its next message) would inflate the figures it is measured by. Near copies
    count, not only exact ones: a ratio of 0.75 or five words in a row in common."""
    from clawd.bench.judge import SPLITS, read_split, response_text

    corpus = [r for s in SPLITS for r in (read_split(s) or [])]
    assert len(corpus) > 400
    close = []
    for example, _ in EXAMPLES:
        mine = {"request": example.request[-1]["content"], "response": example.response, "next": example.next_state}
        for r in corpus:
            theirs = {
                "request": r["messages"][-1]["content"] or "",
                "response": response_text(r["response"]),
                "next": r["next"]["content"],
            }
            for field, text in mine.items():
                ratio = difflib.SequenceMatcher(None, text.lower(), theirs[field].lower()).ratio()
                if ratio >= 0.75 or _shingles(text) & _shingles(theirs[field]):
                    close.append((r["id"], field, round(ratio, 2)))  # ids only: held-out text stays unprinted
    assert not close


class _RecordingScorer:
    source = "gguf"

    def __init__(self):
        self.asked = []

    async def logprob(self, messages, completion):
        self.asked.append(messages)
        return {"\\boxed{-1}": -1.0, "\\boxed{0}": -2.0, "\\boxed{1}": -3.0}[completion]


class _RecordingCompleter:
    source = "self"

    def __init__(self):
        self.asked = []

    async def complete(self, messages, *, temperature, max_tokens, seed):
        self.asked.append(messages)
        return "\\boxed{-1}"


@pytest.mark.parametrize("kind", ["likelihood", "votes"])
def test_both_llm_judges_ask_with_the_examples_they_were_given(kind):
    completer = _RecordingScorer() if kind == "likelihood" else _RecordingCompleter()
    judge = (LikelihoodJudge if kind == "likelihood" else LLMJudge)(completer, examples=EXAMPLES)
    assert asyncio.run(judge.evaluate(INP)).score == -1
    assert completer.asked and all(m == evaluative_messages(INP, EXAMPLES) for m in completer.asked)
    bare = (LikelihoodJudge if kind == "likelihood" else LLMJudge)(type(completer)())
    asyncio.run(bare.evaluate(INP))
    assert all(m == evaluative_messages(INP) for m in bare.completer.asked)


def test_the_setting_decides_whether_the_daemons_judge_shows_them():
    settings = Settings()
    shown = dataclasses.replace(settings, mining=dataclasses.replace(settings.mining, judge_examples=True))
    hidden = dataclasses.replace(settings, mining=dataclasses.replace(settings.mining, judge_examples=False))
    for spec in ("self", "likelihood:self"):
        assert build_judge(spec, shown, object()).examples == EXAMPLES
        assert build_judge(spec, hidden, object()).examples == ()
