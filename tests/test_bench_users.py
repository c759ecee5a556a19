"""Simulated users of the learning benchmark (clawd/bench): the preference detectors, the TOML
loader and its errors, reactions, and that every shipped user's corrections are understood by
the rules judge the benchmark mines with — each must score −1 and become its own hint,
unchanged in meaning — while every approval scores +1. Plus the report's arithmetic."""

from __future__ import annotations

import json
import random
import re

import pytest

from clawd.bench import report
from clawd.bench.users import load_user, parse_user, resolve_user, shipped_users, unseen_users
from clawd.errors import ConfigError
from clawd.judge import JudgeInput
from clawd.judge_rules import RulesJudge
from tests.conftest import ROOT


def user_with(checks: list[dict], **over) -> object:
    data = {
        "name": "u",
        "tasks": ["Say hi."],
        "held_out": ["Say bye."],
        "preference": {"checks": checks},
        "reactions": {"corrections": ["Too long.", "Shorter please."], "approvals": ["Thanks."]},
    }
    data.update(over)
    return parse_user(data)


DETECTOR_CASES = [
    ({"kind": "max_words", "limit": 5}, "The capital is Paris.", True),
    ({"kind": "max_words", "limit": 5}, "The capital of France is Paris.", False),
    ({"kind": "max_words", "limit": 3}, "It's Paris, ok?", True),  # contractions are one word
    ({"kind": "min_words", "limit": 4}, "Plants grow by photosynthesis.", True),
    ({"kind": "min_words", "limit": 5}, "Plants grow by photosynthesis.", False),
    ({"kind": "no_markdown"}, "Sleep early and avoid screens before bed.", True),
    ({"kind": "no_markdown"}, "Tips:\n- sleep early\n- no screens", False),
    ({"kind": "no_markdown"}, "Steps:\n1. boil water\n2. add tea", False),
    ({"kind": "no_markdown"}, "This is **important**.", False),
    ({"kind": "no_markdown"}, "## Heading\ntext", False),
    ({"kind": "no_markdown"}, "Costs 5 - 10 dollars, 2*3 = 6.", True),  # a dash or star inside a line is prose
    ({"kind": "ends_with", "phrases": ["cheers"]}, "Paris is the capital. Cheers!", True),
    ({"kind": "ends_with", "phrases": ["cheers"]}, "Paris is the capital.\n\nCheers,", True),
    ({"kind": "ends_with", "phrases": ["cheers"]}, "Cheers! Paris is the capital.", False),
    ({"kind": "no_exclamation"}, "Happy birthday.", True),
    ({"kind": "no_exclamation"}, "Happy birthday!", False),
    ({"kind": "lowercase"}, "paris is the capital.", True),
    ({"kind": "lowercase"}, "Paris is the capital.", False),
    ({"kind": "sentences", "count": 2}, "Wings push air down. The air pushes back up.", True),
    ({"kind": "sentences", "count": 2}, "Use salt, e.g. sea salt. It costs 3.50 euros", True),  # no end at e.g./3.50
    ({"kind": "sentences", "count": 2}, "Wings push air down.", False),
    ({"kind": "sentences", "count": 2}, "Lift. Drag. Thrust!", False),
    ({"kind": "sentences", "count": 2}, "Really? Yes, it works!", True),
    ({"kind": "sentences", "count": 2}, "**Lift.** Wings push air down.", True),  # emphasis after the dot
    ({"kind": "sentences", "count": 3}, 'It is called "retrogradation." The starch sets. It goes hard.', True),
    ({"kind": "sentences", "count": 2}, "Wings push air down. The air pushes", True),  # a cut tail is read too
    ({"kind": "sentences", "count": 2}, "Ask Dr. Smith. He knows.", True),  # a title's dot ends nothing
    ({"kind": "starts_with", "phrases": ["in short"]}, "In short, rent first.", True),
    ({"kind": "starts_with", "phrases": ["in short"]}, "**In short:** rent first.", True),
    ({"kind": "starts_with", "phrases": ["in short"]}, "Rent first, in short.", False),
    ({"kind": "starts_with", "phrases": ["in short"]}, "Inshort, rent.", False),
    ({"kind": "british_spelling"}, "A grey colour scheme suits the centre.", True),
    ({"kind": "british_spelling"}, "My favorite Color is blue.", False),
    ({"kind": "british_spelling"}, "Organize the shelf by size.", False),
    ({"kind": "british_spelling"}, "Sort the shelf by size.", True),  # no word to spell: passes
    ({"kind": "british_spelling"}, "Prioritize the big items first.", False),  # any -ize form
    ({"kind": "british_spelling"}, "Prioritise by size; a citizen's prize.", True),  # size, citizen, prize: no suffix
    ({"kind": "british_spelling"}, "Resize it, downsizing the oversize box.", True),  # size compounds: same spelling
    ({"kind": "british_spelling"}, "Emphasize the point.", False),  # ends in "size", but an -ize verb
    ({"kind": "british_spelling"}, "The color's depth is recognizable.", False),  # possessive; -izable
    ({"kind": "british_spelling"}, "They honored the organizational plan.", False),
    ({"kind": "no_first_person"}, "Tea suits a quiet morning.", True),
    ({"kind": "no_first_person"}, "I think tea is better.", False),
    ({"kind": "no_first_person"}, "Tea, in my view.", False),
    ({"kind": "no_first_person"}, "I’d pick tea.", False),  # a curly apostrophe too
    ({"kind": "no_first_person"}, "Ask the team, if it helps.", True),
    ({"kind": "no_first_person"}, "Tea is a gold mine of flavour.", True),  # "mine" the noun
    ({"kind": "no_first_person"}, "Tea calms, i.e. it relaxes; disk I/O waits.", True),  # no pronoun "I"
]


