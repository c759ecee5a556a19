"""Judges: a turn (request, response, next state) in, an evaluative score and hints out.

Boundary: this module turns text into signals (METHOD.md §2-3) — judge prompts, vote
parsing (`\\boxed{}`), majority, the rule judge, and the model/endpoint judges that
complete those prompts. It never touches the database and never decides *which* turn
to judge or what to do with the result: that is the miner's job.

Judges, fastest first:
- `RulesJudge`: English patterns for corrections, thanks and tool errors; says None
  when unsure, so the caller can hand the turn to an LLM judge.
- `LLMJudge` over a `Completer`: the served model ("self"), a second local GGUF
  ("gguf:PATH") or any OpenAI-compatible endpoint ("openai:URL[#MODEL]").
"""

from __future__ import annotations

import asyncio
import re
import zlib
from collections import Counter
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
    inner = text[i + 1:close]
    m = _VOTE.fullmatch(inner)
    return int(m.group(1)) if m and "{" not in inner else None


def majority(votes: list[int | None]) -> int:
    """The strict plurality of the valid votes; a tie, or no valid vote, is 0."""
    counts = Counter(v for v in votes if v is not None).most_common()
    if not counts or (len(counts) > 1 and counts[0][1] == counts[1][1]):
        return 0
    return counts[0][0]


def parse_hint(text: str) -> str | None:
    """The hint of a hint-judge answer: needs the last \\boxed to be 1 and text between
    [HINT_START] and [HINT_END] (the last such pair); stripped, None if empty."""
    if parse_boxed(text) != 1:
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
    after = inp.request[i + 1:][-_CONTEXT_MESSAGES:] if i is not None else []
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


def evaluative_messages(inp: JudgeInput) -> list[dict]:
    """Chat messages asking the evaluative judge for \\boxed{1|-1|0} (METHOD §2)."""
    return [
        {"role": "system", "content": _EVALUATIVE_SYSTEM},
        {"role": "user", "content": _turn_sections(inp)
         + "\n\nDid the response fulfil the user's intent? End with \\boxed{1}, \\boxed{-1} or \\boxed{0}."},
    ]


def hint_messages(inp: JudgeInput) -> list[dict]:
    """Chat messages asking the hint judge for \\boxed{1} plus a hint, or \\boxed{-1} (METHOD §3)."""
    return [
        {"role": "system", "content": _HINT_SYSTEM},
        {"role": "user", "content": _turn_sections(inp)
         + "\n\nDoes what came next carry a meaningful correction? If it does, give the hint between "
           "[HINT_START] and [HINT_END] and end with \\boxed{1}; if not, end with \\boxed{-1}."},
    ]


# ---------------------------------------------------------------------------------------
# The rule judge
#
# Tables, not logic: each entry is one regex over the normalised (lower-case, straight
# apostrophes) text. Precedence: STRONG corrections beat approval ("thanks, but that's
# wrong" is -1); WEAK corrections lose to approval ("no, that's perfect" is +1); HOLD cues
# and "approval ... but" leave the turn undecided for the LLM judge.

def _rx(*patterns: str) -> list[re.Pattern]:
    return [re.compile(p) for p in patterns]


# Phrases that contain a cue word but mean no harm; blanked out before matching.
NEUTRAL = _rx(
    r"\bno (problem|worries|worry|stress)\b", r"\bno,? thanks?( you)?\b", r"\bno,? thank you\b",
    r"\bdon'?t (worry|mind)\b", r"\bi (don'?t|do not) know\b", r"\bnot (wrong|incorrect)\b",
    r"\b(nothing|anything|what'?s|what is|what was|something|what went|what goes) (is |was |went |goes )?wrong\b",
    r"\bdon'?t need anything (else|more)\b", r"\bdon'?t change (a thing|anything)\b",
    r"\b(can'?t|couldn'?t) (complain|thank you enough|be happier)\b",
    r"\bno complaints\b", r"\bno longer\b", r"\bno (errors?|issues?|bugs?|problems?)\b",
)

