"""The judge benchmark's arithmetic: the corpus format's checks, per-judge figures, and the
automatic check of a hint against the instruction a correction carries.

Boundary: pure functions over plain data (corpus rows, verdict scores, vote lists, hint
strings). No model, no I/O: clawd/bench/judge.py runs the judges and prints what these compute.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass

KINDS = frozenset(
    "length format tone language spelling factual wrong_tool persona ordering answer_first signoff code_style "
    "units detail_level approval topic_change tool_failure tool_success challenge other".split()
)
VOICES = frozenset("terse polite sarcastic non_native thanks_but challenging_question embedded neutral tool".split())
FIELDS = ("id", "kind", "voice", "messages", "response", "next", "label", "instruction")
ID_PREFIX = {"dev": "dev-", "select": "sel-", "heldout": "ho-"}


# ---------------------------------------------------------------------------------------
# The corpus format (../briefs: h15-corpus-format; also README "Judge benchmark")


def row_problems(row: dict, split: str) -> list[str]:
    """What is wrong with one corpus row; [] when it follows the format."""
    rid = row.get("id", "?")
    out = [f"{rid}: missing field {f!r}" for f in FIELDS if f not in row]
    if out:
        return out
    if not (isinstance(rid, str) and re.fullmatch(re.escape(ID_PREFIX[split]) + r"\d{4}", rid)):
        out.append(f"{rid}: id must look like {ID_PREFIX[split]}0001")
    if row["kind"] not in KINDS:
        out.append(f"{rid}: unknown kind {row['kind']!r}")
    if row["voice"] not in VOICES:
        out.append(f"{rid}: unknown voice {row['voice']!r}")
    if row["label"] not in (-1, 0, 1) or isinstance(row["label"], bool):
        out.append(f"{rid}: label must be -1, 0 or 1")
    msgs = row["messages"]
    if not (isinstance(msgs, list) and msgs and all(isinstance(m, dict) and "role" in m for m in msgs)):
        out.append(f"{rid}: messages must be a non-empty list of chat messages")
    elif msgs[-1]["role"] not in ("user", "tool") or not any(m["role"] == "user" for m in msgs):
        out.append(f"{rid}: messages must hold the user's request and end with it (or a tool result)")
    resp = row["response"]
    if isinstance(resp, dict):
        calls = resp.get("tool_calls")
        if resp.get("role") != "assistant" or not (isinstance(calls, list) and calls):
            out.append(f"{rid}: an object response must be an assistant message with tool_calls")
    elif not (isinstance(resp, str) and resp.strip()):
        out.append(f"{rid}: response must be non-empty text or an assistant tool-call message")
    nxt = row["next"]
    if not (isinstance(nxt, dict) and nxt.get("role") in ("user", "tool") and isinstance(nxt.get("content"), str)):
        out.append(f"{rid}: next must be a user message or a tool result with text content")
    elif not nxt["content"].strip():
        out.append(f"{rid}: next has empty content (the miner never judges an empty next state)")
    elif nxt["role"] == "tool" and not isinstance(resp, dict):
        out.append(f"{rid}: a tool result must follow a tool-call response")
    instr = row["instruction"]
    if instr is not None and (row["label"] != -1 or not (isinstance(instr, str) and instr.strip())):
        out.append(f"{rid}: instruction must be null unless label is -1, and then non-empty text")
    return out


def corpus_problems(splits: dict[str, list[dict]]) -> list[str]:
    """Every row's problems, plus ids repeated anywhere and next states or requests shared
    between splits (the held-out half must not restate the dev half)."""
    out: list[str] = []
    ids = Counter(r.get("id") for rows in splits.values() for r in rows)
    out += [f"{i}: id used {n} times" for i, n in ids.items() if n > 1]
    for split, rows in splits.items():
        for r in rows:
            out += row_problems(r, split)
    if len(splits) > 1:
        seen: dict[str, str] = {}
        for split, rows in splits.items():
            for r in rows:
                for key in _texts(r):
                    if key in seen and seen[key] != split:
                        out.append(f"{r.get('id')}: shares a message with the {seen[key]} split: {key[:60]!r}")
                    seen.setdefault(key, split)
    return out


def _texts(row: dict) -> list[str]:
    norm = lambda s: " ".join(str(s).lower().split())  # noqa: E731 - local one-liner
    texts = [norm((row.get("next") or {}).get("content", ""))]
    users = [m.get("content") for m in row.get("messages") or [] if isinstance(m, dict) and m.get("role") == "user"]
    if users:
        texts.append(norm(users[-1]))
    return [t for t in texts if len(t) > 20]  # short replies ("perfect", "ok") may recur by chance


# ---------------------------------------------------------------------------------------
# Figures per judge


def undecided(score: int | None, votes: list[int | None]) -> bool:
    """Whether the judge reached no verdict: the rules said None, or an LLM judge's votes
    had no valid vote or a tie (its 0 then means "no decision", not "neutral")."""
    if score is None:
        return True
    if not votes:  # the rules judge decided
        return False
    counts = Counter(v for v in votes if v is not None).most_common()
    return not counts or (len(counts) > 1 and counts[0][1] == counts[1][1])


@dataclass(frozen=True)
class Figures:
    n: int
    accuracy: float  # verdict == label; an undecided verdict counts as 0 (what the miner records)
    correction_recall: float | None  # of label -1: judged -1
    approval_precision: float | None  # of judged +1: labelled +1
    inverted: float | None  # of label ±1: judged the opposite sign
    # of label 0: judged -1. A topic change read as a correction trains against an answer the
    # user had nothing against; the figures do not show it, and few-shot judges do it.
    false_corrections: float | None
    undecided: float
    votes_parsed: float | None  # of all LLM votes: parseable (None for the rules judge)
    ms_per_item: float


def _ratio(num: int, den: int) -> float | None:
    return num / den if den else None


def figures(
    labels: list[int], scores: list[int | None], votes: list[list[int | None]], seconds: list[float]
) -> Figures:
    """The benchmark's figures for one judge on one split; `scores[i]` is None when the judge
    was undecided on item i, `votes[i]` its raw votes ([] for rules)."""
    n = len(labels)
    if not (n == len(scores) == len(votes) == len(seconds)) or n == 0:
        raise ValueError("figures needs one score, vote list and time per label, and at least one item")
    given = [0 if s is None else s for s in scores]
    pairs = list(zip(labels, given))
    all_votes = [v for vs in votes for v in vs]
    return Figures(
        n=n,
        accuracy=sum(lab == s for lab, s in pairs) / n,
        correction_recall=_ratio(sum(lab == -1 and s == -1 for lab, s in pairs), labels.count(-1)),
        approval_precision=_ratio(sum(lab == 1 and s == 1 for lab, s in pairs), given.count(1)),
        inverted=_ratio(sum(lab * s == -1 for lab, s in pairs), sum(lab != 0 for lab in labels)),
        false_corrections=_ratio(sum(lab == 0 and s == -1 for lab, s in pairs), labels.count(0)),
        undecided=sum(undecided(s, v) for s, v in zip(scores, votes)) / n,
        votes_parsed=_ratio(sum(v is not None for v in all_votes), len(all_votes)) if all_votes else None,
        ms_per_item=1000 * sum(seconds) / n,
    )


# ---------------------------------------------------------------------------------------
# Does a hint state the carried instruction?
#
# Deliberately simple, so anyone can predict it: a hint passes when (1) it reads as an
# instruction, i.e. its first word (after "please", "always", "never", "do"/"don't") is not a
# pronoun, article, auxiliary or other word that starts a description ("The user wants ...",
# "You forgot ...", "It was too long"); and (2) at least half of the instruction's content
# words (stop words dropped, crude suffix stripping) appear in the hint. A judge that copies
# the user's complaint ("You forgot to sign off") fails (1); a vague hint ("Be more careful")
# fails (2).

_NOT_IMPERATIVE = frozenset(
    "i you he she it we they me him her us them my your his its our their this that these those the a an "
    "there here what which who why how when where is are was were be been has have had will would can could "
    "should may might must shall user assistant response answer reply hint correction no yes not too way "
    "very so but and or well oh ah hi hey hmm hm wow wait really sure ok okay thanks thank sorry good great "
    "nice perfect lovely fine i'm i've i'd you're you've it's that's there's isn't aren't wasn't didn't "
    "doesn't we're they're what's".split()
)
_LEAD_INS = frozenset("please always never do don't dont just kindly also".split())
# "Answer", "reply" and "respond" start an instruction ("Answer in French.") unless a verb of
# description follows ("Answer was too long.", "Reply should be shorter.").
_VERB_NOUNS = frozenset("answer reply respond".split())
_DESCRIBING = frozenset(
    "is was were are be been has had should must could would seems looks sounds too needs lacks missed "
    "ignored misses".split()
)
_STOP = frozenset(
    "the a an and or of to in on at for with without by from as is are be it its this that these those "
    "instead not no only just then than so but also all any each every more most much very too into about "
    "your you their them they use give make say answer write put keep don't dont do".split()
)
_WORD = re.compile(r"[a-z0-9äöüßéèàçñ%°]+(?:'[a-z]+)?")
OVERLAP_NEEDED = 0.5


def _stem(w: str) -> str:
    for suffix in ("ing", "ed", "es", "s"):
        if len(w) > len(suffix) + 3 and w.endswith(suffix):
            return w[: -len(suffix)]
    return w


def content_words(text: str) -> set[str]:
    return {_stem(w) for w in _WORD.findall((text or "").lower()) if len(w) > 2 and w not in _STOP}


def is_imperative(hint: str) -> bool:
    """Reads as an instruction: not a question, and the first word (after lead-ins) is not a
    pronoun, article, auxiliary, interjection, a verb in the third person ("Looks nice")
    or an -ly adverb ("Technically")."""
    text = (hint or "").strip()
    words = _WORD.findall(text.lower())
    while words and words[0] in _LEAD_INS:
        words = words[1:]
    if not words or text.endswith("?"):
        return False
    first = words[0]
    if first in _VERB_NOUNS:
        return len(words) > 1 and words[1] not in _DESCRIBING and not words[1].endswith("n't")
    third_person = first.endswith("s") and not first.endswith(("ss", "us"))
    adverb = first.endswith("ly") and len(first) > 5 and first not in ("multiply",)
    return first not in _NOT_IMPERATIVE and not third_person and not adverb


def hint_overlap(hint: str, instruction: str) -> float:
    want = content_words(instruction)
    return len(want & content_words(hint)) / len(want) if want else 0.0


def hint_states_instruction(hint: str | None, instruction: str | None) -> bool | None:
    """True/False for a correction that carries an instruction; None when there is nothing
    to check against (no instruction). No hint at all is False."""
    if not instruction:
        return None
    if not hint:
        return False
    return is_imperative(hint) and hint_overlap(hint, instruction) >= OVERLAP_NEEDED
