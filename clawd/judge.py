"""Judges: a turn (request, response, next state) in, an evaluative score and hints out.

Boundary: this module turns text into signals (METHOD.md §2-3) — the judge's types, judge
prompts, vote parsing (`\\boxed{}`, or a vote written plainly), majority and the LLM judge.
It never touches the database and never decides *which* turn to judge or what to do with the
result: that is the miner's job.

Judges, fastest first:
- `RulesJudge` (clawd/judge_rules.py): English patterns for corrections, thanks and tool
  errors; says None when unsure, so the caller can hand the turn to an LLM judge.
- `LLMJudge` over a `Completer` (clawd/judge_completers.py): the served model ("self"), a
  second local GGUF ("gguf:PATH") or any OpenAI-compatible endpoint ("openai:URL[#MODEL]").
- `LikelihoodJudge` ("likelihood:self", "likelihood:gguf:PATH"): the same prompt, but the
  verdict is the most likely of the three \\boxed{} endings, scored instead of sampled.
"""

from __future__ import annotations

import asyncio
import re
import zlib
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from clawd.errors import ClawdError, ConfigError, ContextLengthExceeded, Preempted

# A hint must say something: METHOD §3 keeps candidates longer than this (stripped).
MIN_HINT_CHARS = 10


@dataclass(frozen=True)
class JudgeInput:
    request: list[dict]  # the turn's request messages, OpenAI-shaped ({"role", "content"})
    response: str  # the assistant's answer being judged
    next_state: str  # newest message of the next main request (user reply or tool result)
    next_role: str  # "user" or "tool"


@dataclass(frozen=True)
class Verdict:
    score: int  # +1, -1 or 0
    votes: list[int | None]  # raw votes (None = unparseable); [] for rules
    source: str  # "rules" | "self" | "gguf" | "openai"
    # The likelihood judge's log p(\\boxed{v} | prompt) per verdict: what it decided from, kept
    # so a benchmark can study margins and calibration without running the model again.
    logprobs: dict[int, float] | None = None


class JudgeUnavailable(ClawdError):
    """The judge backend could not be reached or failed; the turn stays unjudged."""


# ---------------------------------------------------------------------------------------
# Parsing judge output


_BOXED = re.compile(r"\\boxed\s*")
_VOTE = re.compile(r"\s*(\+?1|-1|0)\s*")
_HINT = re.compile(r"\[HINT_START\](.*?)\[HINT_END\]", re.DOTALL)


def parse_boxed(text: str) -> int | None:
    """The vote in the LAST `\\boxed{...}` of `text`: 1, -1 or 0 ("+1" and spaces are
    fine). None when there is no \\boxed, its braces are missing or unbalanced, or its
    content is anything else (2, "yes", empty, nested braces)."""
    starts = [m.end() for m in _BOXED.finditer(text or "")]
    if not starts:
        return None
    # The last one decides: judges often restate the answer format before answering.
    i = starts[-1]
    if i >= len(text) or text[i] != "{":
        return None
    close = text.find("}", i + 1)
    if close < 0:
        return None
    inner = text[i + 1 : close]
    m = _VOTE.fullmatch(inner)
    return int(m.group(1)) if m and "{" not in inner else None


# A vote written without \boxed: instruct models asked for \boxed{1} mostly answer a bare "1"
# (19 of 102 votes of Qwen2.5-Coder-1.5B were boxed). Only unmistakable forms count: the first
# or the last line is the vote alone (markdown and a full stop around it are fine), or the last
# line ends with one that it names ("Score: 1", "The final answer is -1.").
_BARE_VOTE = re.compile(r"[\s*`$(\[]*(\+?1|-1|0)[\s*`$)\].]*")
_NAMED_VOTE = re.compile(r"\b(?:answer|score|verdict|vote|rating)\b[^\n\d+-]{0,16}?(\+?1|-1|0)[\s*`$)\].]*$", re.I)


def parse_vote(text: str) -> int | None:
    """A judge answer's vote: its last \\boxed{} when it wrote one (a broken box stays None:
    the judge tried the format and failed), else a vote written plainly (see _BARE_VOTE)."""
    text = text or ""
    if _BOXED.search(text):
        return parse_boxed(text)
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    if not lines:
        return None
    for candidate in (lines[0], lines[-1]):
        m = _BARE_VOTE.fullmatch(candidate)
        if m:
            return int(m.group(1))
    m = _NAMED_VOTE.search(lines[-1])
    return int(m.group(1)) if m else None