STRONG = _rx(
    # outright rejection
    r"\b(that'?s|that is|this is|it'?s|it is|you'?re|you are|you got( it)?|still|all|completely|totally"
    r"|is|are|was|were|answer is|seems?|looks?) (\w+ )?(wrong|incorrect|inaccurate|false|not right|not correct)\b",
    r"^\W*(wrong|incorrect|not right|not correct)\b", r"\bwrong (answer|result|number|language|file|format|one"
    r"|approach|unit|units|date|name|value|output|version|library|function|method|word|way)\b",
    r"\bnot (what|the (one|thing|answer|result|format|point))\b", r"^\W*not (it|really|exactly|quite)\b",
    r"\bnot quite\b", r"\bclose,? but\b", r"\w, not (?!bad\b|only\b|just\b|sure\b|yet\b|too\b|that\b|to\b)\w",
    r"\b(that|this|it) (isn'?t|is not|wasn'?t|was not) (it|right|correct|true|accurate|what|helpful|useful)\b",
    r"\bi (don'?t|do not) think (that|this|it)('?s| is| was)? (right|correct|true|accurate)\b",
    r"\b(mistake|typo|mistakes|typos)\b", r"\bthanks for nothing\b", r"\bmakes no sense\b", r"\bnonsense\b",
    r"\b(useless|unhelpful)\b",
    # "I meant", "I asked", rephrasings
    r"(?<!what )(?<!exactly )\bi meant\b", r"\bwhat i meant (was|is)\b",
    r"\bi (was )?(asked|asking) (for|about|you)\b",
    r"\bi said\b", r"(?<!what )\bi wanted\b", r"\bi (never|didn'?t|did not) (ask|say|said|want|request)\b",
    r"\blet me (rephrase|clarify|be clearer|try again)\b", r"\bin other words\b", r"\bto (clarify|be clear)\b",
    r"\bmy question (is|was)\b", r"\bread (my|the) (question|message|request) again\b",
    r"\b(you )?(misunderstood|misread|misunderstand)\b",
    # redo
    r"\b(rewrite|reword|rephrase|redo|re-do|regenerate|retry|start over|try again|do it again"
    r"|do that again|one more time)\b", r"\bgive it another (try|shot|go)\b", r"\banother (try|attempt)\b",
    # it does not work
    r"\b(doesn'?t|does not|didn'?t|did not|won'?t|will not|isn'?t|is not|wasn'?t|can'?t|cannot)"
    r" (work|compile|run|build|help|answer|load|start|fix|solve|make sense|exist|match"
    r"|look right|seem right|seem correct|do what)\b",
    r"\bnot working\b", r"\b(it|this|that|the code|the script|the app|the test|the tests|tests|the build"
    r"|the page|the link|the command) (still )?(fails|failed|failing|crashes|crashed|crashing|breaks|broke"
    r"|hangs|hung|errors|errored)\b", r"\bbroken\b",
    r"\b(get|got|getting|see|seeing|throws?|threw|raises?|raised|gives?|gave|giving|shows?|showed)\b[^.!?]{0,25}"
    r"(error|exception|traceback|segfault|stack trace)\b",
    r"traceback \(most recent call last\)", r"\b\w+(error|exception): ",
    r"\b(there'?s|there is|there are|has|have|got|found) (a|an|another|one|some|two|several) (\w+ )?"
    r"(bug|bugs|error|errors|problem|issue)\b",
    # something missing or ignored
    r"\byou (forgot|missed|left out|skipped|omitted|ignored|didn'?t|did not|never|haven'?t|have not"
    r"|can'?t|still)\b", r"\b(is|are|'s|'re|still) missing\b", r"^\W*missing\b",
    r"\b(it|that|this|the \w+|which|there|you|answer|response) (should|shouldn'?t|should not|must|needs to|has to)"
    # not "work"/"do": "that should work, thanks" is approval
    r" (be|have|use|say|return|not|include|contain|go|mention|handle|ignore|support|show|print|sound|read"
    r"|start|end|only|stay|match|accept|take|list|explain|cover)\b", r"\bshould(n'?t)? have\b", r"\bshould'?ve\b",
    r"\bsupposed to\b", r"\byou (should|need to|have to|must)\b",
    # change requests
    r"\bchange\b[^.!?]{0,40}\bto\b", r"\bchange (it|that|this|the)\b", r"\breplace\b[^.!?]{0,40}\bwith\b",
    r"\bswitch\b[^.!?]{0,40}\bto\b", r"\binstead\b", r"\brather than\b", r"\bfix (it|this|that)\b",
    r"\b(make|keep|write|rewrite|reword|phrase|give|get) (it|this|that|them|these|those|the( \w+){0,2}?"
    r"|your( \w+)? (answer|reply|response)) (a (bit|little|lot) |much |way |even |slightly )?"
    r"(more|less|shorter|longer|simpler|clearer|smaller|bigger|faster|cleaner|friendlier|warmer|funnier|easier"
    r"|briefer|tighter)\b",
    r"\bbe (a (bit|little|lot) |much |way )?(more|less) \w+", r"(^|[.!?]\s*)(a (bit|little|lot) )?(more|less) "
    r"(?!of\b|please\b|than\b|importantly\b|or\b|and\b|likely\b)\w+",
    r"\b(shorter|briefer|terser|simpler|more concise|less verbose|less wordy)\b",
    r"\btoo (long|short|verbose|wordy|formal|informal|casual|complicated|complex|technical|simple|basic|vague"
    r"|generic|repetitive|much|many|slow|big|small|robotic|stiff|dense|brief|terse|lengthy|detailed|advanced"
    r"|cheesy|boring|bland|harsh|cold|dry|academic|fancy|flowery)\b",
    r"\bwould be (great|nice|good|better|helpful) if\b", r"\bit'?d be (great|nice|good|better)\b",
    r"\bwithout (the|any|all|those|these)\b", r"\bno more\b", r"\bget rid of\b",
    r"\bno (bullet|bold|lists?|emojis?|markdown|headers|headings|jargon|intro|preamble|apolog)",
    # imperative don't / never / stop
    r"(^|[.!?;,:]\s*|\b(please|pls|and|but|also|just|so|ok|okay|then|again|seriously)\s+)"
    r"(don'?t|do not|never)\s+(?!mind\b)\w+",
    r"\b(stop|quit) (using|adding|putting|writing|saying|doing|making|being|with|giving|apologi\w*|repeating"
    r"|including|it|that)\b", r"\bi (don'?t|do not) (like|want|need)\b", r"\bi (hate|dislike)\b",
    r"👎|😡|🙄|😤",
)

