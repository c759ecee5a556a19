"""The rule judge on real-sounding turns (METHOD.md §2): corrections and redo requests are
-1, thanks and approval +1, tool errors -1 and tool successes +1, a new task counts only
after an approval word, a correction beats thanks, and anything unclear is None (handed
to the LLM judge). Plus the user's own correction as a hint candidate (METHOD.md §3)."""

from __future__ import annotations

import pytest

from clawd.judge import MIN_HINT_CHARS, JudgeInput
from clawd.judge_rules import RulesJudge

J = RulesJudge()

CODE_REQ = "Write a Python function that checks whether a string is a palindrome."
CODE_RESP = "def is_palindrome(s):\n    return s == s[::-1]"
EMAIL_REQ = "Draft a short email to my landlord asking to fix the heating."
EMAIL_RESP = "Dear Mr. Patel,\n\nI hope you are well. I am writing to let you know that the heating..."
FACT_REQ = "What is the capital of Australia?"
FACT_RESP = "The capital of Australia is Sydney."
SUMMARY_REQ = "Summarize this article about the Mars sample return mission in a few sentences."
SUMMARY_RESP = "**Key points:**\n- NASA is reviewing the budget\n- The mission may be delayed to 2040"
OFFER_RESP = "Here is the regex: `^\\d{3}-\\d{4}$`. Would you like me to explain how it works?"
TOOL_CALL = "I'll run the test suite.\n[called bash]"

