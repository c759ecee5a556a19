"""Worked examples for the evaluative judge: twelve judged turns, shown to an LLM judge as
earlier chat turns before the turn it judges (few-shot, `mining.judge_examples`).

Why: asked for \\boxed{} straight away, a small instruct model reads most next states as
approval and misses corrections phrased as a question, a joke or an aside. A few judged turns
show it the verdict rules of METHOD §2 at work, and show that the verdict comes at once, so a
likelihood judge scores the box where the model expects it. Measured in README ("Worked examples
for the LLM judge"): more corrections found on held-out, but more neutral turns read as
corrections, so it is off by default.

The examples are written for this module, not taken from the judge corpus, and a test keeps
them away from every corpus item (no near copy of a request, response or next message), so both
splits stay honest measures. Six corrections (sarcastic, "thanks, but", non-native, a
correction inside a longer message, a question that challenges a wrong fact, a tool error),
three approvals (one a tool success, one with a follow-up request) and three that tell nothing
(an unrelated new request, a related question, a non-committal reply: 0, the corpus's
convention and METHOD's "ambiguous or unrelated", although METHOD §2 also counts moving on as
+1). The first version had two 0 examples of eleven; this one has three and ends on one, and
still reads most neutral dev turns as corrections without a margin (87% then, 84% now). No three
neighbours share a verdict.
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
        "What can I use instead of buttermilk in pancakes?",
        "Stir a tablespoon of lemon juice into a cup of milk and let it stand for five minutes.",
        "did that, they came out fluffy. thanks!",
        1,
    ),
    _turn(
        "How many legs does a lobster have?",
        "Ten: eight walking legs and two large claws.",
        "Write a limerick about a forgetful robot.",
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
        "Book a table for two at Nonna's tonight at 8.",
        _call("reserve_table", restaurant="Nonna's", party=2, time="20:00", date="2025-13-01"),
        '{"error": "invalid date 2025-13-01: month must be 1-12"}',
        -1,
        "tool",
    ),
    _turn(
        "What is the freezing point of seawater?",
        "0 °C, the same as fresh water.",
        "The same as fresh water? Doesn't the salt lower it?",
        -1,
    ),
    _turn(
        "What does a sommelier do?",
        "A sommelier is a trained wine professional who chooses a restaurant's wines and advises guests on pairings.",
        "Do they need a certificate to work?",
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
        "How many teaspoons are in a tablespoon?",
        "Three.",
        "great, thanks. and how many tablespoons in a cup?",
        1,
    ),
    _turn(
        "explain me what is recursion",
        "Recursion is a technique in which a function invokes itself on a smaller instance of the problem until a "
        "base case is reached; each call pushes a stack frame, and tail-call optimisation can eliminate frames.",
        "is too much complicate for me, please more simple and short",
        -1,
    ),
    _turn(
        "Suggest a title for my blog post about home composting.",
        '"From Scraps to Soil: A Beginner\'s Guide to Home Composting"',
        "hmm. not sure yet, I'll come back to it",
        0,
    ),
)