# A leading "no" is a correction, unless it answers the assistant's own question.
_NO_LEAD = re.compile(r"^\W*(no|nope|nah|nop)\b")
WEAK = _rx(
    r"^\W*actually\b", r"\bare you sure\b", r"^\W*i mean\b",
    r"\b(remove|delete|drop|cut|lose|skip) (the|all|those|these|that|this|it|them|your)\b",
    r"^\W*(ugh+|meh)\b",
)

HOLD = _rx(r"\bnever ?mind\b", r"\bforget (it|that)\b")

APPROVAL = _rx(
    r"\b(thanks|thank (you|u)|thx|thnx|tysm|ty|cheers|ta|much appreciated|appreciate (it|that|this|the help|you))\b",
    r"\b(perfect|excellent|awesome|amazing|brilliant|fantastic|wonderful|superb|great|nice|cool|sweet|neat"
    r"|lovely|exactly|outstanding|beautiful|impressive|helpful|lifesaver|legend|genius)\b",
    r"\b(that|this|it) (works|worked|did it|did the trick|fixed it|helps|helped|solved it|is correct"
    r"|was correct|is right|was right)\b", r"\bworks (now|great|perfectly|fine|well|like a charm)\b",
    r"\b(that'?s|that is|you'?re|you are) (right|correct|spot on|it exactly)\b", r"\bspot on\b", r"\bnailed it\b",
    r"\blove (it|this|that)\b", r"\b(looks|sounds|seems) (good|great|right|fine|perfect)\b", r"\blgtm\b",
    r"\b(good|nice|great) (job|work|answer|stuff|one)\b", r"\bwell done\b", r"\bmakes sense\b",
    r"\bgot it\b", r"\bjust what i (needed|wanted|was looking for)\b", r"^\W*(good|very good|all good|not bad)\b",
    r"\bthat'?s (good|fine|better|much better)\b", r"\bnot bad\b",
    r"👍|🙏|👌|🎉|❤️|❤|😊|🙂|😀|😄|💯|🔥|🥳|✅",
)