CASES = [
    # -- corrections: -1 --
    (FACT_REQ, FACT_RESP, "No, that's wrong. It's Canberra.", "user", -1),
    (FACT_REQ, FACT_RESP, "Wrong.", "user", -1),
    (FACT_REQ, FACT_RESP, "That's incorrect, the capital is Canberra", "user", -1),
    (CODE_REQ, CODE_RESP, "No, I meant it should ignore case and spaces.", "user", -1),
    (CODE_REQ, CODE_RESP, "That's not what I asked for. I wanted it in JavaScript.", "user", -1),
    (CODE_REQ, CODE_RESP, "you forgot to handle punctuation", "user", -1),
    (CODE_REQ, CODE_RESP, "Change the function name to check_palindrome.", "user", -1),
    (CODE_REQ, CODE_RESP, "Use a two-pointer loop instead of slicing.", "user", -1),
    (CODE_REQ, CODE_RESP, "Don't use slicing, my teacher wants a loop.", "user", -1),
    (CODE_REQ, CODE_RESP, "Please don't use one-letter variable names", "user", -1),
    (SUMMARY_REQ, SUMMARY_RESP, "Stop using bullet points, write it as a paragraph.", "user", -1),
    (SUMMARY_REQ, SUMMARY_RESP, "shorter", "user", -1),
    (SUMMARY_REQ, SUMMARY_RESP, "Too long, I need it in two sentences.", "user", -1),
    (SUMMARY_REQ, SUMMARY_RESP, "Can you make it more casual?", "user", -1),
    (SUMMARY_REQ, SUMMARY_RESP, "make the intro a bit less formal", "user", -1),
    (SUMMARY_REQ, SUMMARY_RESP, "No bullet points and no bold please.", "user", -1),
    (EMAIL_REQ, EMAIL_RESP, "Try again, but more polite.", "user", -1),
    (EMAIL_REQ, EMAIL_RESP, "redo it", "user", -1),
    (EMAIL_REQ, EMAIL_RESP, "Rewrite it without the small talk at the start", "user", -1),
    (EMAIL_REQ, EMAIL_RESP, "His name is Mr. Patil, not Patel. You misread it.", "user", -1),
    (EMAIL_REQ, EMAIL_RESP, "Actually, he prefers to be called Raj.", "user", -1),
    (EMAIL_REQ, EMAIL_RESP, "It would be nice if you mentioned that it's been broken for a week.", "user", -1),
    (EMAIL_REQ, EMAIL_RESP, "I said short. This is way too wordy.", "user", -1),
    (EMAIL_REQ, EMAIL_RESP, "Nope. Less groveling, more direct.", "user", -1),
    (CODE_REQ, CODE_RESP, "It doesn't work for 'Racecar'.", "user", -1),
    (CODE_REQ, CODE_RESP, "I get a TypeError when I pass None", "user", -1),
    (
        CODE_REQ,
        CODE_RESP,
        "Traceback (most recent call last):\n  File \"p.py\", line 2\nAttributeError: 'NoneType'",
        "user",
        -1,
    ),
    (CODE_REQ, CODE_RESP, "there's a bug: empty strings crash it", "user", -1),
    (CODE_REQ, CODE_RESP, "it should return False for empty input", "user", -1),
    (FACT_REQ, FACT_RESP, "I don't think that's right.", "user", -1),
    (FACT_REQ, FACT_RESP, "Not quite. Try again.", "user", -1),
    (FACT_REQ, FACT_RESP, "Let me rephrase: which city is the seat of the Australian government?", "user", -1),
    # rephrasing the same request (no cue word at all)
    (FACT_REQ, FACT_RESP, "what is the capital city of australia", "user", -1),
    (SUMMARY_REQ, SUMMARY_RESP, "Summarize the Mars sample return article in a few short sentences", "user", -1),
    (CODE_REQ, CODE_RESP, "👎", "user", -1),
    (CODE_REQ, CODE_RESP, "Use tabs, not spaces.", "user", -1),
    (SUMMARY_REQ, SUMMARY_RESP, "This is great but too long", "user", -1),
    (SUMMARY_REQ, SUMMARY_RESP, "Remove the last bullet.", "user", -1),
    # -- thanks and approval: +1 --
    (FACT_REQ, "The capital of Australia is Canberra.", "thanks!", "user", 1),
    (CODE_REQ, CODE_RESP, "Perfect, thank you.", "user", 1),
    (CODE_REQ, CODE_RESP, "That works, cheers", "user", 1),
    (CODE_REQ, CODE_RESP, "exactly what I needed", "user", 1),
    (CODE_REQ, CODE_RESP, "awesome 👍", "user", 1),
    (CODE_REQ, CODE_RESP, "👍", "user", 1),
    (EMAIL_REQ, EMAIL_RESP, "Looks good, sending it now.", "user", 1),
    (EMAIL_REQ, EMAIL_RESP, "lgtm", "user", 1),
    (EMAIL_REQ, EMAIL_RESP, "thx, that did the trick", "user", 1),
    # moving on after an approval word
    (CODE_REQ, CODE_RESP, "Great, now write pytest tests for it.", "user", 1),
    (FACT_REQ, "The capital of Australia is Canberra.", "Thanks. What's the capital of New Zealand?", "user", 1),
    (SUMMARY_REQ, SUMMARY_RESP, "Nice. Next, draft a tweet announcing the delay.", "user", 1),
    (SUMMARY_REQ, SUMMARY_RESP, "Great, now remove the bullet about the budget from the slides.", "user", 1),
    ("Write a haiku about autumn.", "Crisp leaves drift and fall", "Thanks! Write one about winter", "user", 1),
    # -- tricky negations --
    (CODE_REQ, CODE_RESP, "not bad, thanks", "user", 1),
    (CODE_REQ, CODE_RESP, "No problem with this one, thanks!", "user", 1),
    (CODE_REQ, CODE_RESP, "Thanks, but that's wrong: it fails on 'A man, a plan'.", "user", -1),
    (CODE_REQ, CODE_RESP, "Not perfect, it lowercases nothing.", "user", -1),
    (CODE_REQ, CODE_RESP, "This isn't helpful.", "user", -1),
    (CODE_REQ, CODE_RESP, "Not exactly. I need it recursive.", "user", -1),
    (EMAIL_REQ, EMAIL_RESP, "Actually, that's perfect. Thanks!", "user", 1),
    (EMAIL_REQ, EMAIL_RESP, "Nothing wrong with it, thanks", "user", 1),
    (
        FACT_REQ,
        "The capital of Australia is Canberra.",
        "Great, thanks! What's wrong with my sentence: 'Me and him went'?",
        "user",
        1,
    ),
    (EMAIL_REQ, EMAIL_RESP, "Perfect, don't change anything.", "user", 1),
    (CODE_REQ, CODE_RESP, "Great, it still crashes on None.", "user", -1),
    (EMAIL_REQ, EMAIL_RESP, "thanks for nothing", "user", -1),
    (CODE_REQ, CODE_RESP, "Perfect! Now can you make it shorter?", "user", -1),
    (CODE_REQ, CODE_RESP, "That should work, thanks!", "user", 1),
    (CODE_REQ, CODE_RESP, "No worries, thanks", "user", 1),
    # -- ambiguous: None --
    (CODE_REQ, CODE_RESP, "ok", "user", None),
    (CODE_REQ, CODE_RESP, "hmm", "user", None),
    ("Tell me a joke.", "Why did the scarecrow win an award? ...", "Tell me another joke", "user", None),
    (CODE_REQ, CODE_RESP, "Now write a function that reverses a linked list.", "user", None),
    (CODE_REQ, CODE_RESP, "How would I test this?", "user", None),
    (CODE_REQ, CODE_RESP, "hmm, thanks, but I'm not sure yet", "user", None),
    (CODE_REQ, CODE_RESP, "Thanks, though I ended up using a library.", "user", None),
    (CODE_REQ, OFFER_RESP, "No.", "user", None),
    (CODE_REQ, OFFER_RESP, "no thanks", "user", None),
    (CODE_REQ, CODE_RESP, "never mind, I'll do it myself", "user", None),
    (SUMMARY_REQ, SUMMARY_RESP, "What does sample return actually involve?", "user", None),
    (CODE_REQ, CODE_RESP, "", "user", None),
    (CODE_REQ, CODE_RESP, "I don't know yet.", "user", None),
    # -- tool results --
    ("Run the tests.", TOOL_CALL, "===== 42 passed in 1.31s =====", "tool", 1),
    ("Run the tests.", TOOL_CALL, "===== 40 passed, 2 failed in 1.8s =====", "tool", -1),
    ("Run the tests.", TOOL_CALL, "FAILED tests/test_x.py::test_y - AssertionError", "tool", -1),
    ("List the files.", "[called ls]", "README.md\nsetup.py\nsrc/", "tool", 1),
    ("List the files.", "[called ls]", "ls: cannot access 'srcc': No such file or directory", "tool", -1),
    ("Start the server.", "[called bash]", "bash: uvicorn: command not found", "tool", -1),
    ("Compile it.", "[called bash]", "Process exited with code 2", "tool", -1),
    ("Compile it.", "[called bash]", "Build finished. exit code: 0, 0 errors, 3 warnings", "tool", 1),
    (
        "Read config.",
        "[called read_file]",
        "Traceback (most recent call last):\n  File \"x.py\"\nKeyError: 'port'",
        "tool",
        -1,
    ),
    ("Fetch it.", "[called http_get]", '{"status": "error", "message": "rate limited"}', "tool", -1),
    ("Fetch it.", "[called http_get]", '{"ok": true, "error": null, "items": [1, 2]}', "tool", 1),
    ("Fetch it.", "[called http_get]", "HTTP 404 Not Found", "tool", -1),
    ("Make the dir.", "[called bash]", "", "tool", 1),
    (
        "Show me chat.py.",
        "[called read_file]",
        "class TurnStream:\n    error: ClawdError | None = None\n    failed = []\n    except ValueError:\n",
        "tool",
        1,
    ),
    ("Show the script.", "[called read_file]", "Error: could not open file 'x.csv'", "tool", -1),
]