_CLOSED_VOTE = re.compile(r"\\boxed\s*\{\s*(\+?1|-1|0)\s*\}")
# What may sit between the boxes of a restated answer format: "\boxed{1}, \boxed{-1} or \boxed{0}"
_LISTING = re.compile(r"^[\s,;/]*(or|and)?[\s,;/]*$")


def answer_closed(text: str) -> bool:
    """Whether a judge answer has given its vote: a closed \boxed{1|-1|0} followed by
    something other than the next box of a restated format. Generation can stop there
    (the vote is the last box, METHOD §2), instead of running to max_tokens: small base
    models rarely stop on their own after answering."""
    boxes = list(_CLOSED_VOTE.finditer(text or ""))
    if not boxes:
        return False
    last = boxes[-1]
    after = text[last.end() :]
    if not after.strip() and "\n" not in after:
        return False  # wait one more piece: a listing may go on ("\boxed{1}, \boxed{-1} ...")
    if _LISTING.match(after) and "\n" not in after:
        return False
    before = text[boxes[-2].end() : last.start()] if len(boxes) > 1 else None
    return before is None or not _LISTING.match(before)


def majority(votes: list[int | None]) -> int:
    """The strict plurality of the valid votes; a tie, or no valid vote, is 0."""
    counts = Counter(v for v in votes if v is not None).most_common()
    if not counts or (len(counts) > 1 and counts[0][1] == counts[1][1]):
        return 0
    return counts[0][0]


def parse_hint(text: str) -> str | None:
    """The hint of a hint-judge answer: needs its vote (parse_vote) to be 1 and text between
    [HINT_START] and [HINT_END] (the last such pair); stripped, None if empty."""
    if parse_vote(text) != 1:
        return None
    hints = _HINT.findall(text)
    if not hints:
        return None
    hint = hints[-1].strip()
    return hint or None


# ---------------------------------------------------------------------------------------
# Prompts

# Judge prompts must fit a small model's context: long texts keep their head and tail.
_LIMITS = {"request": 3000, "response": 3000, "next": 2000, "context": 400}
_CONTEXT_MESSAGES = 4


def _content_text(content) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for p in content:
            if isinstance(p, dict) and p.get("type") == "text":
                parts.append(p.get("text") or "")
            elif isinstance(p, str):
                parts.append(p)
        return "".join(parts)
    return str(content)


def _message_text(m: dict) -> str:
    text = _content_text(m.get("content"))
    calls = m.get("tool_calls") or []
    names = [(c.get("function") or {}).get("name", "?") for c in calls if isinstance(c, dict)]
    if names:
        text = (text + "\n" if text else "") + "[called " + ", ".join(names) + "]"
    return text


def _clip(text: str, limit: int) -> str:
    text = text.strip()
    if len(text) <= limit:
        return text
    head, tail = limit * 2 // 3, limit // 3
    return f"{text[:head]}\n[… {len(text) - head - tail} characters omitted …]\n{text[-tail:]}"


def _last_user_index(request: list[dict]) -> int | None:
    for i in range(len(request) - 1, -1, -1):
        if request[i].get("role") == "user":
            return i
    return None


def _transcript(messages: list[dict]) -> str:
    return "\n".join(f"{m.get('role', '?')}: {_clip(_message_text(m), _LIMITS['context'])}" for m in messages)


def _turn_sections(inp: JudgeInput) -> str:
    """The turn as the judges read it: brief context, the user's own request, the
    response, and what came next."""
    i = _last_user_index(inp.request)
    before = inp.request[:i][-_CONTEXT_MESSAGES:] if i is not None else inp.request[-_CONTEXT_MESSAGES:]
    after = inp.request[i + 1 :][-_CONTEXT_MESSAGES:] if i is not None else []
    asked = _message_text(inp.request[i]) if i is not None else "(no user message)"
    parts = []
    if before:
        parts.append("## Earlier conversation (context only)\n" + _transcript(before))
    parts.append("## The user's request\n" + _clip(asked, _LIMITS["request"]))
    if after:
        parts.append("## Steps already taken for this request\n" + _transcript(after))
    parts.append("## The assistant's response\n" + (_clip(inp.response, _LIMITS["response"]) or "(empty)"))
    what = "the result of the tool the assistant called" if inp.next_role == "tool" else "the user's next message"
    parts.append(f"## What came next: {what}\n" + (_clip(inp.next_state, _LIMITS["next"]) or "(empty)"))
    return "\n\n".join(parts)