# Approval followed by "but" is a reservation, not a verdict.
_RESERVATION = re.compile(r"\b(but|however|though|although|except)\b")
_NEGATORS = {"not", "no", "never", "hardly", "barely", "nothing", "far", "nor", "without"}

# Tool results (METHOD §2: a tool error is -1, a success +1). Matched on the original
# case: a tool may return source code, where `error: str` or `failed = []` is no error.
TOOL_NEUTRAL = _rx(
    r"(?i)\b(0|no|zero|without( any)?) (errors?|failures?|failed|exceptions?|issues?)\b",
    r"(?i)\b(errors?|failures?|failed)\s*[:=]\s*0\b", r"(?i)\berror[_ ]?(code|count)\s*[:=]\s*0\b",
    r"(?i)\"(is_)?error\"\s*:\s*(null|none|false|\"\"|\[\]|\{\}|0)",
)
TOOL_ERROR = _rx(
    r"(?i)traceback \(most recent call last\)",
    # a line-start marker, but not code: `error = ...`, `error: str`, `error: ClawdError | None`
    r"(?m)^\s*(Error|ERROR|error|Fatal|FATAL|fatal|Failed|FAILED|failed|Failure|FAILURE|Exception|panic)\b"
    r"(?![^\n]*=)(?!\s*[(.\[])(?!\s*:\s*((str|int|bool|float|dict|list|Optional|None)\b|[A-Z]\w*\s*([|\[,]|$)))",
    r"(?m)^\s*[\w.]*[A-Z]\w*(Error|Exception)\s*:", r"(?im)^\s*\[(error|fatal)\]", r"(?i)\bnpm err!",
    r"(?i)\b(fatal|syntax|runtime|internal|unexpected|unhandled|uncaught) (error|exception)\b",
    r"(?i)\ban? (\w+ )?(error|exception) (occurred|occured|has occurred|was raised|was thrown)\b",
    r"(?i)\b(raised|threw|thrown) an? (\w+ )?exception\b", r"(?i)\bfailed\b(?!\s*[=(.\[:])",
    r"(?i)\b(command not found|no such file or directory|permission denied|segmentation fault|core dumped"
    r"|timed out|connection refused|not recognized as an internal or external command|access denied)\b",
    r"(?i)\b(exit(ed)?( with)?( code| status)?|return ?code|returncode|exit_code)\s*[:=]?\s*-?[1-9]\d*\b",
    r"(?i)\brc\s*[:=]\s*-?[1-9]\d*\b",
    r"(?i)\b(4\d\d|5\d\d) (not found|bad request|unauthorized|forbidden|internal server error"
    r"|service unavailable|bad gateway|gateway timeout)\b", r"(?i)\bhttp(/[\d.]+)? (4\d\d|5\d\d)\b",
    r"(?i)\"?status(_code)?\"?\s*[:=]\s*(4\d\d|5\d\d)\b",
    r"(?i)\"(is_)?error\"\s*:\s*(true|\"[^\"]+\"|\{)", r"(?i)\"status\"\s*:\s*\"(error|failed|failure)\"",
)

_FENCE = re.compile(r"```.*?(```|$)", re.DOTALL)
_WORD = re.compile(r"[a-z0-9]+(?:'[a-z]+)?")
_STOP = set("a an the to of in on for and or is are was be it it's this that that's with as at by me my i i'm "
            "you your please can could would will do does how what what's why which who when where pls".split())
# "another joke", "the next step": asking for a new item is not asking again
_NEW_ITEM = re.compile(r"\b(another|next|new|more|also|different|other|else|too|now|then)\b")
_SENTENCE = re.compile(r"(?<=[.!?])\s+|\n+")
# Lead-ins stripped from a correction. "No", "wrong", "ok"... only when punctuation ends them:
# in "No bold please" or "Wrong language, I asked for Italian" the word is the instruction.
_LEAD_IN = re.compile(
    r"^\s*(((no|nope|nah|wrong|incorrect|not quite|not really|not exactly|sorry|ok|okay|meh)\s*[,.!:;—–-]"
    r"|(hmm+|ugh+|um+|uh+|well|actually|oh|but|and|so)\b"
    r"|(thanks|thank you|great|nice|perfect|cool|looks good)[\s,.!]*but\b)"
    r"[\s,.!:;—–-]*)+",
    re.IGNORECASE,
)
_FILLER = re.compile(r"^\W*(thanks|thank you|thx|ok|okay|hmm+|ugh+|please|pls|sorry|no|nope|wrong)?\W*$", re.I)
_TRACEBACK = re.compile(r"traceback \(most recent call last\)|^\s*[\w.]*(?:error|exception)\s*:", re.I | re.M)