# Rule families widened on the judge corpus's dev split (sentences written for these tests).
WIDENED = [
    # "thanks, but ..." asks for a change, unless the user just moves on
    (EMAIL_REQ, EMAIL_RESP, "Thanks, but the tone is a bit stiff for a neighbour.", "user", -1),
    (EMAIL_REQ, EMAIL_RESP, "Thank you, but I'll write it myself after all.", "user", None),
    # standing preferences and imperative requests
    (SUMMARY_REQ, SUMMARY_RESP, "From now on, put the conclusion in the first line.", "user", -1),
    (SUMMARY_REQ, SUMMARY_RESP, "headline first next time", "user", -1),
    ("Be a pirate and greet me.", "Hello there, how can I help?", "stay in character!", "user", -1),
    (EMAIL_REQ, EMAIL_RESP, "Could you flip the order of the two paragraphs?", "user", -1),
    (EMAIL_REQ, EMAIL_RESP, "Can you use Australian spelling, please?", "user", -1),
    (FACT_REQ, FACT_RESP, "Norwegian, please.", "user", -1),
    (FACT_REQ, FACT_RESP, "auf Deutsch bitte", "user", -1),
    (CODE_REQ, CODE_RESP, "camelCase pls", "user", -1),
    (CODE_REQ, CODE_RESP, "please no recursion, our stack is tiny", "user", -1),
    (SUMMARY_REQ, SUMMARY_RESP, "You don't need the bullet points, it's three facts.", "user", -1),
    (SUMMARY_REQ, SUMMARY_RESP, "Could you just give the date?", "user", -1),
    # sign-offs, language, length complaints
    (EMAIL_REQ, EMAIL_RESP, "sign it 'Best, Ana'", "user", -1),
    (EMAIL_REQ, EMAIL_RESP, "It reads far too cold for a thank-you note.", "user", -1),
    # a correction buried in a longer message, after praise
    (
        EMAIL_REQ,
        EMAIL_RESP,
        "The facts are all there and the dates are right. Our landlord is a company, though, so "
        "I'd rather not open with Dear Mr. Patel. Could you address it to the property office?",
        "user",
        -1,
    ),
    # sarcasm: praise that means the opposite
    (SUMMARY_REQ, SUMMARY_RESP, "Ah yes, a summary longer than the article. Two sentences.", "user", -1),
    (CODE_REQ, CODE_RESP, "Very creative of you to ignore the spaces.", "user", -1),
    (SUMMARY_REQ, SUMMARY_RESP, "Wow, a whole essay. All I wanted was the launch date.", "user", -1),
    # an approval word followed by a complaint is no approval
    (EMAIL_REQ, EMAIL_RESP, "Lovely. Now it sounds like a court summons.", "user", -1),
    (FACT_REQ, FACT_RESP, "Great, except that's the biggest city, not the capital.", "user", -1),
    # ...but moving on after an approval, with a "but" in the new request, is approval
    (CODE_REQ, CODE_RESP, "Nice, now write one that ignores case but keeps digits.", "user", 1),
    (CODE_REQ, CODE_RESP, "the script works, every file got renamed", "user", 1),
    (CODE_REQ, CODE_RESP, "thanks, I always make that mistake with slicing", "user", 1),
    # "are you sure?" challenges without saying it is wrong: undecided
    (FACT_REQ, FACT_RESP, "Are you sure? My atlas says otherwise.", "user", None),
    # a new request that names a language is not a language complaint
    (FACT_REQ, "The capital of Australia is Canberra.", "How do you say 'capital' in Spanish?", "user", None),
    (FACT_REQ, "The capital of Australia is Canberra.", "Could you also tell me how to stop hiccups?", "user", None),
    # tool results: failures on the server's side are nobody's fault (undecided)
    ("Fetch it.", "[called http_get]", '{"status": 503, "error": "Service Unavailable"}', "tool", None),
    ("Fetch it.", "[called http_get]", "Error: connection timed out (host did not respond)", "tool", None),
    ("Fetch it.", "[called http_get]", "HTTP 502 Bad Gateway", "tool", None),
    ("Query it.", "[called sql]", 'ERROR: relation "userz" does not exist', "tool", -1),
    ("Query it.", "[called sql]", '{"error": "invalid_argument", "message": "limit must be an integer"}', "tool", -1),
    # -- stop 36, widened on the second dev batch (phrasings, not its items) --
    # a message that opens on a new subject: its change words are about that subject
    (
        FACT_REQ,
        FACT_RESP.replace("Sydney", "Canberra"),
        "Different topic: I need a shorter title for my blog.",
        "user",
        None,
    ),
    (
        FACT_REQ,
        FACT_RESP.replace("Sydney", "Canberra"),
        "Unrelated: can I use honey instead of sugar in tea?",
        "user",
        None,
    ),
    (
        FACT_REQ,
        FACT_RESP.replace("Sydney", "Canberra"),
        "We're going to redo the bathroom in May. Any tile tips?",
        "user",
        None,
    ),
    # the user's own slip, and their own options asked about
    (EMAIL_REQ, EMAIL_RESP, "Oops, my mistake: it's Mr. Patil, not Patel. Could you fix the name?", "user", None),
    (CODE_REQ, CODE_RESP, "Ugh, I pasted the old snippet. One sec, here's the real one.", "user", None),
    (CODE_REQ, CODE_RESP, "Can I call it on a list instead of a string?", "user", None),
    (CODE_REQ, CODE_RESP, "Could you use a loop instead of slicing?", "user", -1),
    # a change asked for after "thanks, but"; a bare "but" that moves on stays undecided
    (CODE_REQ, CODE_RESP, "Thanks, it runs, but please rename the function to snake_case.", "user", -1),
    (EMAIL_REQ, EMAIL_RESP, "Thanks! But actually the heating came back on, so I won't send it.", "user", None),
    # layouts, orders, units and spellings asked for in a word or two
    (SUMMARY_REQ, SUMMARY_RESP, "Could you lay that out as a table?", "user", -1),
    ("Rank these by price.", "1. Laptop B\n2. Laptop A", "Backwards. Cheapest first.", "user", -1),
    ("How far is Lyon from Geneva?", "About 93 miles.", "kilometres?", "user", -1),
    ("Write a card for Niamh.", "Happy birthday, Neeve!", "It's Niamh. N-I-A-M-H.", "user", -1),
    (SUMMARY_REQ, SUMMARY_RESP, "Why is it suddenly in bullet points?", "user", -1),
    (SUMMARY_REQ, SUMMARY_RESP, "From now please only two sentences.", "user", -1),
    # approvals in negative words, and praise the user only quotes
    (EMAIL_REQ, EMAIL_RESP, "No notes. Sending it.", "user", 1),
    (EMAIL_REQ, EMAIL_RESP, "Can't fault it.", "user", 1),
    (EMAIL_REQ, EMAIL_RESP, "That'll do.", "user", 1),
    (CODE_REQ, CODE_RESP, "The tests pass now.", "user", 1),
    (EMAIL_REQ, EMAIL_RESP + " Hope this helps!", "And there's the 'Hope this helps!' again.", "user", None),
    # ... and what an independent review found those rules misreading at first
    (EMAIL_REQ, EMAIL_RESP, "Great, now I need to send it to my boss. Can you write a cover note?", "user", 1),
    (EMAIL_REQ, EMAIL_RESP, "Thanks, but oops: the date you wrote is wrong.", "user", -1),
    (EMAIL_REQ, EMAIL_RESP, "Whoops, that's not what I asked. Make it shorter.", "user", -1),
    (EMAIL_REQ, EMAIL_RESP, "Another thing: you forgot the attachment line.", "user", -1),
    (CODE_REQ, CODE_RESP, "Could we do it in Python instead?", "user", -1),
    (CODE_REQ, CODE_RESP, "Thanks, that works, but I'll keep it as is for now.", "user", None),
    (CODE_REQ, CODE_RESP, "How do I sort a list in reverse order in Python?", "user", None),
]