@pytest.mark.parametrize("check,text,ok", DETECTOR_CASES)
def test_detectors(check, text, ok):
    assert user_with([check]).complies(text) is ok


@pytest.mark.parametrize("text", ["", "   ", "\n", "..."])
def test_an_empty_answer_never_complies(text):
    # Otherwise "say nothing" would satisfy a word limit or a no-lists rule.
    assert not user_with([{"kind": "max_words", "limit": 5}]).complies(text)
    assert not user_with([{"kind": "no_markdown"}]).complies(text)


def test_all_checks_must_pass():
    u = user_with([{"kind": "max_words", "limit": 5}, {"kind": "no_exclamation"}])
    assert u.complies("Paris.") and not u.complies("Paris!") and not u.complies("one two three four five six")


LOADER_ERRORS = [
    ({"name": "Bad Name"}, "short lowercase id"),
    ({"preference": {"checks": []}}, "checks"),
    ({"preference": {"checks": [{"kind": "haiku"}]}}, "unknown check kind 'haiku'"),
    ({"preference": {"checks": [{"kind": "max_words"}]}}, "needs `limit`"),
    ({"preference": {"checks": [{"kind": "max_words", "limit": "ten"}]}}, "needs `limit`"),
    ({"preference": {"checks": [{"kind": "max_words", "limit": 0}]}}, "limit >= 1"),
    ({"preference": {"checks": [{"kind": "sentences", "count": 0}]}}, "count >= 1"),
    ({"preference": {"checks": [{"kind": "starts_with", "phrases": ["..."]}]}}, "phrases with words"),
    ({"preference": {"checks": [{"kind": "starts_with", "phrases": []}]}}, "at least one phrase"),
    ({"preference": {"checks": [{"kind": "no_markdown", "strict": True}]}}, "takes no strict"),
    ({"reactions": {"corrections": ["only one wording"], "approvals": ["Thanks."]}}, "at least 2"),
    ({"reactions": {"corrections": ["Too long.", "Shorter."]}}, "approvals"),
    ({"tasks": []}, "`tasks`"),
    ({"held_out": ["Say hi."]}, "must not also be training tasks"),
    ({"thumbs": 1.5}, "probability"),
]


@pytest.mark.parametrize("override,message", LOADER_ERRORS)
def test_loader_rejects_bad_files_with_a_message_that_says_what_to_fix(override, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("*", r"\*")):
        user_with([{"kind": "no_exclamation"}], **override)