def _normalise(text: str) -> str:
    text = text.replace("\u2019", "'").replace("\u2018", "'").lower()
    return re.sub(r"\s+", " ", _FENCE.sub(" ", text)).strip()


def _blank(text: str, patterns: list[re.Pattern]) -> str:
    for p in patterns:
        text = p.sub(lambda m: " " * len(m.group(0)), text)
    return text


def _negated(text: str, start: int) -> bool:
    """Whether the approval word at `start` is negated within its own clause
    ("not perfect", "isn't helpful"); such an approval counts as a complaint."""
    clause = re.split(r"[.,;:!?]", text[:start])[-1]
    return any(w in _NEGATORS or w.endswith("n't") for w in clause.split()[-4:])


def _content_words(text: str) -> set[str]:
    return {w for w in _WORD.findall(text.lower()) if w not in _STOP and len(w) > 1}


def _restates(previous: str, text: str) -> bool:
    """The same request asked again (METHOD §1 re-query): most content words shared."""
    a, b = _content_words(previous), _content_words(text)
    if len(a) < 2 or len(b) < 2 or _NEW_ITEM.search(text.lower()):
        return False
    return len(a & b) / len(a | b) >= 0.6


def _ends_with_question(response: str) -> bool:
    return response.rstrip().rstrip("*_)\"'").endswith("?")


@dataclass(frozen=True)
class _Cues:
    strong: bool
    weak: bool
    hold: bool
    approval: bool
    reservation: bool


class RulesJudge:
    """Fast English patterns for the clear cases; None when unsure (METHOD §2: the judge
    may be rules). A change request is a correction, so it scores -1."""

    source = "rules"

    def evaluate(self, inp: JudgeInput) -> Verdict | None:
        score = self._score(inp)
        return None if score is None else Verdict(score, [], self.source)

    def correction(self, inp: JudgeInput) -> str | None:
        """The user's own correction, cleaned of lead-ins ("no,", "nope", "thanks, but"),
        as a hint candidate (METHOD §3); None unless the next state is a user correction
        with something to say (longer than MIN_HINT_CHARS)."""
        if inp.next_role != "user" or self._score(inp) != -1:
            return None
        text = _TRACEBACK.split(inp.next_state, maxsplit=1)[0]  # a pasted error is no instruction
        text = _FENCE.sub(" ", text)
        sentences = [s.strip() for s in _SENTENCE.split(text) if s and s.strip()]
        if sentences:
            sentences[0] = _LEAD_IN.sub("", sentences[0])
        sentences = [s for s in sentences if not _FILLER.match(s)]
        if len(sentences) > 3:  # keep the sentences that carry the correction
            cued = [s for s in sentences if self._cues(_normalise(s), "").strong]
            sentences = (cued or sentences)[:3]
        out = " ".join(sentences).strip()
        if not out:
            return None
        out = out[0].upper() + out[1:]
        return out if len(out) > MIN_HINT_CHARS else None

    # -- internals --

    def _score(self, inp: JudgeInput) -> int | None:
        if inp.next_role == "tool":
            text = _blank(inp.next_state, TOOL_NEUTRAL)
            return -1 if any(p.search(text) for p in TOOL_ERROR) else 1
        if inp.next_role != "user" or not inp.next_state.strip():
            return None
        cues = self._cues(_normalise(inp.next_state), inp.response)
        i = _last_user_index(inp.request)
        restated = i is not None and _restates(_message_text(inp.request[i]), inp.next_state)
        if cues.strong:
            return -1
        if cues.hold:
            return None
        if cues.approval:
            return None if cues.reservation else 1
        if cues.weak or restated:
            return -1
        return None

    def _cues(self, text: str, response: str) -> _Cues:
        text = _blank(text, NEUTRAL)
        strong = any(p.search(text) for p in STRONG)
        approvals = [m for p in APPROVAL for m in p.finditer(text)]
        # "not perfect", "isn't helpful": a negated approval is a complaint
        kept = [m for m in approvals if not _negated(text, m.start())]
        strong = strong or len(kept) < len(approvals)
        weak = any(p.search(text) for p in WEAK) or (
            bool(_NO_LEAD.search(text)) and not _ends_with_question(response))
        first = min((m.start() for m in kept), default=None)
        reservation = first is not None and bool(_RESERVATION.search(text, first))
        return _Cues(strong, weak, any(p.search(text) for p in HOLD), bool(kept), reservation)