_EVALUATIVE_SYSTEM = """\
You judge, in hindsight, whether an AI assistant's response fulfilled the user's intent.
You see the user's request, the assistant's response, and what came next: the user's next \
message, or the result of a tool the assistant called. Judge by what came next.

Score 1: the response worked. The user thanks or approves it, or moves on to a new, different \
request; or the tool call succeeded.
Score -1: the response fell short. The user asks to redo or try again; corrects it ("no, I \
meant ...", "change X to Y", "don't ...", "shorter"); points out a mistake or something \
missing; or rephrases the same request. Or the tool returned an error. A request to change \
the response counts as -1, however politely it is put.
Score 0: what came next does not tell: it is ambiguous, or unrelated to the response.

The user's request is there so you can tell a new request from the same request asked again, \
and whether the reply really shows success. Think in a few sentences at most, then end with \
exactly one of \\boxed{1}, \\boxed{-1} or \\boxed{0}."""

_HINT_SYSTEM = """\
You read one turn of a conversation in hindsight: the user's request, the assistant's \
response, and what came next (the user's next message, or the result of a tool the assistant \
called). Decide whether what came next carries a meaningful correction: information that \
would have made the response better had the assistant known it, such as a mistake to fix, a \
preference, a missing requirement or an error to avoid.

Decide that first, in a sentence or two. Most turns carry none: thanks, approval, a \
successful tool result or an unrelated new request give no hint, and a forced hint is worse \
than none.
- No meaningful correction: end with \\boxed{-1} and write no hint.
- A meaningful correction: write a hint of 1 to 3 sentences between [HINT_START] and \
[HINT_END], then end with \\boxed{1}. The hint is an instruction to the assistant as if given \
before it answered: concrete and actionable (what to do or avoid), not a summary of the \
conversation and not the whole answer.

Layout when there is a hint:
[HINT_START]...[HINT_END]
\\boxed{1}"""


def evaluative_messages(inp: JudgeInput, examples: Sequence[tuple[JudgeInput, int]] = ()) -> list[dict]:
    """Chat messages asking the evaluative judge for \\boxed{1|-1|0} (METHOD §2). Each of
    `examples` (a judged turn and its verdict, clawd/judge_examples.py) comes first as an
    earlier exchange: the same question, answered with the verdict's box alone."""
    shown = []
    for example, verdict in examples:
        shown += [_evaluative_question(example), {"role": "assistant", "content": VERDICT_TEXTS[verdict]}]
    return [{"role": "system", "content": _EVALUATIVE_SYSTEM}, *shown, _evaluative_question(inp)]


def _evaluative_question(inp: JudgeInput) -> dict:
    return {
        "role": "user",
        "content": _turn_sections(inp)
        + "\n\nDid the response fulfil the user's intent? End with \\boxed{1}, \\boxed{-1} or \\boxed{0}.",
    }


def hint_messages(inp: JudgeInput) -> list[dict]:
    """Chat messages asking the hint judge for \\boxed{1} plus a hint, or \\boxed{-1} (METHOD §3)."""
    return [
        {"role": "system", "content": _HINT_SYSTEM},
        {
            "role": "user",
            "content": _turn_sections(inp)
            + "\n\nDoes what came next carry a meaningful correction? If it does, give the hint between "
            "[HINT_START] and [HINT_END] and end with \\boxed{1}; if not, end with \\boxed{-1}.",
        },
    ]


# ---------------------------------------------------------------------------------------
# LLM judges


class Completer(Protocol):
    """One chat completion from some model; raises on failure."""

    source: str

    async def complete(self, messages: list[dict], *, temperature: float, max_tokens: int, seed: int | None) -> str: ...


