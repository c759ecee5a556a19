"""`clawd bench judge`: its arithmetic on hand-built verdicts, the corpus format, the hint
check, the miner-order cascade, and the command itself (rules judge, a few items)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest

from clawd.bench import judge as bench
from clawd.bench import judge_scoring as scoring
from clawd.judge import LLMJudge
from tests.conftest import ROOT, make_env


def test_figures_match_hand_counted_verdicts():
    # 3 corrections: two judged -1, one judged +1 (inverted); 2 approvals: one judged +1,
    # one undecided; 1 neutral judged -1.
    labels = [-1, -1, -1, 1, 1, 0]
    scores = [-1, -1, 1, 1, None, -1]
    f = scoring.figures(labels, scores, [[]] * 6, [0.001, 0.002, 0.003, 0.001, 0.002, 0.003])
    assert f.n == 6
    assert f.correction_recall == pytest.approx(2 / 3)
    assert f.approval_precision == pytest.approx(1 / 2)  # judged +1: one correction, one approval
    assert f.inverted == pytest.approx(1 / 5)  # of the five ±1 items, one read the wrong way
    assert f.false_corrections == 1.0  # the one neutral item was read as a correction
    assert f.undecided == pytest.approx(1 / 6)
    assert f.accuracy == pytest.approx(3 / 6)  # the undecided approval counts as 0, which is wrong
    assert f.votes_parsed is None
    assert f.ms_per_item == pytest.approx(2.0)


def test_llm_votes_count_parsed_and_ties_as_undecided():
    labels = [-1, 1, 0]
    votes = [[-1, -1, None], [1, -1, None], [None, None, None]]  # majority -1; a tie; nothing parsed
    f = scoring.figures(labels, [-1, 0, 0], votes, [0.0, 0.0, 0.0])
    assert f.votes_parsed == pytest.approx(4 / 9)
    assert f.undecided == pytest.approx(2 / 3)
    assert f.correction_recall == 1.0
    assert f.approval_precision is None  # nothing judged +1: no precision to speak of
    assert f.accuracy == pytest.approx(2 / 3)  # the neutral item's 0 matches its label
    assert f.false_corrections == 0.0


def test_hint_check_wants_an_instruction_that_states_the_preference():
    want = "End the answer with 'Cheers'."
    assert scoring.hint_states_instruction("End every answer with 'Cheers'.", want) is True
    assert scoring.hint_states_instruction("Please always end with Cheers.", want) is True
    assert scoring.hint_states_instruction("You forgot to sign off with Cheers at the end.", want) is False
    assert scoring.hint_states_instruction("Could you end with Cheers?", want) is False
    assert scoring.hint_states_instruction("Be more careful next time.", want) is False
    assert scoring.hint_states_instruction(None, want) is False
    assert scoring.hint_states_instruction("End with Cheers.", None) is None
    # "answer" and "reply" start an instruction unless they are described
    assert scoring.hint_states_instruction("Answer in French.", "Reply in French.") is True
    assert scoring.hint_states_instruction("Reply in French only.", "Answer in French.") is True
    assert scoring.hint_states_instruction("Answer was in English, not French.", "Reply in French.") is False
    assert scoring.hint_states_instruction("Answer.", "Reply in French.") is False
    assert scoring.hint_states_instruction("Answer wasn't in French.", "Reply in French.") is False
    assert scoring.hint_states_instruction("Answer too long, French please.", "Reply in French.") is False


def _row(i: str, **kw) -> dict:
    row = {
        "id": i,
        "kind": "length",
        "voice": "terse",
        "messages": [{"role": "user", "content": f"Tell me about the moon, request {i}."}],
        "response": "The moon is Earth's only natural satellite.",
        "next": {"role": "user", "content": f"shorter please, this is reply number {i}"},
        "label": -1,
        "instruction": "Answer in one short sentence.",
    }
    row.update(kw)
    return row


def test_corpus_checks_catch_broken_rows():
    good = [_row("dev-0001"), _row("dev-0002", label=1, instruction=None)]
    assert scoring.corpus_problems({"dev": good}) == []
    bad = {
        "dev": [
            _row("dev-0001"),
            _row("dev-0001"),  # id repeated
            _row("dev-0003", label=2),
            _row("dev-0004", label=0),  # an instruction on a neutral item
            _row("dev-0005", kind="mood"),
            _row("dev-0006", next={"role": "tool", "tool_call_id": "c", "content": "ok"}),  # no call to answer
        ],
        "heldout": [_row("ho-0001", next=_row("dev-0001")["next"])],  # the dev half's next state again
    }
    problems = "\n".join(scoring.corpus_problems(bad))
    for expected in ("dev-0001: id used 2 times", "dev-0003: label", "dev-0004: instruction", "dev-0005: unknown kind"):
        assert expected in problems
    assert "dev-0006: a tool result must follow a tool-call response" in problems
    assert "ho-0001: shares a message with the dev split" in problems


def test_shipped_corpus_follows_the_format():
    splits = {s: rows for s in bench.SPLITS if (rows := bench.read_split(s)) is not None}
    assert scoring.corpus_problems(splits) == []
    dev = splits["dev"]
    assert len(dev) >= 220
    labels = [r["label"] for r in dev]
    # the format's balance, roughly: 45% corrections, 30% approvals, 25% neutral
    assert 0.38 <= labels.count(-1) / len(dev) <= 0.52
    assert 0.24 <= labels.count(1) / len(dev) <= 0.36
    assert 0.18 <= labels.count(0) / len(dev) <= 0.30
    assert {r["voice"] for r in dev} == scoring.VOICES
    assert {r["kind"] for r in dev} == scoring.KINDS
    # every correction that names a fix carries it as an instruction
    assert sum(r["instruction"] is not None for r in dev) >= 0.9 * labels.count(-1)
    # the select split chooses how judges combine: big enough to tell two orders apart, in the
    # same balance, and every correction with its instruction
    select = splits["select"]
    labels = [r["label"] for r in select]
    assert len(select) >= 120
    assert 0.38 <= labels.count(-1) / len(select) <= 0.52 and 0.18 <= labels.count(0) / len(select) <= 0.36
    assert all(r["instruction"] for r in select if r["label"] == -1)


def test_tool_call_response_reads_as_the_calls():
    call = {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}],
    }
    assert json.loads(bench.response_text(call)) == [{"name": "get_weather", "arguments": "{}"}]


class _ScriptedCompleter:
    """An LLM that answers the evaluative prompt with a fixed vote and the hint prompt with a
    fixed hint: enough to drive LLMJudge, the real judge class, through the benchmark."""

    source = "self"

    def __init__(self, vote: str, hint: str):
        self.vote, self.hint = vote, hint

    async def complete(self, messages, *, temperature, max_tokens, seed):
        if "[HINT_START]" in messages[0]["content"]:
            return f"[HINT_START]{self.hint}[HINT_END]\n\\boxed{{1}}"
        return self.vote


def _item(i: str, label: int, instruction: str | None, next_text: str) -> bench.Item:
    return bench.to_item(
        _row(i, label=label, instruction=instruction, next={"role": "user", "content": next_text}), "dev"
    )


def test_llm_rows_and_the_rules_first_cascade():
    items = [
        _item("dev-0001", -1, "End the answer with 'Cheers'.", "You forgot to sign off with Cheers."),
        _item("dev-0002", 1, None, "thanks, that's perfect"),
    ]
    judge = LLMJudge(_ScriptedCompleter("\\boxed{-1}", "End every answer with 'Cheers'."), votes=3)
    llm = asyncio.run(bench.run_llm("self", judge, items))
    assert [(o.score, o.votes) for o in llm] == [(-1, [-1, -1, -1]), (-1, [-1, -1, -1])]
    assert llm[0].hint == "End every answer with 'Cheers'." and llm[0].hint_ok is True
    rules = [
        bench.Outcome("rules", "dev-0001", "dev", -1, None, [], 0.5),  # undecided: the LLM decides
        bench.Outcome("rules", "dev-0002", "dev", 1, 1, [], 0.5),  # decided: the LLM is not asked
    ]
    both = bench.cascade(items, rules, llm)
    assert [o.judge for o in both] == ["rules>self", "rules>self"]
    assert [o.score for o in both] == [-1, 1]
    assert both[1].seconds == 0.5  # the rules decided alone
    assert both[0].hint_ok is True

    # a correction that names no fix ("try again") has no instruction: its hint is shown, not scored
    bare = [_item("dev-0003", -1, None, "try again")]
    (o,) = asyncio.run(bench.run_llm("self", judge, bare))
    assert o.hint == "End every answer with 'Cheers'." and o.hint_ok is None
    assert bench.summarize([o])[0]["hints_checked"] == 0


def test_cli_runs_the_rules_judge_on_a_few_items(tmp_path):
    out = tmp_path / "judge.json"
    p = subprocess.run(
        [sys.executable, "-m", "clawd.cli", "bench", "judge", "--judge", "rules", "--limit", "5", "--json", str(out)],
        cwd=ROOT,
        env=make_env(tmp_path / "home"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr
    assert "| judge | split | n | accuracy | correction recall | approval precision | inverted |" in p.stdout
    assert "| rules | dev | 5 |" in p.stdout
    data = json.loads(out.read_text())
    assert [r["judge"] for r in data["figures"]] == ["rules"]
    assert len(data["outcomes"]) == 5


def test_cli_refuses_a_bad_limit(tmp_path):
    p = subprocess.run(
        [sys.executable, "-m", "clawd.cli", "bench", "judge", "--limit", "0"],
        cwd=ROOT,
        env=make_env(tmp_path / "home"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 1 and "--limit must be at least 1" in p.stderr


def test_sample_spreads_over_the_split_and_is_the_same_every_run():
    rows = list(range(10))
    assert bench.spread(rows, 5) == [0, 2, 4, 6, 8]
    assert bench.spread(rows, 3) == [0, 3, 6]
    assert bench.spread(rows, 20) == rows
    dev = bench.load_items("dev", sample=12)
    assert len(dev) == 12 and dev == bench.load_items("dev", sample=12)
    # spread over the file, not its head: the last item taken lies in its last twelfth
    n = len(bench.read_split("dev"))
    ids = [int(i.id.removeprefix("dev-")) for i in dev]
    assert ids == sorted(ids) and ids[-1] > n * 11 / 12


def test_the_cascade_hints_with_the_users_words_where_only_the_llm_read_a_correction():
    """As the miner does: an LLM -1 on a turn the rules left undecided still gets the user's own
    words as a hint candidate; an undecided cascade gets none."""
    text = "Every reply should kick off with a one-line summary so I can find the gist."
    items = [_item("dev-0001", -1, "Open every reply with a one-line summary.", text)]
    rules = [bench.Outcome("rules", "dev-0001", "dev", -1, None, [], 0.1)]
    judged = [bench.Outcome("likelihood:x", "dev-0001", "dev", -1, -1, [-1], 0.1)]
    (o,) = bench.cascade(items, rules, judged)
    assert o.score == -1 and o.hint == text and o.hint_ok is True
    unsure = [bench.Outcome("likelihood:x", "dev-0001", "dev", -1, 0, [None], 0.1)]
    (o,) = bench.cascade(items, rules, unsure)
    assert o.hint is None and o.hint_ok is False


def test_cascade_only_asks_the_llm_where_the_rules_are_undecided():
    items = [
        _item("dev-0001", -1, "End the answer with 'Cheers'.", "You forgot to sign off with Cheers."),
        _item("dev-0002", 1, None, "thanks, that's perfect"),
    ]
    rules = [
        bench.Outcome("rules", "dev-0001", "dev", -1, -1, [], 0.1),
        bench.Outcome("rules", "dev-0002", "dev", 1, None, [], 0.1),  # undecided: the LLM decides
    ]
    judge = LLMJudge(_ScriptedCompleter("\\boxed{1}", "unused"), votes=1)
    asked = asyncio.run(bench.run_llm("self", judge, [items[1]], hints=False))
    lined = bench.fill_unasked("self", items, asked)
    assert [o.id for o in lined] == ["dev-0001", "dev-0002"] and lined[1] is asked[0]
    both = bench.cascade(items, rules, lined)
    assert [o.score for o in both] == [-1, 1] and both[0].votes == [] and both[1].votes == [1]


def test_likelihood_log_probs_reach_the_outcome():
    from clawd.judge import LikelihoodJudge

    class Scorer:
        source = "gguf"

        async def logprob(self, messages, completion):
            return {"\\boxed{-1}": -3.0, "\\boxed{0}": -2.5, "\\boxed{1}": -1.0}[completion]

    items = [_item("dev-0001", 1, None, "thanks, that's perfect")]
    (o,) = asyncio.run(bench.run_llm("likelihood:gguf:m", LikelihoodJudge(Scorer()), items, hints=False))
    assert o.score == 1 and o.logprobs == {-1: -3.0, 0: -2.5, 1: -1.0}
    undecided = [bench.Outcome("rules", "dev-0001", "dev", 1, None, [], 0.1)]
    assert bench.cascade(items, undecided, [o])[0].logprobs == o.logprobs  # the LLM decided: its numbers
    decided = [bench.Outcome("rules", "dev-0001", "dev", 1, 1, [], 0.1)]
    assert bench.cascade(items, decided, [o])[0].logprobs is None


def test_cli_refuses_limit_with_sample(tmp_path):
    p = subprocess.run(
        [sys.executable, "-m", "clawd.cli", "bench", "judge", "--limit", "3", "--sample", "3"],
        cwd=ROOT,
        env=make_env(tmp_path / "home"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 1 and "not both" in p.stderr


def _judge_ensemble():
    import importlib.util

    spec = importlib.util.spec_from_file_location("judge_ensemble", ROOT / "benchmarks" / "judge_ensemble.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_judge_ensembles_combine_rules_and_log_probs_as_documented():
    ens = _judge_ensemble()
    leans_minus = {"-1": -0.2, "0": -2.0, "1": -2.5}  # -1 by 1.8 nats
    barely_plus = {"-1": -1.3, "0": -1.5, "1": -1.0}  # +1 by 0.3 nats
    assert ens.llm_choice(leans_minus, 1.0) == -1 and ens.llm_choice(barely_plus, 0.5) is None
    # cascade: the rules first, the LLM only where they are undecided and it leads by the margin
    assert ens.cascade(1, leans_minus, 0.0) == 1
    assert ens.cascade(None, leans_minus, 1.0) == -1 and ens.cascade(None, barely_plus, 0.5) is None
    # agree: a verdict only where both say the same
    assert (
        ens.agree(-1, leans_minus) == -1 and ens.agree(1, leans_minus) is None and ens.agree(None, barely_plus) is None
    )
    # veto: the rules' verdict unless the LLM says the opposite sign by the margin
    assert ens.veto(1, leans_minus, 1.0) is None and ens.veto(1, leans_minus, 2.0) == 1
    assert ens.veto(-1, barely_plus, 0.0) is None and ens.veto(0, leans_minus, 0.0) == 0
    # llm first: the LLM where it leads by the margin, else the rules (undecided rules stay so)
    assert ens.llm_first(1, leans_minus, 1.0) == -1 and ens.llm_first(1, leans_minus, 2.0) == 1
    assert ens.llm_first(None, barely_plus, 0.5) is None and ens.llm_first(-1, barely_plus, 0.5) == -1


def test_judge_ensemble_reads_only_runs_with_the_llm_alone(tmp_path, capsys):
    ens = _judge_ensemble()
    lp = {"-1": -0.1, "0": -3.0, "1": -4.0}
    item = {"split": "dev", "votes": [], "seconds": 0.0, "error": None}
    results = {
        "runs": {
            "both": {
                "outcomes": [
                    {**item, "judge": "rules", "id": "a", "label": -1, "score": None, "logprobs": None},
                    {**item, "judge": "likelihood:x", "id": "a", "label": -1, "score": -1, "logprobs": lp},
                    {**item, "judge": "rules", "id": "b", "label": 1, "score": 1, "logprobs": None},
                    {**item, "judge": "likelihood:x", "id": "b", "label": 1, "score": -1, "logprobs": lp},
                ]
            },
            "cascade-only": {
                "outcomes": [
                    {**item, "judge": "rules", "id": "a", "label": -1, "score": None, "logprobs": None},
                    {**item, "judge": "rules>likelihood:x", "id": "a", "label": -1, "score": -1, "logprobs": lp},
                ]
            },
        }
    }
    runs = ens.runs_with_logprobs(results)
    assert list(runs) == ["both"] and runs["both"][0] == "likelihood:x"
    assert [(i["label"], i["rules"]) for i in runs["both"][1]] == [(-1, None), (1, 1)]
    path = tmp_path / "r.json"
    path.write_text(json.dumps(results))
    assert ens.main(["--results", str(path), "--margins", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    # one `clawd bench judge --json` file reads as a collection of that one run
    single = tmp_path / "single.json"
    single.write_text(json.dumps(results["runs"]["both"]))
    assert ens.main(["--results", str(single), "--margins", "1"]) == 0
    assert capsys.readouterr().out.splitlines()[1:] == out[1:] and out[0].startswith("both:")
    # cascade 1: item a from the LLM (-1, right), item b from the rules (+1, right): all right.
    assert [line.split()[:3] for line in out if line.strip().startswith("cascade")] == [["cascade", "1", "100.0"]]
    # veto 1: the LLM's -1 by 2.9 nats vetoes the rules' +1 on b; a stays undecided.
    assert [line.split()[2] for line in out if line.strip().startswith("veto")] == ["0.0"]
    # llm alone 1: -1 on both items (2.9 nats ahead): a right, b inverted; no neutral item (-).
    alone = [line.split() for line in out if line.strip().startswith("llm alone")]
    assert alone == [["llm", "alone", "1", "50.0", "100.0", "-", "50.0", "-", "0.0"]]
    # llm first 1: -1 on both (the LLM is sure on both): as the LLM alone.
    assert [line.split()[3:] for line in out if line.strip().startswith("llm first")] == [alone[0][3:]]