# ---------------------------------------------------------------------------------------
# LLM judges


class Completer(Protocol):
    """One chat completion from some model; raises on failure."""

    source: str

    async def complete(self, messages: list[dict], *, temperature: float, max_tokens: int,
                       seed: int | None) -> str: ...


class LLMJudge:
    """The evaluative and hint judges of METHOD §2-3 over any Completer."""

    def __init__(self, completer: Completer, *, votes: int = 3, temperature: float = 0.6, max_tokens: int = 256):
        if votes < 1:
            raise ConfigError(f"judge votes must be at least 1, got {votes}")
        self.completer = completer
        self.votes = votes
        self.temperature = temperature
        self.max_tokens = max_tokens

    async def evaluate(self, inp: JudgeInput) -> Verdict:
        """m votes with distinct seeds, each parsed from its last \\boxed{}; majority.

        Raises JudgeUnavailable when the backend fails; asyncio.CancelledError and
        Preempted pass through unchanged."""
        messages = evaluative_messages(inp)
        # One vote at a time: the served model runs one call at a time anyway, and the
        # miner can preempt between votes when a user request arrives.
        votes = [parse_boxed(await self._complete(messages, seed)) for seed in _seeds(messages, self.votes)]
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
            return await self.completer.complete(messages, temperature=self.temperature,
                                                 max_tokens=self.max_tokens, seed=seed)
        except (asyncio.CancelledError, Preempted, JudgeUnavailable, ContextLengthExceeded):
            # Cancelled / Preempted: a user request took the engine; that is no backend
            # failure, and the miner retries soon instead of backing off. A turn too long
            # for the judge's context will never fit: the miner gives up on judging it.
            raise
        except Exception as e:
            raise JudgeUnavailable(
                f"The {self.completer.source!r} judge failed: {type(e).__name__}: {e}. The turn stays unjudged "
                "and will be retried; if this persists, check the judge backend or set the judge to \"rules\"."
            ) from e


def _seeds(messages: list[dict], n: int) -> list[int]:
    # Distinct per vote, and reproducible per turn: re-judging a turn gives the same votes.
    base = zlib.crc32(repr(messages).encode()) & 0x3FFFFFFF
    return [base + i for i in range(n)]