def test_loader_reads_any_user_file_from_a_path(tmp_path):
    f = tmp_path / "pirate.toml"
    f.write_text(
        'name = "pirate"\nthumbs = 0.5\ntasks = ["Say hi."]\nheld_out = ["Say bye."]\n'
        '[preference]\nchecks = [{ kind = "ends_with", phrases = ["arr"] }]\n'
        '[reactions]\ncorrections = ["You forgot the arr.", "It should end with arr."]\n'
        'approvals = ["Thanks, matey."]\n'
    )
    u = resolve_user(str(f))
    assert u.name == "pirate" and u.complies("Ahoy, arr!") and not u.complies("Ahoy.")
    with pytest.raises(ConfigError, match="not valid TOML"):
        (tmp_path / "bad.toml").write_text("name = ")
        load_user(tmp_path / "bad.toml")
    with pytest.raises(ConfigError, match="no simulated user 'nobody'"):
        resolve_user("nobody")


def test_reactions_follow_the_detector_and_are_reproducible():
    u = user_with([{"kind": "max_words", "limit": 3}], thumbs=0.5)
    fails = [u.react("far too many words in this answer", random.Random(i)) for i in range(40)]
    passes = [u.react("Paris.", random.Random(i)) for i in range(40)]
    assert {r.text for r in fails} == set(u.corrections) and {r.text for r in passes} == set(u.approvals)
    assert {r.thumbs for r in fails} == {"down", None} and {r.thumbs for r in passes} == {"up", None}
    assert [u.react("x y z w", random.Random(7)) for _ in range(2)] == [u.react("x y z w", random.Random(7))] * 2
    assert u.session_tasks(3, seed=1) == u.session_tasks(3, seed=1) == ["Say hi."] * 3


SHIPPED = sorted(shipped_users())
NEGATIONS = {"no", "not", "don't", "never", "without", "doesn't", "nothing"}


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z']+", text.lower())


def test_at_least_four_users_ship():
    assert len(SHIPPED) >= 4


def test_the_unseen_users_load_by_name_apart_from_the_shipped_ones():
    """Issue 16 item 6: at least 4 users whose preferences need the hint followed, with varied
    correction phrasing, kept out of shipped_users() so that no rules-judge test (and no tuning)
    touches them."""
    unseen = unseen_users()
    assert len(unseen) >= 4 and not set(unseen) & set(shipped_users())
    kinds = set()
    for name in unseen:
        u = resolve_user(name)
        assert u.name == name and len(u.held_out) >= 8 and len(u.corrections) >= 4
        assert len({c.split()[0].lower() for c in u.corrections}) >= 4  # they open differently
        kinds |= {kind for kind, _ in u.checks}
    assert {"sentences", "starts_with", "british_spelling", "no_first_person"} <= kinds


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_user_replies_are_understood_by_the_rules_judge(name):
    u = load_user(shipped_users()[name])
    judge = RulesJudge()
    for text in u.corrections:
        inp = JudgeInput([{"role": "user", "content": u.tasks[0]}], "Some answer.", text, "user")
        verdict, hint = judge.evaluate(inp), judge.correction(inp)
        assert verdict is not None and verdict.score == -1, text
        # The hint is the user's own request, restated as an instruction ("You forgot to sign
        # off with Cheers" -> "Sign off with Cheers"): no words of its own beyond the verb it
        # may put first, and every negation kept, since a cut "no"/"don't" ("No bullet
        # points…" -> "Bullet points…") would invert its meaning for the teacher.
        assert hint is not None, text
        said, kept = _words(text), _words(hint)
        assert set(kept) - set(said) <= {"include", "give", "use", "make", "it", "leave", "out", "answer", "in"}, (
            text,
            hint,
        )
        assert [w for w in kept if w in NEGATIONS] == [w for w in said if w in NEGATIONS], (text, hint)
    for text in u.approvals:
        inp = JudgeInput([{"role": "user", "content": u.tasks[0]}], "Some answer.", text, "user")
        verdict = judge.evaluate(inp)
        assert verdict is not None and verdict.score == 1, text


@pytest.mark.parametrize(
    "passed,expected",
    [
        ([], None),
        ([True, True], None),
        ([True, True, True], 3),
        ([False, True, True, True], 4),
        ([True, True, False, True, True, False, True, True, True, True], 9),
        ([False] * 10, None),
    ],
)
def test_sessions_to_criterion(passed, expected):
    assert report.sessions_to_criterion(passed) == expected


