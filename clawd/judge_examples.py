"""Worked examples for the evaluative judge: eleven judged turns, shown to an LLM judge as
earlier chat turns before the turn it judges (few-shot, `mining.judge_examples`).

Why: asked for \\boxed{} straight away, a small instruct model reads most next states as
approval and misses corrections phrased as a question, a joke or an aside. A few judged turns
show it the verdict rules of METHOD §2 at work, and show that the verdict comes at once, so a
likelihood judge scores the box where the model expects it. Measured in README ("Worked examples
for the LLM judge"): more corrections found on held-out, but more neutral turns read as
corrections, so it is off by default.

The examples are written for this module, not taken from the judge corpus, so both corpus
splits stay honest measures. They mix the verdicts roughly as users do (more corrections than
approvals, some that tell nothing), several voices (sarcastic, "thanks, but", non-native, a
correction inside a longer message, a question that challenges the answer), tool results that
fail and succeed, and an unrelated new request, which says nothing about the answer (0: the
corpus's convention, METHOD's "ambiguous or unrelated"). The order mixes the verdicts (no three
neighbours share one), so no run of them pulls the next answer its way.
"""

from __future__ import annotations

import json

from clawd.judge import JudgeInput


def _call(name: str, **arguments) -> str:
    # A tool call as the judge reads one: the calls as JSON (clawd/bench/judge.py response_text)
    return json.dumps([{"name": name, "arguments": json.dumps(arguments)}])


def _turn(
    request: str, response: str, next_state: str, verdict: int, next_role: str = "user"
) -> tuple[JudgeInput, int]:
    return JudgeInput([{"role": "user", "content": request}], response, next_state, next_role), verdict


EXAMPLES: tuple[tuple[JudgeInput, int], ...] = (
    _turn(
        "Give me a name for my sourdough starter.",
        "Here are twenty names, by theme. Classic: Doughy, Bready, Yeasty. Punny: Bread Pitt, Clint Yeastwood, "
        "Dough Jones. Cute: Bubbles, Puffy, Rosie. Fancy: Sir Loaf, Lady Crumb…",
        "Twenty. I asked for a name. One would have done.",
        -1,
    ),
    _turn(
        "How do I undo my last git commit but keep the changes?",
        "git reset --soft HEAD~1 moves the branch back one commit and keeps your changes staged.",
        "perfect, that did it",
        1,
    ),
    _turn(
        "What is the boiling point of water at the top of Everest?",
        "About 70 °C: the air pressure there is about a third of that at sea level.",
        "Can you suggest a name for a grey kitten?",
        0,
    ),
    _turn(
        "Write a two-line reminder to the team about Friday's deadline.",
        "Hi team! 🎉 Just a friendly reminder that Friday is our BIG deadline!! Let's crush it!! 💪🚀",
        "Thanks, but the director reads these too. Drop the emojis and the exclamation marks.",
        -1,
    ),
    _turn(
        "Save 'call the plumber' to my notes.",
        _call("append_note", text="call the plumber"),
        '{"ok": true, "note_id": 318}',
        1,
        "tool",
    ),
    _turn(
        "What's the weather in Lyon tomorrow?",
        _call("get_forecast", city="Lyon", country="Franse", day="tomorrow"),
        '{"error": "unknown country code: Franse"}',
        -1,
        "tool",
    ),
    _turn(
        "When did the Berlin Wall fall?",
        "The Berlin Wall fell in 1991.",
        "1991? Isn't that when the Soviet Union ended? I'm fairly sure the wall came down earlier.",
        -1,
    ),
    _turn(
        "What is a Roth IRA?",
        "A US retirement account you pay into with after-tax money; qualified withdrawals in retirement are tax-free.",
        "Is there an income limit for opening one?",
        0,
    ),
    _turn(
        "Plan three days in Lisbon for me and my mother.",
        "Day 1: Belém and the monastery, then the riverside walk. Day 2: a day trip to Sintra's palaces. "
        "Day 3: Alfama on foot, up to the castle, fado in the evening.",
        "Looks lovely. We land on the Friday evening though, so day 1 can't be a full day, and my mother can't "
        "walk far, so fewer hills please. Could you add somewhere to eat each night?",
        -1,
    ),
    _turn(
        "Convert this to a table: apples 3, pears 5, plums 2",
        "| fruit | count |\n|---|---|\n| apples | 3 |\n| pears | 5 |\n| plums | 2 |",
        "great, thanks! can you do the same for the vegetables list now?",
        1,
    ),
    _turn(
        "explain me what is recursion",
        "Recursion is a technique in which a function invokes itself on a smaller instance of the problem until a "
        "base case is reached; each call pushes a stack frame, and tail-call optimisation can eliminate frames.",
        "is too much complicate for me, please more simple and short",
        -1,
    ),
)