def _inp(request: str, response: str, next_state: str, role: str, *, earlier: list[dict] | None = None):
    msgs = (earlier or []) + [{"role": "user", "content": request}]
    return JudgeInput(request=msgs, response=response, next_state=next_state, next_role=role)


@pytest.mark.parametrize(
    "request_text,response,next_state,role,expected", CASES, ids=[f"{c[4]}:{c[2][:40]}" for c in CASES]
)
def test_rules_table(request_text, response, next_state, role, expected):
    verdict = J.evaluate(_inp(request_text, response, next_state, role))
    if expected is None:
        assert verdict is None, f"{next_state!r} should be undecided, got {verdict}"
    else:
        assert verdict is not None, f"{next_state!r} should be {expected}, got undecided"
        assert (verdict.score, verdict.votes, verdict.source) == (expected, [], "rules")


@pytest.mark.parametrize(
    "request_text,response,next_state,role,expected", WIDENED, ids=[f"{c[4]}:{c[2][:40]}" for c in WIDENED]
)
def test_widened_rules(request_text, response, next_state, role, expected):
    test_rules_table(request_text, response, next_state, role, expected)


def test_table_is_large_and_covers_every_outcome():
    assert len(CASES) >= 60
    assert {c[4] for c in CASES} == {1, -1, None}
    assert {c[3] for c in CASES} == {"user", "tool"}