class LLMJudge:
    """The evaluative and hint judges of METHOD §2-3 over any Completer."""

    def __init__(
        self,
        completer: Completer,
        *,
        votes: int = 3,
        temperature: float = 0.6,
        max_tokens: int = 256,
        examples: Sequence[tuple[JudgeInput, int]] = (),
    ):
        if votes < 1:
            raise ConfigError(f"judge votes must be at least 1, got {votes}")
        self.completer = completer
        self.examples = tuple(examples)  # judged turns shown before each evaluative question
        self.votes = votes
        self.temperature = temperature
        self.max_tokens = max_tokens

    async def evaluate(self, inp: JudgeInput) -> Verdict:
        """m votes with distinct seeds, each parsed by parse_vote; majority.

        Raises JudgeUnavailable when the backend fails; asyncio.CancelledError and
        Preempted pass through unchanged."""
        messages = evaluative_messages(inp, self.examples)
        # One vote at a time: the served model runs one call at a time anyway, and the
        # miner can preempt between votes when a user request arrives.
        votes = [parse_vote(await self._complete(messages, seed)) for seed in _seeds(messages, self.votes)]
        return Verdict(majority(votes), votes, self.completer.source)

    async def hints(self, inp: JudgeInput, *, votes: int = 1) -> list[str]:
        """Accepted hints (\\boxed{1} plus a hint longer than MIN_HINT_CHARS), deduplicated,
        in vote order; [] when the judge finds no meaningful correction."""
        messages = hint_messages(inp)
        out: list[str] = []
        for seed in _seeds(messages, votes):
            hint = parse_hint(await self._complete(messages, seed))
            if hint and len(hint) > MIN_HINT_CHARS and hint not in out:
                out.append(hint)
        return out

    async def _complete(self, messages: list[dict], seed: int) -> str:
        try:
            return await self.completer.complete(
                messages, temperature=self.temperature, max_tokens=self.max_tokens, seed=seed
            )
        except (asyncio.CancelledError, Preempted, JudgeUnavailable, ContextLengthExceeded):
            # Cancelled / Preempted: a user request took the engine; that is no backend
            # failure, and the miner retries soon instead of backing off. A turn too long
            # for the judge's context will never fit: the miner gives up on judging it.
            raise
        except Exception as e:
            raise JudgeUnavailable(
                f"The {self.completer.source!r} judge failed: {type(e).__name__}: {e}. The turn stays unjudged "
                'and will be retried; if this persists, check the judge backend or set the judge to "rules".'
            ) from e


# The three verdicts as the evaluative prompt asks the judge to end: the likelihood judge
# scores each as the reply to that prompt.
VERDICT_TEXTS = {-1: "\\boxed{-1}", 0: "\\boxed{0}", 1: "\\boxed{1}"}


class Scorer(Protocol):
    """A Completer that can also score a given reply to messages (models clawd runs itself)."""

    source: str

    async def logprob(self, messages: list[dict], completion: str) -> float: ...


def likelihood_choice(logprobs: dict[int, float], margin: float) -> int | None:
    """The verdict with the highest log-prob, or None when it beats the runner-up by less than
    `margin` nats (a near tie is no decision)."""
    best, second = sorted(logprobs, key=logprobs.get, reverse=True)[:2]
    return best if logprobs[best] - logprobs[second] >= margin else None


class LikelihoodJudge(LLMJudge):
    """The evaluative judge by likelihood instead of free text: log p(\\boxed{v} | prompt)
    for v = -1, 0, 1, one scoring pass each (the prompt's cache is shared); the most likely
    verdict wins. Deterministic, never unparseable, and far cheaper than m sampled votes of
    free text. Small models that rarely end a free-text answer with \\boxed{} still rank
    the three endings. Hints still come from free text (LLMJudge.hints).

    `margin` (nats): a verdict that beats the runner-up by less is no decision (score 0, an
    unparsed vote). A small model's three log-probs are often within a fraction of a nat of
    each other; reading such a near tie as a verdict mostly adds wrong signals."""

    def __init__(self, completer, *, margin: float = 0.0, **kw):
        super().__init__(completer, **kw)
        if margin < 0:
            raise ConfigError(f"the likelihood judge's margin must be at least 0, got {margin}")
        self.margin = margin

    async def evaluate(self, inp: JudgeInput) -> Verdict:
        messages = evaluative_messages(inp, self.examples)
        logprobs = {v: await self._logprob(messages, text) for v, text in VERDICT_TEXTS.items()}
        best = likelihood_choice(logprobs, self.margin)
        if best is None:
            return Verdict(0, [None], self.completer.source, logprobs)
        return Verdict(best, [best], self.completer.source, logprobs)

    async def _logprob(self, messages: list[dict], completion: str) -> float:
        try:
            return await self.completer.logprob(messages, completion)
        except (asyncio.CancelledError, Preempted, JudgeUnavailable, ContextLengthExceeded):
            raise  # as in LLMJudge._complete
        except Exception as e:
            raise JudgeUnavailable(
                f"The {self.completer.source!r} likelihood judge failed: {type(e).__name__}: {e}. The turn stays "
                'unjudged and will be retried; if this persists, set the judge to "rules" or "self".'
            ) from e


def _seeds(messages: list[dict], n: int) -> list[int]:
    # Distinct per vote, and reproducible per turn: re-judging a turn gives the same votes.
    base = zlib.crc32(repr(messages).encode()) & 0x3FFFFFFF
    return [base + i for i in range(n)]