def test_compliance_at_reads_the_adapter_live_at_that_step():
    curve = [
        {"step": 0, "greedy": 0.1},
        {"step": 2, "greedy": 0.3},
        {"step": 4, "greedy": 0.5},
        {"step": 6, "greedy": 0.9},
    ]
    assert report.compliance_at(curve, 4, "greedy") == 0.5
    assert report.compliance_at(curve, 5, "greedy") == 0.5  # step 5 happened inside the run that ended at 6
    assert report.compliance_at(curve, 8, "greedy") is None  # never got there


def test_markdown_table_means_over_seeds():
    def arm(seed, after):
        return {
            "user": "terse",
            "method": "hybrid",
            "seed": seed,
            "curve": [{"step": 0, "greedy": 0.0, "sampled": 0.0}, {"step": 4, "greedy": after, "sampled": after}],
            "rounds": [
                {"promoted": True, "gate": {"kl_to_base": 0.1}},
                {"promoted": False, "gate": {"kl_to_base": 0.9}},
            ],
            "sessions": [{"passed": p} for p in (False, True, True, True)],
            "teacher": {"greedy": 0.5 * seed, "sampled": 0.5},
        }

    results = {"config": {"eval_temperature": 0.7, "kl_bound": 0.5}, "arms": [arm(0, 0.5), arm(1, 1.0)]}
    row = report.markdown(results).splitlines()[-1]
    assert row.startswith("| terse | hybrid | 2 | 0% / 0% | 25% / 50% | 75% / 75% | – / – |"), row
    assert "| 4.0 |" in row and "0.100 (0.5)" in row and "1.0 of 2.0" in row


@pytest.mark.parametrize(
    "method,w_rl,w_opd,teacher,support",
    [
        ("hybrid", 1.0, 1.0, "base", "student"),
        ("rl", 1.0, 0.0, "base", "student"),
        ("opd", 0.0, 1.0, "base", "student"),
        ("hybrid-self", 1.0, 1.0, "policy", "student"),
        ("opd-self", 0.0, 1.0, "policy", "student"),
        ("union", 1.0, 1.0, "base", "union"),
        ("opd-union", 0.0, 1.0, "base", "union"),
        ("union-fwd", 1.0, 1.0, "base", "union"),
        ("opd-union-fwd", 0.0, 1.0, "base", "union"),
        ("union-fwd-ta", 1.0, 1.0, "base", "union"),
        ("opd-union-fwd-ta", 0.0, 1.0, "base", "union"),
        ("union-both-ta", 1.0, 1.0, "base", "union"),
        ("opd-union-both-ta", 0.0, 1.0, "base", "union"),
    ],
)
def test_each_method_is_only_loss_weights_and_teacher_and_the_daemon_reads_them(
    tmp_path, method, w_rl, w_opd, teacher, support
):
    from clawd.bench.learning import Budget, daemon_settings
    from clawd.config import load_settings

    budget = Budget(batch=3, epochs=2, learning_rate=3e-4, kl_bound=0.7, holdout=0.0)
    s = load_settings(tmp_path / "config.toml", daemon_settings(method, budget))
    t = s.training
    assert (t.w_rl, t.w_opd, t.teacher, t.opd_support) == (w_rl, w_opd, teacher, support)
    assert t.opd_weighting == ("teacher" if "-fwd" in method else "both" if "-both" in method else "student")
    assert t.teacher_answers == (96 if method.endswith("-ta") else 0)  # the teacher's own answers, in tokens
    assert (t.auto, t.min_signals, t.epochs, t.learning_rate, t.kl_bound, t.holdout) == (False, 3, 2, 3e-4, 0.7, 0.0)
    assert t.batch_size >= 1000  # one run = one batch, whatever the number of signals waiting
    assert s.mining.judge == s.mining.hint_judge == "rules"