def test_request_content_parts_are_read_for_rephrase_detection():
    inp = JudgeInput(
        request=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Translate 'good morning' into German"}]},
        ],
        response="Bonjour",
        next_state="translate good morning into german",
        next_role="user",
    )
    assert J.evaluate(inp).score == -1


def test_unknown_next_role_is_undecided():
    assert J.evaluate(_inp(FACT_REQ, FACT_RESP, "thanks", "assistant")) is None


CORRECTIONS = [
    # (next state, expected correction; None = no user correction to offer)
    ("No, I meant it should ignore case and spaces.", "I meant it should ignore case and spaces."),
    ("nope, use a loop instead of slicing", "Use a loop instead of slicing"),
    ("Thanks, but that's wrong: it fails on 'A man, a plan'.", "That's wrong: it fails on 'A man, a plan'."),
    ("Wrong. Don't use slicing, my teacher wants a loop.", "Don't use slicing, my teacher wants a loop."),
    ("Stop using bullet points, write it as a paragraph.", "Stop using bullet points, write it as a paragraph."),
    ("Hmm, actually, make the intro a bit less formal", "Make the intro a bit less formal"),
    # A leading "no" / "wrong" without punctuation is the instruction itself: keep it.
    ("No bullet points and no bold please.", "No bullet points and no bold please."),
    ("Wrong language, I asked for Italian.", "Wrong language, I asked for Italian."),
    (
        'I get a TypeError when I pass None\nTraceback (most recent call last):\n  File "p.py"\nTypeError: x',
        "I get a TypeError when I pass None",
    ),
    ("Traceback (most recent call last):\n  File \"p.py\", line 2\nAttributeError: 'NoneType'", None),
    ("shorter", None),  # a correction, but too short to be a hint (METHOD §3: > 10 characters)
    ("Perfect, thank you.", None),
    ("Great, now write pytest tests for it.", None),
    ("ok", None),
]