class OpenAICompleter:
    """Any OpenAI-compatible endpoint (Ollama, llama-server, vLLM, a hosted API).
    `base_url` is the API root that holds /chat/completions, usually ending in /v1."""

    source = "openai"

    def __init__(self, base_url: str, model: str = "", api_key: str = "", timeout: float = 60.0):
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.api_key = api_key
        self.timeout = timeout
        self._client = None

    def _http(self):
        import httpx  # deferred: only endpoint judges need it

        if self._client is None:
            headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
            self._client = httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(self.timeout,
                                             connect=min(self.timeout, 10.0)))
        return self._client

    async def complete(self, messages: list[dict], *, temperature: float, max_tokens: int,
                       seed: int | None) -> str:
        model = self.model or await self._first_model()
        body = {"model": model, "messages": messages, "temperature": temperature,
                "max_tokens": max_tokens, "stream": False}
        if seed is not None:
            body["seed"] = seed
        data = await self._request("POST", "/chat/completions", body)
        try:
            content = data["choices"][0]["message"].get("content")
        except (KeyError, IndexError, TypeError, AttributeError):
            raise JudgeUnavailable(
                f"{self.base_url}/chat/completions did not answer with an OpenAI chat completion "
                f"(got {str(data)[:200]!r}). Point the judge at an OpenAI-compatible API root, usually ending in /v1."
            ) from None
        return content if isinstance(content, str) else ""

    async def _first_model(self) -> str:
        data = await self._request("GET", "/models", None)
        try:
            ids = [m["id"] for m in data["data"]]
        except (KeyError, TypeError):
            ids = None
        if not ids:
            raise JudgeUnavailable(
                f"{self.base_url}/models lists no models, so the judge cannot pick one. "
                f"Name it in the judge setting: openai:{self.base_url}#MODEL."
            )
        self.model = ids[0]
        return self.model

    async def _request(self, method: str, path: str, body: dict | None):
        import httpx

        url = self.base_url + path
        try:
            r = await self._http().request(method, url, json=body)
        except httpx.TimeoutException:
            raise JudgeUnavailable(
                f"The judge endpoint {url} did not answer within {self.timeout:g} s. Check that the server there "
                "is running and not overloaded, or raise the judge timeout."
            ) from None
        except httpx.HTTPError as e:
            raise JudgeUnavailable(
                f"Cannot reach the judge endpoint {url} ({type(e).__name__}: {e}). Start the server there "
                "(e.g. `ollama serve` or `llama-server`), or fix the URL in the judge setting."
            ) from None
        if r.status_code >= 400:
            what = {401: "check the API key", 403: "check the API key",
                    404: "check the URL (the API root, usually ending in /v1) and the model name"}
            raise JudgeUnavailable(
                f"The judge endpoint {url} answered HTTP {r.status_code}: {r.text[:200]!r}. "
                f"{what.get(r.status_code, 'Check the server logs there')}."
            )
        try:
            return r.json()
        except ValueError:
            raise JudgeUnavailable(
                f"The judge endpoint {url} answered with something that is not JSON ({r.text[:120]!r}). "
                "Point the judge at an OpenAI-compatible API root, usually ending in /v1."
            ) from None

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None


class ServedModelCompleter:
    """A model clawd runs itself: the served model ("self", base weights, no adapter, at
    background priority so users never wait on judging), or a second local GGUF ("gguf")."""

    def __init__(self, chat, source: str = "self"):
        self.chat = chat
        self.source = source

    async def aclose(self) -> None:
        """Free a second model this judge loaded; the served model is not the judge's to close."""
        if self.source == "gguf":
            await asyncio.get_running_loop().run_in_executor(None, self.chat.runner.close)

    async def complete(self, messages: list[dict], *, temperature: float, max_tokens: int,
                       seed: int | None) -> str:
        # deferred: engines.base pulls in numpy, and `clawd --help` must stay light
        from clawd.engines.base import SamplingParams
        from clawd.protocol import Message

        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=1.0, seed=seed)
        msgs = [Message.model_validate(m) for m in messages]
        # adapter None: the judge is the frozen base model, not the policy being trained
        return await self.chat.complete(msgs, params, adapter=None, background=True)


JUDGE_FORMS = '"rules", "self", "openai:<base_url>[#model]" or "gguf:<path to .gguf>"'


def completer_for(spec: str, *, chat=None, gguf_loader=None, api_key: str = "") -> Completer | None:
    """The Completer a judge setting names; None for "rules" (no model needed).

    `chat` (a ServedModel) serves "self"; `gguf_loader(path)` builds a ServedModel for
    "gguf:PATH". Raises ConfigError for anything else, listing the valid forms."""
    s = (spec or "").strip()
    if s == "rules":
        return None
    if s == "self":
        if chat is None:
            raise ConfigError('judge "self" needs the served model, which is not running here; use "rules" '
                              f"or another judge ({JUDGE_FORMS}).")
        return ServedModelCompleter(chat)
    kind, _, rest = s.partition(":")
    if kind == "openai" and rest:
        url, _, model = rest.partition("#")
        if not re.match(r"https?://[^/\s]+", url):
            raise ConfigError(f"judge {spec!r}: the URL must start with http:// or https://, e.g. "
                              f"openai:http://127.0.0.1:11434/v1#qwen3:4b (judges: {JUDGE_FORMS}).")
        return OpenAICompleter(url, model=model, api_key=api_key)
    if kind == "gguf" and rest.strip():
        if gguf_loader is None:
            raise ConfigError(f"judge {spec!r}: a second local model cannot be loaded here; use {JUDGE_FORMS}.")
        return ServedModelCompleter(gguf_loader(rest.strip()), source="gguf")
    raise ConfigError(f"judge {spec!r} is not a judge clawd knows; use {JUDGE_FORMS}.")