def test_a_run_cut_short_still_writes_what_it_measured(tmp_path):
    from clawd.bench.learning import _write

    measured = {
        "user": "terse",
        "method": "rl",
        "seed": 0,
        "curve": [{"step": 0, "greedy": 0.5, "sampled": 0.25}],
        "rounds": [],
        "sessions": [],
    }
    started = {"user": "terse", "method": "opd", "seed": 0}  # killed before its first measurement
    results = {
        "config": {"eval_temperature": 0.7, "kl_bound": 0.5, "command": "clawd bench learning"},
        "arms": [measured, started],
    }
    _write(results, tmp_path, elapsed=12.0)
    table = (tmp_path / "results.md").read_text()
    assert "| terse | rl | 1 | 50% / 25% | – / – | – / – |" in table and "| opd |" not in table
    assert "wall time 12 s" in table
    assert len(json.loads((tmp_path / "results.json").read_text())["arms"]) == 2


class RecordingDaemon:
    """Stands in for the daemon in measure(): records what was asked, answers from a script."""

    def __init__(self, answer):
        self.asked, self.answer = [], answer

    def chat(self, messages, **kw):
        self.asked.append(messages)
        return {"text": self.answer(messages[-1]["content"])}


@pytest.mark.parametrize("name", shipped_users())
def test_the_teacher_measurement_asks_with_the_hint_the_miner_would_make(name):
    """measure(hinted=teacher_context) asks each held-out prompt in the teacher's context (METHOD §3):
    one of the user's corrections, as the rules judge turns it into a hint, after the marker."""
    from clawd.bench.learning import Budget, measure, teacher_context
    from clawd.served import HINT_MARKER

    user = resolve_user(name)
    budget = Budget(eval_prompts=3)
    d = RecordingDaemon(lambda content: "fine")
    point = measure(d, user, budget, "teacher", hinted=teacher_context)
    assert len(d.asked) == 6 and len(point["answers"]) == 3  # greedy and sampled per prompt
    for i, answer in enumerate(point["answers"]):
        prompt, correction = user.held_out[i], user.corrections[i % len(user.corrections)]
        mined = RulesJudge().correction(
            JudgeInput([{"role": "user", "content": prompt}], "an answer", correction, "user")
        )
        assert mined and answer["prompt"] == prompt + HINT_MARKER + mined
        assert d.asked[2 * i] == d.asked[2 * i + 1] == [{"role": "user", "content": answer["prompt"]}]
    assert point["greedy"] == point["sampled"] == user.complies("fine")


def test_the_teacher_measurement_skips_corrections_that_make_no_hint():
    from clawd.bench.learning import Budget, measure, teacher_context

    user = user_with(
        [{"kind": "lowercase"}],
        held_out=["say bye.", "say hi."],
        reactions={"corrections": ["Hmm.", "Well well."], "approvals": ["Thanks."]},
    )  # no cue: no hint
    d = RecordingDaemon(lambda content: "ok")
    point = measure(d, user, Budget(eval_prompts=2), "teacher", hinted=teacher_context)
    assert d.asked == [] and point["greedy"] is None and point["sampled"] is None
    plain = measure(d, user, Budget(eval_prompts=2), 0)
    assert len(d.asked) == 4 and plain["greedy"] == 1.0  # unhinted: every prompt asked as it is