@pytest.mark.parametrize("next_state,expected", CORRECTIONS, ids=[c[0][:40] for c in CORRECTIONS])
def test_correction_is_the_users_own_words(next_state, expected):
    assert J.correction(_inp(CODE_REQ, CODE_RESP, next_state, "user")) == expected


INSTRUCTIONS = [
    # (correction, the hint: the carried request restated as an instruction)
    ("please answer in Spanish", "Answer in Spanish."),
    ("You forgot to sign off with Cheers.", "Sign off with Cheers."),
    ("Could you keep it under fifty words?", "Keep it under fifty words."),
    ("Thanks, but could you put the total at the top?", "Put the total at the top."),
    ("you should use metric units", "Use metric units."),
    ("Metric, please.", "Use metric."),
    ("SI units, please.", "Use SI units."),  # an acronym keeps its capitals
    ("UK spelling, please.", "Use UK spelling."),
    ("That's not it. I need the dates in ISO format.", "Give the dates in ISO format."),
    ("Way too stiff. More casual, please.", "Make it more casual."),
    ("wrong format. as a table pls", "Give it as a table."),
    ("no emoji please.", "Leave out emoji."),
    ("Too much. just the number.", "Give just the number."),
    ("Nice, but it's for my team in Lyon. En français, s'il vous plaît.", "Answer in French."),
    # a question back, or a complaint with no request in it, stays the user's own words
    ("Why is it so long? This is way too wordy.", "Why is it so long? This is way too wordy."),
    ("No, that's wrong. It's Canberra.", "That's wrong. It's Canberra."),
]


@pytest.mark.parametrize("next_state,expected", INSTRUCTIONS, ids=[c[0][:40] for c in INSTRUCTIONS])
def test_correction_hint_states_the_request_as_an_instruction(next_state, expected):
    assert J.correction(_inp(EMAIL_REQ, EMAIL_RESP, next_state, "user")) == expected


def test_correction_keeps_the_sentences_that_carry_it():
    text = (
        "Okay. So. I read it twice. It is fine overall. But you forgot the deadline. "
        "And it should mention the landlord's name. Don't sign it with my full name."
    )
    got = J.correction(_inp(EMAIL_REQ, EMAIL_RESP, text, "user"))
    # each request restated as an instruction the teacher can follow (METHOD §3)
    assert got == "Include the deadline. Mention the landlord's name. Don't sign it with my full name."


def test_no_correction_from_a_tool_error():
    assert J.correction(_inp("Run it.", TOOL_CALL, "Error: file not found: data.csv", "tool")) is None


def test_corrections_are_long_enough_to_be_hints():
    for _next_state, expected in CORRECTIONS:
        if expected is not None:
            assert len(expected.strip()) > MIN_HINT_CHARS


def test_another_judges_correction_lends_the_users_words_but_never_an_approvals():
    undecided = _inp(EMAIL_REQ, EMAIL_RESP, "Every reply should open with a one-line summary for me.", "user")
    assert J.evaluate(undecided) is None and J.correction(undecided) is None
    assert J.correction(undecided, corrected=True) == "Every reply should open with a one-line summary for me."
    approval = _inp(EMAIL_REQ, EMAIL_RESP, "Thanks, that's perfect, sending it now!", "user")
    assert J.correction(approval, corrected=True) is None