def test_merge_pools_seeds_of_comparable_runs_and_refuses_others(tmp_path, capsys):
    from clawd.bench.learning import main

    def run(seed, after, lr=1e-4, model="m.gguf"):
        arm = {
            "user": "terse",
            "method": "rl",
            "seed": seed,
            "rounds": [],
            "sessions": [],
            "curve": [{"step": 0, "greedy": 0.0, "sampled": 0.0}, {"step": 4, "greedy": after, "sampled": after}],
        }
        cut_short = {"user": "terse", "method": "opd", "seed": seed}  # killed before its first measurement
        config = {
            "batch": 4,
            "epochs": 2,
            "eval_prompts": 8,
            "max_tokens": 48,
            "learning_rate": lr,
            "kl_bound": 0.5,
            "holdout": 0.0,
            "temperature": 0.7,
            "extra": {},
            "eval_temperature": 0.7,
            "model": model,
            "seeds": [seed],
            "methods": ["rl", "opd"],
            "command": f"clawd bench learning --seeds {seed}",
        }
        path = tmp_path / f"run{seed}-{lr}-{model}.json"
        path.write_text(json.dumps({"config": config, "arms": [arm, cut_short], "wall_s": 100.0}))
        return path

    out = tmp_path / "merged"
    assert main(["--merge", str(run(0, 0.5)), str(run(1, 1.0)), "--out", str(out)]) == 0
    table = (out / "results.md").read_text()
    assert "| terse | rl | 2 | 0% / 0% | – / – | 75% / 75% |" in table and "| opd |" not in table
    assert "--seeds 0; clawd bench learning --seeds 1" in table and "wall time 200 s" in table
    merged = json.loads((out / "results.json").read_text())
    assert len(merged["arms"]) == 4 and merged["config"]["seeds"] == [0, 1]

    for other, why in (
        ({"lr": 5e-4}, "other learning_rate"),
        ({"model": "big.gguf"}, "other model"),
        ({}, "the same user, method and seed twice"),
    ):
        assert main(["--merge", str(run(0, 0.5)), str(run(0, 1.0, **other)), "--out", str(tmp_path / "x")]) == 1
        assert why in capsys.readouterr().err and not (tmp_path / "x").exists()
    assert main(["--merge", str(out / "results.json"), "--out", str(out)]) == 1
    assert "would overwrite" in capsys.readouterr().err
    assert main(["--merge", str(tmp_path / "missing.json"), "--out", str(tmp_path / "y")]) == 1
    assert "cannot read" in capsys.readouterr().err
    (tmp_path / "other.json").write_text("[1, 2]")
    assert main(["--merge", str(tmp_path / "other.json"), "--out", str(tmp_path / "z")]) == 1
    assert "is not a results.json" in capsys.readouterr().err


@pytest.mark.parametrize("name", shipped_users())
def test_raw_hints_are_the_users_words_on_the_prompts_the_judge_hints(name):
    """--hint-source raw: the teacher sees the correction as the user typed it, on exactly the
    prompts where the rules judge writes a hint (the same prompts for both sources)."""
    from clawd.bench.learning import Budget, measure, teacher_context, teacher_hint
    from clawd.served import HINT_MARKER

    user = resolve_user(name)
    d = RecordingDaemon(lambda content: "fine")
    point = measure(d, user, Budget(eval_prompts=3), "teacher", hinted=teacher_context, hint_source="raw")
    judged = measure(RecordingDaemon(lambda c: "fine"), user, Budget(eval_prompts=3), "t", hinted=teacher_context)
    assert len(point["answers"]) == len(judged["answers"]) == 3
    for i, answer in enumerate(point["answers"]):
        correction = user.corrections[i % len(user.corrections)]
        assert answer["prompt"] == user.held_out[i] + HINT_MARKER + correction.strip()
        assert teacher_hint(user, user.held_out[i], i, "raw") == correction.strip()
    with pytest.raises(ValueError, match="hint source"):
        teacher_hint(user, user.held_out[0], 0, "llm")


def test_raw_hints_skip_corrections_the_judge_makes_no_hint_of():
    from clawd.bench.learning import teacher_hint

    user = user_with(
        [{"kind": "lowercase"}],
        held_out=["say bye."],
        reactions={"corrections": ["Hmm.", "Well well."], "approvals": ["Thanks."]},
    )  # no cue: the judge makes no hint
    assert teacher_hint(user, "say bye.", 0, "judge") is None
    assert teacher_hint(user, "say bye.", 1, "raw") is None


def test_hint_wording_table_has_a_column_per_source_and_wording_and_a_mean():
    import importlib.util

    spec = importlib.util.spec_from_file_location("hint_wording", ROOT / "benchmarks" / "hint_wording.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rows = [
        {"user": "terse", "source": "raw", "wording": "method", "greedy": 0.5, "sampled": 0.25},
        {"user": "terse", "source": "judge", "wording": "method", "greedy": 1.0, "sampled": 0.75},
        {"user": "calm", "source": "raw", "wording": "method", "greedy": 0.0, "sampled": 0.25},
        {"user": "calm", "source": "judge", "wording": "method", "greedy": 0.5, "sampled": 0.25},
    ]
    lines = mod.table(rows).splitlines()
    assert lines[0] == "| user | raw: method | judge: method |"
    assert lines[2] == "| terse | 50% / 25% | 100% / 75% |"
    assert lines[4] == "| mean | **25% / 25%** | **75% / 50%** |"
